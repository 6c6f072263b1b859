"""``kernels.cold_pairs`` in one launch: an offloaded layer's bookkeeping for each call, a
decode step's or a prompt's (each pair's device slot, the pairs whose experts lie in host
memory, the layer's counters), which as torch ops is about twenty launches a layer a step
(``moe_infer.offload``).

Shape letters: P pairs (T tokens x k slots), E experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

TILE = 16384  # a step's [pairs, experts] comparisons at most: the pairs a step takes follow E


@triton.jit
def _cold_pairs_kernel(ids_ptr, table_ptr, routed_ptr, tally_ptr, slot_ptr, cold_ptr, P, E, first,
                       WAY: tl.constexpr, BLOCK: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr):
    """One program, one pass over the pairs in blocks of BLOCK. The cold experts met: a flag
    per expert, raised by the block's cold pairs ([BLOCK, E_PAD] comparisons), counted at
    the end, so a call of many pairs (a prefill) costs its pairs times E, not its pairs
    squared. The counters are read, added to and written back (one program; the calls of
    a stream follow each other). WAY < 0: no way counted."""
    pdl_enter(PDL)
    n_here = 0.0
    n_cold = 0.0
    experts = tl.arange(0, E_PAD)
    met = tl.zeros([E_PAD], tl.int32)
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
        hit = (e[:, None] == experts[None, :]) & cold[:, None]
        met = tl.maximum(met, tl.max(hit.to(tl.int32), axis=0))
    n_met = tl.sum(met, axis=0).to(tl.float32)
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
    e_pad = max(16, triton.next_power_of_2(table.numel()))
    _cold_pairs_kernel[(1,)](flat, table, routed, tally, slot, cold, flat.numel(), table.numel(), first,
                             WAY=-1 if way is None else way, BLOCK=max(16, min(64, TILE // e_pad)), E_PAD=e_pad,
                             num_warps=4, **pdl_launch(ids.device, pdl))
    return slot, cold
