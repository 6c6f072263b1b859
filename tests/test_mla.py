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


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_the_blocks_add_and_norm_go_into_the_input_projection(tmp_path, monkeypatch, family):
    """``forward_normed`` (the block's residual add and attention norm, inside the merged
    input projection's launch where its table entry says so): the same queries and latent
    rows as the layer on the normed sum, and the sum; unmerged, the norm runs before."""
    from dense.norm import RMSNorm

    save_hf_model(family, tmp_path)
    m = read_hf_config(tmp_path).model
    attn = LatentAttention(m).double()
    init_random(attn, torch.Generator().manual_seed(0))
    norm = RMSNorm(m.hidden_size, m.norm_eps).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(m.hidden_size, dtype=torch.float64, generator=gen) + 0.5)
    x, residual = (torch.randn(2, 1, m.hidden_size, dtype=torch.float64, generator=gen) for _ in range(2))
    monkeypatch.setattr(attn, "_attend", lambda q, kv, ctx, cache, layer: (q, kv))  # what attention would get
    with torch.no_grad():
        want = attn(norm(x + residual), None)
        for merged in (False, True):
            if merged:
                assert attn.merge_projections()
            (q, kv), summed = attn.forward_normed(x, residual, norm, None)
            torch.testing.assert_close(q, want[0], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(kv, want[1], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gapped", [False, True])
def test_prompt_attention_up_projected_equals_the_absorbed_form(tmp_path, family, causal, gapped):
    """Prompt tokens attend over keys and values up-projected from the latents at the head
    width (``_decompressed``); the absorbed form (scores and outputs in the latent's space,
    as decode runs) gives the same output, causal or under a mask over more keys; with the
    up projection's weight as loaded and as kept with the rotary key's gap (its views give
    the same W_UK and W_UV)."""
    import torch.nn.functional as F

    save_hf_model(family, tmp_path)
    m = read_hf_config(tmp_path).model
    attn = LatentAttention(m).double()
    init_random(attn, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(2)
    b, t, s = 2, 5, 5 if causal else 9
    n, p, r, c = attn.num_heads, attn.nope_dim, attn.rope_dim, attn.latent
    q_p = torch.randn(b, n, t, p, dtype=torch.float64, generator=gen)
    q_r = torch.randn(b, n, t, r, dtype=torch.float64, generator=gen)
    key = torch.randn(b, 1, s, c + r, dtype=torch.float64, generator=gen)
    mask = None if causal else torch.rand(b, 1, t, s, generator=gen) < 0.7
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    w = attn.kv_b_proj.weight.view(n, p + attn.v_dim, c).clone()
    if gapped:
        assert attn.gap_up_projection() and not hasattr(attn, "kv_b_proj") and not attn.gap_up_projection()
    w_uk, w_uv = attn._up_weights()
    assert torch.equal(w_uk, w[:, :p]) and torch.equal(w_uv, w[:, p:])
    with torch.no_grad():
        query = torch.cat([torch.einsum("bntp,npc->bntc", q_p, w[:, :p]), q_r], dim=-1)
        out = F.scaled_dot_product_attention(query, key.expand(-1, n, -1, -1), key[..., :c].expand(-1, n, -1, -1),
                                             attn_mask=mask, is_causal=causal, scale=attn.scale)
        want = attn._output(out, w[:, p:])
        got = attn._decompressed(torch.cat([q_p, q_r], dim=-1), key, mask, causal)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_prompts_in_pieces_give_the_whole_prefills_tokens(tmp_path):
    """A prompt prefilled in pieces (each piece's queries over the latents its earlier pieces
    cached, under a mask) gives the greedy tokens of one whole forward."""
    save_hf_model("deepseek_v3", tmp_path)
    prompts = [[5, 17, 3, 44, 12, 9, 31, 2, 8], [8, 2, 60]]
    whole = moe_infer.load(checkpoint=tmp_path, device="cpu", dtype=torch.float32, progress=False)
    parts = moe_infer.load(checkpoint=tmp_path, device="cpu", dtype=torch.float32, progress=False)
    parts.config.engine.prefill_tokens = 4
    want = [o.token_ids for o in whole.generate(prompts, max_new_tokens=4)]
    assert [o.token_ids for o in parts.generate(prompts, max_new_tokens=4)] == want
