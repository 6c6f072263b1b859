"""Greedy sampling's argmax over the vocabulary, split across the SMs.

Shape letters: B rows, V vocabulary, C chunks of BLOCK columns.

torch's argmax reduces a row of a decode step's logits (B of them, V ~ 50-150k) in one
block per row, a measurable part of a small model's decode step on a GPU with many
SMs. Here each of C programs per row finds its chunk's maximum and the first index that holds it, and a second launch
picks the first chunk with the row maximum: the smallest index of the maximum, as torch
returns it. NaN counts as larger than any number (torch's rule too).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

BLOCK = 4096


@triton.jit
def _chunk_max_kernel(x_ptr, max_ptr, idx_ptr, V, C, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * C + chunk, best)
    tl.store(idx_ptr + row * C + chunk, chunk * BLOCK + where)


@triton.jit
def _pick_kernel(max_ptr, idx_ptr, out_ptr, C, C_P: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_P)
    m = tl.load(max_ptr + row * C + c, mask=c < C, other=float("-inf"))
    _, first = tl.max(m, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * C + first).to(tl.int64))


def argmax_triton(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x {list(x.shape)}: expected [B, V] logits with V >= 1")
    b, v = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    c = triton.cdiv(v, BLOCK)
    maxes = torch.empty(b, c, dtype=torch.float32, device=x.device)
    idx = torch.empty(b, c, dtype=torch.int32, device=x.device)
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b:
        _chunk_max_kernel[(b, c)](x, maxes, idx, v, c, x.stride(0), BLOCK=BLOCK, num_warps=8,
                                  **pdl_launch(x.device, pdl))
        _pick_kernel[(b,)](maxes, idx, out, c, C_P=triton.next_power_of_2(c), num_warps=1,
                           **pdl_launch(maxes.device, pdl))
    return out
