"""Multi-head latent attention's decode step around its attention, in one launch each
side (DeepSeek-V2 / V3; ``dense.mla.LatentAttention``):

- ``_latent_query_kernel``, after the projections: each head's absorbed query (its
  position-free part times that head's W_UK, into the latent's space), the rotary turn of
  every head's rotary query and of the shared rotary key, the latent's RMSNorm, the cache
  append of [latent, rotary key], and the queries [latent part, rotary part] the decode
  attention reads (``kernels.paged_latent_decode``). As torch ops that is a batched GEMM
  and about fifteen launches a layer.
- ``_latent_output_kernel``, after the attention: each head's softmax-weighted latent
  times that head's W_UV, written as the [B, N * V] rows the output projection reads (a
  batched GEMM and a copy out of its head-major order as torch ops).

Shape letters: B rows (one token each), N heads, C the latent, R the rotary width, P the
position-free part of a query head, V the value width, N_POOL pool rows.

Both are per-head GEMVs at decode sizes, read-bound on the weights: program (head, block
of output columns) reads its block of the head's weights once and takes every row's
product with it, in blocks of 16 rows (the tensor cores' smallest M). The query kernel's
programs of column block 0 also turn their head's rotary queries, and program i norms and
appends rows i, i + programs, ... Rounding follows the torch ops in the model dtype step by
step (the norm, then each product and sum of the rotation), as
``kernels.attention.qkv_decode_triton``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.decode import _dot
from kernels.attention.qkv_decode_triton import _rnd
from kernels.attention.reference import check_latent_output, check_latent_prologue
from kernels.pdl import pdl_enter, pdl_launch

BLOCK_B = 16  # rows a product takes at once: the tensor cores' smallest M


@triton.jit
def _turn(base, cos, sin, r, partner, sign, mask, DT: tl.constexpr):
    """x * cos + rotate_half(x) * sin of the rows at ``base`` (+ r along the last axis),
    float32 values rounded to DT at each step the torch ops round."""
    x = tl.load(base + r, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    return _rnd(_rnd(x * cos, DT) + _rnd(sign * xp * sin, DT), DT)


@triton.jit
def _latent_query_kernel(
    q_ptr,  # [B, N * (P + R)] the query projection's rows
    w_ptr,  # [N, P, C] each head's W_UK, any strides but unit along C
    kv_ptr,  # [B, C + R] the latent projection's rows: the latent, then the rotary key
    norm_ptr,  # [C] the latent's RMSNorm weights
    cos_ptr, sin_ptr,  # [B, R] rotary tables
    pool_ptr,  # [N_POOL, C + R] this layer's cache
    slot_ptr,  # int64 [B] each row's pool row
    out_ptr,  # [B, N, C + R] the queries the decode attention reads
    B, eps, stride_q, stride_wn, stride_wp, stride_kv, stride_cos, stride_pool,
    N: tl.constexpr, C: tl.constexpr, C_PAD: tl.constexpr, BLOCK_C: tl.constexpr, R: tl.constexpr,
    P: tl.constexpr, P_PAD: tl.constexpr, BLOCK_B: tl.constexpr, ROPE: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    n, cb = tl.program_id(0), tl.program_id(1)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows0 = tl.arange(0, BLOCK_B)
    # this head's absorbed queries, columns cb * BLOCK_C ...: q_p [B, P] @ W_UK[n] [P, BLOCK_C]
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    p = tl.arange(0, P_PAD)
    p_ok = p < P
    # The weights are no kernel's output: their load is in flight before the PDL wait.
    w = tl.load(w_ptr + n * stride_wn + p[:, None] * stride_wp + c[None, :], mask=p_ok[:, None] & c_ok[None, :],
                other=0.0)
    pdl_enter(PDL)
    w = w.to(tl.float32)
    for b0 in range(0, B, BLOCK_B):
        rows = (b0 + rows0).to(tl.int64)
        b_ok = rows < B
        q_p = tl.load(q_ptr + rows[:, None] * stride_q + n * (P + R) + p[None, :], mask=b_ok[:, None] & p_ok[None, :],
                      other=0.0).to(tl.float32)
        q_c = _dot(q_p, w, IEEE)
        tl.store(out_ptr + (rows[:, None] * N + n) * (C + R) + c[None, :], q_c.to(DT),
                 mask=b_ok[:, None] & c_ok[None, :])
    r = tl.arange(0, R)
    partner = (r + R // 2) % R
    sign = tl.where(r < R // 2, -1.0, 1.0)
    if cb == 0:  # this head's rotary queries, every row
        for b0 in range(0, B, BLOCK_B):
            rows = (b0 + rows0).to(tl.int64)
            b_ok = rows < B
            cos = tl.full([BLOCK_B, R], 1.0, tl.float32)
            sin = tl.zeros([BLOCK_B, R], tl.float32)
            if ROPE:
                cos = tl.load(cos_ptr + rows[:, None] * stride_cos + r[None, :], mask=b_ok[:, None], other=1.0)
                sin = tl.load(sin_ptr + rows[:, None] * stride_cos + r[None, :], mask=b_ok[:, None], other=0.0)
                cos, sin = cos.to(tl.float32), sin.to(tl.float32)
            q_r = _turn(q_ptr + rows[:, None] * stride_q + n * (P + R) + P, cos, sin, r[None, :], partner[None, :],
                        sign[None, :], b_ok[:, None], DT)
            tl.store(out_ptr + (rows[:, None] * N + n) * (C + R) + C + r[None, :], q_r.to(DT), mask=b_ok[:, None])
    # the latent's norm and the rotary key of rows pid, pid + programs, ..., stored at their pool rows
    cc = tl.arange(0, C_PAD)
    cc_ok = cc < C
    norm_w = tl.load(norm_ptr + cc, mask=cc_ok, other=0.0).to(tl.float32)
    programs = N * tl.num_programs(1)
    for b in range(n * tl.num_programs(1) + cb, B, programs):
        row = kv_ptr + b * stride_kv
        x = tl.load(row + cc, mask=cc_ok, other=0.0).to(tl.float32)
        normed = _rnd(x * tl.math.rsqrt(tl.sum(x * x, axis=0) / C + eps), DT)
        dest = pool_ptr + tl.load(slot_ptr + b) * stride_pool
        tl.store(dest + cc, (norm_w * normed).to(DT), mask=cc_ok)
        cos = tl.full([R], 1.0, tl.float32)
        sin = tl.zeros([R], tl.float32)
        if ROPE:
            cos = tl.load(cos_ptr + b * stride_cos + r).to(tl.float32)
            sin = tl.load(sin_ptr + b * stride_cos + r).to(tl.float32)
        k_r = _turn(row + C, cos, sin, r, partner, sign, r < R, DT)
        tl.store(dest + C + r, k_r.to(DT))


@triton.jit
def _latent_output_kernel(
    x_ptr,  # [B, N, C] the softmax-weighted latents, unit stride along C
    w_ptr,  # [N, V, C] each head's W_UV, any strides but unit along C
    y_ptr,  # [B, N * V]
    B, stride_xb, stride_xn, stride_wn, stride_wv,
    N: tl.constexpr, C: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    n, vb = tl.program_id(0), tl.program_id(1)
    DT: tl.constexpr = y_ptr.dtype.element_ty
    v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V
    k = tl.arange(0, BLOCK_K)
    # The first block of weights (the whole latent up to BLOCK_K) is loaded before the PDL
    # wait, as the query kernel's: no kernel wrote it.
    w0 = tl.load(w_ptr + n * stride_wn + v[None, :] * stride_wv + k[:, None], mask=(k < C)[:, None] & v_ok[None, :],
                 other=0.0)
    pdl_enter(PDL)
    w0 = w0.to(tl.float32)
    for b0 in range(0, B, BLOCK_B):
        rows = (b0 + tl.arange(0, BLOCK_B)).to(tl.int64)
        b_ok = rows < B
        x = tl.load(x_ptr + rows[:, None] * stride_xb + n * stride_xn + k[None, :],
                    mask=b_ok[:, None] & (k < C)[None, :], other=0.0).to(tl.float32)
        acc = _dot(x, w0, IEEE)
        for k0 in range(BLOCK_K, C, BLOCK_K):
            kk = k0 + k
            k_ok = kk < C
            x = tl.load(x_ptr + rows[:, None] * stride_xb + n * stride_xn + kk[None, :],
                        mask=b_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + n * stride_wn + v[None, :] * stride_wv + kk[:, None],
                        mask=k_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
            acc += _dot(x, w, IEEE)
        tl.store(y_ptr + rows[:, None] * (N * V) + n * V + v[None, :], acc.to(DT), mask=b_ok[:, None] & v_ok[None, :])


def latent_prologue_triton(q, w_uk, kv, norm_w, eps, cos, sin, pool, slot, *, pdl: bool = True) -> torch.Tensor:
    """Same contract as ``latent_prologue_ref``, in one launch (R a power of two)."""
    b, n, c, r, p = check_latent_prologue(q, w_uk, kv)
    pool2 = pool.reshape(pool.shape[0], -1)
    q, kv = q.reshape(b, -1), kv.reshape(b, -1)
    if q.stride(1) != 1 or kv.stride(1) != 1 or w_uk.stride(2) != 1 or pool2.stride(1) != 1:
        raise ValueError("q / w_uk / kv / pool: expected unit stride along their last axis")
    out = torch.empty(b, n, c + r, dtype=q.dtype, device=q.device)
    rope = cos is not None
    if rope:
        cos, sin = cos.reshape(b, r), sin.reshape(b, r)
    block_c = min(64, triton.next_power_of_2(c))
    _latent_query_kernel[(n, triton.cdiv(c, block_c))](
        q, w_uk, kv, norm_w, cos if rope else q, sin if rope else q, pool2, slot.reshape(b), out, b, float(eps),
        q.stride(0), w_uk.stride(0), w_uk.stride(1), kv.stride(0), cos.stride(0) if rope else 0, pool2.stride(0),
        N=n, C=c, C_PAD=triton.next_power_of_2(c), BLOCK_C=block_c, R=r, P=p,
        P_PAD=max(16, triton.next_power_of_2(p)), BLOCK_B=BLOCK_B, ROPE=rope, IEEE=q.dtype == torch.float32,
        num_warps=4, **pdl_launch(q.device, pdl))
    return out


def latent_output_triton(x, w_uv, *, pdl: bool = True) -> torch.Tensor:
    """Same contract as ``latent_output_ref``, in one launch."""
    b, n, c, v = check_latent_output(x, w_uv)
    if x.stride(2) != 1 or w_uv.stride(2) != 1:
        raise ValueError("x / w_uv: expected unit stride along the latent")
    y = torch.empty(b, n * v, dtype=x.dtype, device=x.device)
    # 16 value columns a program and the whole latent (to 512) in one product: each program's
    # weights are then a single load in flight, not a chain of dependent ones.
    block_v = 16
    _latent_output_kernel[(n, triton.cdiv(v, block_v))](
        x, w_uv, y, b, x.stride(0), x.stride(1), w_uv.stride(0), w_uv.stride(1),
        N=n, C=c, V=v, BLOCK_V=block_v, BLOCK_K=min(512, max(16, triton.next_power_of_2(c))), BLOCK_B=BLOCK_B,
        IEEE=x.dtype == torch.float32, num_warps=4, **pdl_launch(x.device, pdl))
    return y
