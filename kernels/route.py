"""Routing in one launch at decode sizes: top-k gating and the expert-to-token maps
(DeepSpeed-Inference V-C steps 1 and 2 fused; the paper's point is that these small steps
must not each cost a kernel).

Shape letters: T tokens, E experts, k slots, n = T * k pairs.
``route_triton(logits, k, ...) -> ids [T, k], weights [T, k], (offsets [E + 1], rows [T, k],
row_pair [n])``: one program when the whole batch fits a register tile (n <= SMALL_PAIRS),
else the gating kernel followed by the multi-block maps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gating import _check_logits, _outputs, _topk_table, topk_gating_triton
from kernels.maps import SMALL_PAIRS, _maps_block, token_maps_triton


@triton.jit
def _route_small_kernel(
    logits_ptr,  # [T, E] router logits, any float dtype and strides
    ids_ptr, weights_ptr,  # [T, K] int32 / float32 out: the top-k table
    offsets_ptr,  # [E + 1] int32 out
    rows_ptr,  # [T * K] int32 out: buffer row of each pair
    row_pair_ptr,  # [T * K] int32 out: pair of each buffer row
    T, E, stride_lt, stride_le,
    K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
    N_PAIRS: tl.constexpr,  # BLOCK_T * BLOCK_K
):
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < T
    top_ids, top_w = _topk_table(logits_ptr, rows, row_ok, E, stride_lt, stride_le, K, SOFTMAX,
                                 RENORMALIZE, BLOCK_E, BLOCK_K)
    slots = tl.arange(0, BLOCK_K)
    pair = rows[:, None] * K + slots[None, :]  # [BLOCK_T, BLOCK_K]
    ok = row_ok[:, None] & (slots[None, :] < K)
    tl.store(ids_ptr + pair, top_ids, mask=ok)
    tl.store(weights_ptr + pair, top_w, mask=ok)
    # Flattened row-major, the table lists pairs in increasing pair order, as the maps need.
    _maps_block(tl.reshape(top_ids, [N_PAIRS]), tl.reshape(pair, [N_PAIRS]), tl.reshape(ok, [N_PAIRS]),
                offsets_ptr, rows_ptr, row_pair_ptr, 0, E, E_PAD, False)


def route_triton(logits: torch.Tensor, k: int, score: str = "softmax", renormalize: bool = True):
    """Top-k gating and dropless maps: -> ids, weights, (offsets, rows, row_pair)."""
    _check_logits(logits, k, score)
    t, e = logits.shape
    block_t, block_k = triton.next_power_of_2(max(t, 1)), triton.next_power_of_2(k)
    block_e = triton.next_power_of_2(e)
    if t == 0 or block_t * block_k > SMALL_PAIRS or block_t * block_e > 8192:
        ids, weights = topk_gating_triton(logits, k, score, renormalize)
        return ids, weights, token_maps_triton(ids, e)
    ids, weights = _outputs(logits, k)
    offsets = torch.empty(e + 1, dtype=torch.int32, device=logits.device)
    rows = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    row_pair = torch.empty(t * k, dtype=torch.int32, device=logits.device)
    _route_small_kernel[(1,)](
        logits, ids, weights, offsets, rows, row_pair, t, e, logits.stride(0), logits.stride(1),
        K=k, SOFTMAX=score == "softmax", RENORMALIZE=bool(renormalize), BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_K=block_k, E_PAD=triton.next_power_of_2(e + 1),
        N_PAIRS=block_t * block_k, num_warps=4)
    return ids, weights, (offsets, rows, row_pair)
