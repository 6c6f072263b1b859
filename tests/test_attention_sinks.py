"""Attention sinks (GPT-OSS) outside the decode kernel: ``Attention._sdpa_sinks`` against the
softmax written out with the sink column, for every mask a step passes, and with a mask of one
row's size, never one per head (a long prompt's prefill would hold heads x T x S of it)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dense.attention import Attention, StepContext


def _sink_attention(heads, head_dim, seed=0):
    cfg = SimpleNamespace(head_dim=head_dim, num_heads=heads[0], num_kv_heads=heads[1], hidden_size=4 * head_dim,
                          qkv_bias=True, out_bias=True, qk_norm=None, norm_eps=1e-6, clip_qkv=None,
                          attention_sinks=True)
    attn = Attention(cfg).double()
    torch.manual_seed(seed)
    with torch.no_grad():
        attn.sinks.normal_(0, 2.0)
    return attn


def _reference(q, k, v, sinks, allowed):
    """softmax([scores, sink]) @ [v, 0] in float64; ``allowed`` [B or 1, 1, T, S] bool."""
    hq, hkv = q.shape[1], k.shape[1]
    k, v = (z.repeat_interleave(hq // hkv, dim=1) for z in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return weights @ v


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
def test_sink_attention_equals_the_softmax_with_a_sink_column(heads, mask, monkeypatch):
    attn = _sink_attention(heads, head_dim=16)
    b, t, s, d = 3, 5, 5 if mask == "causal" else 11, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, heads[0], t, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, heads[1], s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    if mask == "causal":
        allowed = torch.ones(t, s, dtype=torch.bool).tril()[None, None]
        ctx = StepContext(None, None, None, None, causal=True)
    else:
        allowed = torch.rand(b, 1, t, s, generator=gen) < 0.6
        allowed[..., 0] = True  # every query sees a key (a row of none is the sink's alone: also fine)
        given = allowed if mask == "bool" else torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
            ~allowed, float("-inf"))
        ctx = StepContext(None, given, None, None)
    shapes = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: shapes.append(kw["attn_mask"].shape) or real(*a, **kw))
    got = attn._sdpa_sinks(q, k, v, ctx)
    want = _reference(q, k, v, attn.sinks.detach().double(), allowed)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(shapes) == 1 and shapes[0][1] == 1, shapes  # one mask row per sequence, not per head


@pytest.mark.parametrize("sinks", [False, True])
def test_partial_attentions_over_split_keys_combine_to_the_whole(sinks):
    """``dense.kv_shard``: attention over each rank's share of the keys, merged by the
    shares of the softmax's denominator (``kernels.merge_partials``), equals attention over
    all keys; a row with no key in a share, or none at all (padding), gets no NaN."""
    from kernels import merge_partials
    from kernels.attention.reference import partial_attention_ref as partial_attention

    gen = torch.Generator().manual_seed(2)
    b, h, hkv, t, s, d, ranks = 3, 4, 2, 2, 10, 8, 3
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(b, 1, t, s, generator=gen) < 0.7
    allowed[2] = False  # a padding row: no key at all
    owner = torch.arange(s) % ranks  # each key on one rank
    parts = [partial_attention(q, k, v, allowed & (owner == r), d ** -0.5) for r in range(ranks)]
    sink = torch.randn(h, generator=gen, dtype=torch.float64) if sinks else None
    packed = torch.stack([torch.cat([o, lse[..., None]], dim=-1).transpose(0, 1)
                          for o, lse in parts])  # [P, H, B, T, D + 1]
    got = merge_partials(packed, sink, torch.float64)
    assert torch.isfinite(got).all() and not got[2].any()
    want = _reference(q[:2], k[:2], v[:2], sink if sinks else torch.full((h,), -torch.inf, dtype=torch.float64),
                      allowed[:2])
    torch.testing.assert_close(got[:2], want, rtol=1e-10, atol=1e-12)
