"""Bad checkpoints fail with an error naming the file and the tensor; nothing is unpickled."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels
import moe_infer
from kernels.moe.mxfp4 import dequantize_mxfp4
from moe_infer import CheckpointError, ConfigError
from hf_models import save_hf_model


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    save_hf_model("mixtral", path)
    return path


@pytest.fixture
def copy(good, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def edit_tensors(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def load(path):
    return moe_infer.load(path, device="cpu", progress=False)


def test_missing_tensor(copy):
    edit_tensors(copy, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight'"):
        load(copy)


def test_unexpected_tensor(copy):
    edit_tensors(copy, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load(copy)


def shape_error(name, found, expected):
    """The message for a checkpoint tensor of the wrong shape, as a regex."""
    return (rf"model\.safetensors: tensor '{re.escape(name)}' has shape {re.escape(str(found))}, "
            rf"expected {re.escape(str(expected))} from config\.json")


@pytest.mark.parametrize("proj,found,expected", [("q", [71, 72], [72, 72]), ("k", [35, 72], [36, 72]),
                                                  ("v", [35, 72], [36, 72])])
def test_wrong_shape(copy, proj, found, expected):
    """Each of q, k and v is checked alone, before they are concatenated into qkv_proj."""
    name = f"model.layers.0.self_attn.{proj}_proj.weight"
    edit_tensors(copy, lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match=shape_error(name, found, expected)):
        load(copy)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a saved tiny checkpoint of it, written once per module."""
    paths = {}

    def get(family):
        if family not in paths:
            paths[family] = tmp_path_factory.mktemp(family)
            save_hf_model(family, paths[family])
        return paths[family]
    return get


def shrink_rows(t):
    return t[:-1]


def widen(t):
    return torch.cat([t, t[:1]])


def drop_column(t):
    return t[:, :-1].contiguous()


def transpose(t):
    return t.T.contiguous()


def flatten(t):
    return t.flatten()


BAD_SHAPES = [  # family, tensor, edit, found shape, expected shape
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w1.weight", shrink_rows, [39, 72], [40, 72]),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w3.weight", widen, [41, 72], [40, 72]),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.4.w2.weight", transpose, [40, 72], [72, 40]),
    ("mixtral", "model.layers.1.block_sparse_moe.gate.weight", flatten, [360], [5, 72]),
    ("mixtral", "model.layers.1.self_attn.o_proj.weight", flatten, [5184], [72, 72]),
    ("mixtral", "model.embed_tokens.weight", drop_column, [101, 71], [101, 72]),
    ("qwen2_moe", "model.layers.2.mlp.experts.6.gate_proj.weight", drop_column, [20, 59], [20, 60]),
    ("qwen2_moe", "model.layers.0.self_attn.k_proj.bias", shrink_rows, [59], [60]),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert.up_proj.weight", shrink_rows, [35, 60], [36, 60]),
    ("qwen2_moe", "model.layers.2.mlp.shared_expert.down_proj.weight", transpose, [36, 60], [60, 36]),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", flatten, [60], [1, 60]),
    ("qwen2_moe", "model.layers.1.mlp.gate_proj.weight", widen, [45, 60], [44, 60]),
    ("qwen3_moe", "model.layers.1.self_attn.q_norm.weight", widen, [11], [10]),
    ("olmoe", "model.layers.1.mlp.experts.8.gate_proj.weight", shrink_rows, [27, 84], [28, 84]),
    ("olmoe", "model.layers.0.mlp.experts.2.down_proj.weight", transpose, [28, 84], [84, 28]),
    ("olmoe", "model.layers.0.self_attn.k_norm.weight", widen, [29], [28]),
]


@pytest.mark.parametrize("family,name,edit,found,expected", BAD_SHAPES,
                         ids=[f"{b[0]}-{b[1].split('layers.')[-1]}-{b[2].__name__}" for b in BAD_SHAPES])
def test_tensor_of_wrong_shape_is_named_before_any_concatenation(saved, tmp_path, family, name, edit, found,
                                                                 expected):
    """Expert, shared-expert, router, norm and dense tensors: the file, the checkpoint
    tensor, what config.json implies and what the file holds, never a torch error from
    stacking or concatenating them."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved(family), path)
    edit_tensors(path, lambda t: t.update({name: edit(t[name])}))
    with pytest.raises(CheckpointError, match=shape_error(name, found, expected)):
        load(path)


def test_transposed_tensor_is_hinted(copy):
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    edit_tensors(copy, lambda t: t.update({name: transpose(t[name])}))
    with pytest.raises(CheckpointError, match=re.escape("expected [72, 40] from config.json (transposed?)")):
        load(copy)


def test_fused_expert_layout_of_wrong_shape(copy):
    """Experts already fused into one [E, 2F, H] tensor (transformers' in-memory layout)."""
    def fuse(t):
        m = "model.layers.0.block_sparse_moe.experts."
        for kind, parts in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
            t[m + kind] = torch.stack([torch.cat([t.pop(f"{m}{e}.{w}.weight") for w in parts]) for e in range(5)])
        t[m + "gate_up_proj"] = t[m + "gate_up_proj"][:, :-1].contiguous()
    edit_tensors(copy, fuse)
    with pytest.raises(CheckpointError, match=shape_error("model.layers.0.block_sparse_moe.experts.gate_up_proj",
                                                          [5, 79, 72], [5, 80, 72])):
        load(copy)


def non_finite_error(name, nan, inf):
    return (rf"model\.safetensors: tensor '{re.escape(name)}' has {nan} NaN and {inf} infinite values; "
            rf"expected finite weights")


def test_nan_in_an_expert_tensor(copy):
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"

    def poison(t):
        t[name][7, 11] = float("nan")
        t[name][0, 0] = float("nan")
    edit_tensors(copy, poison)
    with pytest.raises(CheckpointError, match=non_finite_error(name, 2, 0)):
        load(copy)


def test_inf_in_a_norm_weight(copy):
    name = "model.layers.1.post_attention_layernorm.weight"

    def poison(t):
        t[name][5] = float("-inf")
    edit_tensors(copy, poison)
    with pytest.raises(CheckpointError, match=non_finite_error(name, 0, 1)):
        load(copy)


def test_values_beyond_the_model_dtype(copy, good):
    """A float32 weight too large for float16 would turn into inf on the way in."""
    name = "model.layers.0.self_attn.o_proj.weight"

    def enlarge(t):
        t[name][3, 4] = 1e6
    edit_tensors(copy, enlarge)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{re.escape(name)}' has values up to "
                                              rf"1e\+06, beyond the range of torch\.float16"):
        moe_infer.load(copy, device="cpu", dtype="float16", progress=False)
    moe_infer.load(copy, device="cpu", dtype="float32", progress=False)  # finite in float32: fine
    moe_infer.load(good, device="cpu", dtype="float16", progress=False)


def test_wrong_dtype(copy):
    edit_tensors(copy, lambda t: t.update({"model.norm.weight": torch.ones(72, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"tensor .model\.norm\.weight. has dtype I32, expected a float"):
        load(copy)


def test_pickle_only_checkpoint_is_refused_unread(copy):
    (copy / "model.safetensors").unlink()
    # A file whose unpickling would raise loudly: it must never be opened as a pickle.
    (copy / "pytorch_model.bin").write_bytes(b"\x80\x04cbuiltins\nexit\n.")
    with pytest.raises(CheckpointError, match=r"found pytorch_model\.bin but no \*\.safetensors; .*never unpickles"):
        load(copy)


def test_truncated_file(copy):
    f = copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: "):
        load(copy)


def test_sharded_checkpoint_loads_and_missing_shard_is_named(copy, good):
    tensors = load_file(copy / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    (copy / "model.safetensors").unlink()
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, copy / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    a = load(copy).logits([[1, 2, 3]])
    b = load(good).logits([[1, 2, 3]])
    torch.testing.assert_close(a, b)
    (copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: listed in model\.safetensors\.index\.json but not found"):
        load(copy)


def test_unsupported_architecture_and_rope(copy):
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"config\.json: model_type='llama'.*expected one of MixtralForCausalLM"):
        load(copy)
    cfg["rope_parameters"] = {"rope_type": "proportional", "factor": 4.0, "rope_theta": 1e4}
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"rope_type='proportional': expected default or one of linear"):
        load(copy)


def test_impossible_config_json(copy):
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    with pytest.raises(ConfigError, match=r"config\.json: moe\.top_k=9: expected at most moe\.num_experts=5"):
        load(copy)


def test_not_a_model_path(tmp_path):
    with pytest.raises(ConfigError, match=r"'no-such-model': not a checkpoint directory, a \.yaml file or a built-in name"):
        moe_infer.load("no-such-model")
    with pytest.raises(ConfigError, match=r"config\.json: not found"):
        moe_infer.load(tmp_path)


def test_lazy_view_reads_the_same_values_as_the_whole_tensor(good):
    """Sharded loading indexes a lazy view of the checkpoint; any slice of it equals the
    same slice of the assembled tensor (q/k/v concatenated; experts stacked)."""
    from moe_infer.checkpoint import _Lazy, _Reader, safetensors_files
    from moe_infer.hf import Source

    reader = _Reader(safetensors_files(good))
    p = "model.layers.1.self_attn."
    qkv = Source(((p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"),),
                 (((72, 72), (36, 72), (36, 72)),))
    full = torch.cat([reader.get(n) for n in qkv.parts[0]])
    lazy = _Lazy(qkv, reader)
    assert lazy.shape == full.shape and lazy.dim() == 2
    for index in [(slice(None),), (slice(60, 100),), (slice(70, 80), slice(5, 9)), (slice(None), slice(3, 30))]:
        torch.testing.assert_close(lazy[index], full[index], rtol=0, atol=0)
    m = "model.layers.0.block_sparse_moe.experts."
    experts = Source(tuple((f"{m}{e}.w1.weight", f"{m}{e}.w3.weight") for e in range(5)),
                     (((40, 72), (40, 72)),) * 5, stacked=True)
    full = torch.stack([torch.cat([reader.get(n) for n in g]) for g in experts.parts])
    lazy = _Lazy(experts, reader)
    assert lazy.shape == full.shape
    torch.testing.assert_close(lazy[1:4, 30:50, 7:20], full[1:4, 30:50, 7:20], rtol=0, atol=0)


def test_gpt_oss_configs_the_kernels_do_not_compute_are_refused(saved, tmp_path):
    """Another clamp or slope of GPT-OSS's SwiGLU, a quantization other than MXFP4 and layer
    types other than sliding / full attention: one line each."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved("gpt_oss"), path)
    cfg = json.loads((path / "config.json").read_text())
    for edit, match in (({"swiglu_limit": 10.0}, r"swiglu_limit=10\.0: expected 7\.0"),
                        ({"swiglu_alpha": 1.0}, r"swiglu_alpha=1\.0: expected 1\.702"),
                        ({"quantization_config": {"quant_method": "fp8"}},
                         r"quant_method='fp8': expected mxfp4 or an unquantized checkpoint"),
                        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
                         r"layer_types=.*'chunked_attention'.*expected num_hidden_layers=3 entries"),
                        ({"layer_types": ["full_attention"]}, r"expected num_hidden_layers=3 entries")):
        (path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ConfigError, match=match):
            load(path)
    # Every layer full attention: no window at all; every layer sliding: the one window for all.
    from moe_infer.hf import config_from_hf
    m = config_from_hf({**cfg, "layer_types": ["full_attention"] * 3}).model
    assert m.sliding_window is None and m.sliding_layers == ()
    m = config_from_hf({**cfg, "layer_types": ["sliding_attention"] * 3}).model
    assert m.sliding_window == 5 and m.sliding_layers == ()
    m = config_from_hf(cfg).model
    assert m.sliding_layers == (0, 2) and m.attention_sinks and m.activation == "swiglu_oai"


def test_gpt_oss_expert_layout_is_rearranged_lazily(saved):
    """GPT-OSS's gate_up_proj [E, H, 2F] (gate and up interleaved) and down_proj [E, F, H]
    read as our w13 [E, 2F, H] and w2 [E, H, F], sliced as any other tensor."""
    from moe_infer.checkpoint import _Lazy, _Reader, safetensors_files
    from moe_infer.hf import _gate_up, _transposed, rearranged

    reader = _Reader(safetensors_files(saved("gpt_oss")))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    raw = reader.get(name)  # [7, 60, 40]
    lazy = _Lazy(rearranged(name, (7, 60, 40), _gate_up, (7, 40, 60)), reader)
    assert lazy.shape == (7, 40, 60)
    torch.testing.assert_close(lazy[2:5, 3:9], torch.cat([raw[2:5, :, 0::2], raw[2:5, :, 1::2]], -1)
                               .transpose(1, 2)[:, 3:9], rtol=0, atol=0)
    down = reader.get("model.layers.0.mlp.experts.down_proj")
    lazy = _Lazy(rearranged("model.layers.0.mlp.experts.down_proj", (7, 20, 60), _transposed, (7, 60, 20)), reader)
    torch.testing.assert_close(lazy[:], down.transpose(1, 2), rtol=0, atol=0)


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] -> MXFP4 blocks [..., R, K / 32, 16] and scales [..., R, K / 32], the
    checkpoint format (``kernels.quantize_mxfp4``'s codes, in groups of 16 bytes)."""
    packed, scales = kernels.quantize_mxfp4(w.float())
    return packed.unflatten(-1, (-1, 16)), scales


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path, monkeypatch):
    """A checkpoint in GPT-OSS's MXFP4 layout (``*_blocks`` / ``*_scales``, written from known
    weights) loads to the values of transformers' own dequantization, rearranged to ours;
    and the model generates."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moe_infer.hf import _gate_up

    save_hf_model("gpt_oss", tmp_path, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=32)
    tensors, expected = load_file(tmp_path / "model.safetensors"), {}
    for i in range(3):
        m = f"model.layers.{i}.mlp.experts."
        for kind in ("gate_up_proj", "down_proj"):
            blocks, scales = to_mxfp4(tensors.pop(m + kind).transpose(1, 2))  # [E, out, in]: packed along in
            tensors[m + kind + "_blocks"], tensors[m + kind + "_scales"] = blocks, scales
            ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # the unquantized layout
            expected[(i, kind)] = _gate_up(ref) if kind == "gate_up_proj" else ref.transpose(1, 2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = moe_infer.load(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    for i in range(3):
        experts = engine.model.layers[i].ffn.experts
        torch.testing.assert_close(experts.w13.data, expected[(i, "gate_up_proj")], rtol=0, atol=0)
        torch.testing.assert_close(experts.w2.data, expected[(i, "down_proj")], rtol=0, atol=0)
    assert len(engine.generate([[5, 17, 3]], max_new_tokens=4)[0].token_ids) == 4
    from moe_infer.experts import Mxfp4Experts

    # kept 4-bit (engine.quantize: mxfp4): the checkpoint's codes and scales read as they are
    # (nothing quantized: the experts never exist in full precision), the same tokens
    with monkeypatch.context() as patch:
        patch.setattr(Mxfp4Experts, "quantize", staticmethod(lambda *a: pytest.fail("quantized instead of read")))
        four = moe_infer.load(tmp_path, device="cpu", dtype=torch.float32, progress=False, quantize="mxfp4")
    for i in range(3):
        experts = four.model.layers[i].ffn.experts
        assert experts.w13.dtype == torch.uint8 and experts.w13.shape[-1] == expected[(i, "gate_up_proj")].shape[-1] // 2
        torch.testing.assert_close(dequantize_mxfp4(experts.w13, experts.w13_scale, torch.float32),
                                   expected[(i, "gate_up_proj")], rtol=0, atol=0)
        torch.testing.assert_close(dequantize_mxfp4(experts.w2, experts.w2_scale, torch.float32),
                                   expected[(i, "down_proj")], rtol=0, atol=0)
    prompts = [[5, 17, 3], [9, 2, 44, 1]]
    assert [o.token_ids for o in four.generate(prompts, max_new_tokens=6)] == \
        [o.token_ids for o in engine.generate(prompts, max_new_tokens=6)]
    cfg["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"intermediate_size=40: expected a multiple of 32"):
        load(tmp_path)


def test_llama4_layer_lists_of_the_wrong_length_or_kind_are_refused(saved, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(saved("llama4_text"), path)
    cfg = json.loads((path / "config.json").read_text())
    for edit in ({"no_rope_layers": [1, 0]}, {"layer_types": ["chunked_attention", "sliding_attention"] * 2}):
        (path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ConfigError, match=r"expected num_hidden_layers=4 entries each"):
            load(path)
    from moe_infer.hf import config_from_hf
    read = config_from_hf(cfg)
    m, e = read.model, read.moe
    assert (m.chunked_layers, m.nope_layers, m.attention_chunk, m.nope_temperature) == ((0, 1, 2), (3,), 4, (3.0, 0.5))
    assert m.qk_norm == "l2" and m.rope_interleaved and e.weighted_input and e.dense_layers == (0, 2)
    m = config_from_hf({**cfg, "attn_temperature_tuning": False, "use_qk_norm": False,
                        "attention_chunk_size": None}).model
    assert (m.nope_temperature, m.qk_norm, m.chunked_layers, m.attention_chunk) == (None, "none", (), None)


def test_deepseek_multi_token_prediction_layers_are_skipped_with_a_note(saved, tmp_path, caplog):
    """DeepSeek-V3 checkpoints carry the multi-token-prediction layer after the last one:
    skipped at load, with a note; a stray tensor of a real layer is still refused."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved("deepseek_v3"), path)
    edit_tensors(path, lambda t: t.update({"model.layers.3.eh_proj.weight": torch.zeros(60, 120),
                                           "model.layers.3.enorm.weight": torch.ones(60)}))
    with caplog.at_level("WARNING", logger="moe_infer.checkpoint"):
        load(path)
    assert "skipped 2 tensors of the multi-token-prediction layers (layers 3 and on)" in caplog.text
    edit_tensors(path, lambda t: t.update({"model.layers.1.eh_proj.weight": torch.zeros(60, 120)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.1\.eh_proj\.weight'"):
        load(path)


def test_fp8_block_scaled_weights_load_dequantized(saved, tmp_path):
    """DeepSeek-V3's release format (quant_method fp8): float8 e4m3 linear weights, each
    with a float32 weight_scale_inv per 16 x 16 block here (partial blocks at the edges),
    load as w * scale; the scales count as read; a scale of the wrong shape is named."""
    from moe_infer.checkpoint import dequantize_fp8

    path = tmp_path / "ckpt"
    shutil.copytree(saved("deepseek_v3"), path)
    block, expected = (16, 16), {}

    def to_fp8(t):
        for name in [n for n in t if n.endswith("proj.weight") and "layers." in n]:
            w = t[name].float()
            rows, cols = -(-w.shape[0] // 16), -(-w.shape[1] // 16)
            amax = torch.zeros(rows, cols)
            for i in range(rows):
                for j in range(cols):
                    amax[i, j] = w[16 * i:16 * i + 16, 16 * j:16 * j + 16].abs().max()
            scale = (amax / 448.0).clamp(min=1e-12)
            full = scale.repeat_interleave(16, 0)[:w.shape[0]].repeat_interleave(16, 1)[:, :w.shape[1]]
            t[name] = (w / full).to(torch.float8_e4m3fn)
            t[name + "_scale_inv"] = scale
            expected[name] = dequantize_fp8(t[name], scale, block)
    edit_tensors(path, to_fp8)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(cfg))
    engine = load(path)
    attn = engine.model.layers[1].attn
    kv_b = torch.cat(attn._up_weights(), dim=1).reshape(-1, attn.latent)  # (kept with the rotary key's gap)
    torch.testing.assert_close(kv_b, expected["model.layers.1.self_attn.kv_b_proj.weight"], rtol=0, atol=0)
    w13 = engine.model.layers[1].ffn.experts.w13.data[4]
    m = "model.layers.1.mlp.experts.4."
    torch.testing.assert_close(w13, torch.cat([expected[m + "gate_proj.weight"], expected[m + "up_proj.weight"]]),
                               rtol=0, atol=0)
    assert len(engine.generate([[5, 17, 3]], max_new_tokens=3)[0].token_ids) == 3
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    edit_tensors(path, lambda t: t.update({name: t[name][:1]}))
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name!r} has shape [1, 4], expected [2, 4]")):
        load(path)
