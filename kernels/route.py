"""Routing in one launch at decode sizes: top-k gating and the expert-to-token maps
(DeepSpeed-Inference V-C steps 1 and 2 fused; the paper's point is that these small steps
must not each cost a kernel), optionally with the scatter into the expert-major buffer
(step 3) in the same launch.

Shape letters: T tokens, E experts, k slots, n = T * k pairs, H hidden.
``route_triton(logits, k, ...) -> ids [T, k], weights [T, k], (offsets [E + 1], rows [T, k],
row_pair [n])``: one program when the whole batch fits a register tile (n <= SMALL_PAIRS),
else the gating kernel followed by the multi-block maps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

from kernels.gating import _check_logits_once, _topk_table, topk_gating_triton
from kernels.launcher import CachedLaunch
from kernels.layout import scatter_rows_triton
from kernels.maps import SMALL_PAIRS, _maps_block, token_maps_triton


@triton.jit
def _route_scatter_kernel(
    logits_ptr,  # [T, E] router logits
    x_ptr,  # [T, H] tokens
    ids_ptr, weights_ptr,  # [T, K] int32 / float32 out
    offsets_ptr, rows_ptr, row_pair_ptr,  # maps out, as in _route_small_kernel
    xs_ptr,  # [T * K, H] out: the expert-major buffer
    T, E, H, stride_lt, stride_le, stride_x, stride_xs,
    K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
    N_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr,
    SCATTER: tl.constexpr,  # copy x into xs too (else one program: gating and maps only)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # Every program recomputes the (tiny) gating and maps in registers, as the paper
    # replicates pre-GEMM work across SMs, then copies its BLOCK_H columns of every pair;
    # program 0 alone writes the table and the maps.
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < T
    top_ids, top_w = _topk_table(logits_ptr, rows, row_ok, E, stride_lt, stride_le, K, SOFTMAX,
                                 RENORMALIZE, BLOCK_E, BLOCK_K, False)
    slots = tl.arange(0, BLOCK_K)
    pair = rows[:, None] * K + slots[None, :]  # [BLOCK_T, BLOCK_K]
    ok = row_ok[:, None] & (slots[None, :] < K)
    first = pid == 0
    tl.store(ids_ptr + pair, top_ids, mask=ok & first)
    tl.store(weights_ptr + pair, top_w, mask=ok & first)
    pair = tl.reshape(pair, [N_PAIRS])
    row, kept = _maps_block(tl.reshape(top_ids, [N_PAIRS]), pair, tl.reshape(ok, [N_PAIRS]),
                            offsets_ptr, rows_ptr, row_pair_ptr, 0, E, E_PAD, False, first)
    if SCATTER:
        h = pid * BLOCK_H + tl.arange(0, BLOCK_H)
        m = kept[:, None] & (h[None, :] < H)
        vals = tl.load(x_ptr + (pair // K)[:, None].to(tl.int64) * stride_x + h[None, :], mask=m)
        tl.store(xs_ptr + row[:, None].to(tl.int64) * stride_xs + h[None, :], vals, mask=m)


def _small(t: int, e: int, k: int) -> tuple[int, int, int] | None:
    """Tile sizes when routing fits one register tile, else None."""
    # Plain int arithmetic: triton.next_power_of_2 costs measurable host time a call, and
    # this runs on every routing call.
    block_t, block_k, block_e = (1 << (max(v, 1) - 1).bit_length() for v in (t, k, e))
    if t == 0 or block_t * block_k > SMALL_PAIRS or block_t * block_e > 8192:
        return None
    return block_t, block_e, block_k


def route_scatter_triton(x: torch.Tensor, logits: torch.Tensor, k: int, score: str = "softmax",
                         renormalize: bool = True):
    """Gating, dropless maps and the scatter of x [T, H] into the expert-major buffer:
    -> ids, weights, (offsets, rows, row_pair), xs [T * k, H]. One launch at decode sizes."""
    _check_logits_once(logits, k, score)
    t, e = logits.shape
    if x.dim() != 2 or x.shape[0] != t:
        raise ValueError(f"x {list(x.shape)}: expected [T={t}, H] to match logits {list(logits.shape)}")
    if _small(t, e, k) is None:
        ids, weights, maps = route_triton(logits, k, score, renormalize)
        return ids, weights, maps, scatter_rows_triton(x, maps[1])
    return _launch(logits, k, score, renormalize, x.contiguous())


_route_scatter = CachedLaunch(_route_scatter_kernel)


def _launch(logits, k, score, renormalize, x=None):
    """The one-launch path; scatters x when given. At decode sizes this is the whole
    routing of an eager step, so its host time counts: the five int32 outputs are views of
    one allocation, and the kernel launches through its compiled launcher (``CachedLaunch``)
    under a key that fixes every argument's specialization; tile sizes and constexprs are
    worked out once per key."""
    t, e = logits.shape
    dev = logits.device
    n = t * k
    h = x.shape[1] if x is not None else 0
    key = (dev.type, dev.index, t, e, k, score, renormalize, logits.dtype, logits.stride(), logits.data_ptr() % 16,
           None if x is None else (h, x.dtype, x.stride(0), x.data_ptr() % 16))

    def plan():
        block_t, block_e, block_k = _small(t, e, k)
        n_pairs = block_t * block_k
        block_h = max(16, min(1024, 8192 // n_pairs, triton.next_power_of_2(max(h, 1))))
        return (max(1, triton.cdiv(h, block_h)),), dict(
            K=k, SOFTMAX=score == "softmax", RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_K=block_k, E_PAD=triton.next_power_of_2(e + 1), N_PAIRS=n_pairs, BLOCK_H=block_h,
            SCATTER=x is not None, num_warps=4, **pdl_launch(dev))

    # ids, weights (float32 bits), offsets, rows, row_pair: every offset is fixed by (T, E, k).
    ids, weights, offsets, rows, row_pair = torch.split_with_sizes(
        torch.empty(4 * n + e + 1, dtype=torch.int32, device=dev), (n, n, e + 1, n, n))
    ids, weights, rows = ids.view(t, k), weights.view(torch.float32).view(t, k), rows.view(t, k)
    xs = x.new_empty(n, h) if x is not None else None
    _route_scatter(key, (logits, x if x is not None else logits, ids, weights, offsets, rows, row_pair,
                         xs if xs is not None else logits, t, e, h, logits.stride(0), logits.stride(1),
                         x.stride(0) if x is not None else 0, xs.stride(0) if xs is not None else 0), plan, dev)
    return ids, weights, (offsets, rows, row_pair), xs


def route_triton(logits: torch.Tensor, k: int, score: str = "softmax", renormalize: bool = True):
    """Top-k gating and dropless maps: -> ids, weights, (offsets, rows, row_pair)."""
    _check_logits_once(logits, k, score)
    t, e = logits.shape
    if _small(t, e, k) is None:
        ids, weights = topk_gating_triton(logits, k, score, renormalize)
        return ids, weights, token_maps_triton(ids, e)
    return _launch(logits, k, score, renormalize)[:3]
