"""A measured routing (``moe_infer.routing``, ``moe-infer routing``) and the cost model's
use of it (``plan --routing``): counts of every pick, the file checked against the model,
and a step's experts priced by the distinct experts that routing hits."""
import json

import pytest
import torch

import moe_infer
import moe_infer.loader
from moe_infer.cli import main
from moe_infer.config import Config, ConfigError, ModelConfig, MoEConfig, ParallelConfig
from moe_infer.closed_forms import distinct_experts
from moe_infer.costmodel import CostModel
from moe_infer.hardware_profile import Hardware, Link, moe_kernel_key
from moe_infer.routing import load, measure


@pytest.fixture(scope="module")
def engine():
    return moe_infer.load("tiny-moe", device="cpu", progress=False)


def test_every_pick_of_every_moe_layer_is_counted_once(engine):
    """Each layer counts top-k picks a token; prompts counted apart add up to prompts counted
    together (each is its own forward: no padding token routes)."""
    a, b = [5, 9, 2, 7, 11, 3], [4, 8, 1]
    both, one, two = measure(engine, [a, b]), measure(engine, [a]), measure(engine, [b])
    e = engine.config.moe
    assert both["tokens"] == 9 and both["prompts"] == 2 and both["num_experts"] == e.num_experts
    assert sorted(map(int, both["layers"])) == [i for i in range(engine.config.model.num_layers)
                                                if engine.config.is_moe_layer(i)]
    for key, picks in both["layers"].items():
        assert sum(picks) == 9 * e.top_k
        assert picks == [x + y for x, y in zip(one["layers"][key], two["layers"][key])]
    # the hooks are gone afterwards
    assert all(not blk.ffn.router._forward_hooks for blk in engine.model.layers if hasattr(blk.ffn, "router"))


def test_the_command_writes_what_plan_reads(tmp_path, capsys):
    out, prompts = tmp_path / "routing.json", tmp_path / "prompts.txt"
    prompts.write_text("Shall I compare thee\n\nto a summer's day?\n")  # the embedded model has a tokenizer
    assert main(["routing", "--device", "cpu", "--prompt", "Thou art more lovely", "--prompts-file", str(prompts),
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["prompts"] == 3
    assert main(["routing", "--model", "tiny-moe", "--device", "cpu", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                 "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["prompts"] == 2 and record["tokens"] == 5
    cfg = moe_infer.loader.resolve_config("tiny-moe")
    assert load(out, cfg) == {int(k): [float(n) for n in v] for k, v in record["layers"].items()}
    capsys.readouterr()
    assert main(["plan", "--model", "tiny-moe", "--gpus", "1", "--hardware", "nvidia-h200", "--batch", "8",
                 "--routing", str(out)]) == 0
    assert "tiny-moe on 1 x nvidia-h200" in capsys.readouterr().out


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(num_experts=7), r"num_experts=7, expected the model's 6"),
    (lambda d: d["layers"].update({"99": [1] * 6}), r"layers\['99'\]: not a MoE layer"),
    (lambda d: d["layers"].update({"0": [1, 2]}), r"layers\['0'\]: expected 6 pick counts"),
    (lambda d: d["layers"].update({"0": [0] * 6}), r"layers\['0'\]: expected 6 pick counts >= 0, not all 0"),
    (lambda d: d["layers"].update({"0": [-1, 1, 1, 1, 1, 1]}), r"layers\['0'\]"),
    (lambda d: d.pop("layers"), r"expected a record of moe-infer routing"),
])
def test_a_bad_routing_file_is_refused_naming_the_field(tmp_path, edit, message):
    cfg = moe_infer.loader.resolve_config("tiny-moe")
    data = {"num_experts": 6, "layers": {"0": [1, 2, 3, 4, 5, 6]}}
    edit(data)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message):
        load(path, cfg)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        load(path, cfg)


def machine(**kw):
    return Hardware(**{**dict(name="test", memory_gb=1000, mem_gbps=1000, matmul_tflops={"bfloat16": 1000,
                       "int8": 2000}, nvlink=Link(0.0, 1e9), network=Link(0.0, 1e9), layer_overhead_us=0.0), **kw})


def moe_config():
    return Config(ModelConfig(vocab_size=1000, hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=8,
                              ffn_hidden=4096), MoEConfig(num_experts=8, top_k=2, expert_hidden=4096))


def test_a_peaked_routing_reads_only_the_experts_it_hits():
    """Every pick on experts 0 and 1: batch 8 reads 2 experts a layer, not uniform routing's
    8 x (1 - (6/8)^8); a layer the routing lacks stays uniform."""
    cfg = moe_config()
    expert = 3 * 1024 * 4096 * 2
    peaked = [1.0, 1.0] + [0.0] * 6
    uniform = CostModel(cfg, machine()).predict(ParallelConfig(), "decode", 8, 0)
    both = CostModel(cfg, machine(), histogram={0: peaked, 1: peaked}).predict(ParallelConfig(), "decode", 8, 0)
    first = CostModel(cfg, machine(), histogram={0: peaked}).predict(ParallelConfig(), "decode", 8, 0)
    saved = (distinct_experts(8, 2, 8) - 2) * expert / 1e12 * 1e3  # ms a layer at 1000 GB/s
    assert uniform.split["memory"] - both.split["memory"] == pytest.approx(2 * saved, rel=1e-6)
    assert uniform.split["memory"] - first.split["memory"] == pytest.approx(saved, rel=1e-6)


def test_a_timed_kernel_follows_the_routing_down_to_its_math():
    """calibrate times the kernel under uniform routing: a routing that hits fewer experts
    takes off the reads of the experts it no longer hits, but never goes below the pairs'
    FLOPs."""
    cfg = moe_config()
    key = moe_kernel_key(8, 8, 1024, 4096, 2, "swiglu")
    hw = machine(moe_kernel={key: {1: 100.0, 8: 400.0, 1024: 5000.0}})
    peaked = [1.0, 1.0] + [0.0] * 6
    cm = CostModel(cfg, hw, histogram={0: peaked})
    read = 3 * 1024 * 4096 * 2 / 1000e9  # one expert at 1000 GB/s
    assert cm._ffn(ParallelConfig(), 0, 8, 8)[2] == pytest.approx(400e-6 - (distinct_experts(8, 2, 8) - 2) * read)
    assert cm._ffn(ParallelConfig(), 1, 8, 8)[2] == pytest.approx(400e-6)  # layer 1: uniform
    slow = CostModel(cfg, machine(moe_kernel=hw.moe_kernel, matmul_tflops={"bfloat16": 0.001, "int8": 0.001}),
                     histogram={0: peaked})
    flops = 2 * 1024 * 2 * 3 * 1024 * 4096  # 1024 tokens, two picks each
    assert slow._ffn(ParallelConfig(), 0, 1024, 1024)[2] == pytest.approx(flops / 1e9)


def test_a_kernel_timed_under_concentrated_routing_prices_it_where_calibrate_timed_it():
    """``moe_skew`` (calibrate on one GPU's experts): linear in the experts hit between the
    counts timed at a token count, log-log in the tokens between the counts timed; it takes
    the place of the estimate from uniform routing's time, which stays where the tokens or
    the share were not timed so."""
    cfg = moe_config()
    key = moe_kernel_key(8, 8, 1024, 4096, 2, "swiglu")
    skew = {16: {2: 200.0, 4: 300.0, 7.2: 500.0}, 64: {2: 800.0, 4: 1000.0, 8.0: 1600.0}}
    hw = machine(moe_kernel={key: {1: 100.0, 16: 500.0, 64: 1600.0, 256: 4000.0}}, moe_skew={key: skew})
    assert hw.moe_skewed_s(key, 16, 3) == pytest.approx(250e-6)
    assert hw.moe_skewed_s(key, 16, 1) == pytest.approx(200e-6)  # fewer than timed: the fewest's
    assert hw.moe_skewed_s(key, 64, 6) == pytest.approx(1300e-6)
    assert hw.moe_skewed_s(key, 32, 2) == pytest.approx((200 * 800) ** 0.5 * 1e-6)  # halfway in log tokens
    assert hw.moe_skewed_s(key, 8, 2) is None and hw.moe_skewed_s(key, 128, 2) is None
    assert hw.moe_skewed_s(moe_kernel_key(4, 8, 1024, 4096, 2, "swiglu"), 16, 2) is None
    peaked = [1.0, 1.0] + [0.0] * 6  # two experts hit, whatever the tokens
    cm = CostModel(cfg, hw, histogram={0: peaked})
    assert cm._ffn(ParallelConfig(), 0, 16, 16)[2] == pytest.approx(200e-6)
    assert cm._ffn(ParallelConfig(), 1, 16, 16)[2] == pytest.approx(500e-6)  # uniform: the uniform table
    read = 3 * 1024 * 4096 * 2 / 1000e9
    assert cm._ffn(ParallelConfig(), 0, 256, 256)[2] == pytest.approx(  # past the tokens timed so
        4000e-6 - (distinct_experts(8, 2, 256) - 2) * read)


def test_calibrate_times_one_gpus_share_under_concentrated_routing(tmp_path):
    """The shares of one GPU's experts are timed with the routed picks on top_k, 2 top_k, ...
    experts (each token's picks distinct, spread evenly) and under uniform routing at its
    expected count; expert-parallel shares are not."""
    from moe_infer.calibrate import concentrated_ids, skew_counts

    ids = concentrated_ids(10, 3, [7, 1, 4, 6], torch.device("cpu"))
    assert ids.dtype == torch.int32 and ids.shape == (10, 3)
    assert all(len(set(row.tolist())) == 3 for row in ids)
    assert sorted(torch.bincount(ids.flatten(), minlength=8).tolist()) == [0, 0, 0, 0, 7, 7, 8, 8]
    assert skew_counts(128, 8, 128) == [8, 16, 32, 64] and skew_counts(128, 8, 1) == []
    assert skew_counts(8, 2, 2) == [2]  # uniform hits 3.5 of 8
    out = tmp_path / "skew.yaml"
    assert main(["calibrate", "--smoke", "--device", "cpu", "--out", str(out), "--models", "tiny-moe",
                 "--moe-ranks", "1,2", "--moe-tokens", "1,4,16"]) == 0
    hw = Hardware.load(out)
    e, m = moe_infer.loader.resolve_config("tiny-moe").moe, moe_infer.loader.resolve_config("tiny-moe").model
    ep2 = moe_kernel_key(e.num_experts // 2, e.num_experts, m.hidden_size, e.expert_hidden, e.top_k, m.activation)
    assert ep2 in hw.moe_kernel and ep2 not in hw.moe_skew and len(hw.moe_skew) == 2
    for key, by_tokens in hw.moe_skew.items():
        assert sorted(by_tokens) == [4, 16]
        for t, by_hit in by_tokens.items():
            uniform = round(distinct_experts(e.num_experts, e.top_k, t), 1)
            assert sorted(by_hit) == [*skew_counts(e.num_experts, e.top_k, t), pytest.approx(uniform, abs=0.01)]
            assert all(us > 0 for us in by_hit.values())
            assert by_hit[max(by_hit)] == hw.moe_kernel[key][t]  # the uniform call is the table's


def test_the_command_refuses_a_run_without_prompts_in_one_line(tmp_path, capsys):
    assert main(["routing", "--model", "tiny-moe", "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 2
    assert "no prompt: pass --prompt TEXT" in capsys.readouterr().err
    assert main(["routing", "--model", "tiny-moe", "--device", "cpu", "--prompts-file", str(tmp_path / "none.txt"),
                 "--out", str(tmp_path / "r.json")]) == 2
    assert "--prompts-file" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_folded_shared_experts_are_not_counted_as_routed_picks(tmp_path):
    """Where the loader folds the shared experts into the routed call (ids E.. in every
    token's table), only the top-k routed slots count."""
    text = (moe_infer.config_files.configs_dir() / "tiny-moe.yaml").read_text()
    text = text.replace("shared_expert_hidden: 96", "shared_expert_hidden: 256").replace(
        "shared_expert_gate: true", "shared_expert_gate: false")
    path = tmp_path / "folded.yaml"
    path.write_text(text)
    engine = moe_infer.load(str(path), device="cpu", progress=False)
    assert engine.config.folded_experts() == 2 and engine.model.layers[0].ffn.router.slots == 4
    record = measure(engine, [[5, 9, 2, 7], [3, 1]])
    for picks in record["layers"].values():
        assert len(picks) == 6 and sum(picks) == 6 * 2
