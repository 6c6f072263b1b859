"""The cost model (``moe_infer.costmodel``): its layouts' terms on a synthetic machine, the
shipped hardware profiles, and ``moe-infer plan`` (its closed forms: test_closed_forms.py)."""
from pathlib import Path

import pytest

from moe_infer.cli import main, parse_layout
from moe_infer.config import ConfigError, ModelConfig, ParallelConfig
from moe_infer.closed_forms import all_reduce_s, busiest_rank_experts
from moe_infer.costmodel import CostModel, layout_name
from moe_infer.hardware_profile import HARDWARE_DIR, Hardware, Link
from moe_infer.loader import resolve_config

ROOT = Path(__file__).resolve().parent.parent


def test_measured_collectives_interpolate_and_replace_the_closed_forms():
    hw = machine(nvlink=Link(5.0, 100.0), gpus_per_node=4,
                 collectives={"all_reduce": {2: {1000: 10.0, 3000: 30.0, 5000: 40.0}}})
    assert hw.collective_s("all_reduce", 10, 2) == pytest.approx(10e-6)  # below the table: its latency
    assert hw.collective_s("all_reduce", 2000, 2) == pytest.approx(20e-6)  # linear between sizes
    assert hw.collective_s("all_reduce", 7000, 2) == pytest.approx(50e-6)  # the last slope beyond
    assert hw.collective_s("all_reduce", 2000, 4) is None and hw.collective_s("all_to_all", 2000, 2) is None
    # the model takes the table for tp2's sums, the closed form where the table lacks the size
    cfg = dense_config(layers=1)
    measured = CostModel(cfg, hw).predict(ParallelConfig(tp=2), "decode", batch=1, context=16)
    closed = CostModel(cfg, machine(nvlink=Link(5.0, 100.0), gpus_per_node=4)).predict(
        ParallelConfig(tp=2), "decode", batch=1, context=16)
    act = 1024 * 2  # one row of the hidden size, bf16
    sums = 2 * (hw.collective_s("all_reduce", act, 2) - all_reduce_s(act, 2, hw.nvlink))
    assert measured.ms - closed.ms == pytest.approx(sums * 1e3)
    # a group that leaves the node is priced over the network whatever the table holds
    cm = CostModel(cfg, machine(nvlink=Link(5.0, 100.0), network=Link(50.0, 10.0), gpus_per_node=1,
                                collectives={"all_reduce": {2: {1000: 1.0}}}))
    assert cm._collective("all_reduce", act, 2) == pytest.approx(all_reduce_s(act, 2, Link(50.0, 10.0)))


def test_layouts_that_sum_through_nccl_take_its_measured_all_reduce():
    """parallel.all_reduce nccl: every sum of a block at NCCL's measured time
    ("all_reduce_nccl", calibrate's), the layers' own sum's where that was not measured."""
    cfg = dense_config(layers=1)
    both = machine(gpus_per_node=4, collectives={"all_reduce": {2: {1000: 10.0}}, "all_reduce_nccl": {2: {1000: 30.0}}})
    auto = CostModel(cfg, both).predict(ParallelConfig(tp=2), "decode", batch=1, context=16)
    nccl = CostModel(cfg, both).predict(ParallelConfig(tp=2, all_reduce="nccl"), "decode", batch=1, context=16)
    assert nccl.split["collectives"] - auto.split["collectives"] == pytest.approx(2 * 20e-3)  # two sums a block, ms
    only_auto = machine(gpus_per_node=4, collectives={"all_reduce": {2: {1000: 10.0}}})
    assert CostModel(cfg, only_auto).predict(ParallelConfig(tp=2, all_reduce="nccl"), "decode", 1, 16).ms == \
        pytest.approx(auto.ms)


def test_experts_read_at_the_measured_fraction_of_the_bandwidth():
    table = {1000: {1: 0.5, 16: 0.9}, 100000: {1: 0.8, 16: 1.0}}
    hw = machine(moe_read=table)
    assert hw.expert_read(1000, 1) == pytest.approx(0.5) and hw.expert_read(100000, 16) == pytest.approx(1.0)
    assert hw.expert_read(1000, 4) == pytest.approx(0.7)  # log-linear in the rows: 4 is halfway from 1 to 16
    assert hw.expert_read(10000, 1) == pytest.approx(0.65)  # and in the bytes
    assert hw.expert_read(10, 0.5) == pytest.approx(0.5) and hw.expert_read(1e9, 64) == pytest.approx(1.0)
    assert machine().expert_read(1000, 1) == 1.0  # no table: the copy rate
    # a decode step of a memory-bound MoE model: its experts' time grows as the fraction falls
    from moe_infer.config import Config, MoEConfig

    cfg = Config(ModelConfig(vocab_size=1000, hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=8,
                             ffn_hidden=4096), MoEConfig(num_experts=8, top_k=2, expert_hidden=4096))
    expert = 3 * 1024 * 4096 * 2
    fast = CostModel(cfg, machine(mem_gbps=1.0)).predict(ParallelConfig(), "decode", batch=1, context=0)
    slow = CostModel(cfg, machine(mem_gbps=1.0, moe_read={expert: {1: 0.5}})).predict(
        ParallelConfig(), "decode", batch=1, context=0)
    experts_s = 2 * 2 * expert / 1e9  # two layers, two experts each at 1 GB/s
    assert (slow.ms - fast.ms) / 1e3 == pytest.approx(experts_s, rel=1e-6)


def test_folded_shared_experts_read_at_the_moe_kernels_rate():
    """Shared experts folded into the routed call (one GPU, the option on) are read at the
    MoE kernel's measured fraction of the bandwidth, as experts every token takes; a
    tensor-parallel layout (or the option off) runs them as a dense MLP at the copy rate."""
    import dataclasses

    from moe_infer.config import Config, EngineConfig, MoEConfig

    cfg = Config(ModelConfig(vocab_size=1000, hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=8,
                             ffn_hidden=4096),
                 MoEConfig(num_experts=8, top_k=2, expert_hidden=1024, shared_experts=2, shared_expert_hidden=1024))
    expert = 3 * 1024 * 1024 * 2
    hw = machine(mem_gbps=1.0, moe_read={expert: {1: 0.5}})
    folded = CostModel(cfg, hw)._ffn(ParallelConfig(), 0, 1, 1)[0]
    off = dataclasses.replace(cfg, engine=EngineConfig(fold_shared_experts=False))
    dense = CostModel(off, hw)._ffn(ParallelConfig(), 0, 1, 1)[0]
    assert folded - dense == pytest.approx(2 * expert / 0.5 - 2 * expert)  # two shared experts at half the rate
    tp = ParallelConfig(tp=2)
    assert CostModel(cfg, hw)._ffn(tp, 0, 1, 1)[0] == CostModel(off, hw)._ffn(tp, 0, 1, 1)[0]


def test_the_measured_moe_kernel_time_holds_its_compute_up_to_the_rows_measured():
    """``moe_read`` times the fused kernel itself: up to the most rows an expert it measured,
    its figure is the experts' whole time, and the dense GEMM rate at those rows (which
    counts a dense kernel's own weight reads) adds nothing; past them the compute bound
    comes back."""
    from moe_infer.config import Config, MoEConfig

    cfg = Config(ModelConfig(vocab_size=1000, hidden_size=1024, num_layers=1, num_heads=8, num_kv_heads=8,
                             ffn_hidden=4096), MoEConfig(num_experts=8, top_k=2, expert_hidden=4096))
    expert = 3 * 1024 * 4096 * 2
    timed = CostModel(cfg, machine(moe_read={expert: {1: 0.5, 16: 0.9}}))
    assert timed.hw.moe_rows_measured() == 16 and machine().moe_rows_measured() == 0
    reads, seconds, _, _ = timed._ffn(ParallelConfig(), 0, 1, 1)  # one token: 2 experts, a row each
    assert seconds == 0 and reads == pytest.approx(2 * expert / 0.5)
    _, untimed, _, _ = CostModel(cfg, machine())._ffn(ParallelConfig(), 0, 1, 1)
    assert untimed > 0
    _, past, _, _ = timed._ffn(ParallelConfig(), 0, 256, 256)  # 64 rows an expert: past the table
    assert past == pytest.approx(2 * 256 * 2 * (expert / 2) / timed._rate(64))


def test_the_kernel_timed_on_a_ranks_share_stands_in_for_the_generic_expert_terms():
    """``moe_kernel`` (calibrate ``--models``): where the profile timed the fused kernel on
    the experts a rank of the layout holds, that time, log-log in the tokens between the
    measured counts, is the experts' whole cost; past the most tokens measured, or for a
    share not timed, the generic terms (bytes over ``moe_read``'s rate) come back."""
    from moe_infer.config import Config, MoEConfig
    from moe_infer.hardware_profile import moe_kernel_key

    cfg = Config(ModelConfig(vocab_size=1000, hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=8,
                             ffn_hidden=4096), MoEConfig(num_experts=8, top_k=2, expert_hidden=4096))
    whole, ep2 = moe_kernel_key(8, 8, 1024, 4096, 2, "swiglu"), moe_kernel_key(4, 8, 1024, 4096, 2, "swiglu")
    assert whole == "E8/8:H1024:F4096:k2:swiglu"
    timed = CostModel(cfg, machine(moe_kernel={whole: {1: 100.0, 16: 400.0}, ep2: {1: 60.0}}))
    assert timed._ffn(ParallelConfig(), 0, 1, 1) == (0.0, 0.0, pytest.approx(100e-6), 0.0)
    assert timed._ffn(ParallelConfig(), 0, 4, 4)[2] == pytest.approx(200e-6)  # 4 tokens: halfway, in logs
    assert timed._ffn(ParallelConfig(), 0, 0.5, 0.5)[2] == pytest.approx(100e-6)  # below: the fewest's time
    assert timed._ffn(ParallelConfig(dp=2, ep=2), 0, 1, 1)[2] == pytest.approx(60e-6)  # the ep2 rank's share
    generic = CostModel(cfg, machine())
    for p, t in ((ParallelConfig(), 32), (ParallelConfig(tp=2), 1)):  # past the table; F / 2 not timed
        assert timed._ffn(p, 0, t, t) == generic._ffn(p, 0, t, t) and timed._ffn(p, 0, t, t)[2] == 0.0
    assert CostModel(cfg, timed.hw, weight_bytes=1.0)._ffn(ParallelConfig(), 0, 1, 1)[2] == 0.0  # int8: not timed
    # a decode step: each of the two MoE layers costs its timed kernel instead of reading two experts
    expert = 3 * 1024 * 4096 * 2
    a, b = (m.predict(ParallelConfig(), "decode", batch=1, context=0) for m in (timed, generic))
    assert (a.split["memory"] - b.split["memory"]) / 1e3 == pytest.approx(2 * (100e-6 - 2 * expert / 1000e9))


def machine(**kw):
    base = dict(name="test", memory_gb=1000, mem_gbps=1000, matmul_tflops={"bfloat16": 1000, "int8": 2000},
                nvlink=Link(0.0, 1e9), network=Link(0.0, 1e9), layer_overhead_us=0.0)
    return Hardware(**{**base, **kw})


def dense_config(layers=4):
    from moe_infer.config import Config

    return Config(ModelConfig(vocab_size=1000, hidden_size=1024, num_layers=layers, num_heads=8, num_kv_heads=8,
                              ffn_hidden=4096))


def test_a_dense_decode_step_reads_its_weights_once():
    cfg = dense_config()
    m = cfg.model
    weights = m.num_layers * (4 * m.hidden_size ** 2 + 3 * m.hidden_size * m.ffn_hidden) * 2  # bf16
    head = m.vocab_size * m.hidden_size * 2
    cm = CostModel(cfg, machine())
    one = cm.predict(ParallelConfig(), "decode", 1, context=0)
    assert one.ms == pytest.approx((weights + head) / 1e12 * 1e3, rel=1e-3)  # 1000 GB/s
    tp = cm.predict(ParallelConfig(tp=2), "decode", 1, context=0)
    assert tp.ms == pytest.approx(one.ms / 2, rel=1e-3)  # free links: half the bytes a rank
    # Pipeline stages: each reads half, but a token passes both, one stage a slot.
    pp = cm.predict(ParallelConfig(pp=2), "decode", 2, context=0)
    assert pp.ms == pytest.approx(cm.predict(ParallelConfig(), "decode", 1, context=0).ms, rel=0.05)
    assert pp.memory_gb == pytest.approx(one.memory_gb / 2, rel=0.1)


def test_a_calls_fixed_cost_is_paid_once_by_its_prompts_not_by_decode_steps():
    """``prefill_call_us``: the host's set-up and sync of a generate() call, once for all its
    prompts and forwards whatever their size; a decode step does not pay it."""
    cfg = dense_config()
    bare, host = CostModel(cfg, machine()), CostModel(cfg, machine(prefill_call_us=500.0))
    for batch, prompt in ((1, 16), (8, 2048)):
        a, b = (m.predict(ParallelConfig(), "prefill", batch, 0, prompt=prompt) for m in (bare, host))
        assert b.ms == pytest.approx(a.ms + 0.5, rel=1e-9) and b.split["overhead"] == pytest.approx(a.split["overhead"] + 0.5)
    assert host.predict(ParallelConfig(), "decode", 4, 128).ms == bare.predict(ParallelConfig(), "decode", 4, 128).ms


def test_a_prefill_runs_in_the_engines_forwards():
    """A prefill is priced as generate() runs it (``engine.prefill_plan``): forwards of at
    most ``engine.prefill_tokens`` tokens, whole prompts together while they fit, each
    reading the weights again; a longer prompt in pieces."""
    import dataclasses

    cfg = dense_config()
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, prefill_tokens=1024))
    cm = CostModel(cfg, machine(matmul_tflops={"bfloat16": 1e9, "int8": 1e9}))  # weight-bound at any size
    two = cm.predict(ParallelConfig(), "prefill", 2, 0, prompt=512)  # one forward of 1024 tokens
    eight = cm.predict(ParallelConfig(), "prefill", 8, 0, prompt=512)  # four of them
    assert eight.ms == pytest.approx(4 * two.ms, rel=1e-6)
    assert eight.tokens_per_s == pytest.approx(two.tokens_per_s, rel=1e-6)
    # One 4096-token prompt: four 1024-token pieces, each its own forward (its own weight reads)
    assert cm.predict(ParallelConfig(), "prefill", 1, 0, prompt=4096).ms > 3.9 * two.ms
    # A budget that holds all eight prompts: one forward, the weights (and the head) read once
    # in place of four times; the passes over the activations are the same tokens' either way
    wide = CostModel(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, prefill_tokens=4096)),
                     machine(matmul_tflops={"bfloat16": 1e9, "int8": 1e9}))
    m = cfg.model
    weights = m.num_layers * (4 * m.hidden_size ** 2 + 3 * m.hidden_size * m.ffn_hidden) * 2 \
        + m.vocab_size * m.hidden_size * 2
    saved = eight.ms - wide.predict(ParallelConfig(), "prefill", 8, 0, prompt=512).ms
    assert saved == pytest.approx(3 * weights / 1e12 * 1e3, rel=1e-6)  # 1000 GB/s


def test_expert_terms_follow_the_layout():
    cfg = resolve_config("mixtral-8x7b")
    cm = CostModel(cfg, machine())
    one, ep = (cm.predict(p, "decode", 1, 0) for p in (ParallelConfig(), ParallelConfig(dp=2, ep=2)))
    # batch 1: two of eight experts; under ep2 the busier rank reads both with probability
    # 3 / 7 (the second pick among the other 7 lands on its 3 others), else one: 10 / 7
    e = cfg.moe
    expert = 3 * cfg.model.hidden_size * e.expert_hidden * 2 / 1e12 * 1e3  # ms to read one
    assert busiest_rank_experts(8, 2, 1, 2) == pytest.approx(10 / 7, rel=0.02)
    assert one.split["memory"] - ep.split["memory"] == pytest.approx(
        cfg.model.num_layers * expert * (2 - busiest_rank_experts(8, 2, 1, 2)), rel=1e-3)
    # data-parallel attention: each replica's own row, the experts seeing both
    dpa = cm.predict(ParallelConfig(dp=2, ep=2, dp_attention=True), "decode", 2, 0)
    assert dpa.split["collectives"] >= 0 and dpa.tokens_per_s > 0


def offloaded(cfg, budget_gb, mode="stream"):
    import dataclasses

    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, gpu_memory_gb=budget_gb, offload=mode))


def test_an_offloaded_models_cold_experts_cross_the_host_link_or_run_on_the_cpu():
    """Mixtral at batch 1 in a budget that keeps every other weight and one expert a layer
    on the device (the planner's even spread): uniform routing finds its expert there for an
    eighth of the pairs; the other expected distinct experts' bytes come over
    the host link (or, offload: cpu, at the CPU's read rate) after the device's part; a
    measured hit rate replaces the routing's; a budget holding every expert adds nothing."""
    cfg = resolve_config("mixtral-8x7b")
    m, e = cfg.model, cfg.moe
    hw = machine(h2d_gbps=50.0, cpu_matmul_gbps=20.0)
    whole = CostModel(cfg, hw).predict(ParallelConfig(), "decode", 1, 0)
    expert = 3 * m.hidden_size * e.expert_hidden * 2
    fixed = whole.memory_gb * 1e9 - m.num_layers * e.num_experts * expert
    budget = (fixed + (m.num_layers + 0.5) * expert) / 1e9  # one expert a layer kept
    one = CostModel(offloaded(cfg, budget), hw).predict(ParallelConfig(), "decode", 1, 0)
    # batch 1: two picks; an eighth of them on the kept expert, the rest over 7 experts
    cold = 7 * (1 - (1 - 2 * 7 / 8 / 7) ** 1)
    assert one.split["host"] == pytest.approx(m.num_layers * cold * expert / 50e9 * 1e3, rel=1e-6)
    assert one.memory_gb == pytest.approx(budget, rel=1e-3)
    assert one.split["host"] < one.ms < whole.ms + one.split["host"]  # the device reads the kept experts alone
    cpu = CostModel(offloaded(cfg, budget, "cpu"), hw).predict(ParallelConfig(), "decode", 1, 0)
    assert cpu.split["host"] == pytest.approx(one.split["host"] * 50 / 20, rel=1e-6)
    measured = CostModel(offloaded(cfg, budget), hw, hit_rate=0.75).predict(ParallelConfig(), "decode", 1, 0)
    assert measured.split["host"] == pytest.approx(m.num_layers * 2 * 0.25 * expert / 50e9 * 1e3, rel=1e-6)
    room = CostModel(offloaded(cfg, 1e4), hw).predict(ParallelConfig(), "decode", 1, 0)
    assert room.split["host"] == 0 and room.ms == pytest.approx(whole.ms)


def test_plan_predicts_an_offloaded_model(capsys):
    args = ["plan", "--model", "olmoe-1b-7b", "--gpus", "1", "--hardware", "nvidia-h200"]
    assert main([*args, "--gpu-memory-gb", "4", "--hit-rate", "0.8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "host ms" in out[1]
    row = out[2].split()  # one GPU, ms, tokens/s, GB/GPU, memory / compute / collectives / host ms, ...
    assert float(row[8]) > 0 and float(row[4]) < 4.5  # the budget and this context's KV
    assert main([*args, "--hit-rate", "0.8"]) == 2
    assert "--hit-rate: only with --gpu-memory-gb" in capsys.readouterr().err
    assert main([*args, "--gpu-memory-gb", "4", "--hit-rate", "1.5"]) == 2
    assert "expected a share between 0 and 1" in capsys.readouterr().err


def test_the_largest_batch_and_context_that_fit_the_memory():
    """The dense test model: 138,313,728 bytes of weights and 16,384 of KV cache a token
    (4 layers x keys and values x 8 heads x 128 x 2 bytes), on a GPU whose usable memory
    holds them and 1050.5 tokens more."""
    cfg = dense_config()
    weights, per_token = 138_313_728, 16_384
    cm = CostModel(cfg, machine(memory_gb=(weights + 1050.5 * per_token) / CostModel.USABLE / 1e9))
    assert cm.predict(ParallelConfig(), "decode", 1, 0).memory_gb * 1e9 == pytest.approx(weights + per_token)
    one = ParallelConfig()
    assert cm.largest(one, "decode", 1, 99) == 10  # 10 rows of 99 cached + 1 new tokens
    assert cm.largest(one, "decode", 1, 0, vary="context") == 1049
    assert cm.largest(one, "decode", 2, 0, vary="context") == 524
    assert cm.largest(one, "prefill", 1, 0, 100, vary="batch") == 10  # prompts of 100 tokens
    small = CostModel(cfg, machine(memory_gb=weights / CostModel.USABLE / 1e9))
    assert small.largest(one, "decode", 1, 0) == 0
    # Two pipeline stages hold half the weights and half the cache a token each.
    assert cm.largest(ParallelConfig(pp=2), "decode", 1, 99) > 2 * 10


def test_largest_bisects_where_the_memory_is_no_line(monkeypatch):
    """Memory growing as the square of the rows: the line through 1 and 2 overshoots, and
    the bisection finds the last that fits (100 GB usable: 10 rows)."""
    import dataclasses

    cm = CostModel(dense_config(), machine(memory_gb=100 / CostModel.USABLE))
    real = cm.predict(ParallelConfig(), "decode", 1, 0)
    monkeypatch.setattr(cm, "predict", lambda p, phase, batch, context, prompt=None: dataclasses.replace(
        real, memory_gb=float(batch ** 2), fits=batch ** 2 <= 100))
    assert cm.largest(ParallelConfig(), "decode", 1, 0) == 10


def test_matmul_rate_follows_the_measured_curve(tmp_path):
    """Log-linear between measured rows, proportional below the first (a weight-bound GEMM
    takes as long with fewer rows), the last rate beyond; a dtype without a curve runs at
    its dense rate; the curve survives a dump and load."""
    hw = machine(matmul_curve={"bfloat16": {8: 10.0, 128: 100.0, 2048: 800.0}})
    assert hw.matmul_rate("bfloat16", 8) == pytest.approx(10e12)
    assert hw.matmul_rate("bfloat16", 4) == pytest.approx(5e12)
    assert hw.matmul_rate("bfloat16", 32) == pytest.approx(55e12)  # halfway from 8 to 128 in log
    assert hw.matmul_rate("bfloat16", 512) == pytest.approx(450e12)
    assert hw.matmul_rate("bfloat16", 1 << 20) == pytest.approx(800e12)
    assert hw.matmul_rate("int8", 4) == pytest.approx(2000e12)
    hw.dump(tmp_path / "curve.yaml")
    assert Hardware.load(tmp_path / "curve.yaml") == hw


def test_attention_rate_follows_the_measured_curve(tmp_path):
    """The nearest measured head widths, log-linear in the keys between the measured
    prompts, the end points' rates beyond them; None for a kind without a curve."""
    hw = machine(attention_curve={"causal": {"128/128": {512: 10.0, 2048: 40.0}, "64/64": {512: 1.0}}})
    assert hw.attention_rate("causal", 128, 128, 1024) == pytest.approx(25e12)  # halfway in log
    assert hw.attention_rate("causal", 136, 136, 256) == pytest.approx(10e12)
    assert hw.attention_rate("causal", 128, 128, 1 << 20) == pytest.approx(40e12)
    assert hw.attention_rate("causal", 72, 72, 4096) == pytest.approx(1e12)
    assert hw.attention_rate("masked", 128, 128, 1024) is None
    hw.dump(tmp_path / "attention.yaml")
    assert Hardware.load(tmp_path / "attention.yaml") == hw


def test_a_prompts_attention_runs_at_the_measured_attention_rate():
    """A fresh prompt attends causally (the half of its query-key pairs the kernel computes)
    at the curve's rate for its keys; with sinks the masked kernel computes every pair, at
    the padded head width (dense.attention._sdpa_sinks), at the masked curve's rate. On a
    machine whose memory and GEMMs cost nothing, that is the whole prefill."""
    import dataclasses

    cfg, t = dense_config(layers=2), 1024
    m = cfg.model
    d = m.hidden_size // m.num_heads
    free = dict(mem_gbps=1e12, matmul_tflops={"bfloat16": 1e12, "int8": 1e12})
    curves = {"causal": {"128/128": {512: 10.0, 2048: 40.0}}, "masked": {"128/128": {256: 5.0, 4096: 5.0}}}
    causal = CostModel(cfg, machine(**free, attention_curve=curves)).predict(ParallelConfig(), "prefill", 1, 0, prompt=t)
    flops = m.num_layers * 2 * m.num_heads * t * (t / 2) * 2 * d
    assert causal.ms == pytest.approx(flops / 25e12 * 1e3, rel=1e-3)
    sinks = dataclasses.replace(cfg, model=dataclasses.replace(m, attention_sinks=True))
    masked = CostModel(sinks, machine(**free, attention_curve=curves)).predict(ParallelConfig(), "prefill", 1, 0,
                                                                               prompt=t)
    assert masked.ms == pytest.approx(m.num_layers * 2 * m.num_heads * t * t * 2 * (d + 8) / 5e12 * 1e3, rel=1e-3)
    # without a curve: the matmul rate of the score rows, far faster here
    assert CostModel(cfg, machine(**free)).predict(ParallelConfig(), "prefill", 1, 0, prompt=t).ms < causal.ms / 100


def test_a_prefill_replayed_from_a_graph_runs_at_the_graph_kernels_rate():
    """A forward within ``engine.prefill_graph_tokens`` replays a CUDA graph, whose attention
    runs on the kernels ``cudnn_prefill_graphs`` picks: the "causal-graph" curve's rate; a
    larger forward, or the option off, at the eager kernels' curve."""
    import dataclasses

    cfg, t = dense_config(layers=2), 1024
    m = cfg.model
    flops = m.num_layers * 2 * m.num_heads * t * (t / 2) * 2 * (m.hidden_size // m.num_heads)
    free = dict(mem_gbps=1e12, matmul_tflops={"bfloat16": 1e12, "int8": 1e12})
    curves = {"causal": {"128/128": {512: 10.0, 2048: 10.0}}, "causal-graph": {"128/128": {512: 20.0, 2048: 20.0}}}
    hw = machine(**free, attention_curve=curves)
    assert hw.attention_rate("causal", 128, 128, 1024, graphed=True) == pytest.approx(20e12)
    assert hw.attention_rate("masked", 128, 128, 1024, graphed=True) is None

    def ms(**engine):
        c = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **engine))
        return CostModel(c, hw).predict(ParallelConfig(), "prefill", 1, 0, prompt=t).ms

    assert ms() == pytest.approx(flops / 20e12 * 1e3, rel=1e-3)
    for eager in (dict(prefill_graph_tokens=512), dict(cudnn_prefill_graphs=False), dict(cuda_graphs=False)):
        assert ms(**eager) == pytest.approx(flops / 10e12 * 1e3, rel=1e-3)


def test_the_activation_passes_follow_the_layout():
    """Mixtral's bytes a token in a block's element-wise kernels: two residual adds with
    norms (8 H), the attention epilogue (twice the rank's query, key and value heads) and
    the dispatch (each token read once, a copy written for each pick on the rank)."""
    cm = CostModel(resolve_config("mixtral-8x7b"), machine())
    h, d = 4096, 128
    assert cm._activation_bytes(ParallelConfig(), 0, 10) == 10 * 2 * (8 * h + 2 * (32 + 16) * d + 3 * h)
    assert cm._activation_bytes(ParallelConfig(tp=2, ep=2), 0, 1) == 2 * (8 * h + 2 * (16 + 8) * d + 2 * h)


def test_expert_gemms_run_at_the_rate_of_their_rows():
    """Mixtral at batch 1024 on a machine whose memory costs nothing: each of the 8 experts
    gets 256 of the 2048 pairs. A curve that halves the rate at 256 rows and keeps it at
    1024 (the attention's and the head's rows) adds exactly the experts' FLOPs at the dense
    rate to the compute time."""
    cfg = resolve_config("mixtral-8x7b")
    m, e = cfg.model, cfg.moe
    flat = CostModel(cfg, machine(mem_gbps=1e9)).predict(ParallelConfig(), "decode", 1024, 0)
    curved = CostModel(cfg, machine(mem_gbps=1e9, matmul_curve={"bfloat16": {256: 500.0, 1024: 1000.0}}))
    curved = curved.predict(ParallelConfig(), "decode", 1024, 0)
    expert_flops = m.num_layers * 2 * 1024 * e.top_k * 3 * m.hidden_size * e.expert_hidden
    assert curved.split["compute"] - flat.split["compute"] == pytest.approx(expert_flops / 1e15 * 1e3, rel=1e-3)
    assert curved.ms > flat.ms


def test_mxfp4_experts_read_and_hold_a_quarter_and_a_bit_of_their_bf16_bytes():
    from moe_infer.costmodel import weight_sizes

    cfg = resolve_config("mixtral-8x7b")
    bf16, mx = CostModel(cfg, machine()), CostModel(cfg, machine(), **weight_sizes("mxfp4"))
    a, b = (cm.predict(ParallelConfig(), "decode", 1, 0) for cm in (bf16, mx))
    expert = 3 * cfg.model.hidden_size * cfg.moe.expert_hidden  # weights of one expert
    layers = cfg.model.num_layers
    # batch 1 reads its two experts a layer at 4.25 bits a weight in place of 16
    assert a.split["memory"] - b.split["memory"] == pytest.approx(
        layers * 2 * expert * (2 - 4.25 / 8) / 1e12 * 1e3, rel=1e-3)
    held = layers * cfg.moe.num_experts * expert * (2 - 4.25 / 8) / 1e9
    assert a.memory_gb - b.memory_gb == pytest.approx(held, rel=0.02)
    assert weight_sizes("int8") == {"weight_bytes": 1.0} and weight_sizes(None) == {"weight_bytes": 2.0}


def test_the_kv_cache_split_by_tokens_holds_1_over_tp_of_a_copied_cache():
    from moe_infer.cli import parse_layout

    latent, gqa = resolve_config("deepseek-v2-lite"), resolve_config("qwen3-30b-a3b")  # one latent head; 4 KV heads
    cm = CostModel(latent, machine())
    heads, tokens = (cm.predict(parse_layout(f"tp4{s}", 4), "decode", 8, 4096) for s in ("", "-kv-tokens"))
    kv = latent.model.num_layers * 8 * 4096 * (latent.model.kv_lora_rank + latent.model.rotary_width) * 2
    assert heads.split["memory"] - tokens.split["memory"] == pytest.approx(kv * (1 - 1 / 4) / 1e12 * 1e3, rel=1e-3)
    assert tokens.split["collectives"] > heads.split["collectives"]
    names = {layout_name(p) for p in cm.layouts(4)}
    assert "tp4-kv-tokens" in names and "tp2-dp2-kv-tokens" in names
    gqa_names = {layout_name(p) for p in CostModel(gqa, machine()).layouts(8)}
    assert "tp8-ep8-kv-tokens" in gqa_names and not any(n.startswith("tp4") and "kv-tokens" in n for n in gqa_names)


def test_latent_attention_is_priced_as_it_runs_absorbed_at_decode_up_projected_for_prompts():
    """DeepSeek-V2-Lite (16 heads, P 128, R 64, V 128, C 512): a decode query costs 2 C + R
    = 1088 multiply-adds a key and head (the absorbed form over the latent, which all 16
    heads read: 16 rows a key); prompt tokens P + R + V = 320 at the head width (a key per
    head: the prompt's rows), plus each key's latent up-projected to every head's key and
    value once."""
    cfg = resolve_config("deepseek-v2-lite")
    cm, one = CostModel(cfg, machine()), ParallelConfig()
    projections = 2 * cm._attention(one, 1, 1, 0).weights / 2.0  # 2 FLOPs a weight a token (bf16 weights)
    n, p, r, v, c = 16, 128, 64, 128, 512
    decode = cm._attention(one, 4, 1, 1000)
    assert decode.flops == pytest.approx(4 * projections)
    assert decode.score_flops == pytest.approx(2 * 4 * 1000 * n * (2 * c + r)) and decode.score_rows == n
    prompt = cm._attention(one, 2, 512, 256)
    assert prompt.flops - 2 * 512 * projections == pytest.approx(2 * 2 * 512 * c * n * (p + v))
    assert prompt.score_flops == pytest.approx(2 * 2 * 512 * 256 * n * (p + r + v)) and prompt.score_rows == 512


def test_decode_attention_runs_at_the_rate_of_the_query_rows_sharing_a_key():
    """Qwen3-30B-A3B (32 query heads on 4 KV heads): at decode each key read serves 8 query
    rows, so its scores run at the matmul rate of 8 rows, not of the one new token; and under
    tp2 the split keeps the group (16 on 2)."""
    cfg = resolve_config("qwen3-30b-a3b")
    cm = CostModel(cfg, machine())
    a = cm._attention(ParallelConfig(), 1, 1, 2048)
    assert a.score_rows == 8 and a.score_flops == pytest.approx(4 * 2048 * 32 * 128)
    assert cm._attention(ParallelConfig(tp=2), 1, 1, 2048).score_rows == 8


def test_shipped_profiles_load_and_round_trip(tmp_path):
    names = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
    assert {"nvidia-a100-sxm", "nvidia-h100-sxm", "nvidia-h200", "tpu-v4"} <= set(names)
    for name in names:
        hw = Hardware.load(name)
        assert hw.mem_gbps > 0 and hw.matmul_tflops["bfloat16"] > 0 and hw.source
        hw.dump(tmp_path / f"{name}.yaml")
        assert Hardware.load(tmp_path / f"{name}.yaml") == hw
    with pytest.raises(ConfigError, match="no such profile .*nvidia-h100-sxm"):
        Hardware.load("nvidia-b300")


def test_parse_layout():
    p = parse_layout("tp2-ep4", 8)
    assert (p.tp, p.ep, p.dp, p.pp) == (2, 4, 4, 1)
    p = parse_layout("tp=2,pp=2,ep=4,dp-attention", 8)
    assert (p.tp, p.pp, p.dp, p.ep, p.dp_attention) == (2, 2, 2, 4, True)
    with pytest.raises(ConfigError, match="'xy3' is not one of"):
        parse_layout("xy3", 4)
    with pytest.raises(ConfigError, match="not the 4 GPUs"):
        parse_layout("tp3", 4)


def test_plan_ranks_layouts_and_refuses_what_cannot_run(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "2", "--hardware", "nvidia-h200"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mixtral-8x7b on 2 x nvidia-h200") and out[1].split()[0] == "layout"
    ms = [float(line.split()[1]) for line in out[2:] if line and not line.startswith("hardware")]
    assert ms == sorted(ms) and len(ms) > 3
    assert out[1].split()[-4:] == ["max", "batch", "max", "context"]
    assert out[2].endswith("32768 (model)")  # Mixtral's 32k positions bind before 2 x 141 GB do
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "2", "--parallel", "ep2"]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("ep2-dp2")
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "2", "--parallel", "ep3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.ep=3" in err[0]
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "1", "--hardware", "tpu-v4"]) == 2
    assert "no layout fits the memory" in capsys.readouterr().err


def test_parallel_auto_picks_a_layout_of_the_launched_ranks(tmp_path, capsys, monkeypatch):
    """--parallel auto in one process: the one-rank layout, said on stderr; a model YAML's
    ``parallel: auto`` loads the same way; without a profile for this machine, one line."""
    import yaml

    import moe_infer
    from moe_infer.costmodel import choose_layout

    args = ["generate", "--model", "tiny-moe", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu",
            "--parallel", "auto", "--hardware", "nvidia-h200"]
    assert main(args) == 0
    assert "parallel: auto chose one GPU for 1 ranks on nvidia-h200" in capsys.readouterr().err
    raw = yaml.safe_load((ROOT / "configs" / "tiny-moe.yaml").read_text())
    raw["parallel"] = "auto"
    raw.setdefault("engine", {})["hardware"] = "nvidia-h100-sxm"
    (tmp_path / "auto.yaml").write_text(yaml.safe_dump(raw))
    engine = moe_infer.load(tmp_path / "auto.yaml", device="cpu", progress=False)
    assert engine.auto_layout.startswith("parallel: auto chose one GPU") and engine.config.parallel.world_size == 1
    import moe_infer.costmodel as cm

    monkeypatch.setattr(cm, "local_profile", lambda: None)  # a machine with no shipped profile
    with pytest.raises(ConfigError, match="parallel: auto needs a hardware profile"):
        choose_layout(resolve_config("tiny-moe"), 2)
    # four GPUs of Mixtral: a layout of four ranks that fits, chosen by the predicted step
    p, note = choose_layout(resolve_config("mixtral-8x7b"), 4, "nvidia-h100-sxm", batch=1)
    assert p.world_size == 4 and "for 4 ranks on nvidia-h100-sxm" in note
    serve_only, _ = choose_layout(resolve_config("mixtral-8x7b"), 4, "nvidia-h100-sxm", batch=64, dp_attention=False)
    assert not serve_only.dp_attention
