"""A paged decode step's shared inputs in one launch: each row's token, position, KV-cache
write slot, the pool rows of its keys, the attention mask, and the rotary cos / sin rows.

Shape letters: B rows, N blocks per row's table, S key slots per row, D rotary head dim.

The runner's fixed-shape decode step (``moe_infer.runner.PagedDecodeStep``) keeps its
inputs in one int64 buffer [B, 4 + N]: per row the new token, its position (the tokens
cached before it), 1 for a real row or 0 for padding, the index in the runner's ``prev``
to take the token from instead (-1: none), then the block table. Derived with torch ops
the step's context is about thirty small launches (the token gather, the slot arithmetic,
the read slots, the mask's comparisons, the rotary frequencies, casts); inside a CUDA
graph each costs its launch latency, which at batch 1 is several per cent of a step. Here
one program a row derives them all, with the values the torch ops give (the rotary rows
copied out of tables the caller computed once, ``dense.rotary.Rotary.table``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

BLOCK_S = 1024


@triton.jit
def _paged_context_kernel(in_ptr, prev_ptr, cos_tab_ptr, sin_tab_ptr, tok_ptr, pos_ptr, write_ptr, read_ptr,
                          mask_ptr, lens_ptr, cos_ptr, sin_ptr, stride_in, S, D, L, trash, window,
                          BS: tl.constexpr, HAS_WINDOW: tl.constexpr, ROTARY: tl.constexpr, BIAS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = in_ptr + b * stride_in
    token = tl.load(row)
    pos = tl.load(row + 1)
    real = tl.load(row + 2) != 0
    src = tl.load(row + 3)
    fed = tl.load(prev_ptr + tl.maximum(src, 0))
    tl.store(tok_ptr + b, tl.where(src >= 0, fed, token))
    tl.store(pos_ptr + b, pos)
    n = tl.where(real, pos + 1, 0)  # keys after this step (0: padding)
    tl.store(lens_ptr + b, n)
    block = tl.load(row + 4 + pos // BS, mask=real, other=0)
    tl.store(write_ptr + b, tl.where(real, block * BS + pos % BS, trash))
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        inside = s < S
        held = s < n
        blocks = tl.load(row + 4 + s // BS, mask=inside & held, other=0)
        tl.store(read_ptr + b * S + s, tl.where(held, blocks * BS + s % BS, trash), mask=inside)
        ok = held & (s <= pos)
        if HAS_WINDOW:
            ok = ok & (pos - s < window)
        ok = ok | ((s == 0) & (n == 0))  # a padding row sees key 0: a finite softmax
        if BIAS:
            tl.store(mask_ptr + b * S + s, tl.where(ok, 0.0, float("-inf")).to(mask_ptr.dtype.element_ty),
                     mask=inside)
        else:
            tl.store(mask_ptr + b * S + s, ok.to(tl.int8), mask=inside)
    if ROTARY:  # a position past the tables (a broken contract) reads nothing outside them
        d = tl.arange(0, BLOCK_D)
        inside = (d < D) & (pos < L)
        tl.store(cos_ptr + b * D + d, tl.load(cos_tab_ptr + pos * D + d, mask=inside, other=0.0), mask=d < D)
        tl.store(sin_ptr + b * D + d, tl.load(sin_tab_ptr + pos * D + d, mask=inside, other=0.0), mask=d < D)


def paged_decode_context_triton(inputs: torch.Tensor, prev: torch.Tensor, block_size: int, num_keys: int,
                                trash: int, dtype: torch.dtype, tables: tuple[torch.Tensor, torch.Tensor] | None,
                                sliding_window: int | None = None, bias: bool = False, pdl: bool = True) -> dict:
    """inputs [B, 4 + N] int64 (see the module docstring), prev [P] int64 -> a dict of
    tokens [B, 1], positions [B, 1], write slots [B, 1], lens [B] (keys after the step, 0
    for padding), read slots [B, S] (the pool row of each key, ``trash`` past the row's
    length), mask [B, 1, 1, S] (bool, or with ``bias`` additive 0 / -inf in ``dtype``)
    and cos, sin [B, 1, D] in ``dtype`` (None without rotary ``tables`` [L, D]). A real
    row's table must hold the blocks of its first ``num_keys`` keys, or as many as it has."""
    if inputs.dim() != 2 or inputs.dtype != torch.long or inputs.shape[1] < 4 + -(-num_keys // block_size):
        raise ValueError(f"inputs {list(inputs.shape)} {inputs.dtype}: expected [B, 4 + N] int64 with N >= "
                         f"{-(-num_keys // block_size)} table entries for {num_keys} keys")
    if prev.dim() != 1 or prev.dtype != torch.long:
        raise ValueError(f"prev {list(prev.shape)} {prev.dtype}: expected [P] int64")
    b, dev = inputs.shape[0], inputs.device
    out = {name: torch.empty(b, 1, dtype=torch.long, device=dev) for name in ("tokens", "positions", "write")}
    out["lens"] = torch.empty(b, dtype=torch.long, device=dev)
    out["read"] = torch.empty(b, num_keys, dtype=torch.long, device=dev)
    mask = torch.empty(b, 1, 1, num_keys, dtype=dtype if bias else torch.int8, device=dev)
    if tables is not None:
        cos_tab, sin_tab = tables
        length, d = cos_tab.shape
        cos = torch.empty(b, 1, d, dtype=dtype, device=dev)
        sin = torch.empty(b, 1, d, dtype=dtype, device=dev)
    else:
        cos_tab = sin_tab = cos = sin = mask  # unused (ROTARY=False)
        length, d = 0, 1
    if b:
        _paged_context_kernel[(b,)](
            inputs, prev, cos_tab, sin_tab, out["tokens"], out["positions"], out["write"], out["read"], mask,
            out["lens"], cos, sin, inputs.stride(0), num_keys, d, length, trash, sliding_window or 0, BS=block_size,
            HAS_WINDOW=sliding_window is not None, ROTARY=tables is not None, BIAS=bias,
            BLOCK_S=min(BLOCK_S, triton.next_power_of_2(num_keys)), BLOCK_D=triton.next_power_of_2(d), num_warps=4,
            **pdl_launch(dev, pdl))
    out["mask"] = mask if bias else mask.view(torch.bool)
    out["cos"], out["sin"] = (cos, sin) if tables is not None else (None, None)
    return out
