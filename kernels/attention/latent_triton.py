"""The epilogue of multi-head latent attention's projections at a decode step, in one
launch (DeepSeek-V2 / V3; ``dense.mla.LatentAttention``): the latent's RMSNorm, the rotary
turn of every head's rotary query and of the shared rotary key, the cache append of
[latent, rotary key], and the absorbed query [latent part, rotary part] the decode
attention reads (``kernels.paged_latent_decode``). As torch ops that is about fifteen
launches a layer.

Shape letters: B rows (one token each), N heads, C the latent, R the rotary width, P the
position-free part of a query head, N_POOL pool rows.

Program (b, head block) copies its heads' latent queries and turns their rotary parts; the
head block 0 also norms the row's latent, turns its rotary key and stores both at the
row's pool row. Rounding follows the torch ops in the model dtype step by step (the norm,
then each product and sum of the rotation), as ``kernels.attention.qkv_decode_triton``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.qkv_decode_triton import _rnd
from kernels.attention.reference import check_latent_prologue
from kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _turn(base, cos, sin, r, partner, sign, mask, DT: tl.constexpr):
    """x * cos + rotate_half(x) * sin of the rows at ``base`` (+ r along the last axis),
    float32 values rounded to DT at each step the torch ops round."""
    x = tl.load(base + r, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    return _rnd(_rnd(x * cos, DT) + _rnd(sign * xp * sin, DT), DT)


@triton.jit
def _latent_prologue_kernel(
    qc_ptr,  # [B, N, C] the absorbed latent queries, any strides
    q_ptr,  # [B, N * (P + R)] the query projection's rows
    kv_ptr,  # [B, C + R] the latent projection's rows: the latent, then the rotary key
    norm_ptr,  # [C] the latent's RMSNorm weights
    cos_ptr, sin_ptr,  # [B, R] rotary tables
    pool_ptr,  # [N_POOL, C + R] this layer's cache
    slot_ptr,  # int64 [B] each row's pool row
    out_ptr,  # [B, N, C + R] the queries the decode attention reads
    eps, stride_qcb, stride_qch, stride_q, stride_kv, stride_cos, stride_pool,
    N: tl.constexpr, HB: tl.constexpr, C: tl.constexpr, C_PAD: tl.constexpr, R: tl.constexpr,
    P: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    h_ok = heads < N
    DT: tl.constexpr = out_ptr.dtype.element_ty
    c = tl.arange(0, C_PAD)
    c_ok = c < C
    r = tl.arange(0, R)
    partner = (r + R // 2) % R
    sign = tl.where(r < R // 2, -1.0, 1.0)
    cos = tl.full([R], 1.0, tl.float32)
    sin = tl.zeros([R], tl.float32)
    if ROPE:
        cos = tl.load(cos_ptr + b * stride_cos + r).to(tl.float32)
        sin = tl.load(sin_ptr + b * stride_cos + r).to(tl.float32)
    out_rows = out_ptr + (b * N + heads[:, None]) * (C + R)
    qc = tl.load(qc_ptr + b * stride_qcb + heads[:, None] * stride_qch + c[None, :],
                 mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    tl.store(out_rows + c[None, :], qc, mask=h_ok[:, None] & c_ok[None, :])
    q_rows = q_ptr + b * stride_q + heads[:, None] * (P + R) + P
    q_r = _turn(q_rows, cos[None, :], sin[None, :], r[None, :], partner[None, :], sign[None, :], h_ok[:, None], DT)
    tl.store(out_rows + C + r[None, :], q_r.to(DT), mask=h_ok[:, None])
    if tl.program_id(1) == 0:
        row = kv_ptr + b * stride_kv
        x = tl.load(row + c, mask=c_ok, other=0.0).to(tl.float32)
        normed = _rnd(x * tl.math.rsqrt(tl.sum(x * x, axis=0) / C + eps), DT)
        w = tl.load(norm_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        dest = pool_ptr + tl.load(slot_ptr + b) * stride_pool
        tl.store(dest + c, (w * normed).to(DT), mask=c_ok)
        k_r = _turn(row + C, cos, sin, r, partner, sign, r < R, DT)
        tl.store(dest + C + r, k_r.to(DT))


def latent_prologue_triton(q_c, q, kv, norm_w, eps, cos, sin, pool, slot, *, pdl: bool = True) -> torch.Tensor:
    """Same contract as ``latent_prologue_ref``, in one launch (R a power of two)."""
    b, n, c, r, p = check_latent_prologue(q_c, q, kv)
    pool2 = pool.reshape(pool.shape[0], -1)
    q, kv = q.reshape(b, -1), kv.reshape(b, -1)
    if q.stride(1) != 1 or kv.stride(1) != 1 or q_c.stride(2) != 1 or pool2.stride(1) != 1:
        raise ValueError("q_c / q / kv / pool: expected unit stride along their last axis")
    out = torch.empty(b, n, c + r, dtype=q_c.dtype, device=q_c.device)
    rope = cos is not None
    if rope:
        cos, sin = cos.reshape(b, r), sin.reshape(b, r)
    hb = min(16, triton.next_power_of_2(n))
    _latent_prologue_kernel[(b, triton.cdiv(n, hb))](
        q_c, q, kv, norm_w, cos if rope else q, sin if rope else q, pool2, slot.reshape(b), out, float(eps),
        q_c.stride(0), q_c.stride(1), q.stride(0), kv.stride(0), cos.stride(0) if rope else 0, pool2.stride(0),
        N=n, HB=hb, C=c, C_PAD=triton.next_power_of_2(c), R=r, P=p, ROPE=rope, num_warps=4,
        **pdl_launch(q_c.device, pdl))
    return out
