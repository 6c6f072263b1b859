"""The decode step's fused kernels against their torch references: RMSNorm with the residual
add in front, and the QKV epilogue (q/k norms, clip, rotary, KV-cache append); on CPU under
the interpreter and on a GPU, where the model's fused decode path must match the unfused one."""
import pytest
import torch

import kernels
from kernels.norm import rms_norm_ref, rms_norm_triton
from kernels.qkv_decode import qkv_decode_ref, qkv_decode_triton

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
BACKENDS = [
    pytest.param("cpu", torch.float32, id="interp-fp32", marks=pytest.mark.interp),
    pytest.param("cpu", torch.bfloat16, id="interp-bf16", marks=pytest.mark.interp),
    pytest.param("cuda", torch.bfloat16, id="gpu-bf16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float16, id="gpu-fp16", marks=pytest.mark.gpu),
]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 64), (3, 1, 200), (5, 4096), (2, 3, 33)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, shape, with_residual):
    gen = torch.Generator().manual_seed(sum(shape) + with_residual)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(device, dtype)
    r = torch.randn(shape, generator=gen).to(device, dtype) if with_residual else None
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(device, dtype)
    out = rms_norm_triton(x, w, 1e-5, r)
    ref = rms_norm_ref(x.double(), w.double(), 1e-5, None if r is None else r.double())
    if with_residual:
        (out, summed), (ref, ref_sum) = out, ref
        assert summed.dtype == dtype and rel(summed, ref_sum) < TOL[dtype]
    assert out.shape == x.shape and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]


def test_rms_norm_rejects_mismatched_shapes():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight \[7\]: expected \[8\]"):
        rms_norm_triton(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match=r"residual \[2, 4\]: expected x's shape \[2, 8\]"):
        rms_norm_triton(x, torch.ones(8), 1e-6, torch.randn(2, 4))


def _qkv_case(device, dtype, b, hq, hkv, d, s, qk_norm, rope, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=gen) * 2).to(device, dtype)
    kc = torch.randn(b, hkv, s, d, generator=gen).to(device, dtype)
    vc = torch.randn(b, hkv, s, d, generator=gen).to(device, dtype)
    pos = torch.randint(0, 500, (b, 1), generator=gen).float()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    cos, sin = (ang.cos().to(device, dtype), ang.sin().to(device, dtype)) if rope else (None, None)
    qw = kw = None
    if qk_norm == "head":
        qw, kw = ((torch.rand(d, generator=gen) + 0.5).to(device, dtype) for _ in range(2))
    elif qk_norm == "full":
        qw = (torch.rand(hq * d, generator=gen) + 0.5).to(device, dtype)
        kw = (torch.rand(hkv * d, generator=gen) + 0.5).to(device, dtype)
    return qkv, kc, vc, cos, sin, qw, kw


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("b,hq,hkv,d", [(1, 4, 4, 16), (3, 6, 2, 32), (2, 5, 1, 64)])
@pytest.mark.parametrize("qk_norm", [None, "head", "full"])
@pytest.mark.parametrize("rope,clip,tensor_slot", [(True, None, True), (True, 1.5, False), (False, None, False)])
def test_qkv_decode_matches_reference(device, dtype, b, hq, hkv, d, qk_norm, rope, clip, tensor_slot):
    s, slot = 9, 6
    qkv, kc, vc, cos, sin, qw, kw = _qkv_case(device, dtype, b, hq, hkv, d, s, qk_norm, rope, b * hq + d)
    slot_arg = torch.tensor(slot, device=device) if tensor_slot else slot
    kc2, vc2 = kc.clone(), vc.clone()
    q = qkv_decode_triton(qkv, hq, hkv, d, kc, vc, slot_arg, cos, sin, qk_norm, qw, kw, 1e-6, clip)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kc2.double(), vc2.double()
    qr = qkv_decode_ref(qkv.double(), hq, hkv, d, kr, vr, slot, up(cos), up(sin), qk_norm, up(qw), up(kw), 1e-6,
                        clip)
    assert q.shape == (b, hq, 1, d) and q.dtype == dtype
    # Norm and rotation round to the dtype at each step, as the torch modules do: against the
    # float64 math that is a few roundings of error; against the same ops in the dtype, less
    # (on a GPU; the interpreter's bf16 casts truncate rather than round).
    loose, tight = (2 * TOL[dtype], TOL[dtype] / 2) if device == "cuda" else (3 * TOL[dtype], 3 * TOL[dtype])
    assert rel(q, qr) < loose and rel(kc[:, :, slot], kr[:, :, slot]) < loose
    kd, vd = kc2.clone(), vc2.clone()
    qd = qkv_decode_ref(qkv, hq, hkv, d, kd, vd, slot, cos, sin, qk_norm, qw, kw, 1e-6, clip)
    assert rel(q, qd) < tight and rel(kc[:, :, slot], kd[:, :, slot]) < tight
    assert rel(vc[:, :, slot], vr[:, :, slot]) < TOL[dtype]
    others = [i for i in range(s) if i != slot]  # the append touches the one slot only
    assert torch.equal(kc[:, :, others], kc2[:, :, others]) and torch.equal(vc[:, :, others], vc2[:, :, others])


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("qk_norm", [None, "head", "full"])
def test_qkv_epilogue_of_a_prefill(device, dtype, qk_norm):
    """T tokens per row (a prefill): one program per token, each at its own position and
    cache slot; q comes back [B, Hq, T, D]."""
    b, t, hq, hkv, d, s, slot = 2, 5, 4, 2, 16, 9, 3
    qkv, kc, vc, _, _, qw, kw = _qkv_case(device, dtype, b, hq, hkv, d, s, qk_norm, False, 7)
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(b, t, qkv.shape[1], generator=gen) * 2).to(device, dtype)
    pos = torch.arange(slot, slot + t).float()[None, :, None].expand(b, t, 1)
    ang = pos * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = (z.to(device, dtype) for z in (torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()))
    kc2, vc2 = kc.clone(), vc.clone()
    q = qkv_decode_triton(qkv, hq, hkv, d, kc, vc, slot, cos, sin, qk_norm, qw, kw, 1e-6, 1.5)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kc2.double(), vc2.double()
    qr = qkv_decode_ref(qkv.double(), hq, hkv, d, kr, vr, slot, up(cos), up(sin), qk_norm, up(qw), up(kw), 1e-6,
                        1.5)
    assert q.shape == (b, hq, t, d) and qr.shape == q.shape
    tol = 2 * TOL[dtype] if device == "cuda" else 3 * TOL[dtype]
    new = slice(slot, slot + t)
    assert rel(q, qr) < tol and rel(kc[:, :, new], kr[:, :, new]) < tol and rel(vc[:, :, new], vr[:, :, new]) < tol
    others = [i for i in range(s) if not slot <= i < slot + t]
    assert torch.equal(kc[:, :, others], kc2[:, :, others]) and torch.equal(vc[:, :, others], vc2[:, :, others])
    # Token by token through the decode form gives the same q.
    kd, vd = kc2.clone(), vc2.clone()
    for i in range(t):
        qi = qkv_decode_triton(qkv[:, i].contiguous(), hq, hkv, d, kd, vd, slot + i, cos[:, i], sin[:, i], qk_norm,
                               qw, kw, 1e-6, 1.5)
        assert torch.equal(qi[:, :, 0], q[:, :, i])
    assert torch.equal(kd, kc) and torch.equal(vd, vc)


def test_qkv_decode_rejects_bad_shapes():
    kc = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"qkv \[1, 40\]: expected \[B, \(Hq \+ 2 Hkv\) \* D = 64\]"):
        qkv_decode_triton(torch.randn(1, 40), 4, 2, 8, kc, kc.clone(), 0)
    with pytest.raises(ValueError, match=r"k_cache / v_cache"):
        qkv_decode_triton(torch.randn(1, 64), 4, 2, 8, torch.zeros(1, 3, 4, 8), kc, 0)
    with pytest.raises(ValueError, match=r"qk_norm='layer'"):
        qkv_decode_triton(torch.randn(1, 64), 4, 2, 8, kc, kc.clone(), 0, qk_norm="layer")


def _gpu_attention(qk_norm: str, seed: int, options=None):
    """A bf16 attention block on the GPU (GQA 8 / 2, D = 64) with random weights (the same
    for a seed, whatever the ``KernelOptions``)."""
    from types import SimpleNamespace

    from dense.attention import Attention
    from kernels.options import KernelOptions

    cfg = SimpleNamespace(head_dim=64, num_heads=8, num_kv_heads=2, hidden_size=256, qkv_bias=False,
                          out_bias=False, qk_norm=qk_norm, norm_eps=1e-6, clip_qkv=None)
    torch.manual_seed(seed)
    attn = Attention(cfg, options=options or KernelOptions()).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.05)
    return attn


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
    assert kernels.qkv_decode_supported(64) and not kernels.qkv_decode_supported(96)


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


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("t,h,e", [(1, 64, 8), (3, 200, 20), (16, 256, 64)])
def test_rms_norm_router_matches_reference(device, dtype, t, h, e):
    gen = torch.Generator().manual_seed(t + h + e)
    x = (torch.randn(t, h, generator=gen) * 2).to(device, dtype)
    r = torch.randn(t, h, generator=gen).to(device, dtype)
    nw = (torch.rand(h, generator=gen) + 0.5).to(device, dtype)
    rw = (torch.randn(e, h, generator=gen) / h ** 0.5).to(device, dtype)
    out_h, summed, logits = kernels.norm.rms_norm_router_triton(x, r, nw, 1e-5, rw)
    ref_h, ref_sum, ref_logits = kernels.norm.rms_norm_router_ref(x.double(), r.double(), nw.double(), 1e-5,
                                                                  rw.double())
    assert out_h.dtype == summed.dtype == logits.dtype == dtype and logits.shape == (t, e)
    assert rel(summed, ref_sum) < TOL[dtype] and rel(out_h, ref_h) < TOL[dtype]
    assert rel(logits, ref_logits) < 2 * TOL[dtype]


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("t,h,e,k,score,renorm", [(1, 64, 8, 2, "softmax", True), (3, 200, 20, 4, "sigmoid", False),
                                                 (16, 256, 64, 8, "softmax", False), (2, 128, 128, 8, "softmax", True)])
def test_rms_norm_router_with_gating(device, dtype, t, h, e, k, score, renorm):
    """The top-k table from the norm + router launch (its last program, by ticket) equals
    the gating kernel run on the logits the same launch wrote; twice in a row, so the
    ticket counter is seen to reset. A k over E is refused like the gating refuses it."""
    gen = torch.Generator().manual_seed(t * h + e)
    for _ in range(2):
        x = (torch.randn(t, h, generator=gen) * 2).to(device, dtype)
        r = torch.randn(t, h, generator=gen).to(device, dtype)
        nw = (torch.rand(h, generator=gen) + 0.5).to(device, dtype)
        rw = (torch.randn(e, h, generator=gen) / h ** 0.5).to(device, dtype)
        out_h, summed, logits, ids, w = kernels.norm.rms_norm_router_triton(x, r, nw, 1e-5, rw, (k, score, renorm))
        plain = kernels.norm.rms_norm_router_triton(x, r, nw, 1e-5, rw)
        for a, b in zip((out_h, summed, logits), plain):
            assert torch.equal(a, b)
        # The gating kernel on the same logits: the same table, ties included (bf16 logits
        # tie often; torch.topk on CPU need not break ties by index).
        ref_ids, ref_w = kernels.topk_gating_triton(logits, k, score, renorm)
        assert ids.shape == (t, k) and ids.dtype == torch.int32 and w.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w)
    with pytest.raises(ValueError, match="expected an int with 1 <= k"):
        kernels.norm.rms_norm_router_triton(x, r, nw, 1e-5, rw, (e + 1, score, renorm))


def test_rms_norm_router_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"router weight \[4, 7\]: expected \[T, H\], \[T, H\], \[H\], \[E, H\]"):
        kernels.norm.rms_norm_router_triton(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 1e-6,
                                            torch.randn(4, 7))


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("b,v", [(1, 50304), (3, 4097), (2, 7)])
def test_argmax_matches_torch(device, dtype, b, v):
    gen = torch.Generator().manual_seed(b * v)
    x = torch.randn(b, v, generator=gen).to(device, dtype)
    x[0, v // 3] = x[0, v - 1] = x[0].max() + 1  # a tie: the first index wins
    out = kernels.argmax_triton(x)
    assert out.dtype == torch.int64 and torch.equal(out.cpu(), x.float().argmax(dim=-1).cpu())
    x[-1, v // 2] = float("nan")  # torch's rule: NaN is the maximum
    assert kernels.argmax_triton(x)[-1].item() == v // 2


def test_argmax_rejects_empty_rows():
    with pytest.raises(ValueError, match=r"x \[2, 0\]: expected \[B, V\] logits with V >= 1"):
        kernels.argmax_triton(torch.empty(2, 0))


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rope", [True, False])
def test_decode_context_in_one_launch_equals_the_torch_context(device, dtype, window, rope):
    """kernels.decode_context_triton against StepContext.decode_static's torch ops (on CPU
    tensors, where it never takes the one launch): the rows' positions, the additive mask
    (left padding, a sliding window, a padding row that sees only itself) and the rotary
    rows looked up in Rotary.table, for several slots."""
    from dense.attention import StepContext
    from dense.rotary import Rotary

    b, s = 4, 37
    pad = torch.tensor([0, 3, 11, 36])  # the last row is all padding before slot 36
    slots = torch.arange(s)
    key_valid = (slots[None, :] >= pad[:, None]).to(device)
    positions = (slots[None, :] - pad[:, None]).clamp(min=0).to(device)
    rotary = Rotary(16, 10000.0) if rope else None
    tables = rotary.table(s, dtype, torch.device(device)) if rope else None
    for slot in (0, 7, 20, 36):
        slot_t = torch.tensor(slot, device=device)
        ref = StepContext.decode_static(slot_t.cpu(), key_valid.cpu(), positions.cpu(), rotary, dtype, window)
        pos, bias, cos, sin = kernels.decode_context_triton(slot_t, key_valid, positions, dtype, tables, window)
        assert torch.equal(pos.cpu(), ref.positions) and bias.dtype == dtype
        assert torch.equal(bias.cpu(), ref.attn_mask)
        if rope:
            assert cos.shape == ref.cos.shape == (b, 1, 16)
            torch.testing.assert_close(cos.cpu(), ref.cos, rtol=0, atol=TOL[dtype] / 10)
            torch.testing.assert_close(sin.cpu(), ref.sin, rtol=0, atol=TOL[dtype] / 10)
        else:
            assert cos is None and sin is None and ref.cos is None
    if rope:  # positions past the tables read nothing outside them: zero rows
        short = (tables[0][:10], tables[1][:10])
        _, _, cos, sin = kernels.decode_context_triton(torch.tensor(20, device=device), key_valid, positions, dtype,
                                                       short)
        assert not cos[:2].any() and not sin[:2].any() and cos[2:].any()  # positions 20, 17 | 9, 0
    with pytest.raises(ValueError, match="0-d int64"):
        kernels.decode_context_triton(torch.tensor([3], device=device), key_valid, positions, dtype, tables)
    with pytest.raises(ValueError, match="bool and int64"):
        kernels.decode_context_triton(torch.tensor(3, device=device), key_valid.long(), positions, dtype, tables)


_COMPILE_CONTEXT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.decode_context import _decode_context_kernel as kernel

window, rotary, pdl = (int(v) for v in sys.argv[1:])
const = dict(HAS_WINDOW=window, ROTARY=rotary, BLOCK_S=1024, BLOCK_D=128, PDL=pdl)
types = {"slot_ptr": "*i64", "valid_ptr": "*i1", "kpos_ptr": "*i64", "pos_ptr": "*i64", "S": "i32", "D": "i32",
         "L": "i32", "window": "i32"}
sig = {n: "constexpr" if n in const else types.get(n, "*bf16") for n in kernel.arg_names}
compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print("cubin bytes", len(compiled.asm["cubin"]))
"""


@pytest.mark.parametrize("window,rotary,pdl", [(1, 1, 2), (0, 0, 0)])
def test_decode_context_compiles_for_hopper(window, rotary, pdl):
    """The decode-context kernel's whole Triton compile for sm_90 (tests.hopper)."""
    from tests.hopper import compile_in_subprocess

    assert int(compile_in_subprocess(_COMPILE_CONTEXT, window, rotary, pdl).split()[-1]) > 0


_COMPILE_ROUTER = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.norm import _rms_norm_router_kernel as kernel

bk, k, one, pdl = (int(v) for v in sys.argv[1:])
const = dict(BT=1, BE=4, BK=bk, K=k, SOFTMAX=True, RENORMALIZE=False, E_ALL=64, BLOCK_K=max(k, 1), ONE=bool(one),
             PDL=pdl)
types = {"ids_ptr": "*i32", "weights_ptr": "*fp32", "count_ptr": "*i32", "T": "i32", "H": "i32", "E": "i32",
         "eps": "fp32"}
sig = {n: "constexpr" if n in const else types.get(n, "i64" if n.startswith("stride") else "*bf16")
       for n in kernel.arg_names}
compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print("cubin bytes", len(compiled.asm["cubin"]))
"""


@pytest.mark.parametrize("bk,k,one,pdl", [(2048, 8, 1, 2), (512, 0, 0, 2)])
def test_rms_norm_router_compiles_for_hopper(bk, k, one, pdl):
    """The norm + router kernel's whole Triton compile for sm_90 (tests.hopper): one step
    over H with the weights loaded before the wait (ONE), and the loop over H in steps."""
    from tests.hopper import compile_in_subprocess

    assert int(compile_in_subprocess(_COMPILE_ROUTER, bk, k, one, pdl).split()[-1]) > 0


_COMPILE_QKV_DECODE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.qkv_decode import _qkv_decode_kernel as kernel

qk_norm, pdl = (int(v) for v in sys.argv[1:])
const = dict(HQ=16, HKV=4, HQ_P=16, HKV_P=4, D=128, QK_NORM=qk_norm, CLIP=True, ROPE=True, SLOT_PTR=True, PDL=pdl)
types = {"slot_ptr": "*i64", "slot": "i64", "T": "i32", "eps": "fp32", "clip": "fp32"}
sig = {n: "constexpr" if n in const else types.get(n, "i64" if n.startswith("stride") else "*bf16")
       for n in kernel.arg_names}
compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print("cubin bytes", len(compiled.asm["cubin"]))
"""


@pytest.mark.parametrize("qk_norm,pdl", [(0, 0), (1, 2), (2, 2)])
def test_qkv_decode_compiles_for_hopper(qk_norm, pdl):
    """The QKV epilogue kernel's whole Triton compile for sm_90 (tests.hopper), with each
    q / k norm."""
    from tests.hopper import compile_in_subprocess

    assert int(compile_in_subprocess(_COMPILE_QKV_DECODE, qk_norm, pdl).split()[-1]) > 0
