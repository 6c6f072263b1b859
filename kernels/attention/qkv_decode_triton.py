"""The QKV epilogue of a decode step in one launch: split, q/k norms, rotary and the
KV-cache append (DeepSpeed-Inference III-A's deep fusion, on the decode path). A prefill
of T tokens per row runs the same kernel with one program per token.

Shape letters: B rows, T tokens per row (1 when decoding), Hq / Hkv query / KV heads,
D head dim, N pool rows of the paged cache.

After the fused QKV projection a decode token needs, per layer: its q and k normalised
(none, per head as Qwen3, or over all heads as OLMoE), clipped where the model clips,
rotated, and its k and v written into the cache. As torch ops that is 20 to 40 tiny
kernels per layer; here one program per row does it all. Rounding follows the torch
modules in the model dtype step by step (norm, then each product and sum of the rotation),
so the fused step and the unfused one agree to the last bit in most elements.

The cache is a paged pool [N, Hkv, D] that every row shares, each token written at its
own pool row. A prefill that attends over its own keys only (a fresh prompt) has k and v
stored into ``kv_out`` as well, so it reads them there instead of gathering them back out
of the pool.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.reference import QK_NORMS, check_qkv, qkv_decode_ref, qkv_decode_supported
from kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _rnd(x, dtype: tl.constexpr):
    """Round a float32 value to the model dtype and back: the rounding a torch op applies."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _load_all(base, H: tl.constexpr, H_P: tl.constexpr, D: tl.constexpr):
    """All H * D values of one row's q or k as an [H_P, D] float32 tile (rows past H zero)."""
    heads = tl.arange(0, H_P)
    return tl.load(base + heads[:, None] * D + tl.arange(0, D)[None, :], mask=(heads < H)[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _rstd_all(x, eps, H: tl.constexpr, D: tl.constexpr):
    """1 / RMS over a ``_load_all`` tile (the all-heads norm, before the clip)."""
    return tl.math.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (H * D) + eps)  # as torch.rsqrt


@triton.jit
def _full_rstd(base, eps, H: tl.constexpr, H_P: tl.constexpr, D: tl.constexpr):
    """1 / RMS over all H * D values of one row's q or k."""
    return _rstd_all(_load_all(base, H, H_P, D), eps, H, D)


@triton.jit
def _rotary(cos_ptr, sin_ptr, r, stride_cos, D: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr):
    """(d, the rotate-half partners, their signs, row r's cos and sin) over a head's D
    dimensions, of which the first R turn: past R a dimension is its own partner, with
    cos 1 and sin 0, so the rotation passes it as it is (zeros without rotary)."""
    d = tl.arange(0, D)
    partner = tl.where(d < R, (d + R // 2) % R, d)
    sign = tl.where(d < R // 2, -1.0, 1.0)
    cos = tl.zeros([D], tl.float32)
    sin = tl.zeros([D], tl.float32)
    if ROPE:
        cos = tl.load(cos_ptr + r * stride_cos + d, mask=d < R, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + r * stride_cos + d, mask=d < R, other=0.0).to(tl.float32)
    return d, partner, sign, cos, sin


@triton.jit
def _row_setup(qkv_ptr, cos_ptr, sin_ptr, r, stride_qkv, stride_cos, eps, HQ: tl.constexpr, HKV: tl.constexpr,
               HQ_P: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr,
               ROPE: tl.constexpr):
    """What every program of token r needs first: its QKV row, the head-dim offsets d, their
    rotate-half partners and signs, the row's cos / sin (``_rotary``), and the all-heads
    1 / RMS of q and k (1.0 unless QK_NORM is 2)."""
    d, partner, sign, cos, sin = _rotary(cos_ptr, sin_ptr, r, stride_cos, D, R, ROPE)
    row = qkv_ptr + r * stride_qkv
    rstd_q = 1.0
    rstd_k = 1.0
    if QK_NORM == 2:
        rstd_q = _full_rstd(row, eps, HQ, HQ_P, D)
        rstd_k = _full_rstd(row + HQ * D, eps, HKV, HKV_P, D)
    return row, d, partner, sign, cos, sin, rstd_q, rstd_k


@triton.jit
def _norm_weights(w_ptr, heads, d, partner, H: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr):
    """(w, w at the rotate-half partners) of the q or k norm for ``heads``, as float32:
    [H_P, D] for the all-heads norm, [D] per head; zeros without a norm. No kernel writes
    them, so a PDL kernel may load them before its wait."""
    wx = tl.zeros([D], tl.float32)
    wp = tl.zeros([D], tl.float32)
    if QK_NORM == 2:
        ok = (heads < H)[:, None] & (d < D)[None, :]
        wx = tl.load(w_ptr + heads[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + heads[:, None] * D + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    elif QK_NORM == 1:
        wx = tl.load(w_ptr + d).to(tl.float32)
        wp = tl.load(w_ptr + partner).to(tl.float32)
    return wx, wp


@triton.jit
def _load_heads(base, heads, d, partner, H: tl.constexpr, D: tl.constexpr):
    """(x, x at the rotate-half partners): [H_P, D] float32 blocks of some heads of one
    row's q or k (rows of heads >= H zero)."""
    ok = (heads < H)[:, None] & (d < D)[None, :]
    x = tl.load(base + heads[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(base + heads[:, None] * D + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    return x, xp


@triton.jit
def _norm_rotate(x, xp, wx, wp, cos, sin, sign, eps, clip, rstd, D: tl.constexpr, QK_NORM: tl.constexpr,
                 CLIP: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr):
    """``_load_heads``' blocks clipped, normalised, rotated (float32 values rounded to DT at
    each step the torch modules round). ``wx``, ``wp``: the norm's ``_norm_weights``.
    ``rstd``: the row's all-heads 1 / RMS where QK_NORM is 2, unused otherwise."""
    if QK_NORM == 2:
        x = _rnd(_rnd(x * rstd, DT) * wx, DT)
        xp = _rnd(_rnd(xp * rstd, DT) * wp, DT)
    if CLIP:
        x = tl.minimum(tl.maximum(x, -clip), clip)
        xp = tl.minimum(tl.maximum(xp, -clip), clip)
    if QK_NORM == 1:  # per head over its D values
        rstd_h = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [H_P], as torch.rsqrt
        x = _rnd(_rnd(x * rstd_h[:, None], DT) * wx[None, :], DT)
        xp = _rnd(_rnd(xp * rstd_h[:, None], DT) * wp[None, :], DT)
    if ROPE:  # rotate-half: x * cos + cat(-x2, x1) * sin
        x = _rnd(_rnd(x * cos[None, :], DT) + _rnd(sign[None, :] * xp * sin[None, :], DT), DT)
    return x


@triton.jit
def _normed_rotated(base, wx, wp, cos, sin, heads, d, partner, sign, eps, clip, rstd,
                    H: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr, CLIP: tl.constexpr,
                    ROPE: tl.constexpr, DT: tl.constexpr):
    """[H_P, D] block of some heads of one row's q or k, loaded and ``_norm_rotate``d."""
    x, xp = _load_heads(base, heads, d, partner, H, D)
    return _norm_rotate(x, xp, wx, wp, cos, sin, sign, eps, clip, rstd, D, QK_NORM, CLIP, ROPE, DT)


@triton.jit
def _qkv_decode_kernel(qkv_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, q_ptr,
                       kc_ptr, vc_ptr,  # the pools [N, Hkv, D]
                       slot_ptr,  # int64 [B * T]: each token's pool row
                       ko_ptr, vo_ptr,  # [B, T, Hkv, D] that receive k and v as well (KV_OUT)
                       eps, clip, stride_qkv, stride_cos,
                       stride_kh, stride_kn, stride_vh, stride_vn,  # the pools' head and row strides
                       HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr,
                       D: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr, CLIP: tl.constexpr,
                       ROPE: tl.constexpr, KV_OUT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)  # token r = b * T + t, stored at pool row slot[r]
    DT: tl.constexpr = q_ptr.dtype.element_ty
    row, d, partner, sign, cos, sin, rstd_q, rstd_k = _row_setup(qkv_ptr, cos_ptr, sin_ptr, r, stride_qkv, stride_cos,
                                                                 eps, HQ, HKV, HQ_P, HKV_P, D, R, QK_NORM, ROPE)
    slot = tl.load(slot_ptr + r)
    hq = tl.arange(0, HQ_P)
    qw, qwp = _norm_weights(qn_w_ptr, hq, d, partner, HQ, D, QK_NORM)
    q = _normed_rotated(row, qw, qwp, cos, sin, hq, d, partner, sign, eps, clip, rstd_q, HQ, D, QK_NORM, CLIP,
                        ROPE, DT)
    q_ok = (hq < HQ)[:, None]
    tl.store(q_ptr + (r * HQ + hq[:, None]) * D + d[None, :], q.to(DT), mask=q_ok)  # q [B, T, HQ, D]
    hk = tl.arange(0, HKV_P)
    kw, kwp = _norm_weights(kn_w_ptr, hk, d, partner, HKV, D, QK_NORM)
    k = _normed_rotated(row + HQ * D, kw, kwp, cos, sin, hk, d, partner, sign, eps, clip, rstd_k, HKV, D, QK_NORM,
                        CLIP, ROPE, DT)
    kv_ok = (hk < HKV)[:, None]
    tl.store(kc_ptr + hk[:, None] * stride_kh + slot * stride_kn + d[None, :], k.to(DT), mask=kv_ok)
    v = tl.load(row + (HQ + HKV) * D + hk[:, None] * D + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
    if CLIP:
        v = tl.minimum(tl.maximum(v, -clip), clip)
    tl.store(vc_ptr + hk[:, None] * stride_vh + slot * stride_vn + d[None, :], v.to(DT), mask=kv_ok)
    if KV_OUT:
        out = (r * HKV + hk[:, None]) * D + d[None, :]
        tl.store(ko_ptr + out, k.to(DT), mask=kv_ok)
        tl.store(vo_ptr + out, v.to(DT), mask=kv_ok)


def rotary_tables(cos, sin, rows: int, head_dim: int) -> tuple[bool, tuple | None]:
    """(whether there is a rotation, (cos, sin) as [rows, R] views): R <= D, even, the
    dimensions of each head that turn. Raises ValueError naming the tables otherwise."""
    if cos is None:
        return False, None
    r = cos.shape[-1]
    if r % 2 or r > head_dim or cos.numel() != rows * r or sin.shape != cos.shape:
        raise ValueError(f"cos / sin {list(cos.shape)} / {list(sin.shape)}: expected {rows} rows of an even "
                         f"R <= D = {head_dim}")
    return True, (cos.reshape(rows, r), sin.reshape(rows, r))


def qkv_decode_triton(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos=None, sin=None,
                      qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, pdl=True, kv_out=None):
    """Same contract as ``qkv_decode_ref``; one launch, one program per token."""
    b, t = check_qkv(qkv, k_cache, v_cache, num_heads, num_kv_heads, head_dim, qk_norm, slot, kv_out)
    if not qkv_decode_supported(head_dim):
        return qkv_decode_ref(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos, sin, qk_norm,
                              q_norm_w, k_norm_w, eps, clip, kv_out)
    qkv = qkv.reshape(b * t, qkv.shape[-1])
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    # q is stored [B, T, Hq, D] and returned as its [B, Hq, T, D] view: attention then
    # writes its output in that layout too, and the output projection reads it in place.
    q = torch.empty(b, t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device).transpose(1, 2)
    rope, rot = rotary_tables(cos, sin, b * t, head_dim)
    if rope:
        cos, sin = rot
    slot = slot.reshape(b * t).contiguous()
    k_out, v_out = kv_out if kv_out is not None else (qkv, qkv)
    _qkv_decode_kernel[(b * t,)](
        qkv, q_norm_w if q_norm_w is not None else qkv, k_norm_w if k_norm_w is not None else qkv,
        cos if rope else qkv, sin if rope else qkv, q, k_cache, v_cache, slot, k_out, v_out,
        float(eps), float(clip or 0.0), qkv.stride(0), cos.stride(0) if rope else 0,
        k_cache.stride(1), k_cache.stride(0), v_cache.stride(1), v_cache.stride(0), HQ=num_heads, HKV=num_kv_heads,
        HQ_P=triton.next_power_of_2(num_heads), HKV_P=triton.next_power_of_2(num_kv_heads), D=head_dim,
        R=cos.shape[-1] if rope else head_dim, QK_NORM=QK_NORMS[qk_norm], CLIP=clip is not None, ROPE=rope,
        KV_OUT=kv_out is not None, num_warps=4,
        **pdl_launch(qkv.device, pdl))
    return q
