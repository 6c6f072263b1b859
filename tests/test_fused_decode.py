"""The attention module's fused decode paths: the QKV epilogue kernel (q/k norms, clip,
rotary, KV-cache append) and the one-launch decode attention must match the unfused torch
ops, in a decode step and a prefill, over the paged cache (on the CPU through the kernels'
references, and on a GPU; there also replayed in a CUDA graph). The kernels alone against
their references are in tests/kernels/ (test_decode_attention.py, test_qkv_attention.py,
test_norm.py)."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.options import KernelOptions

# (device, dtype) of the paged tests: the CPU runs the kernels' torch references.
PAGED_DEVICES = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                 pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _attention(qk_norm: str, seed: int, device="cuda", dtype=torch.bfloat16, options=None, heads=(8, 2), head_dim=64,
               clip=None):
    """An attention block (GQA ``heads`` = (Hq, Hkv), hidden 4 D) with random weights (the
    same for a seed, whatever the ``KernelOptions``)."""
    from types import SimpleNamespace

    from dense.attention import Attention

    cfg = SimpleNamespace(head_dim=head_dim, num_heads=heads[0], num_kv_heads=heads[1], hidden_size=4 * head_dim,
                          qkv_bias=False, out_bias=False, qk_norm=qk_norm, norm_eps=1e-6, clip_qkv=clip)
    torch.manual_seed(seed)
    attn = Attention(cfg, options=options or KernelOptions()).to(device, dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.05)
    return attn


def _paged_case(attn, device, dtype, starts, news, seed, block=4):
    """A step over a PagedKVCache of random contents: rows that hold ``starts`` tokens add
    ``news`` (0: a padding row, as the fixed-shape decode step pads), left-padded to
    T = max(news), their tokens in scattered blocks -> (x [B, T, H], ctx, cache)."""
    from dense.attention import PagedKVCache, StepContext
    from dense.rotary import Rotary

    gen = torch.Generator().manual_seed(seed)
    b, t, d = len(starts), max(news), attn.head_dim
    lens = [st + n for st, n in zip(starts, news)]
    keys = max(lens)
    blocks = -(-keys // block)
    cache = PagedKVCache(1, b * blocks, block, attn.num_kv_heads, d, dtype, device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen)), cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    tables = torch.randperm(b * blocks, generator=gen).view(b, blocks)
    positions, valid, write = [], [], []
    for row, (st, n) in enumerate(zip(starts, news)):
        positions.append([0] * (t - n) + list(range(st, st + n)))
        valid.append([False] * (t - n) + [True] * n)
        write.append([cache.trash] * (t - n) + [int(tables[row, i // block]) * block + i % block
                                                for i in range(st, st + n)])
    dev = lambda z: torch.tensor(z, device=device)  # noqa: E731
    cache.set_step(dev(write), tables.to(device), dev(lens), keys)
    fresh = all(st == 0 and n == t for st, n in zip(starts, news))
    ctx = StepContext.paged(dev(positions), dev(valid), dev(lens), keys, Rotary(d, 10000.0), dtype, causal=fresh)
    x = torch.randn(b, t, 4 * d, generator=gen).to(device, dtype)
    return x, ctx, cache


def _unfused_paged(attn, x, ctx, cache):
    """The torch ops on a copy of the pool: the module's unfused q, k, v, written at the
    step's slots, every row's keys gathered, SDPA under the mask as a bool one (the causal
    one where the context has none) -> (output
    [B, T, H], k pool, v pool)."""
    b, t, _ = x.shape
    k_pool, v_pool = cache.k[0].clone(), cache.v[0].clone()
    q, k, v = attn._unfused(attn.qkv_proj(x), ctx)
    rows = cache.write_slots.reshape(-1)
    k_pool.index_copy_(0, rows, k.transpose(1, 2).reshape(b * t, attn.num_kv_heads, attn.head_dim))
    v_pool.index_copy_(0, rows, v.transpose(1, 2).reshape(b * t, attn.num_kv_heads, attn.head_dim))
    kk, vv = k_pool[cache.read_slots].transpose(1, 2), v_pool[cache.read_slots].transpose(1, 2)
    if ctx.attn_mask is None:  # causal: each query sees the keys up to its position
        mask = (torch.arange(kk.shape[2], device=x.device) <= ctx.positions[:, :, None])[:, None]
    else:
        mask = ctx.attn_mask if ctx.attn_mask.dtype == torch.bool else ctx.attn_mask > float("-inf")
    out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k_pool, v_pool


def _count_calls(monkeypatch, *names):
    """{name: calls} of these ops of ``kernels``, counted from now on."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        def counted(*a, _name=name, _op=getattr(kernels, name), **k):
            calls[_name] += 1
            return _op(*a, **k)
        monkeypatch.setattr(kernels, name, counted)
    return calls


def _assert_paged_equal(attn, x, ctx, cache, dtype):
    """The module's step over the cache against ``_unfused_paged``: output and pool (the
    trash row aside: padding tokens all write there)."""
    with torch.no_grad():
        want, k_ref, v_ref = _unfused_paged(attn, x, ctx, cache)
        got = attn(x, ctx, cache, 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == want.shape and rel(got, want) < tol
    written = cache.write_slots[cache.write_slots != cache.trash]
    assert rel(cache.k[0, written], k_ref[written]) < tol / 2 and rel(cache.v[0, written], v_ref[written]) < tol / 2
    others = torch.ones(cache.trash, dtype=torch.bool, device=x.device).index_fill_(0, written, False)
    assert torch.equal(cache.k[0, :-1][others], k_ref[:-1][others])
    assert torch.equal(cache.v[0, :-1][others], v_ref[:-1][others])


@pytest.mark.parametrize("device,dtype", PAGED_DEVICES)
@pytest.mark.parametrize("qk_norm,clip", [("none", None), ("head", 1.5), ("full", None)])
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 16), ((8, 2), 16), ((8, 2), 24)])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bool_mask", [False, True])
def test_paged_decode_step_equals_the_unfused_math(device, dtype, qk_norm, clip, heads, head_dim, fused, bool_mask,
                                                   monkeypatch):
    """A decode step over a PagedKVCache (rows of different depths, a padding row): the one
    launch (kernels.qkv_attention) where the option allows it, else the epilogue launch
    (kernels.qkv_decode at the write slots) and then the pool read in place; a head dim
    the kernels do not take (24) runs the torch ops. The
    same output and pool as the torch ops, with StepContext.paged's additive mask or a
    bool one (as kernels.attention.paged_context builds it without ``bias``)."""
    attn = _attention(qk_norm, 3, device, dtype, KernelOptions(fused_decode_attention=fused), heads, head_dim, clip)
    x, ctx, cache = _paged_case(attn, device, dtype, starts=[9, 2, 0, 5], news=[1, 1, 0, 1], seed=4)
    assert ctx.attn_mask.dtype == dtype and ctx.attn_mask.shape == (4, 1, 1, 10) and not ctx.causal
    if bool_mask:
        ctx.attn_mask = ctx.attn_mask > float("-inf")
    calls = _count_calls(monkeypatch, "qkv_attention", "qkv_decode")
    _assert_paged_equal(attn, x, ctx, cache, dtype)
    kernel = head_dim == 16
    assert calls == {"qkv_attention": int(kernel and fused), "qkv_decode": int(kernel and not fused)}


@pytest.mark.parametrize("device,dtype", PAGED_DEVICES)
@pytest.mark.parametrize("qk_norm,clip", [("none", None), ("head", 1.5), ("full", None)])
@pytest.mark.parametrize("starts,news", [([0, 0], [6, 6]), ([5, 0, 3], [4, 2, 1])])
def test_paged_prefill_equals_the_unfused_math(device, dtype, qk_norm, clip, starts, news, monkeypatch):
    """A prefill over a PagedKVCache: the epilogue launch writes the pool. Fresh prompts of
    one length (``causal``) attend causally over their own keys (the epilogue stores them
    out too), nothing gathered from the pool; rows that continue a cached prefix or are
    left-padded gather their keys under the mask."""
    attn = _attention(qk_norm, 5, device, dtype, heads=(8, 2), head_dim=16, clip=clip)
    x, ctx, cache = _paged_case(attn, device, dtype, starts, news, seed=6)
    assert ctx.causal == (starts == [0, 0])
    if ctx.causal:
        monkeypatch.setattr(cache, "gather", lambda layer: pytest.fail("a fresh prompt gathered its keys"))
    calls = _count_calls(monkeypatch, "qkv_attention", "qkv_decode")
    _assert_paged_equal(attn, x, ctx, cache, dtype)
    assert calls == {"qkv_attention": 0, "qkv_decode": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_paged_decode_step_replays_in_a_cuda_graph(fused):
    """The paged decode step captured in a CUDA graph (no host sync, no shape from device
    values) and replayed for new inputs: the eager step's output and pool, bit for bit."""
    attn = _attention("full", 7, options=KernelOptions(fused_decode_attention=fused), heads=(4, 4))
    x, ctx, cache = _paged_case(attn, "cuda", torch.bfloat16, starts=[30, 2, 0, 17], news=[1, 1, 0, 1], seed=8)
    pool = cache.k.clone(), cache.v.clone()
    x_new = torch.randn_like(x)
    with torch.no_grad():
        eager = attn(x_new, ctx, cache, 0)
        k_eager, v_eager = cache.k.clone(), cache.v.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiled and loaded outside the capture
            attn(x, ctx, cache, 0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn(x, ctx, cache, 0)
        cache.k.copy_(pool[0]), cache.v.copy_(pool[1])
        x.copy_(x_new)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(cache.k[:, :-1], k_eager[:, :-1]) and torch.equal(cache.v[:, :-1], v_eager[:, :-1])
