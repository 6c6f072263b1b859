"""Plain-torch references for the layout steps between token order and the expert-major
buffer (DeepSpeed-Inference V-C, steps 2, 3 and the inverse of 3).

Shape letters: T tokens, H hidden, E experts, k slots per token, N = T * k rows of the
expert-major buffer.

  maps      expert_ids [T, k]        -> offsets [E + 1] int32, rows [T, k] int32
  scatter   x [T, H], rows           -> xs [N, H]   (grouped by expert)
  gather    ys [N, H], rows, weights -> out [T, H]  (weighted sum over the k slots)

No one-hot tensors: the maps are a histogram and an exclusive prefix scan, and the
scatter / gather are row copies. The Triton kernels (``kernels.layout.maps``,
``kernels.layout.rows``) must match these functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def token_maps_ref(expert_ids: torch.Tensor, num_experts: int,
                   capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-major layout: ``offsets [E + 1]`` (exclusive scan of per-expert counts) and
    ``rows [T, k]``, the buffer row of each (token, slot); -1 where capacity dropped it.

    Within an expert, rows keep token order (slot order breaks ties), as a stable sort would.
    """
    flat = expert_ids.reshape(-1).long()  # [N]
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    offsets = F.pad(torch.cumsum(counts, 0), (1, 0))  # [E + 1]
    order = torch.argsort(flat, stable=True)  # buffer row -> flat index
    sorted_pos = torch.empty_like(order)
    sorted_pos[order] = torch.arange(n, device=flat.device)  # flat index -> buffer row
    if capacity is None:
        rows = sorted_pos
    else:
        rank = sorted_pos - offsets[flat]  # position of this pair inside its expert
        counts = counts.clamp(max=capacity)
        offsets = F.pad(torch.cumsum(counts, 0), (1, 0))
        rows = torch.where(rank < capacity, offsets[flat] + rank, torch.full_like(rank, -1))
    return offsets.to(torch.int32), rows.view(expert_ids.shape).to(torch.int32)


def row_pair_ref(rows: torch.Tensor) -> torch.Tensor:
    """The inverse map: the (token, slot) pair held by each buffer row ([T * k]; rows no
    pair maps to hold -1)."""
    flat = rows.reshape(-1).long()
    keep = flat >= 0
    row_pair = torch.full_like(flat, -1)
    row_pair[flat[keep]] = torch.arange(flat.numel(), device=rows.device)[keep]
    return row_pair.to(torch.int32)


def scatter_rows_ref(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copies token t's hidden state to buffer row rows[t, j] for every slot j.

    The buffer (``out`` when given) has T * k rows; rows past ``offsets[E]`` (dropped pairs)
    stay zero in a new buffer and untouched in ``out``."""
    t, k = rows.shape
    xs = x.new_zeros(t * k, x.shape[1]) if out is None else out  # [N, H]
    flat = rows.reshape(-1).long()
    keep = flat >= 0
    token = torch.arange(t, device=x.device).repeat_interleave(k)  # [N]
    xs[flat[keep]] = x[token[keep]]
    return xs


TAG_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # the integer a row's tag column is read as


def dispatch_rows_ref(x: torch.Tensor, rows: torch.Tensor, expert_ids: torch.Tensor, experts_per_rank: int,
                      out: torch.Tensor) -> torch.Tensor:
    """The send buffer of an expert-parallel all-to-all: x [T, H] copied to rows ``rows``
    [T, k * es] of ``out`` [N, H + pad] (es rows per pair), and in column H of each written
    row, read as an integer of the element's width, the pair's local expert
    ``expert_ids % experts_per_rank``."""
    t, units = rows.shape
    h = x.shape[1]
    scatter_rows_ref(x, rows, out=out[:, :h])
    local = (expert_ids % experts_per_rank).repeat_interleave(units // expert_ids.shape[1], dim=1)
    flat = rows.reshape(-1).long()
    keep = flat >= 0
    ints = TAG_INTS[out.element_size()]
    out.view(ints)[flat[keep], h] = local.reshape(-1)[keep].to(ints)
    return out


def gather_rows_ref(ys: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                    limit: int | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * ys[rows[t, j]], accumulated in float32; a row of -1,
    or at or past ``limit`` (rows not sent, so not in ys), adds nothing (ys may then have
    no rows at all)."""
    if not ys.shape[0]:
        return ys.new_zeros(rows.shape[0], ys.shape[1])
    flat = rows.long()
    if limit is not None:
        flat = torch.where(flat < limit, flat, -1)
    picked = ys[flat.clamp(min=0)].float()  # [T, k, H]
    w = torch.where(flat >= 0, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    return (picked * w.unsqueeze(-1)).sum(dim=1).to(ys.dtype)
