"""Configs: presets load, and every bad value fails at load with one line naming it."""
import pytest
import yaml

from kernels.options import KernelOptions
from moe_infer.config import ConfigError, EngineConfig
from moe_infer.config_files import config_from_dict, load_preset, load_yaml_config, preset_names

BASE = {
    "model": dict(vocab_size=128, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, ffn_hidden=64),
    "moe": dict(num_experts=6, top_k=2, expert_hidden=32),
}


def with_change(section, **kw):
    data = {k: dict(v) for k, v in BASE.items()}
    data.setdefault(section, {}).update(kw)
    return data


def test_every_preset_loads():
    names = preset_names()
    for expected in ["default", "mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "olmoe-1b-7b", "glm-4.5-air",
                     "gpt-oss-20b", "deepseek-v2-lite", "ds-moe-1.3b-e128", "ds-moe-47b-e128", "gpt-j-6b", "lm-530b"]:
        assert expected in names
    for name in names:
        cfg = load_preset(name)
        assert cfg.model.hidden_size % cfg.parallel.tp == 0


def test_table_ii_presets_match_the_paper():
    cfg = load_preset("ds-moe-24b-e128")
    m, e, p = cfg.model, cfg.moe, cfg.parallel
    assert (m.num_layers, m.hidden_size, p.tp, p.ep, p.expert_slicing, p.world_size) == (40, 8192, 8, 128, 2, 256)
    assert (m.norm, m.activation, m.positions, e.top_k, e.every) == ("layernorm", "gelu", "learned", 1, 2)
    assert [i for i in range(m.num_layers) if cfg.is_moe_layer(i)][:3] == [1, 3, 5]


@pytest.mark.parametrize("data,match", [
    (with_change("model", hidden=48), r"model\.hidden=48: unknown key \(did you mean 'hidden_size'\?\)"),
    (with_change("model", num_layers="four"), r"model\.num_layers='four': expected an integer"),
    (with_change("model", num_layers=True), r"model\.num_layers=True: expected an integer"),
    (with_change("model", hidden_size=50), r"model\.num_heads=6: expected a divisor of model\.hidden_size=50"),
    (with_change("model", num_kv_heads=4), r"model\.num_kv_heads=4: expected a divisor of model\.num_heads=6"),
    (with_change("model", norm="batchnorm"), r"model\.norm='batchnorm': expected one of rmsnorm, layernorm"),
    (with_change("model", vocab_size=-3), r"model\.vocab_size=-3: expected a positive number"),
    (with_change("moe", top_k=7), r"moe\.top_k=7: expected at most moe\.num_experts=6"),
    (with_change("moe", shared_expert_gate=True), r"moe\.shared_expert_gate=True"),
    (with_change("moe", every=3, first_dense=2), r"moe='no MoE layer'"),
    (with_change("parallel", ep=4, dp=4), r"parallel\.ep=4: expected a divisor of moe\.num_experts=6"),
    (with_change("parallel", tp=4), r"parallel\.tp=4: expected a divisor of model\.num_heads=6"),
    (with_change("parallel", tp=2, ep=4), r"parallel\.ep=4: expected ep \* expert_slicing \(4\) dividing"),
    (with_change("parallel", a2a_fixed_tokens=-1), r"parallel\.a2a_fixed_tokens=-1: expected an integer >= 0"),
    (with_change("parallel", pp=9), r"parallel\.pp=9: expected at most model\.num_layers=\d+ \(a block or more a stage\)"),
    (with_change("parallel", all_reduce="mpi"), r"parallel\.all_reduce='mpi': expected one of auto, nccl"),
    (with_change("parallel", dp_attention="yes"), r"parallel\.dp_attention='yes': expected true or false"),
    (with_change("parallel", dp_attention=True), r"parallel\.dp_attention=True: expected false for this layout: "
                                                 r"it needs data-parallel replicas \(dp > 1, got 1\)"),
    (with_change("parallel", dp=2, dp_attention=True), r"parallel\.dp_attention=True: expected false"),
    (with_change("engine", max_seq_len=10 ** 6), r"engine\.max_seq_len=1000000: expected at most model\.max_position"),
    (with_change("engine", dtype="fp8"), r"engine\.dtype='fp8'"),
    (with_change("engine", prefill_tokens=0), r"engine\.prefill_tokens=0: expected a positive number"),
    (with_change("engine", prefill_tokens=2.5), r"engine\.prefill_tokens=2\.5: expected an integer"),
    (with_change("engine", prefill_graph_tokens=-1), r"engine\.prefill_graph_tokens=-1: expected an integer >= 0"),
    (with_change("engine", prefill_graph_tokens=True), r"engine\.prefill_graph_tokens=True: expected an integer"),
    (with_change("engine", pdl="off"), r"engine\.pdl='off': expected true or false"),
    (with_change("engine", gpu_memory_gb=0), r"engine\.gpu_memory_gb=0\.0: expected a positive number of GB, or null"),
    (with_change("engine", offload="disk"), r"engine\.offload='disk': expected one of auto, cpu, stream, layers"),
    (with_change("engine", offload="layers", gpu_memory_gb=8), r"engine\.gpu_memory_gb=8(\.0)?: expected null with "
                                                              r"offload: layers"),
    (with_change("engine", prefetch_layers=-1), r"engine\.prefetch_layers=-1: expected an integer >= 0"),
    (with_change("engine", offload_dir="/tmp/x"), r"engine\.offload_dir='/tmp/x': expected null unless "
                                                  r"gpu_memory_gb or offload: layers"),
    (with_change("engine", fused_decode_attention=0), r"engine\.fused_decode_attention=0: expected true or false"),
    ({**BASE, "model": {**BASE["model"], "num_heads": 4, "num_kv_heads": 2},
      "parallel": dict(tp=4, dp=1, ep=2, expert_slicing=1)}, r"parallel\.pcc=True: expected false for this layout"),
    ({**with_change("parallel", dp=2, ep=2), "moe": {**BASE["moe"], "capacity_factor": 1.25}},
     r"moe\.capacity_factor=1\.25: expected null \(expert parallelism runs dropless\)"),
    ({**BASE, "modle": {}}, r"modle=\{\}: expected a top-level key"),
    ({"moe": BASE["moe"]}, r"expected a 'model' section"),
    (with_change("model", num_heads=None), r"model\.num_heads=None: expected an integer"),
])
def test_bad_config_fails_with_one_line_naming_the_key(data, match):
    with pytest.raises(ConfigError, match=match) as info:
        config_from_dict(data)
    assert "\n" not in str(info.value)


def test_kernel_options_come_from_the_engine_section():
    """``engine: {pdl, fused_decode_attention}`` (both on by default) fill the options the
    model hands its layers; a non-boolean built in code fails naming the key."""
    assert config_from_dict(BASE).engine.kernel_options() == KernelOptions(pdl=True, fused_decode_attention=True)
    cfg = config_from_dict(with_change("engine", pdl=False, fused_decode_attention=False))
    assert cfg.engine.kernel_options() == KernelOptions(pdl=False, fused_decode_attention=False)
    assert config_from_dict(with_change("engine", pdl=False)).engine.kernel_options() == KernelOptions(pdl=False)
    with pytest.raises(ConfigError, match=r"^engine\.pdl='no': expected true or false$"):
        EngineConfig(pdl="no")
    with pytest.raises(ConfigError, match=r"^engine\.fused_decode_attention=1: expected true or false$"):
        EngineConfig(fused_decode_attention=1)
    off = config_from_dict(with_change("engine", cudnn_prefill_graphs=False)).engine.kernel_options()
    assert off == KernelOptions(cudnn_prefill_graphs=False) and KernelOptions().cudnn_prefill_graphs
    with pytest.raises(ConfigError, match=r"^engine\.cudnn_prefill_graphs='yes': expected true or false$"):
        EngineConfig(cudnn_prefill_graphs="yes")


def test_missing_required_key_is_named():
    data = with_change("model")
    del data["model"]["ffn_hidden"]
    with pytest.raises(ConfigError, match=r"model\.ffn_hidden='<missing>'"):
        config_from_dict(data)


def test_yaml_file_round_trip_and_syntax_error(tmp_path):
    good = tmp_path / "m.yaml"
    good.write_text(yaml.safe_dump(BASE))
    cfg = load_yaml_config(good)
    assert cfg.moe.num_experts == 6 and cfg.model.num_kv_heads == 2 and cfg.model.head_dim == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {hidden_size: 4\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_yaml_config(bad)


@pytest.mark.parametrize("name,arch", [("glm-4.5-air", "Glm4MoeForCausalLM"), ("gpt-oss-20b", "GptOssForCausalLM"),
                                       ("deepseek-v2-lite", "DeepseekV2ForCausalLM")])
def test_family_preset_is_what_its_config_json_gives(name, arch):
    """The glm-4.5-air, gpt-oss-20b and deepseek-v2-lite presets' model and MoE sections equal
    those read from a transformers config of their shape (bench_decode's peer config)."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        from peer_configs import hf_config
    finally:
        sys.path.pop(0)
    from moe_infer.hf import config_from_hf

    preset = load_preset(name)
    hf = {**hf_config(preset).to_dict(), "architectures": [arch]}
    read = config_from_hf(hf)
    assert read.model == preset.model and read.moe == preset.moe


def test_every_preset_resolves_by_its_name():
    """Names with dots (qwen1.5-moe-a2.7b, glm-4.5-air) are presets, not file names with a suffix."""
    from moe_infer.loader import resolve_config

    for name in preset_names():
        assert resolve_config(name).model == load_preset(name).model, name
    with pytest.raises(ConfigError, match=r"no-such\.7b: not a checkpoint directory or a \.yaml file"):
        resolve_config("no-such.7b")


def test_kv_shard_is_checked_against_the_layout_and_the_attention():
    import dataclasses

    from moe_infer.config import ParallelConfig
    from moe_infer.loader import resolve_config

    with pytest.raises(ConfigError, match=r"parallel\.kv_shard='rows': expected one of heads, tokens"):
        ParallelConfig(kv_shard="rows")
    with pytest.raises(ConfigError, match=r"parallel\.kv_shard='tokens': expected heads with tp = 1"):
        ParallelConfig(kv_shard="tokens")
    cfg = resolve_config("tiny-moe")
    offloaded = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, kv_offload="all"))
    with pytest.raises(ConfigError, match=r"parallel\.kv_shard='tokens': expected heads with engine\.kv_offload"):
        dataclasses.replace(offloaded, parallel=ParallelConfig(tp=2, kv_shard="tokens"))
    cfg = resolve_config("tiny-moe")
    assert dataclasses.replace(cfg, parallel=ParallelConfig(tp=2, kv_shard="tokens")).parallel.kv_shard == "tokens"
