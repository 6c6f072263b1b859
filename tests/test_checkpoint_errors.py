"""Bad checkpoints fail with an error naming the file and the tensor; nothing is unpickled."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_infer
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


def test_wrong_shape(copy):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]
    edit_tensors(copy, shrink)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensors 'model\.layers\.0\.self_attn\.q_proj\.weight' \+ "
                                              r"'model\.layers\.0\.self_attn\.k_proj\.weight' \+ .* give layers\.0\.attn\.qkv_proj\.weight shape \[143, 72\], expected \[144, 72\]"):
        load(copy)


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
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"rope_type='yarn'"):
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
    qkv = Source(((p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"),))
    full = torch.cat([reader.get(n) for n in qkv.parts[0]])
    lazy = _Lazy(qkv, reader)
    assert lazy.shape == full.shape and lazy.dim() == 2
    for index in [(slice(None),), (slice(60, 100),), (slice(70, 80), slice(5, 9)), (slice(None), slice(3, 30))]:
        torch.testing.assert_close(lazy[index], full[index], rtol=0, atol=0)
    m = "model.layers.0.block_sparse_moe.experts."
    experts = Source(tuple((f"{m}{e}.w1.weight", f"{m}{e}.w3.weight") for e in range(5)), stacked=True)
    full = torch.stack([torch.cat([reader.get(n) for n in g]) for g in experts.parts])
    lazy = _Lazy(experts, reader)
    assert lazy.shape == full.shape
    torch.testing.assert_close(lazy[1:4, 30:50, 7:20], full[1:4, 30:50, 7:20], rtol=0, atol=0)
