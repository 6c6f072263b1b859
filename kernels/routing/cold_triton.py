"""``kernels.cold_pairs`` in one launch: an offloaded layer's bookkeeping for each call, a
decode step's or a prompt's (each pair's device slot, the pairs whose experts lie in host
memory, the cold pairs of each expert, the layer's counters), which as torch ops is about
twenty launches a layer a step (``moe_infer.offload``).

Shape letters: P pairs (T tokens x k slots), E experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch, ticket_counters

TILE = 16384  # a block's [pairs, experts] comparisons at most: the pairs a block takes follow E
SPAN = 1024  # pairs a program takes (a multiple of every block): a decode step's call is one program


@triton.jit
def _cold_pairs_kernel(ids_ptr, table_ptr, routed_ptr, tally_ptr, slot_ptr, cold_ptr, met_ptr, scratch_ptr, P, E,
                       first, WAY: tl.constexpr, BLOCK: tl.constexpr, E_PAD: tl.constexpr, SPAN: tl.constexpr,
                       PDL: tl.constexpr):
    """Program i: pairs i * SPAN .. in blocks of BLOCK; each block's cold pairs counted by
    expert ([BLOCK, E_PAD] comparisons), so a call of many pairs costs its pairs times E.
    One program stores its counts itself. Several add theirs (and their pairs here) into
    ``scratch`` [E + 2] int32 (zeros between calls: the last slot is the ticket) and take
    a ticket; the last one reads the sums back, setting them to zero, and writes the
    counts and the counters. The counters are read, added to and written back by one
    program (the calls of a stream follow each other). WAY < 0: no way counted."""
    pdl_enter(PDL)
    lo = tl.program_id(0) * SPAN
    n_here = 0
    experts = tl.arange(0, E_PAD)
    e_ok = experts < E
    met = tl.zeros([E_PAD], tl.int32)
    for i0 in range(lo, tl.minimum(lo + SPAN, P), BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        ok = i < P
        e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int64) - first
        here = ok & (e >= 0) & (e < E)
        s = tl.load(table_ptr + e, mask=here, other=-2)
        cold = here & (s == -1)
        tl.store(slot_ptr + i, s, mask=ok)
        tl.store(cold_ptr + i, tl.where(cold, e, -1), mask=ok)
        tl.atomic_add(routed_ptr + e, tl.where(here, 1.0, 0.0), mask=here)
        n_here += tl.sum(here.to(tl.int32), axis=0)
        met += tl.sum(((e[:, None] == experts[None, :]) & cold[:, None]).to(tl.int32), axis=0)
    last = tl.num_programs(0) == 1
    if not last:
        tl.atomic_add(scratch_ptr + experts, met, mask=e_ok)
        tl.atomic_add(scratch_ptr + E, n_here)
        tl.debug_barrier()  # every thread's sums are in before the ticket is taken
        last = tl.atomic_add(scratch_ptr + E + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1
        if last:  # the sums of every program, the scratch left at zero for the next call
            met = tl.where(e_ok, tl.atomic_xchg(scratch_ptr + experts, 0, mask=e_ok), 0)
            n_here = tl.atomic_xchg(scratch_ptr + E, 0)
            tl.atomic_xchg(scratch_ptr + E + 1, 0)
    if last:
        tl.store(met_ptr + experts, met, mask=e_ok)
        n_cold = tl.sum(met, axis=0).to(tl.float64)
        tl.store(tally_ptr + 0, tl.load(tally_ptr + 0) + n_here.to(tl.float64))
        tl.store(tally_ptr + 1, tl.load(tally_ptr + 1) + n_cold)
        tl.store(tally_ptr + 2, tl.load(tally_ptr + 2) + tl.sum((met > 0).to(tl.float64), axis=0))
        if WAY >= 0:
            tl.store(tally_ptr + WAY, tl.load(tally_ptr + WAY) + tl.where(n_cold > 0, 1.0, 0.0))


def cold_pairs_triton(ids: torch.Tensor, table: torch.Tensor, routed: torch.Tensor, tally: torch.Tensor,
                      way: int | None, first: int = 0, pdl: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``cold_pairs_ref``: one program for up to ``SPAN`` pairs, one a
    ``SPAN`` beyond."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    slot = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
    cold = torch.empty_like(slot)
    e = table.numel()
    met = torch.empty(e, dtype=torch.int32, device=ids.device)
    e_pad = max(16, triton.next_power_of_2(e))
    block = max(16, min(64, TILE // e_pad))
    _cold_pairs_kernel[(max(1, triton.cdiv(flat.numel(), SPAN)),)](
        flat, table, routed, tally, slot, cold, met, ticket_counters(ids.device, e + 2, "cold_pairs"), flat.numel(),
        e, first, WAY=-1 if way is None else way, BLOCK=block, E_PAD=e_pad, SPAN=SPAN, num_warps=4,
        **pdl_launch(ids.device, pdl))
    return slot, cold, met
