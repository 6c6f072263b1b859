"""Triton top-k gating: router logits -> the token-to-expert table, in one kernel
(DeepSpeed-Inference section V-C, step 1).

Shape letters: T tokens, E experts, k slots per token, G expert groups, S = E / G experts per
group.

  topk_gating_triton   logits [T, E]           -> ids [T, k] int32, weights [T, k] float32
  grouped_topk_triton  logits [T, E], bias [E] -> ids [T, k] int32, weights [T, k] float32

Each program owns BLOCK_T rows of logits and keeps them in registers from load to store: scores,
the k rounds of max/argmax and the renormalisation never touch memory. Logits are converted
to float32 right after the load (the interpreter computes bf16 arithmetic wrongly, and router
scores want float32 anyway). ids come out in descending score order and ties go to the lowest
expert index, as torch.topk does; ``kernels.routing.reference`` holds the reference math.

bf16 and fp16 logits (the decode step's router writes bf16) are ranked as one int32 key per
expert (``_topk_keys``): a round is then one integer max, a single warp instruction on the
GPU, where a float max and an index argmin are two chains of shuffles; the batch-1 decode
step measured faster with it (docs/performance.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launcher import CachedLaunch
from kernels.routing.reference import check_logits, check_shared
from kernels.pdl import pdl_enter, pdl_launch

TILE = 4096  # float32 scores a program holds: 16 rows of 256 experts, 64 rows of 64
# The plain top-k's tile on a GPU: one warp over a row or two of scores, many programs. Its
# k rounds of two reductions are serial within a program, so spreading the rows over more
# programs measured faster than fuller tiles for every batch and expert count tried. (The
# CPU interpreter runs programs one after another: there TILE's fewer, fuller ones.)
TOPK_TILE = 256


@triton.jit
def _topk_table(
    logits_ptr, rows, row_ok, E, stride_lt, stride_le,
    K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, FROM_L2: tl.constexpr,
):
    """Scores and the top-k table of the logits rows ``rows``, in registers:
    -> ids [BLOCK_T, BLOCK_K] int32, weights [BLOCK_T, BLOCK_K] float32. ``FROM_L2``: load
    past L1 (logits other programs of the same launch wrote). 16-bit logits take
    ``_topk_keys``; float32 and float64 logits take k rounds of a max and an argmin."""
    LT: tl.constexpr = logits_ptr.dtype.element_ty
    if LT == tl.bfloat16 or LT == tl.float16:
        return _topk_keys(logits_ptr, rows, row_ok, E, stride_lt, stride_le, K, SOFTMAX, RENORMALIZE, BLOCK_E,
                          BLOCK_K, FROM_L2)
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    col_ok = cols < E
    rows64 = rows.to(tl.int64)  # T * stride can pass 2**31
    ptrs = logits_ptr + rows64[:, None] * stride_lt + cols[None, :] * stride_le
    if FROM_L2:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    # Padding experts get -inf so softmax gives them 0; padding rows stay 0 (no NaN) and
    # are never stored.
    x = tl.where(col_ok[None, :], x, float("-inf"))  # [BLOCK_T, BLOCK_E]
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = p / tl.sum(p, axis=1)[:, None]
    else:
        s = tl.sigmoid(x)
    # -inf, not 0, so a padding expert never beats a real expert whose score underflowed.
    s = tl.where(col_ok[None, :], s, float("-inf"))

    # k rounds of max / argmax; each winner is knocked out with -inf. The table is built in
    # registers ([BLOCK_T, BLOCK_K]) so the renormalisation needs no second pass.
    slots = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    top_ids = tl.zeros([rows.shape[0], BLOCK_K], dtype=tl.int32)
    top_w = tl.zeros([rows.shape[0], BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(s, axis=1)  # [BLOCK_T]
        # Lowest index among the maxima: ties resolve as torch.topk does.
        idx = tl.min(tl.where(s == best[:, None], cols[None, :], BLOCK_E), axis=1)
        top_ids = tl.where(slots[None, :] == j, idx[:, None], top_ids)
        top_w = tl.where(slots[None, :] == j, best[:, None], top_w)
        s = tl.where(cols[None, :] == idx[:, None], float("-inf"), s)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]  # padding slots hold 0
    return top_ids, top_w


@triton.jit
def _bits_to_float(bits, LT: tl.constexpr):
    """16-bit patterns (int32, low 16 bits) of dtype LT (bfloat16 or float16) -> float32."""
    if LT == tl.bfloat16:
        return (bits << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _topk_keys(
    logits_ptr, rows, row_ok, E, stride_lt, stride_le,
    K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, FROM_L2: tl.constexpr,
):
    """``_topk_table`` for bfloat16 / float16 logits. Softmax and sigmoid keep the logits'
    order, so the winners are chosen on the logits: each becomes one int32 key, its 16 bits
    mapped to an order-preserving integer (-0 as +0) in the high half and 0xFFFF - expert
    in the low half. Keys are distinct, a larger key is a larger logit or an equal one of a
    lower expert (torch.topk's order), so each of the k rounds is one integer max (a single
    warp instruction on the GPU, ``redux.sync``) and the knock-out of that key; a round of
    float max and index argmin is two chains of shuffles. The weights follow from the k
    winning logits and, for softmax, the row's sum of exp(x - max)."""
    LT: tl.constexpr = logits_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    ok = row_ok[:, None] & (cols < E)[None, :]
    rows64 = rows.to(tl.int64)  # T * stride can pass 2**31
    ptrs = (logits_ptr + rows64[:, None] * stride_lt + cols[None, :] * stride_le).to(tl.pointer_type(tl.int16))
    if FROM_L2:
        raw = tl.load(ptrs, mask=ok, other=0, cache_modifier=".cg")
    else:
        raw = tl.load(ptrs, mask=ok, other=0)
    bits = raw.to(tl.int32) & 0xFFFF  # [BLOCK_T, BLOCK_E]
    bits = tl.where(bits == 0x8000, 0, bits)  # -0 ties with +0, as the float comparison has it
    signed = tl.where(bits >= 0x8000, bits - 0x10000, bits)
    order = signed ^ ((signed >> 15) & 0x7FFF)  # monotone in the logit, -32768 .. 32767
    INT_MIN: tl.constexpr = -2147483648
    keys = tl.where(ok, (order << 16) | (0xFFFF - cols[None, :]), INT_MIN)  # padding below every real key

    slots = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    top = tl.full([rows.shape[0], BLOCK_K], INT_MIN, dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(keys, axis=1)  # [BLOCK_T]
        top = tl.where(slots[None, :] == j, best[:, None], top)
        keys = tl.where(keys == best[:, None], INT_MIN, keys)
    top_ids = 0xFFFF - (top & 0xFFFF)
    top_order = top >> 16
    top_x = _bits_to_float((top_order ^ ((top_order >> 15) & 0x7FFF)) & 0xFFFF, LT)  # the winning logits
    if SOFTMAX:
        x = tl.where(ok, _bits_to_float(bits, LT), float("-inf"))
        row_max = tl.max(x, axis=1)
        row_max = tl.where(row_max > float("-inf"), row_max, 0.0)  # padding rows: no NaN
        total = tl.sum(tl.exp(x - row_max[:, None]), axis=1)
        top_w = tl.exp(top_x - row_max[:, None]) / total[:, None]
    else:
        top_w = tl.sigmoid(top_x)
    top_w = tl.where(slots[None, :] < K, top_w, 0.0)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    return top_ids, top_w


@triton.jit
def _topk_gating_kernel(
    logits_ptr,  # [T, E] router logits, any float dtype, any strides
    ids_ptr,  # [T, K] int32 output, contiguous
    weights_ptr,  # [T, K] float32 output, contiguous
    T, E,  # rows, experts (E <= BLOCK_E)
    stride_lt, stride_le,  # logits strides in elements, along T and E
    K: tl.constexpr,  # slots per token
    SOFTMAX: tl.constexpr,  # softmax scores, else sigmoid
    RENORMALIZE: tl.constexpr,  # divide the k weights by their sum
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SHARED: tl.constexpr, SHARED_PAD: tl.constexpr,  # fixed slots after the k (``_store_table``)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    row_ok = rows < T
    top_ids, top_w = _topk_table(logits_ptr, rows, row_ok, E, stride_lt, stride_le, K, SOFTMAX,
                                 RENORMALIZE, BLOCK_E, BLOCK_K, False)
    _store_table(ids_ptr, weights_ptr, rows, row_ok, top_ids, top_w, E, K, BLOCK_K, SHARED, SHARED_PAD)


@triton.jit
def _store_table(ids_ptr, weights_ptr, rows, row_ok, top_ids, top_w, E, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 SHARED: tl.constexpr, SHARED_PAD: tl.constexpr):
    """Rows ``rows`` of the table [T, K + SHARED]: the top-k, then SHARED slots of ids E,
    E + 1, ... with weight 1 (shared experts held after the routed ones: every token's)."""
    slots = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    out = rows64[:, None] * (K + SHARED) + slots[None, :]
    out_ok = row_ok[:, None] & (slots[None, :] < K)
    tl.store(ids_ptr + out, top_ids, mask=out_ok)
    tl.store(weights_ptr + out, top_w, mask=out_ok)
    if SHARED > 0:
        extra = tl.arange(0, SHARED_PAD)
        at = rows64[:, None] * (K + SHARED) + K + extra[None, :]
        ok = row_ok[:, None] & (extra[None, :] < SHARED)
        tl.store(ids_ptr + at, tl.zeros([rows.shape[0], SHARED_PAD], tl.int32) + (E + extra)[None, :], mask=ok)
        tl.store(weights_ptr + at, tl.full([rows.shape[0], SHARED_PAD], 1.0, tl.float32), mask=ok)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr,  # [T, E] router logits, any float dtype, any strides
    bias_ptr,  # [E] score-correction bias, any float dtype; steers the choice only
    ids_ptr,  # [T, K] int32 output, contiguous
    weights_ptr,  # [T, K] float32 output, contiguous
    T,  # rows
    stride_lt, stride_le,  # logits strides in elements, along T and E
    stride_b,  # bias stride in elements
    scale,  # routed_scaling_factor, applied after the renormalisation
    K: tl.constexpr,  # slots per token
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,  # E = N_GROUP * GROUP_SIZE, contiguous
    TOPK_GROUP: tl.constexpr,  # groups kept per token
    SOFTMAX: tl.constexpr,  # softmax scores, else sigmoid
    RENORMALIZE: tl.constexpr,  # divide the k weights by their sum
    GROUP_MAX: tl.constexpr,  # a group's score is its best choice (DeepSeek-V2), else its best two's sum
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHARED: tl.constexpr, SHARED_PAD: tl.constexpr,  # fixed slots after the k (``_store_table``)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # Tiles are [BLOCK_T, BLOCK_G, BLOCK_S]: one row of logits seen as G groups of S experts,
    # each padded separately, so per-group reductions are plain reductions over the last axis
    # and S need not be a power of two.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    groups = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    within = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    row_ok = rows < T
    e_ok = (groups[:, None] < N_GROUP) & (within[None, :] < GROUP_SIZE)  # [BLOCK_G, BLOCK_S]
    # Expert index of each tile position; padding gets a sentinel past every real index, so a
    # padded slot of group g never aliases the first expert of group g + 1.
    BIG: tl.constexpr = BLOCK_G * BLOCK_S
    expert = tl.where(e_ok, groups[:, None] * GROUP_SIZE + within[None, :], BIG)
    rows64 = rows.to(tl.int64)  # T * stride can pass 2**31
    ptrs = logits_ptr + rows64[:, None, None] * stride_lt + expert[None, :, :] * stride_le
    x = tl.load(ptrs, mask=row_ok[:, None, None] & e_ok[None, :, :], other=0.0).to(tl.float32)
    x = tl.where(e_ok[None, :, :], x, float("-inf"))  # [BLOCK_T, BLOCK_G, BLOCK_S]
    if SOFTMAX:
        p = tl.exp(x - tl.max(tl.max(x, axis=2), axis=1)[:, None, None])
        scores = p / tl.sum(tl.sum(p, axis=2), axis=1)[:, None, None]
    else:
        scores = tl.sigmoid(x)
    bias = tl.load(bias_ptr + expert * stride_b, mask=e_ok, other=0.0).to(tl.float32)
    choice = tl.where(e_ok[None, :, :], scores + bias[None, :, :], float("-inf"))

    # Group score: the sum of the group's two best choices (the only one for S = 1).
    first = tl.max(choice, axis=2)  # [BLOCK_T, BLOCK_G]
    first_at = tl.min(tl.where(choice == first[:, :, None], within[None, None, :], BLOCK_S), axis=2)
    if GROUP_SIZE > 1 and not GROUP_MAX:
        rest = tl.where(within[None, None, :] == first_at[:, :, None], float("-inf"), choice)
        group_score = first + tl.max(rest, axis=2)  # padding groups: -inf
    else:
        group_score = first

    # Keep the TOPK_GROUP best groups (rounds of max / argmax, lowest index on ties).
    keep = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_score, axis=1)  # [BLOCK_T]
        g = tl.min(tl.where(group_score == best[:, None], groups[None, :], BLOCK_G), axis=1)
        hit = groups[None, :] == g[:, None]  # [BLOCK_T, BLOCK_G]
        keep = tl.where(hit, 1, keep)
        group_score = tl.where(hit, float("-inf"), group_score)
    choice = tl.where(keep[:, :, None] != 0, choice, float("-inf"))

    # Top-k over the choice in the kept groups; the weight is the unbiased score.
    slots = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(tl.max(choice, axis=2), axis=1)  # [BLOCK_T]
        idx = tl.min(tl.min(tl.where(choice == best[:, None, None], expert[None, :, :], BIG),
                            axis=2), axis=1)
        hit = expert[None, :, :] == idx[:, None, None]  # exactly one position per row
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        top_ids = tl.where(slots[None, :] == j, idx[:, None], top_ids)
        top_w = tl.where(slots[None, :] == j, w[:, None], top_w)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]  # padding slots hold 0
    top_w = top_w * scale
    _store_table(ids_ptr, weights_ptr, rows, row_ok, top_ids, top_w, N_GROUP * GROUP_SIZE, K, BLOCK_K, SHARED,
                 SHARED_PAD)


def _block_t(t: int, tile_cols: int, tile: int = TILE) -> int:
    """Rows per program: fill a ``tile``-element tile, but no more rows than there are tokens."""
    return max(1, min(64, tile // tile_cols, triton.next_power_of_2(t)))


def _outputs(t: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k table's outputs, ids [T, k] int32 and weights [T, k] float32: two allocations.
    They measured less host time than views of one on most hosts, and the whole call was
    faster there. These launches run on every eager decode step."""
    return (torch.empty(t, k, dtype=torch.int32, device=device),
            torch.empty(t, k, dtype=torch.float32, device=device))


_gating = CachedLaunch(_topk_gating_kernel)
_CHECKED: set = set()  # (shape, dtype, k, type of k, score, shared, its type) whose checks passed before


def _check_logits_once(logits: torch.Tensor, k: int, score: str, shared: int = 0) -> None:
    """``check_logits`` and ``check_shared``, skipped for a (shape, dtype, k, score, shared)
    that passed before: what they read is all in that key. The types of k and shared are in
    it too (True and 8.0 equal 1 and 8). The routing launches at decode sizes call this on
    every step, where the host time counts."""
    seen = (logits.shape, logits.dtype, k, type(k), score, shared, type(shared))
    if seen not in _CHECKED:
        check_logits(logits, k, score)
        check_shared(shared)
        _CHECKED.add(seen)


def topk_gating_triton(logits: torch.Tensor, k: int, score: str = "softmax", renormalize: bool = True,
                       pdl: bool = True, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the router scores: ids [T, k + shared] int32 (descending score, then the
    shared slots) and weights [T, k + shared] float32; the same contract as
    ``topk_gating_ref``.

    At decode sizes this launch is the layer's whole routing, and in an eager step its host
    time is the cost: the checks run once per key (``_check_logits_once``), the outputs are
    two plain allocations (``_outputs``), and the kernel launches through its compiled
    launcher (``kernels.launcher``)."""
    _check_logits_once(logits, k, score, shared)
    t, e = logits.shape
    dev = logits.device
    ids, weights = _outputs(t, k + shared, dev)
    if t == 0:
        return ids, weights
    key = (dev.type, dev.index, t, e, k, score, renormalize, pdl, logits.dtype, logits.stride(),
           logits.data_ptr() % 16, shared)

    def plan():
        block_e = triton.next_power_of_2(e)
        block_t = _block_t(t, block_e, TOPK_TILE if dev.type == "cuda" else TILE)
        # A decode step's tile (a few rows of logits) in one warp: each of the k rounds' two
        # reductions then stays in the warp's shuffles, with no shared-memory round trip.
        warps = 1 if block_t * block_e <= 1024 else 4
        return (triton.cdiv(t, block_t),), dict(K=k, SOFTMAX=score == "softmax", RENORMALIZE=bool(renormalize),
                                                BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
                                                SHARED=shared, SHARED_PAD=triton.next_power_of_2(max(shared, 1)),
                                                num_warps=warps, **pdl_launch(dev, pdl))

    _gating(key, (logits, ids, weights, t, e, logits.stride(0), logits.stride(1)), plan, dev)
    return ids, weights


def _check_grouped_args(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
                        topk_group: int, routed_scaling_factor: float) -> None:
    e = logits.shape[1]
    if bias.dim() != 1 or bias.shape[0] != e:
        raise ValueError(f"bias: expected [E={e}], got shape {list(bias.shape)}")
    if not bias.is_floating_point():
        raise ValueError(f"bias: expected a float dtype, got {bias.dtype}")
    if bias.device != logits.device:
        raise ValueError(f"bias: expected device {logits.device}, got {bias.device}")
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or e % n_group:
        raise ValueError(f"n_group={n_group!r}: expected a positive int dividing E={e}")
    if (isinstance(topk_group, bool) or not isinstance(topk_group, int)
            or not 1 <= topk_group <= n_group):
        raise ValueError(f"topk_group={topk_group!r}: expected an int with "
                         f"1 <= topk_group <= n_group={n_group}")
    kept = topk_group * (e // n_group)
    if k > kept:
        raise ValueError(f"k={k}: expected k <= topk_group * E / n_group = {kept} experts "
                         "that the kept groups hold")
    if not isinstance(routed_scaling_factor, (int, float)) or isinstance(routed_scaling_factor,
                                                                         bool):
        raise ValueError(f"routed_scaling_factor={routed_scaling_factor!r}: expected a number")


def grouped_topk_triton(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
                        topk_group: int, score: str = "sigmoid", renormalize: bool = True,
                        routed_scaling_factor: float = 1.0, pdl: bool = True,
                        group_max: bool = False, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: ids [T, k] int32 (descending ``scores + bias``) and weights [T, k]
    float32 (unbiased scores, renormalised if asked, times ``routed_scaling_factor``), each
    followed by ``shared`` fixed slots; the same contract as ``grouped_topk_ref``."""
    check_logits(logits, k, score)
    _check_grouped_args(logits, bias, k, n_group, topk_group, routed_scaling_factor)
    check_shared(shared)
    t, e = logits.shape
    ids, weights = _outputs(t, k + shared, logits.device)
    if t == 0:
        return ids, weights
    group_size = e // n_group
    block_g, block_s = triton.next_power_of_2(n_group), triton.next_power_of_2(group_size)
    block_t = _block_t(t, block_g * block_s)
    # As topk_gating_triton's: a decode step's tile in one warp, its reductions in shuffles.
    warps = 1 if block_t * block_g * block_s <= 1024 else 4
    _grouped_topk_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, ids, weights, t, logits.stride(0), logits.stride(1), bias.stride(0),
        float(routed_scaling_factor),
        K=k, N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group,
        SOFTMAX=score == "softmax", RENORMALIZE=bool(renormalize), GROUP_MAX=bool(group_max),
        BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_S=block_s,
        BLOCK_K=triton.next_power_of_2(k), SHARED=shared, SHARED_PAD=triton.next_power_of_2(max(shared, 1)),
        num_warps=warps, **pdl_launch(logits.device, pdl))
    return ids, weights
