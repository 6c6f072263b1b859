"""Triton layout transforms between token order and the expert-major buffer
(DeepSpeed-Inference V-C, steps 3 and its inverse): row copies driven by the maps, never
one-hot einsums.

Shape letters: T tokens, k slots, H hidden, N = T * k buffer rows, S split-K partials.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layout.reference import TAG_INTS
from kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _scatter_kernel(
    x_ptr,  # [T, H] tokens
    rows_ptr,  # [T * k] int32 buffer row of each (token, slot), -1 if dropped
    xs_ptr,  # [N, H] out: the expert-major buffer
    ids_ptr,  # [T, K / ES] expert of each pair (read only if TAG)
    tag_ptr,  # the buffer seen as integers of its element width (written only if TAG)
    H, stride_x, stride_xs, e_local,
    K: tl.constexpr, BLOCK_H: tl.constexpr,
    TAG: tl.constexpr,  # also write expert % e_local into the integer column H of each row
    ES: tl.constexpr,  # rows per pair (expert slices): row j of a token belongs to pair j // ES
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    v = tl.load(x_ptr + t * stride_x + h, mask=hm)  # read the token once, write it k times
    for j in tl.static_range(K):
        r = tl.load(rows_ptr + t * K + j)
        tl.store(xs_ptr + r * stride_xs + h, v, mask=hm & (r >= 0))
        if TAG:
            if tl.program_id(1) == 0:
                e = tl.load(ids_ptr + t * (K // ES) + j // ES)
                tl.store(tag_ptr + r * stride_xs + H, (e % e_local).to(tag_ptr.dtype.element_ty), mask=r >= 0)


@triton.jit
def _gather_kernel(
    ys_ptr,  # [S, N, H] expert outputs (S split-K partials, summed here)
    rows_ptr,  # [T * k] int32 buffer row of each (token, slot), -1 if dropped
    w_ptr,  # [T * k] float32 combine weights (unused unless HAS_W)
    out_ptr,  # [T, H] out
    H, stride_ys_s, stride_ys, stride_out,
    limit,  # rows at or past it add nothing (not sent, so not in ys)
    K: tl.constexpr, S: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr,
    IDENTITY: tl.constexpr,  # rows[t, j] = t * K + j: buffer rows are pairs (no rows read)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        r = t * K + j if IDENTITY else tl.load(rows_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j) if HAS_W else 1.0
        for s in tl.static_range(S):
            y = tl.load(ys_ptr + s * stride_ys_s + r * stride_ys + h, mask=hm & (r >= 0) & (r < limit),
                        other=0.0)
            acc += w * y.to(tl.float32)
    tl.store(out_ptr + t * stride_out + h, acc.to(out_ptr.dtype.element_ty), mask=hm)


def _block_h(h: int) -> int:
    return min(1024, triton.next_power_of_2(h))


def scatter_rows_triton(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None,
                        pdl: bool = True) -> torch.Tensor:
    """x [T, H], rows [T, k] -> xs [T * k, H]. Buffer rows past ``offsets[E]`` (there are
    some only when capacity dropped pairs) are not written: nothing reads them, and
    skipping the fill saves a launch on the decode path. ``out`` may be a view whose rows
    are strided (a padded send buffer)."""
    t, k = rows.shape
    if x.dim() != 2 or x.shape[0] != t:
        raise ValueError(f"x {list(x.shape)}: expected [T={t}, H] to match rows {list(rows.shape)}")
    x = x.contiguous()
    xs = x.new_empty(t * k, x.shape[1]) if out is None else _check_out(out, x, t * k)
    bh = _block_h(x.shape[1])
    _scatter_kernel[(t, triton.cdiv(x.shape[1], bh))](
        x, rows.reshape(-1).contiguous(), xs, rows, rows, x.shape[1], x.stride(0), xs.stride(0), 1,
        K=k, BLOCK_H=bh, TAG=False, ES=1, **pdl_launch(x.device, pdl))
    return xs


def dispatch_rows_triton(x: torch.Tensor, rows: torch.Tensor, expert_ids: torch.Tensor, experts_per_rank: int,
                         out: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """The send buffer of an expert-parallel all-to-all, in one launch: x [T, H] to rows
    ``rows`` [T, k * es] of ``out`` [N, H + pad] (es rows per pair, one per expert slice),
    and into column H of each written row, read as an integer of the element's width
    (``TAG_INTS``), the pair's local expert ``expert_ids % experts_per_rank``
    (``dispatch_rows_ref``)."""
    t, units = rows.shape
    if expert_ids.dim() != 2 or expert_ids.shape[0] != t or units % expert_ids.shape[1]:
        raise ValueError(f"expert_ids {list(expert_ids.shape)}: expected [T={t}, k] with k dividing "
                         f"the {units} rows per token")
    h = x.shape[1]
    if out.dim() != 2 or out.shape[1] <= h or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out {list(out.shape)} {out.dtype}: expected a contiguous [N, more than H={h}] "
                         f"{x.dtype} buffer")
    x = x.contiguous()
    bh = _block_h(h)
    _scatter_kernel[(t, triton.cdiv(h, bh))](
        x, rows.reshape(-1).contiguous(), out, expert_ids.to(torch.int32).contiguous(),
        out.view(TAG_INTS[out.element_size()]), h, x.stride(0), out.stride(0), experts_per_rank,
        K=units, BLOCK_H=bh, TAG=True, ES=units // expert_ids.shape[1], **pdl_launch(x.device, pdl))
    return out


def _check_out(out: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    if out.shape != (n, x.shape[1]) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {list(out.shape)} {out.dtype}: expected [{n}, {x.shape[1]}] {x.dtype} "
                         "with contiguous rows")
    return out


def combine_rows_triton(ys: torch.Tensor, rows: torch.Tensor | None, weights: torch.Tensor | None,
                        out_dtype: torch.dtype, topk: int | None = None, limit: int | None = None, *,
                        pdl: bool) -> torch.Tensor:
    """ys [S, N, H] (partials) -> out [T, H] = sum over slots and partials of w * ys.
    ``rows=None``: buffer row t * topk + j holds pair (t, j). Rows at or past ``limit``
    (default N) add nothing."""
    identity = rows is None
    t, k = (ys.shape[1] // topk, topk) if identity else rows.shape
    s, _, h = ys.shape
    out = torch.empty(t, h, dtype=out_dtype, device=ys.device)
    bh = _block_h(h)
    rows = ys if identity else rows.reshape(-1).contiguous()  # a placeholder pointer when identity
    w = weights.reshape(-1).float().contiguous() if weights is not None else rows
    _gather_kernel[(t, triton.cdiv(h, bh))](
        ys, rows, w, out, h, ys.stride(0), ys.stride(1), out.stride(0), ys.shape[1] if limit is None else limit,
        K=k, S=s, HAS_W=weights is not None, BLOCK_H=bh, IDENTITY=identity,
        **pdl_launch(ys.device, pdl))
    return out


def gather_rows_triton(ys: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                       limit: int | None = None, pdl: bool = True) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * ys[rows[t, j]], accumulated in float32 (``gather_rows_ref``)."""
    if weights.shape != rows.shape:
        raise ValueError(f"weights {list(weights.shape)}: expected the shape of rows {list(rows.shape)}")
    if limit is not None and not 0 <= limit <= ys.shape[0]:
        raise ValueError(f"limit={limit}: expected 0..{ys.shape[0]} (the rows of ys)")
    return combine_rows_triton(ys.contiguous().unsqueeze(0), rows, weights, ys.dtype, limit=limit, pdl=pdl)
