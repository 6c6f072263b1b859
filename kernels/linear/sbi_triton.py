"""SBI-GeMM in Triton: the small-batch GEMM of the decode path (DeepSpeed-Inference III-B)
with the deep-fusion prologue and epilogue: y = norm(x) @ W.T (+ bias) (+ residual).

Shape letters: T rows (<= 16 at decode), K in, N out, BN output tile, S split-K partials.

Tiles run along N; when N is too narrow to give every SM work, K is split as well and a
second kernel sums the S float32 partials (deterministic, no atomics) and applies the
epilogue. The norm (RMSNorm or LayerNorm) is recomputed by every program for the few rows
it needs, as the paper replicates pre-GEMM work across SMs, so no normalised copy of x is
written. int8 weights are widened in registers and scaled per output channel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

NORMS = {None: 0, "rmsnorm": 1, "layernorm": 2}


@triton.jit
def _sbi_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [N, K] (K contiguous), bf16 / fp16 / fp32 or int8
    scale_ptr,  # [N] float32 (INT8_W)
    norm_w_ptr, norm_b_ptr,  # [K] (NORM; the bias only for LayerNorm)
    bias_ptr,  # [N] (HAS_BIAS, applied here only without split-K)
    res_ptr,  # [T, N] (HAS_RES, likewise)
    out_ptr,  # [T, N] (SPLIT_K == 1) or [S, T, N] float32 partials
    T, N, K, eps, stride_x, stride_w, stride_res, stride_os, stride_o,
    BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, NORM: tl.constexpr,
    INT8_W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BT)
    row_ok = rows < T
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    if NORM != 0:  # statistics of the whole row, recomputed by each program
        s1 = tl.zeros([BT], tl.float32)
        s2 = tl.zeros([BT], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            xv = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            s1 += tl.sum(xv, axis=1)
            s2 += tl.sum(xv * xv, axis=1)
        if NORM == 2:
            mean = s1 / K
            rstd = 1.0 / tl.sqrt(s2 / K - mean * mean + eps)
        else:
            mean = tl.zeros([BT], tl.float32)
            rstd = 1.0 / tl.sqrt(s2 / K + eps)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_w
    k_span = tl.cdiv(K, SPLIT_K * BK) * BK
    acc = tl.zeros([BT, BN], tl.float32)
    for k0 in range(pid_k * k_span, pid_k * k_span + k_span, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM != 0:
            g = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :]
            if NORM == 2:
                a += tl.load(norm_b_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            a = tl.where(row_ok[:, None] & k_ok[None, :], a, 0.0)
        if UPCAST:  # the interpreter (its bf16 arithmetic is wrong) or fp32 inputs
            a = a.to(tl.float32)
        else:
            a = a.to(x_ptr.dtype.element_ty)
        b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0).to(a.dtype)  # [BK, BN]
        acc += tl.dot(a, b, input_precision="ieee" if UPCAST else None)
    if INT8_W:
        acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + pid_k * stride_os + rows[:, None] * stride_o + cols[None, :], acc, mask=ok)


@triton.jit
def _reduce_kernel(
    part_ptr,  # [S, T, N] float32
    bias_ptr, res_ptr, out_ptr,  # [N], [T, N], [T, N]
    N, stride_ps, stride_p, stride_res, stride_o,
    S: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(part_ptr + s * stride_ps + t * stride_p + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + t * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sbi_config(t: int, n: int, k: int, sms: int) -> dict:
    """Launch configuration: output tiles of BN columns; K split until about two programs
    per SM, each keeping at least 512 of K."""
    bn = 64 if n >= 64 * sms else 32
    split = 1
    while triton.cdiv(n, bn) * split < 2 * sms and k // (split * 2) >= 512 and split < 16:
        split *= 2
    return dict(bt=max(16, triton.next_power_of_2(t)), bn=bn, bk=128, split_k=split, num_warps=4, num_stages=4)


def sbi_linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      norm: tuple | None = None, config: dict | None = None, pdl: bool = True) -> torch.Tensor:
    """y [T, N] = norm(x [T, K]) @ dequant(w [N, K]).T (+ bias [N]) (+ residual [T, N]), in x's
    dtype. ``norm`` is (kind, weight [K], bias [K] or None, eps), kind "rmsnorm" or "layernorm"."""
    t, k = x.shape
    n = w.shape[0]
    if t > 64:
        raise ValueError(f"x {list(x.shape)}: the small-batch GEMM takes at most 64 rows")
    x = x if x.stride(-1) == 1 else x.contiguous()
    kind, g, gb, eps = norm if norm is not None else (None, None, None, 0.0)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    cfg = config or sbi_config(t, n, k, sms)
    split = cfg["split_k"]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    target = out if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    dummy = x
    _sbi_kernel[(triton.cdiv(n, cfg["bn"]), split)](
        x, w, scale if scale is not None else dummy, g if g is not None else dummy,
        gb if gb is not None else dummy, bias if bias is not None else dummy,
        residual if residual is not None else dummy, target,
        t, n, k, float(eps), x.stride(0), w.stride(0), residual.stride(0) if residual is not None else 0,
        target.stride(0) if split > 1 else 0, target.stride(-2),
        BT=cfg["bt"], BN=cfg["bn"], BK=cfg["bk"], SPLIT_K=split, NORM=NORMS[kind], INT8_W=w.dtype == torch.int8,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        UPCAST=x.device.type == "cpu" or x.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(x.device, pdl))
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(t, triton.cdiv(n, block))](
            target, bias if bias is not None else dummy, residual if residual is not None else dummy, out,
            n, target.stride(0), target.stride(1), residual.stride(0) if residual is not None else 0, out.stride(0),
            S=split, BLOCK=block, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            **pdl_launch(target.device, pdl))
    return out
