"""Triton grouped expert GEMM over the expert-major buffer (DeepSpeed-Inference V-C step 4;
the small-batch design of section III).

Shape letters: E experts, H hidden, F expert width, N buffer rows (= T * k), BM x BN
output tiles, BK the reduction step, S split-K partials.

One kernel serves both expert GEMMs:
- up:   A = x rows gathered through ``row_pair`` (the scatter fused into the load),
        W = w13 [E, 2F, H]; SiLU(gate) * up (or GeLU) in the epilogue -> h [N, F].
- down: A = h [N, F], W = w2 [E, H, F]; the combine weight of each row is applied in
        the epilogue and S split-K partials go to a float32 buffer [S, N, H] (without
        split-K, the caller's dtype), summed by the combine kernel in float32
        (deterministic: no atomics).

Expert e owns buffer rows offsets[e] .. offsets[e + 1], cut into ceil(count / BM) row
tiles; every program rebuilds that tile map from ``offsets`` (E values), so nothing is
read back to the host and the grid is sized from T alone: CUDA-graph safe. At decode
sizes (T <= 16) each active expert is one row tile, so each weight byte is read once;
at large T the same kernel runs with 128-row tiles on the tensor cores.

Tile order: programs run in groups of GROUP_M row tiles; within a group the row tile
changes fastest, then the column tile. At large T a group's A rows are then reused by
all its column tiles while they are still in L2 (with row tiles fastest over the whole
buffer, a down GEMM re-read its [N, F] input from memory once per column tile: 8 times
200 MB for Qwen3-30B-A3B at T = 16384). GROUP_M = all row tiles is plain row-major order.

Short last tiles (``sub_m``): an expert's last row tile is mostly padding at large T (13%
of the multiplied rows for OLMoE at T = 4096, 27% for Qwen3-30B-A3B). With sub_m 2 (or 4) a
tile whose rows fit in BM / 2 (BM / 4) runs at that height; the grid and the tile map stay.

Weight tiles come by TMA where the configuration asks for it (``tma``; Hopper): the
descriptor copies [BN, BK] boxes into shared memory without the per-element address
tensors of a pointer load. A's rows are gathered (the fused scatter), which TMA on Hopper
cannot do, so A always loads through pointers.

int8 weights carry per-output-channel scales: the tile is widened to the activation
dtype before the dot and the scale multiplies the accumulator once, in the epilogue.
MXFP4 weights (``kernels.moe.mxfp4``) come two a byte with a power-of-two scale per 32 along
K: each tile's codes are decoded and scaled in registers before the dot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _e2m1(code):
    """4-bit E2M1 codes (sign in bit 3) -> float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    c = code.to(tl.int32)
    ex = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(ex == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((ex - 1).to(tl.float32)))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _mxfp4_tile(w_cols, s_cols, k0, K, col_ok, BK: tl.constexpr, BN: tl.constexpr):
    """[BK, BN] float32 weights k0 .. k0 + BK of an MXFP4 tile: w_cols / s_cols [1, BN] point at
    each output row's packed bytes [K / 2] and group scales [K / 32] (BK a multiple of 32)."""
    kb = k0 // 2 + tl.arange(0, BK // 2)
    p = tl.load(w_cols + kb[:, None], mask=(kb < K // 2)[:, None] & col_ok[None, :], other=0)  # [BK / 2, BN]
    pairs = tl.join(_e2m1(p & 15), _e2m1(p >> 4))  # [BK / 2, BN, 2]: the even K index in the low nibble
    v = tl.reshape(tl.permute(pairs, (0, 2, 1)), (BK, BN))
    kg = k0 // 32 + tl.arange(0, BK // 32)
    sc = tl.load(s_cols + kg[:, None], mask=(kg < K // 32)[:, None] & col_ok[None, :], other=127)
    scale = tl.exp2(sc.to(tl.float32) - 127.0)  # [BK / 32, BN]: E8M0
    return tl.reshape(tl.reshape(v, (BK // 32, 32, BN)) * scale[:, None, :], (BK, BN))


@triton.jit
def _gemm_tile(
    a_ptr, row_pair_ptr, w_ptr, scale_ptr, bias_ptr, offsets_ptr, pair_w_ptr, out_ptr,
    N_OUT, K, W_ROWS, e, ids, r0, hi, pid_n, pid_k,
    stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_os, stride_om,
    TOPK: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    A_FROM_TOKENS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    ROW_WEIGHT: tl.constexpr, INT8_W: tl.constexpr, MXFP4_W: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, FROM_IDS: tl.constexpr, EVEN_K: tl.constexpr, W_TMA: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
):
    """One [TM, BN] output tile of expert e: buffer rows r0 .. min(r0 + TM, hi) (FROM_IDS:
    the pairs among the first TM whose ids [TM] name e), columns pid_n * BN .., split pid_k of K."""
    if FROM_IDS:  # rows are pair indices, masked to this expert's pairs
        rows = tl.arange(0, TM)
        row_ok = ids == e
        pair = rows
    else:
        rows = r0 + tl.arange(0, TM)
        row_ok = rows < hi
        if A_FROM_TOKENS or ROW_WEIGHT:
            pair = tl.load(row_pair_ptr + rows, mask=row_ok, other=0)
    if A_FROM_TOKENS:  # read tokens in place: the layout transform fused into the load
        a_rows = pair // TOPK
    else:
        a_rows = rows
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N_OUT
    k_span = tl.cdiv(K, SPLIT_K * BK) * BK
    k_lo = pid_k * k_span

    a_base = a_ptr + a_rows[:, None].to(tl.int64) * stride_a
    if W_TMA:  # weight tiles by the tensor-memory accelerator: [BN, BK] boxes of [E * W_ROWS, K]
        w_row = e * W_ROWS + pid_n * BN
    else:
        w_base = w_ptr + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    if MXFP4_W:  # each output row's group scales
        s_cols = scale_ptr + e.to(tl.int64) * stride_se + cols[None, :].to(tl.int64) * stride_sn
    acc = tl.zeros([TM, BN], dtype=tl.float32)
    acc_up = tl.zeros([TM, BN], dtype=tl.float32)
    for k0 in range(0, k_span, BK):
        ks = k_lo + k0 + tl.arange(0, BK)
        k_ok = ks < K
        if EVEN_K:  # K a multiple of SPLIT_K * BK: only the rows are masked
            a = tl.load(a_base + ks[None, :], mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # interpreter (its bf16 arithmetic is wrong) or fp32 inputs: fp32 dot
            a = a.to(tl.float32)
        # int8 weights widen to the activation dtype (exact up to 127). Columns past N_OUT
        # (and, by TMA, K past the end, zero-filled) only reach masked outputs.
        # MXFP4 weights widen to float32 (scaled by their groups' powers of two), then to
        # the activation dtype (exact: a code times a power of two).
        if MXFP4_W:
            b = _mxfp4_tile(w_base, s_cols, k_lo + k0, K, col_ok, BK, BN).to(a.dtype)
        elif W_TMA:
            b = w_ptr.load([w_row, k_lo + k0]).T.to(a.dtype)
        else:
            b = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0).to(a.dtype)
        acc += tl.dot(a, b, input_precision="ieee" if IEEE else None)
        if GATED:
            if MXFP4_W:
                b_up = _mxfp4_tile(w_base + N_OUT * stride_wn, s_cols + N_OUT * stride_sn, k_lo + k0, K, col_ok,
                                   BK, BN).to(a.dtype)
            elif W_TMA:
                b_up = w_ptr.load([w_row + N_OUT, k_lo + k0]).T.to(a.dtype)
            else:
                b_up = tl.load(w_base + N_OUT * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                               other=0).to(a.dtype)
            acc_up += tl.dot(a, b_up, input_precision="ieee" if IEEE else None)

    if INT8_W:
        s_base = scale_ptr + e * stride_se
        acc *= tl.load(s_base + cols, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(s_base + N_OUT + cols, mask=col_ok, other=0.0)[None, :]
    if ROW_WEIGHT and WEIGHT_FIRST:  # the pair's weight on the expert's input (Llama 4): (w x) W = w (x W)
        row_w = tl.load(pair_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        acc *= row_w
        if GATED:
            acc_up *= row_w
    if HAS_BIAS:  # [E, W_ROWS] per expert and output row, added once (by split pid_k 0)
        b_base = bias_ptr + e * stride_be
        first = (pid_k == 0).to(tl.float32)
        acc += first * tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += first * tl.load(b_base + N_OUT + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACT == "swiglu_oai":  # GPT-OSS: the gate clamped above, up clamped both ways, (up + 1)
            g = tl.minimum(acc, 7.0)
            u = tl.minimum(tl.maximum(acc_up, -7.0), 7.0)
            acc = g / (1.0 + tl.exp(-1.702 * g)) * (u + 1.0)
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # SiLU(gate) * up
    elif ACT == "gelu":
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    if ROW_WEIGHT and not WEIGHT_FIRST:
        acc *= tl.load(pair_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out = out_ptr + pid_k * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [*, K] activations: x [T, H] (A_FROM_TOKENS) or the buffer [N, K]
    row_pair_ptr,  # [N] int32 pair held by each buffer row (token = pair // TOPK)
    w_ptr,  # [E, W_ROWS, K] weights, K contiguous (W_TMA: a descriptor over [E * W_ROWS, K]; MXFP4_W: K / 2 bytes)
    scale_ptr,  # [E, W_ROWS] float32 per-output-channel scales (INT8_W); [E, W_ROWS, K / 32] uint8 (MXFP4_W)
    bias_ptr,  # [E, W_ROWS] per-output-channel biases (HAS_BIAS only)
    offsets_ptr,  # [E + 1] int32 expert segments of the buffer; FROM_IDS: [N] int32 expert of each pair
    pair_w_ptr,  # [T * TOPK] float32 combine weight of each pair (ROW_WEIGHT only)
    out_ptr,  # [S, N, N_OUT] out
    N_OUT, K, W_ROWS,  # output columns (F for gated up: gate rows, then up rows at +F)
    N_ROWS,  # pairs (FROM_IDS only)
    M_TILES, GROUP_M,  # row tiles in the grid; row tiles per group of the tile order
    stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_os, stride_om,
    E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, SUB_M: tl.constexpr,
    A_FROM_TOKENS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    ROW_WEIGHT: tl.constexpr, INT8_W: tl.constexpr, MXFP4_W: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, FROM_IDS: tl.constexpr, EVEN_K: tl.constexpr, W_TMA: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    group = GROUP_M * tl.cdiv(N_OUT, BN)
    first_m = pid // group * GROUP_M
    group_m = tl.minimum(M_TILES - first_m, GROUP_M)
    pid_m = first_m + pid % group % group_m
    pid_n = pid % group // group_m
    if FROM_IDS:
        # Decode sizes (all pairs fit one row tile): program pid_m takes the pid_m-th
        # distinct expert, in order of first use, straight from the ids: no maps kernel.
        rows = tl.arange(0, BM)
        ids = tl.load(offsets_ptr + rows, mask=rows < N_ROWS, other=-1)
        earlier = (ids[:, None] == ids[None, :]) & (rows[None, :] < rows[:, None])
        leader = (tl.sum(earlier.to(tl.int32), axis=1) == 0) & (rows < N_ROWS)
        if pid_m >= tl.sum(leader.to(tl.int32)):
            return  # fewer distinct experts than programs
        rank = tl.cumsum(leader.to(tl.int32), axis=0) - 1
        e = tl.sum(tl.where(leader & (rank == pid_m), ids, 0))
        r0 = 0
        hi = 0
        fit = 0
    else:
        # Tile map: which expert owns row tile pid_m, and where its rows start.
        e_idx = tl.arange(0, E_PAD)
        seg_lo = tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0)
        seg_hi = tl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
        tiles = (seg_hi - seg_lo + BM - 1) // BM
        tiles_end = tl.cumsum(tiles, axis=0)
        if pid_m >= tl.sum(tiles):
            return  # the grid is sized for the worst case; this tile has no rows
        e = tl.sum((tiles_end <= pid_m).to(tl.int32))
        mine = e_idx == e
        ids = e  # unused: rows come from the tile map
        first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0))
        r0 = tl.sum(tl.where(mine, seg_lo, 0)) + (pid_m - first_tile) * BM
        hi = tl.sum(tl.where(mine, seg_hi, 0))
        # An expert's last tile often holds few rows: with SUB_M > 1 it runs as a tile of
        # BM / 2 (or BM / 4) rows where they fit, so the tensor cores do not multiply padding.
        fit = 0
        if SUB_M >= 2:
            fit += (hi - r0 <= BM // 2).to(tl.int32)
        if SUB_M >= 4:
            fit += (hi - r0 <= BM // 4).to(tl.int32)
    args = (a_ptr, row_pair_ptr, w_ptr, scale_ptr, bias_ptr, offsets_ptr, pair_w_ptr, out_ptr,
            N_OUT, K, W_ROWS, e, ids, r0, hi, pid_n, pid_k,
            stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_os, stride_om)
    if fit == 0:
        _gemm_tile(*args, TOPK, BM, BN, BK, SPLIT_K, A_FROM_TOKENS, GATED, ACT, ROW_WEIGHT, INT8_W, MXFP4_W,
                   HAS_BIAS, UPCAST, IEEE, FROM_IDS, EVEN_K, W_TMA, WEIGHT_FIRST)
    if SUB_M >= 2:
        if fit == 1:
            _gemm_tile(*args, TOPK, BM // 2, BN, BK, SPLIT_K, A_FROM_TOKENS, GATED, ACT, ROW_WEIGHT, INT8_W, MXFP4_W,
                       HAS_BIAS, UPCAST, IEEE, FROM_IDS, EVEN_K, W_TMA, WEIGHT_FIRST)
    if SUB_M >= 4:
        if fit == 2:
            _gemm_tile(*args, TOPK, BM // 4, BN, BK, SPLIT_K, A_FROM_TOKENS, GATED, ACT, ROW_WEIGHT, INT8_W, MXFP4_W,
                       HAS_BIAS, UPCAST, IEEE, FROM_IDS, EVEN_K, W_TMA, WEIGHT_FIRST)


def max_row_tiles(num_rows: int, num_experts: int, bm: int) -> int:
    """Upper bound on the row tiles of any routing: each expert's last tile may be partial."""
    return triton.cdiv(num_rows, bm) + min(num_experts, num_rows)


def tma_ok(w: torch.Tensor, cfg: dict) -> bool:
    """Whether weight tiles can come by TMA: asked for (``tma`` in the launch configuration),
    a Hopper-or-later GPU or the CPU interpreter, contiguous weights with 16-byte aligned
    rows in device memory (not read in place from pinned host memory), and a [BN, BK] box
    TMA can copy (at most 256 per side, rows of 16 bytes or more)."""
    if not cfg.get("tma") or w.is_pinned():
        return False
    if w.is_cuda and torch.cuda.get_device_capability(w.device)[0] < 9:
        return False
    row_bytes = w.shape[-1] * w.element_size()
    return (w.is_contiguous() and row_bytes % 16 == 0 and w.data_ptr() % 16 == 0
            and cfg["bn"] <= 256 and cfg["bk"] <= 256 and cfg["bk"] * w.element_size() >= 16)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor | None, row_pair: torch.Tensor | None,
                 cfg: dict, *, num_rows: int, topk: int, a_from_tokens: bool, gated: bool,
                 act: str = "none", scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 pair_weights: torch.Tensor | None = None, weight_first: bool = False,
                 out_dtype: torch.dtype | None = None,
                 pair_ids: torch.Tensor | None = None, pdl: bool) -> torch.Tensor:
    """Runs one expert GEMM; returns [S, num_rows, N_OUT] (S = cfg["split_k"]).

    ``cfg`` holds the launch configuration: bm, bn, bk, split_k, num_warps, num_stages, and
    optionally group_m (row tiles per group of the tile order; absent: row-major order),
    tma (weight tiles by TMA where ``tma_ok``) and sub_m (1, 2 or 4: a row tile with at most
    bm / 2 or bm / 4 rows, an expert's last, runs at that height; bm / sub_m >= 16).
    With ``pair_ids`` ([N] int32 expert of each pair, N <= cfg["bm"]) instead of the maps,
    buffer rows are pair indices and each program finds its expert itself (decode sizes).
    """
    e, w_rows, k = w.shape
    mx = w.dtype == torch.uint8  # MXFP4: two weights a byte, group scales
    if mx:
        k *= 2
        if scale is None or tuple(scale.shape) != (e, w_rows, k // 32):
            raise ValueError(f"MXFP4 weights {list(w.shape)} need group scales [E, W_ROWS, K / 32] = "
                             f"{[e, w_rows, k // 32]}")
        if cfg["bk"] < 32:  # a tile holds whole groups
            cfg = {**cfg, "bk": 32}
    n_out = w_rows // 2 if gated else w_rows
    split = cfg["split_k"]
    if bias is not None and tuple(bias.shape) != (e, w_rows):
        raise ValueError(f"bias {list(bias.shape)}: expected [E, W_ROWS] = {[e, w_rows]}")
    if split > 1 and (gated or act != "none"):
        raise ValueError("split_k > 1 needs a linear epilogue (the down GEMM)")
    out = torch.empty(split, num_rows, n_out, device=a.device,
                      dtype=torch.float32 if split > 1 else (out_dtype or a.dtype))
    int8 = w.dtype == torch.int8
    if int8 and scale is None:
        raise ValueError("int8 weights need their per-channel scales")
    from_ids = pair_ids is not None
    sub_m = 1 if from_ids else cfg.get("sub_m") or 1
    if sub_m not in (1, 2, 4) or cfg["bm"] // sub_m < 16:
        raise ValueError(f"sub_m: expected 1, 2 or 4 with bm / sub_m >= 16, got sub_m={sub_m}, bm={cfg['bm']}")
    if from_ids and num_rows > cfg["bm"]:
        raise ValueError(f"pair_ids: {num_rows} pairs need bm >= {num_rows}, got bm={cfg['bm']}")
    tiles = min(e, num_rows) if from_ids else max_row_tiles(num_rows, e, cfg["bm"])
    grid = (tiles * triton.cdiv(n_out, cfg["bn"]), split)
    table = pair_ids if from_ids else offsets
    group_m = max(1, min(cfg.get("group_m") or tiles, tiles))
    tma = tma_ok(w, cfg) and not mx
    w_arg = TensorDescriptor.from_tensor(w.view(e * w_rows, k), [cfg["bn"], cfg["bk"]]) if tma else w
    scaled = int8 or mx
    _grouped_gemm_kernel[grid](
        a, row_pair if row_pair is not None else table, w_arg, scale if scaled else w,
        bias if bias is not None else w, table, pair_weights if pair_weights is not None else table, out,
        n_out, k, w_rows, num_rows, tiles, group_m, a.stride(0), w.stride(0), w.stride(1),
        scale.stride(0) if scaled else 0, scale.stride(1) if mx else 0, bias.stride(0) if bias is not None else 0,
        out.stride(0), out.stride(1),
        E=e, E_PAD=triton.next_power_of_2(e), TOPK=topk,
        BM=cfg["bm"], BN=cfg["bn"], BK=cfg["bk"], SPLIT_K=split, SUB_M=sub_m,
        A_FROM_TOKENS=a_from_tokens, GATED=gated, ACT=act, ROW_WEIGHT=pair_weights is not None,
        INT8_W=int8, MXFP4_W=mx, HAS_BIAS=bias is not None, UPCAST=a.device.type == "cpu" or a.dtype == torch.float32,
        IEEE=a.dtype == torch.float32, FROM_IDS=from_ids, EVEN_K=k % (split * cfg["bk"]) == 0, W_TMA=tma,
        WEIGHT_FIRST=weight_first,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(a.device, pdl))
    return out
