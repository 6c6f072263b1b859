"""RMSNorm in one launch, with the residual add fused in front of it.

Shape letters: R rows (every leading dimension flattened), H features.

The decode step's norms are latency-bound: a handful of rows, each a few KB. Written as
torch ops an RMSNorm is about eight kernels (cast, square, mean, add, rsqrt, two products,
cast back), plus one more for the residual add before it; here it is one. The arithmetic
follows the reference models: statistics in float32, the normalised value rounded to the
input dtype before the scale multiplies it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_FEATURES = 32768  # one program holds a whole row in registers up to this width


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
                     stride_x, stride_res, stride_out, stride_sum,
                     BLOCK_H: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:  # s = x + residual, rounded to the stream's dtype as torch's add rounds it
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """norm(x) [.., H], or with ``residual``: (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed  # cast before scaling: the Llama-family order
    return (out, x) if residual is not None else out


def _rows(t: torch.Tensor, name: str, h: int) -> torch.Tensor:
    if t.shape[-1] != h:
        raise ValueError(f"{name} {list(t.shape)}: expected the last dimension to be {h}")
    t = t.reshape(-1, h)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Same contract as ``rms_norm_ref``; one launch, one program per row."""
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight {list(weight.shape)}: expected [{h}] to match x {list(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {list(residual.shape)}: expected x's shape {list(x.shape)}")
    if h > MAX_FEATURES:
        return rms_norm_ref(x, weight, eps, residual)
    x2 = _rows(x, "x", h)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    r2 = _rows(residual, "residual", h) if residual is not None else x2
    s2 = summed.view(-1, h) if summed is not None else out.view(-1, h)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(rows,)](x2, r2, weight, out.view(-1, h), s2, h, eps, x2.stride(0), r2.stride(0),
                                  h, h, BLOCK_H=block, HAS_RES=residual is not None,
                                  num_warps=max(1, min(16, block // 512)))
    return (out, summed) if residual is not None else out
