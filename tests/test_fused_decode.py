"""The attention module's fused decode paths: the QKV epilogue kernel (q/k norms, clip,
rotary, KV-cache append) and the one-launch decode attention must match the unfused torch
ops, in a decode step and a prefill, over the static cache (on a GPU) and over the paged
cache (on the CPU through the kernels' references, and on a GPU; there also replayed in a
CUDA graph). The kernels alone against their references are in tests/kernels/
(test_attention.py, test_norm.py)."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.attention import qkv_decode_supported
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


def _gpu_attention(qk_norm: str, seed: int, options=None):
    """A bf16 attention block on the GPU (GQA 8 / 2, D = 64)."""
    return _attention(qk_norm, seed, options=options)


def _fused_and_unfused(attn, x, ctx, caches):
    """q, k, v through the fused epilogue (into caches[0]) and through the torch ops (into
    caches[1]); they must agree in shape and to bf16 rounding."""
    with torch.no_grad():
        qkv = attn.qkv_proj(x)
        fused = attn._fused_decode(qkv, ctx, caches[0], 0)
        unfused = attn._unfused(qkv, ctx, caches[1], 0)
    assert fused is not None
    for a, r in zip(fused, unfused):
        assert a.shape == r.shape and rel(a, r) < 1e-2
    return fused, unfused


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])  # the config's spellings
def test_attention_fused_decode_equals_unfused(qk_norm):
    """The model's attention on a decode token: the fused kernel and the torch ops agree
    (same cache contents, same output), for a tensor slot and an int start."""
    from dense.attention import KVCache, StepContext
    from dense.rotary import Rotary

    attn = _gpu_attention(qk_norm, seed=0)
    b, s = 3, 64
    x = torch.randn(b, 1, 256, device="cuda", dtype=torch.bfloat16)
    key_valid = torch.ones(b, s, dtype=torch.bool, device="cuda")
    positions = torch.arange(s, device="cuda").expand(b, s).contiguous()
    slot = torch.tensor(17, device="cuda")
    ctx = StepContext.decode_static(slot, key_valid, positions, Rotary(64, 10000.0), torch.bfloat16)
    caches = [KVCache(1, b, 2, s, 64, torch.bfloat16, "cuda") for _ in range(2)]
    for c in caches[1:]:
        c.k.copy_(caches[0].k.normal_()), c.v.copy_(caches[0].v.normal_())
    _fused_and_unfused(attn, x, ctx, caches)
    assert rel(caches[0].k, caches[1].k) < 1e-3 and rel(caches[0].v, caches[1].v) == 0.0
    assert qkv_decode_supported(64) and not qkv_decode_supported(96)


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
def test_attention_one_launch_equals_epilogue_then_sdpa(qk_norm, monkeypatch):
    """A static decode step through the module: kernels.qkv_attention (one launch) against
    the QKV epilogue launch then SDPA (the option ``fused_decode_attention`` off), as the
    graph decode runs them; same output, same cache, with left padding in the mask."""
    from dense.attention import KVCache, StepContext
    from dense.rotary import Rotary
    from kernels.options import KernelOptions

    attns = [_gpu_attention(qk_norm, seed=2, options=KernelOptions(fused_decode_attention=fused))
             for fused in (True, False)]
    attns[1].load_state_dict(attns[0].state_dict())
    calls, real = [], kernels.qkv_attention
    monkeypatch.setattr(kernels, "qkv_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    b, s = 3, 128
    x = torch.randn(b, 1, 256, device="cuda", dtype=torch.bfloat16)
    key_valid = torch.arange(s, device="cuda")[None, :] >= torch.tensor([0, 4, 30], device="cuda")[:, None]
    positions = torch.arange(s, device="cuda").expand(b, s).contiguous()
    slot = torch.tensor(77, device="cuda")
    ctx = StepContext.decode_static(slot, key_valid, positions, Rotary(64, 10000.0), torch.bfloat16)
    caches = [KVCache(1, b, 2, s, 64, torch.bfloat16, "cuda") for _ in range(2)]
    caches[1].k.copy_(caches[0].k.normal_()), caches[1].v.copy_(caches[0].v.normal_())
    outs, launches = [], []
    with torch.no_grad():
        for attn, cache in zip(attns, caches):
            before = len(calls)
            outs.append(attn(x, ctx, cache, 0))
            launches.append(len(calls) - before)
    assert launches == [1, 0]  # the one launch only where the option allows it
    assert outs[0].shape == outs[1].shape == (b, 1, 256)
    assert rel(outs[0], outs[1]) < 1e-2
    assert rel(caches[0].k, caches[1].k) < 1e-3 and rel(caches[0].v, caches[1].v) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
@pytest.mark.parametrize("no_padding", [True, False])
def test_attention_fused_prefill_equals_unfused(qk_norm, no_padding):
    """A prefill through the fused epilogue (one program per token) and through the torch
    ops: same q, keys, values and cache; causal (unpadded) or masked (left padding)."""
    import torch.nn.functional as F

    from dense.attention import KVCache, StepContext
    from dense.rotary import Rotary

    attn = _gpu_attention(qk_norm, seed=1)
    b, t, s = 3, 37, 48
    x = torch.randn(b, t, 256, device="cuda", dtype=torch.bfloat16)
    pad = torch.tensor([0, 0, 0] if no_padding else [0, 5, 11], device="cuda")
    slots = torch.arange(t, device="cuda")
    key_valid = slots[None, :] >= pad[:, None]
    positions = (slots[None, :] - pad[:, None]).clamp(min=0)
    ctx = StepContext.build(positions, key_valid, positions, 0, Rotary(64, 10000.0), torch.bfloat16,
                            no_padding=no_padding)
    assert ctx.causal == no_padding
    caches = [KVCache(1, b, 2, s, 64, torch.bfloat16, "cuda") for _ in range(2)]
    fused, unfused = _fused_and_unfused(attn, x, ctx, caches)
    # Every written slot is a fresh key (the rest stay zero), so this is the full bf16
    # rounding difference of the rotation (1.7e-3 to 2.0e-3 measured), not diluted as in
    # the decode test above.
    assert rel(caches[0].k, caches[1].k) < 1e-2 and rel(caches[0].v, caches[1].v) == 0.0
    # Causal over the fresh keys equals the mask over the cache.
    q, k, v = fused
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if ctx.causal else ctx.attn_mask,
                                         is_causal=ctx.causal, enable_gqa=True)
    kc, vc = caches[1].k[0, :, :, :t], caches[1].v[0, :, :, :t]
    ref = F.scaled_dot_product_attention(unfused[0].float(), kc.float(), vc.float(), attn_mask=ctx.attn_mask,
                                         enable_gqa=True)
    assert rel(out, ref) < 2e-2


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
    step's slots, every row's keys gathered, SDPA under the mask as a bool one -> (output
    [B, T, H], k pool, v pool)."""
    b, t, _ = x.shape
    k_pool, v_pool = cache.k[0].clone(), cache.v[0].clone()
    q, k, v = attn._unfused(attn.qkv_proj(x), ctx, None, 0)
    rows = cache.write_slots.reshape(-1)
    k_pool.index_copy_(0, rows, k.transpose(1, 2).reshape(b * t, attn.num_kv_heads, attn.head_dim))
    v_pool.index_copy_(0, rows, v.transpose(1, 2).reshape(b * t, attn.num_kv_heads, attn.head_dim))
    kk, vv = k_pool[cache.read_slots].transpose(1, 2), v_pool[cache.read_slots].transpose(1, 2)
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
    (kernels.qkv_decode at the write slots) and then the pool read in place (GQA up to 2)
    or gathered for SDPA; a head dim the kernels do not take (24) runs the torch ops. The
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
