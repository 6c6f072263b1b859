"""The MoE layer's shared experts folded into its routed experts' fused call
(``MoELayer.fold_shared``): the same outputs, and only where the layer allows it."""
import dataclasses

import pytest
import torch

import moe_infer
from hf_models import save_hf_model
from kernels.options import KernelOptions
from moe_infer.config import ConfigError, EngineConfig
from moe_infer.hf import read_hf_config
from moe_infer.model import init_random
from moe_infer.moe_layer import MoELayer


def _layer(tmp_path, family, options=KernelOptions(), **moe):
    save_hf_model(family, tmp_path)
    cfg = read_hf_config(tmp_path)
    layer = MoELayer(cfg.model, dataclasses.replace(cfg.moe, **moe), options=options).double()
    init_random(layer, torch.Generator().manual_seed(0))
    with torch.no_grad():  # norm-like 1-D parameters were set to 1: give the score bias some spread
        for p in layer.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)
    return cfg, layer


@pytest.mark.parametrize("family, n", [("deepseek_v2", 1), ("glm4_moe", 2), ("deepseek_v3", 2),
                                       ("llama4_text", 1)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_folded_shared_experts_give_the_same_output(tmp_path, family, n, tokens):
    """n shared experts of the routed width become experts E .. E + n - 1 that every token
    takes with weight 1: the outputs equal the shared MLP's plus the routed experts', to the
    combine's float32 accumulation (which now sums the shared experts' rows too)."""
    cfg, layer = _layer(tmp_path, family)
    x = torch.randn(tokens, cfg.model.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = layer(x)
        e = layer.experts.w13.shape[0]
        assert layer.fold_shared()
        assert layer.shared is None and layer.router.shared == n and layer.experts.w13.shape[0] == e + n
        assert layer.experts.w2.shape[0] == e + n and layer.experts.expert_range == (0, e + n)
        routing = layer.router(x)
        assert routing.expert_ids.shape == (tokens, cfg.moe.top_k + n)
        assert (routing.expert_ids[:, -n:] == torch.arange(e, e + n, dtype=torch.int32)).all()
        after = layer(x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-8)
    assert not layer.fold_shared()  # once


def test_fold_is_skipped_where_the_layer_does_not_allow_it(tmp_path):
    """A shared gate (Qwen2-MoE), a capacity, the option off, no shared expert: nothing moves."""
    _, gated = _layer(tmp_path / "q", "qwen2_moe")
    _, capped = _layer(tmp_path / "d", "deepseek_v2", capacity_factor=1.5)
    _, off = _layer(tmp_path / "g", "glm4_moe", KernelOptions(fold_shared_experts=False))
    _, plain = _layer(tmp_path / "m", "mixtral")
    for layer in (gated, capped, off, plain):
        w13 = layer.experts.w13
        assert not layer.fold_shared()
        assert layer.experts.w13 is w13 and layer.router.shared == 0


def test_loaded_models_fold_unless_the_engine_says_not(tmp_path):
    """Loaded models fold; not where the experts become MXFP4 (the shared experts would go
    4-bit with them), nor with the option off."""
    save_hf_model("glm4_moe", tmp_path, hidden_size=64, moe_intermediate_size=32)
    engine = moe_infer.load(checkpoint=tmp_path, device="cpu", dtype=torch.float32, progress=False)
    layers = [m for m in engine.model.modules() if isinstance(m, MoELayer)]
    assert layers and all(m.shared is None and m.router.shared == 2 for m in layers)
    four = moe_infer.load(checkpoint=tmp_path, device="cpu", dtype=torch.float32, progress=False, quantize="mxfp4")
    layers = [m for m in four.model.modules() if isinstance(m, MoELayer)]
    assert layers and all(m.shared is not None and m.router.shared == 0 and m.experts.w13.shape[0] == 9
                          for m in layers)
    ids = [[5, 17, 3, 44], [8, 2]]
    assert torch.isfinite(four.logits(ids)).all()
    with pytest.raises(ConfigError, match="fold_shared_experts"):
        EngineConfig(fold_shared_experts="no")
    with pytest.raises(ConfigError, match="overlap_shared_experts"):
        EngineConfig(overlap_shared_experts=1)
    assert not EngineConfig(overlap_shared_experts=False).kernel_options().overlap_shared_experts
