"""Triton expert-to-token maps: per-expert counts, an exclusive prefix scan, and each
(token, slot) pair's row in the expert-major buffer (DeepSpeed-Inference V-C, step 2).

Shape letters: T tokens, k slots, n = T * k pairs (pair p is token p // k, slot p % k),
E experts. Outputs, as ``token_maps_ref``: ``offsets [E + 1]``, ``rows [T, k]`` (-1 where
capacity dropped the pair), and the inverse ``row_pair [n]`` (the pair in each buffer
row) that the grouped GEMM uses to read tokens straight from x.

Within an expert, rows keep pair order, so the result equals a stable sort by expert.
Small n (decode) runs in one program; large n in three launches (per-block counts and
ranks; a scan over blocks, parallel over experts; then the rows, each program redoing the
short scan across experts). No host synchronisation either way, so the maps can be
captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

SMALL_PAIRS = 128  # up to this many pairs, one program does everything
BLOCK_PAIRS = 128  # pairs per program in the multi-block path
SCAN_EXPERTS = 16  # experts per program of the scan over blocks
SCAN_CHUNK = 64  # blocks per step of that scan (T = 16384, k = 8: 1024 blocks, 16 steps)


@triton.jit
def _maps_block(
    ids, pair, valid,  # [BLOCK] expert, pair index, validity; pair increases along the vector
    offsets_ptr, rows_ptr, row_pair_ptr, capacity,
    E: tl.constexpr, E_PAD: tl.constexpr, HAS_CAP: tl.constexpr, STORE=True, MASKED: tl.constexpr = False,
):
    """All the maps of one block of pairs, in registers (the decode sizes); written out when
    ``STORE`` (one program of a grid that recomputes them). -> (row, kept) per pair.
    ``MASKED``: pairs in the bin past the experts (experts elsewhere) get row -1."""
    ids = tl.where(valid, ids, E)  # padding lands in a bin past the experts
    pos = tl.arange(0, ids.shape[0])
    # rank of each pair among earlier pairs of the same expert: a BLOCK x BLOCK compare,
    # cheap at decode sizes and free of atomics, so the order is deterministic.
    same = (ids[:, None] == ids[None, :]) & (pos[None, :] < pos[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    kept = valid & (rank < capacity) if HAS_CAP else valid
    # rows before this pair's expert segment: kept pairs of smaller experts.
    before = (ids[None, :] < ids[:, None]) & kept[None, :]
    row = tl.sum(before.to(tl.int32), axis=1) + rank
    here = (ids < E) if MASKED else kept
    tl.store(rows_ptr + pair, tl.where(kept & here, row, -1), mask=valid & STORE)
    tl.store(row_pair_ptr + row, pair, mask=kept & STORE)
    counts = tl.histogram(tl.where(kept, ids, E), E_PAD)  # [E_PAD]
    e = tl.arange(0, E_PAD)
    counts = tl.where(e < E, counts, 0)
    excl = tl.cumsum(counts, axis=0) - counts
    tl.store(offsets_ptr + e, excl, mask=(e <= E) & STORE)
    return row, kept


@triton.jit
def _local_ids(ids, first, E: tl.constexpr, MASKED: tl.constexpr):
    """``MASKED``: the model's expert ids -> their index among the E experts from ``first``
    on, or E (the bin past them) for an expert elsewhere."""
    if MASKED:
        ids = ids - first
        ids = tl.where((ids >= 0) & (ids < E), ids, E)
    return ids


@triton.jit
def _maps_small_kernel(
    ids_ptr,  # [n] int32 expert id of each pair
    offsets_ptr,  # [E + 1] int32 out: expert segment starts, then the total
    rows_ptr,  # [n] int32 out: buffer row of each pair, -1 if dropped
    row_pair_ptr,  # [n] int32 out: pair held by each buffer row
    n, capacity,  # number of pairs; per-expert capacity (ignored unless HAS_CAP)
    first,  # MASKED: the first expert id here
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, HAS_CAP: tl.constexpr,
    MASKED: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    i = tl.arange(0, BLOCK)
    valid = i < n
    ids = _local_ids(tl.load(ids_ptr + i, mask=valid, other=E), first, E, MASKED)
    _maps_block(ids, i, valid, offsets_ptr, rows_ptr, row_pair_ptr, capacity, E, E_PAD, HAS_CAP, MASKED=MASKED)


@triton.jit
def _maps_count_kernel(
    ids_ptr,  # [n] int32 expert id of each pair
    counts_ptr,  # [num_blocks, E_PAD] int32 out: pairs per expert in each block
    rank_ptr,  # [n] int32 out: rank of the pair among its block's pairs of the same expert
    n, first,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
    MASKED: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    ids = tl.where(valid, _local_ids(tl.load(ids_ptr + i, mask=valid, other=E), first, E, MASKED), E)
    j = tl.arange(0, BLOCK)
    same = (ids[:, None] == ids[None, :]) & (j[None, :] < j[:, None])
    tl.store(rank_ptr + i, tl.sum(same.to(tl.int32), axis=1), mask=valid)
    e = tl.arange(0, E_PAD)
    tl.store(counts_ptr + b * E_PAD + e, tl.histogram(ids, E_PAD))


@triton.jit
def _maps_scan_kernel(
    counts_ptr,  # [num_blocks, E_PAD] int32 in: per-block counts; out: each block's base per expert
    cap_ptr,  # [E_PAD] int32 out: kept pairs per expert (counts clipped to capacity)
    num_blocks, capacity,
    E: tl.constexpr, E_PAD: tl.constexpr, E_BLOCK: tl.constexpr, CHUNK: tl.constexpr, HAS_CAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p scans the counts of experts p * E_BLOCK .. over all blocks (the experts'
    scans are independent, so they run side by side; the scan across experts is left to
    the rows kernel)."""
    pdl_enter(PDL)
    e = tl.program_id(0) * E_BLOCK + tl.arange(0, E_BLOCK)
    running = tl.zeros([E_BLOCK], dtype=tl.int32)
    for c in range(0, num_blocks, CHUNK):
        blk = c + tl.arange(0, CHUNK)
        ptrs = counts_ptr + blk[:, None] * E_PAD + e[None, :]
        m = blk[:, None] < num_blocks
        cnt = tl.load(ptrs, mask=m, other=0)  # [CHUNK, E_BLOCK]
        incl = tl.cumsum(cnt, axis=0)
        tl.store(ptrs, running[None, :] + incl - cnt, mask=m)  # rank base within the expert
        running += tl.sum(cnt, axis=0)
    kept = tl.where(e < E, running, 0)
    if HAS_CAP:
        kept = tl.minimum(kept, capacity)
    tl.store(cap_ptr + e, kept)


@triton.jit
def _maps_rows_kernel(
    ids_ptr,  # [n] int32
    base_ptr,  # [num_blocks, E_PAD] int32: rank base of each expert at the block start
    rank_ptr,  # [n] int32: rank within the block
    cap_ptr,  # [E_PAD] int32: kept pairs per expert
    offsets_ptr,  # [E + 1] int32 out (program 0 writes it)
    rows_ptr,  # [n] int32 out
    row_pair_ptr,  # [n] int32 out
    n, capacity, first,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, HAS_CAP: tl.constexpr,
    MASKED: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    # Expert segment starts: an exclusive scan of the kept counts (E_PAD values, cheap to
    # redo in every program).
    e = tl.arange(0, E_PAD)
    kept_e = tl.load(cap_ptr + e)
    starts = tl.cumsum(kept_e, axis=0) - kept_e
    tl.store(offsets_ptr + e, starts, mask=(e <= E) & (b == 0))
    i = b * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    ids = tl.where(valid, _local_ids(tl.load(ids_ptr + i, mask=valid, other=0), first, E, MASKED), 0)
    rank = tl.load(base_ptr + b * E_PAD + ids, mask=valid, other=0) + tl.load(rank_ptr + i, mask=valid, other=0)
    kept = valid & (rank < capacity) if HAS_CAP else valid
    row = tl.gather(starts, ids, 0) + rank
    here = (ids < E) if MASKED else kept
    tl.store(rows_ptr + i, tl.where(kept & here, row, -1), mask=valid)
    tl.store(row_pair_ptr + row, i, mask=kept)


def token_maps_triton(expert_ids: torch.Tensor, num_experts: int, capacity: int | None = None, pdl: bool = True,
                      first: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ids [T, k] -> offsets [E + 1], rows [T, k], row_pair [T * k] (all int32).
    ``first`` (the experts here are ids first .. first + E - 1 of the model's; expert
    parallelism over ranks that hold the same tokens): the ids count from it, and pairs of
    experts elsewhere go to a bin past the E (rows no GEMM tile runs) with row -1, as
    ``here_or_past`` then the maps would give, in the same launches."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids: expected [T, k], got shape {list(expert_ids.shape)}")
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity={capacity}: expected a positive number or None")
    ids = expert_ids.reshape(-1).to(torch.int32).contiguous()
    n, dev = ids.numel(), ids.device
    e_pad = triton.next_power_of_2(num_experts + 1)  # one spare bin for padding pairs
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    rows = torch.empty(n, dtype=torch.int32, device=dev)
    row_pair = torch.empty(n, dtype=torch.int32, device=dev)
    cap = capacity if capacity is not None else n
    masked, first = first is not None, first or 0
    if n <= SMALL_PAIRS:
        _maps_small_kernel[(1,)](ids, offsets, rows, row_pair, n, cap, first, E=num_experts, E_PAD=e_pad,
                                 BLOCK=max(16, triton.next_power_of_2(n)), HAS_CAP=capacity is not None,
                                 MASKED=masked, **pdl_launch(ids.device, pdl))
    else:
        blocks = triton.cdiv(n, BLOCK_PAIRS)
        counts = torch.empty(blocks, e_pad, dtype=torch.int32, device=dev)
        rank = torch.empty(n, dtype=torch.int32, device=dev)
        kept = torch.empty(e_pad, dtype=torch.int32, device=dev)
        _maps_count_kernel[(blocks,)](ids, counts, rank, n, first, E=num_experts, E_PAD=e_pad, BLOCK=BLOCK_PAIRS,
                                      MASKED=masked, **pdl_launch(ids.device, pdl))
        e_block = min(e_pad, SCAN_EXPERTS)
        _maps_scan_kernel[(e_pad // e_block,)](counts, kept, blocks, cap, E=num_experts, E_PAD=e_pad,
                                               E_BLOCK=e_block, CHUNK=SCAN_CHUNK, HAS_CAP=capacity is not None,
                                               **pdl_launch(counts.device, pdl))
        _maps_rows_kernel[(blocks,)](ids, counts, rank, kept, offsets, rows, row_pair, n, cap, first,
                                     E=num_experts, E_PAD=e_pad, BLOCK=BLOCK_PAIRS, HAS_CAP=capacity is not None,
                                     MASKED=masked, **pdl_launch(ids.device, pdl))
    return offsets, rows.view(expert_ids.shape), row_pair
