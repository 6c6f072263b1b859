"""Latent attention's two input projections merged into one GEMM
(``LatentAttention.merge_projections``): the same queries and latent rows."""
import dataclasses

import pytest
import torch

import moe_infer
from dense.mla import LatentAttention
from dense.quant import Int8Linear
from hf_models import save_hf_model
from moe_infer.hf import read_hf_config
from moe_infer.model import init_random


@pytest.mark.parametrize("family, bias", [("deepseek_v2", False), ("deepseek_v3", False), ("deepseek_v3", True)])
def test_merged_input_projections_give_the_same_rows(tmp_path, family, bias):
    """Without q-LoRA (V2-Lite) the query projection and the latent's stack; with it (V3)
    the query's down projection and the latent's (its norm and up projection after);
    biases on either side carried over."""
    save_hf_model(family, tmp_path)
    m = dataclasses.replace(read_hf_config(tmp_path).model, qkv_bias=bias)
    attn = LatentAttention(m).double()
    init_random(attn, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 1:  # biases and norm scales: away from 0 and 1
                p.normal_(0.5, 0.3)
        x = torch.randn(2, 3, m.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        q, kv = attn._project(x)
        assert attn.merge_projections()
        assert attn.in_proj is not None and not hasattr(attn, "kv_a_proj")
        assert (attn.in_proj.bias is not None) == bias
        q2, kv2 = attn._project(x)
    torch.testing.assert_close(q2, q, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kv2, kv, rtol=1e-12, atol=1e-14)
    assert not attn.merge_projections()  # once


def test_loaded_latent_attention_runs_merged_and_quantizes_merged(tmp_path):
    save_hf_model("deepseek_v2", tmp_path)
    for quantize, kind in ((None, torch.nn.Linear), ("int8", Int8Linear)):
        engine = moe_infer.load(tmp_path, device="cpu", dtype=torch.float32, progress=False, quantize=quantize)
        layers = [m for m in engine.model.modules() if isinstance(m, LatentAttention)]
        assert layers and all(isinstance(a.in_proj, kind) for a in layers)
