"""A static decode step's shared inputs in one launch: each row's position, the additive
attention mask over the cache, and the rotary cos / sin rows.

Shape letters: B rows, S cache slots, D rotary head dim.

``dense.attention.StepContext.decode_static`` built these with about twenty small torch
launches a step (the mask's comparisons, the rotary frequencies, cos, sin, casts); inside a
CUDA graph each costs its launch latency, and none takes part in PDL. Here one program a
row reads the row's position at the step's slot, writes the mask row (0 where the query
may attend: a valid key at or before the slot, within the sliding window if any, and
always the slot itself; -inf elsewhere) and copies the position's cos / sin rows out of
tables the caller computed once (``dense.rotary.Rotary.table``), so the values are the
ones the per-step computation gives.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

BLOCK_S = 1024


@triton.jit
def _decode_context_kernel(slot_ptr, valid_ptr, kpos_ptr, cos_tab_ptr, sin_tab_ptr, pos_ptr, bias_ptr, cos_ptr,
                           sin_ptr, S, D, L, window, HAS_WINDOW: tl.constexpr, ROTARY: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr)
    pos = tl.load(kpos_ptr + b * S + slot)
    tl.store(pos_ptr + b, pos)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        inside = s < S
        ok = (tl.load(valid_ptr + b * S + s, mask=inside, other=0) != 0) & (s <= slot)
        if HAS_WINDOW:
            ok = ok & (pos - tl.load(kpos_ptr + b * S + s, mask=inside, other=0) < window)
        ok = ok | (s == slot)  # a padding row still sees itself: a finite softmax
        bias = tl.where(ok, 0.0, float("-inf"))
        tl.store(bias_ptr + b * S + s, bias.to(bias_ptr.dtype.element_ty), mask=inside)
    if ROTARY:  # a position past the tables (a broken contract) reads nothing outside them
        d = tl.arange(0, BLOCK_D)
        inside = (d < D) & (pos < L)
        tl.store(cos_ptr + b * D + d, tl.load(cos_tab_ptr + pos * D + d, mask=inside, other=0.0), mask=d < D)
        tl.store(sin_ptr + b * D + d, tl.load(sin_tab_ptr + pos * D + d, mask=inside, other=0.0), mask=d < D)


def decode_context_triton(slot: torch.Tensor, key_valid: torch.Tensor, key_positions: torch.Tensor,
                          dtype: torch.dtype, tables: tuple[torch.Tensor, torch.Tensor] | None,
                          sliding_window: int | None = None, pdl: bool = True):
    """slot: 0-d int64; key_valid [B, S] bool; key_positions [B, S] int64; ``tables``: the
    rotary (cos, sin) [L, D] in ``dtype`` for positions 0 .. L - 1 (None: learned
    positions). -> (positions [B, 1], bias [B, 1, 1, S] in ``dtype``, cos, sin [B, 1, D] or
    None). A row's position at the slot must be below L (the caller's table covers the
    cache: positions count a row's own tokens, which sit at or before the slot)."""
    b, s = key_valid.shape
    if key_positions.shape != key_valid.shape or key_valid.dtype != torch.bool or key_positions.dtype != torch.long:
        raise ValueError(f"key_valid {list(key_valid.shape)} {key_valid.dtype}, key_positions "
                         f"{list(key_positions.shape)} {key_positions.dtype}: expected [B, S] bool and int64")
    if slot.dim() != 0 or slot.dtype != torch.long:
        raise ValueError(f"slot {list(slot.shape)} {slot.dtype}: expected a 0-d int64 tensor")
    dev = key_valid.device
    positions = torch.empty(b, 1, dtype=torch.long, device=dev)
    bias = torch.empty(b, 1, 1, s, dtype=dtype, device=dev)
    if tables is not None:
        cos_tab, sin_tab = tables
        length, d = cos_tab.shape
        cos = torch.empty(b, 1, d, dtype=dtype, device=dev)
        sin = torch.empty(b, 1, d, dtype=dtype, device=dev)
    else:
        cos_tab = sin_tab = cos = sin = bias  # unused (ROTARY=False)
        length, d = 0, 1
    if b:
        _decode_context_kernel[(b,)](
            slot, key_valid.contiguous(), key_positions.contiguous(), cos_tab, sin_tab, positions, bias, cos, sin,
            s, d, length, sliding_window or 0, HAS_WINDOW=sliding_window is not None, ROTARY=tables is not None,
            BLOCK_S=min(BLOCK_S, triton.next_power_of_2(s)), BLOCK_D=triton.next_power_of_2(d), num_warps=4,
            **pdl_launch(dev, pdl))
    return positions, bias, (cos if tables is not None else None), (sin if tables is not None else None)
