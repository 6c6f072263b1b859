"""``kernels.cold_pairs`` in one launch: an offloaded layer's decode-step bookkeeping (each
pair's device slot, the pairs whose experts lie in host memory, the layer's counters),
which as torch ops is about twenty launches a layer a step (``moe_infer.offload``).

Shape letters: P pairs (T tokens x k slots), E experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

BLOCK = 64  # pairs a step of the kernel's loops takes


@triton.jit
def _cold_pairs_kernel(ids_ptr, table_ptr, routed_ptr, tally_ptr, slot_ptr, cold_ptr, P, E, first,
                       WAY: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program. Pair i is the first of its cold expert when no cold pair j < i has the
    same expert: the cold experts met are counted from [BLOCK, BLOCK] comparisons of the
    blocks up to i's. The counters are read, added to and written back (one program; the
    calls of a stream follow each other). WAY < 0: no way counted."""
    pdl_enter(PDL)
    n_here = 0.0
    n_cold = 0.0
    n_met = 0.0
    for i0 in range(0, P, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        ok = i < P
        e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int64) - first
        here = ok & (e >= 0) & (e < E)
        s = tl.load(table_ptr + e, mask=here, other=-2)
        cold = here & (s == -1)
        tl.store(slot_ptr + i, s, mask=ok)
        tl.store(cold_ptr + i, tl.where(cold, e, -1), mask=ok)
        tl.atomic_add(routed_ptr + e, tl.where(here, 1.0, 0.0), mask=here)
        n_here += tl.sum(here.to(tl.float32), axis=0)
        n_cold += tl.sum(cold.to(tl.float32), axis=0)
        seen = tl.zeros([BLOCK], tl.int32)  # an earlier cold pair has the same expert
        for j0 in range(0, i0 + BLOCK, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            j_ok = j < P
            ej = tl.load(ids_ptr + j, mask=j_ok, other=0).to(tl.int64) - first
            j_here = j_ok & (ej >= 0) & (ej < E)
            cold_j = j_here & (tl.load(table_ptr + ej, mask=j_here, other=0) == -1)
            same = (ej[None, :] == e[:, None]) & cold_j[None, :] & (j[None, :] < i[:, None])
            seen = tl.maximum(seen, tl.max(same.to(tl.int32), axis=1))
        n_met += tl.sum((cold & (seen == 0)).to(tl.float32), axis=0)
    tl.store(tally_ptr + 0, tl.load(tally_ptr + 0) + n_here)
    tl.store(tally_ptr + 1, tl.load(tally_ptr + 1) + n_cold)
    tl.store(tally_ptr + 2, tl.load(tally_ptr + 2) + n_met)
    if WAY >= 0:
        tl.store(tally_ptr + WAY, tl.load(tally_ptr + WAY) + tl.where(n_cold > 0, 1.0, 0.0))


def cold_pairs_triton(ids: torch.Tensor, table: torch.Tensor, routed: torch.Tensor, tally: torch.Tensor,
                      way: int | None, first: int = 0, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``cold_pairs_ref``, in one launch."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    slot = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
    cold = torch.empty_like(slot)
    _cold_pairs_kernel[(1,)](flat, table, routed, tally, slot, cold, flat.numel(), table.numel(), first,
                             WAY=-1 if way is None else way, BLOCK=BLOCK, num_warps=4, **pdl_launch(ids.device, pdl))
    return slot, cold
