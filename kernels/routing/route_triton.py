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

from kernels.pdl import pdl_enter, pdl_launch

from kernels.routing.gating import _check_logits_once, _topk_table, topk_gating_triton
from kernels.launcher import CachedLaunch
from kernels.layout.maps import SMALL_PAIRS, _maps_block, token_maps_triton


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] router logits
    ids_ptr, weights_ptr,  # [T, K] int32 / float32 out
    offsets_ptr, rows_ptr, row_pair_ptr,  # maps out, as kernels.layout.maps writes them
    T, E, stride_lt, stride_le,
    K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
    N_PAIRS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # One program: the whole batch's gating table and maps in registers.
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < T
    top_ids, top_w = _topk_table(logits_ptr, rows, row_ok, E, stride_lt, stride_le, K, SOFTMAX,
                                 RENORMALIZE, BLOCK_E, BLOCK_K, False)
    slots = tl.arange(0, BLOCK_K)
    pair = rows[:, None] * K + slots[None, :]  # [BLOCK_T, BLOCK_K]
    ok = row_ok[:, None] & (slots[None, :] < K)
    tl.store(ids_ptr + pair, top_ids, mask=ok)
    tl.store(weights_ptr + pair, top_w, mask=ok)
    pair = tl.reshape(pair, [N_PAIRS])
    _maps_block(tl.reshape(top_ids, [N_PAIRS]), pair, tl.reshape(ok, [N_PAIRS]), offsets_ptr, rows_ptr, row_pair_ptr,
                0, E, E_PAD, False)


def _small(t: int, e: int, k: int) -> tuple[int, int, int] | None:
    """Tile sizes when routing fits one register tile, else None."""
    # Plain int arithmetic: triton.next_power_of_2 costs measurable host time a call, and
    # this runs on every routing call.
    block_t, block_k, block_e = (1 << (max(v, 1) - 1).bit_length() for v in (t, k, e))
    if t == 0 or block_t * block_k > SMALL_PAIRS or block_t * block_e > 8192:
        return None
    return block_t, block_e, block_k


_route = CachedLaunch(_route_kernel)


def _launch(logits, k, score, renormalize, pdl: bool):
    """The one-launch path. At decode sizes this is the whole routing of an eager step, so
    its host time counts: the five int32 outputs are views of one allocation, and the
    kernel launches through its compiled launcher (``CachedLaunch``) under a key that fixes
    every argument's specialization; tile sizes and constexprs are worked out once per key."""
    t, e = logits.shape
    dev = logits.device
    n = t * k
    key = (dev.type, dev.index, t, e, k, score, renormalize, pdl, logits.dtype, logits.stride(),
           logits.data_ptr() % 16)

    def plan():
        block_t, block_e, block_k = _small(t, e, k)
        return (1,), dict(K=k, SOFTMAX=score == "softmax", RENORMALIZE=bool(renormalize), BLOCK_T=block_t,
                          BLOCK_E=block_e, BLOCK_K=block_k, E_PAD=triton.next_power_of_2(e + 1),
                          N_PAIRS=block_t * block_k, num_warps=4, **pdl_launch(dev, pdl))

    # ids, weights (float32 bits), offsets, rows, row_pair: every offset is fixed by (T, E, k).
    ids, weights, offsets, rows, row_pair = torch.split_with_sizes(
        torch.empty(4 * n + e + 1, dtype=torch.int32, device=dev), (n, n, e + 1, n, n))
    ids, weights, rows = ids.view(t, k), weights.view(torch.float32).view(t, k), rows.view(t, k)
    _route(key, (logits, ids, weights, offsets, rows, row_pair, t, e, logits.stride(0), logits.stride(1)), plan, dev)
    return ids, weights, (offsets, rows, row_pair)


def route_triton(logits: torch.Tensor, k: int, score: str = "softmax", renormalize: bool = True, pdl: bool = True):
    """Top-k gating and dropless maps: -> ids, weights, (offsets, rows, row_pair)."""
    _check_logits_once(logits, k, score)
    t, e = logits.shape
    if _small(t, e, k) is None:
        ids, weights = topk_gating_triton(logits, k, score, renormalize, pdl)
        return ids, weights, token_maps_triton(ids, e, pdl=pdl)
    return _launch(logits, k, score, renormalize, pdl)
