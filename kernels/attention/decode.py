"""Decode attention over a paged KV cache in Triton (DeepSpeed-Inference III: the fused
decode attention of the deep-fusion path), split over the keys, then a combine.

Shape letters: B rows, Hq query heads, Hkv KV heads, G = Hq / Hkv query heads per KV head,
S key slots per row, N pool rows, D head dim, P key splits.

One token per row. Program (b, kv head, split) reads its share of that KV head's keys and
values once for all G query heads (GQA / MQA aware) and keeps a running max, sum and
weighted value sum in float32 (flash-decoding); the combine kernel merges the P splits.
Hidden keys (padding, a window's past) are masked out of the loads, so they cost no reads;
keys past a row's position, where the step gives positions, are never walked.

``_paged_split_kernel`` reads each row's keys in place in the pool [N, Hkv, D], through
the row's slots, with both products on the tensor cores. ``_latent_split_kernel`` is its
form for multi-head latent attention (DeepSeek-V2 / V3): one cached row of C + R a token
(the latent, which is also the value, then the rotary key) read once for every head.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import tuning
from kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def mask_visible(mask_row, s, ok, ADDITIVE: tl.constexpr):
    """Whether a row's keys s are visible (False where not ``ok``), from its mask row: 0 /
    -inf floats (ADDITIVE, as SDPA takes them) or bytes, 1 where visible (a bool mask)."""
    if ADDITIVE:
        visible = tl.load(mask_row + s, mask=ok, other=float("-inf")).to(tl.float32) > float("-inf")
    else:
        visible = tl.load(mask_row + s, mask=ok, other=0) != 0
    return visible


def mask_bytes(mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A [B, S] mask as the kernels read it -> (mask, ADDITIVE): floats (0 / -inf) as they
    are, a bool mask as its bytes (a view, no copy); rows made contiguous where they are not."""
    additive = mask.is_floating_point()
    if not additive:
        mask = mask.view(torch.int8) if mask.dtype == torch.bool else mask.to(torch.int8)
    return (mask if mask.stride(-1) == 1 else mask.contiguous()), additive


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr,  # as written by _paged_split_kernel
    sink_ptr,  # [Hq] float: each head's sink logit (HAS_SINK only)
    out_ptr,  # [B, Hq, D]
    lse_ptr,  # [B, Hq] float32: the log of each row and head's softmax denominator (WRITE_LSE only)
    D, stride_ob, stride_oh, HQ,
    P: tl.constexpr, P_PAD: tl.constexpr, D_PAD: tl.constexpr, HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    b, hq = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, P_PAD)
    d = tl.arange(0, D_PAD)
    base = (b * HQ + hq) * P
    m = tl.load(m_ptr + base + p, mask=p < P, other=float("-inf"))
    l = tl.load(l_ptr + base + p, mask=p < P, other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINK:  # one more key, of this logit and no value: the denominator alone grows
        sink = tl.load(sink_ptr + hq).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # splits that saw no key weigh 0
    acc = tl.load(acc_ptr + (base + p)[:, None] * D + d[None, :], mask=(p < P)[:, None] & (d < D)[None, :],
                  other=0.0)
    den = tl.sum(w * l, axis=0)
    if HAS_SINK:
        den += tl.exp(sink - m_all)
    if WRITE_LSE:  # (a partial: a row with no visible key gets zeros and -inf)
        tl.store(lse_ptr + b * HQ + hq, m_all + tl.log(den))
        out = tl.where(den > 0, tl.sum(w[:, None] * acc, axis=0) / tl.where(den > 0, den, 1.0), 0.0)
    else:
        out = tl.sum(w[:, None] * acc, axis=0) / den
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _merge_kernel(
    parts_ptr,  # [P, H, B * T, D + 1] float32: each share's normalized output, then its log-sum-exp
    sink_ptr,  # [H] float: each head's sink logit (HAS_SINK only)
    out_ptr,  # [B, H, T, D]
    H, BT, T, D,
    P: tl.constexpr, P_PAD: tl.constexpr, D_PAD: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Program (row b and token t, head h): the P shares' partial attentions merged, each
    weighted by exp(its log-sum-exp - the whole one's); a share with no key (-inf) weighs 0,
    and a row with none anywhere gets zeros."""
    bt, h = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, P_PAD)
    d = tl.arange(0, D_PAD)
    row = ((p * H + h) * BT + bt) * (D + 1)  # [P_PAD]: each share's row
    lse = tl.load(parts_ptr + row + D, mask=p < P, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINK:
        m = tl.maximum(m, tl.load(sink_ptr + h).to(tl.float32))
    finite = m > float("-inf")
    m = tl.where(finite, m, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
    den = tl.sum(w, axis=0)
    if HAS_SINK:
        den += tl.exp(tl.load(sink_ptr + h).to(tl.float32) - m)
    outs = tl.load(parts_ptr + row[:, None] + d[None, :], mask=(p < P)[:, None] & (d < D)[None, :], other=0.0)
    out = tl.where(finite, tl.sum(w[:, None] * outs, axis=0) / tl.where(den > 0, den, 1.0), 0.0)
    b, t = bt // T, bt % T
    tl.store(out_ptr + ((b * H + h) * T + t) * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b on the tensor cores: full precision for float32 caches (IEEE), TF32 otherwise
    (bf16 and fp16 values are exact in it)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _softmax_block(scores, visible, v, m, l, acc, IEEE: tl.constexpr):
    """One key block of the running softmax (flash-decoding): scores [G, BLOCK_S] of the
    block's keys (float32), visible [BLOCK_S], v [BLOCK_S, D] their values (float32, or the
    model dtype for a product at its tensor-core rate) -> the running max, sum and
    weighted value sum after it."""
    scores = tl.where(visible[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    w = tl.exp(scores - m_new[:, None])
    # the weights enter the second product in the values' dtype (as flash attention rounds them)
    return m_new, l * alpha + tl.sum(w, axis=1), acc * alpha[:, None] + _dot(w.to(v.dtype), v, IEEE)


@triton.jit
def _key_range(pos_ptr, b, p, S, SPLIT_LEN: tl.constexpr, P: tl.constexpr, BLOCK_S: tl.constexpr,
               POS: tl.constexpr):
    """Split p's keys [lo, hi) of row b: SPLIT_LEN of the S slots, or with ``POS`` its share
    of the row's keys 0 .. pos[b] (the rest of the step's key bucket never walked). Reads
    only the step's positions, which no kernel of the step writes."""
    end = tl.minimum(tl.load(pos_ptr + b) + 1, S) if POS else S
    span = tl.cdiv(tl.cdiv(end, P), BLOCK_S) * BLOCK_S if POS else SPLIT_LEN
    lo = p * span
    return lo, tl.minimum(lo + span, end)


@triton.jit
def _paged_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr, v_ptr,  # pools [N, Hkv, D] (D contiguous)
    slot_ptr,  # [B, S] int64: the pool row of each row's key s
    mask_ptr,  # [B, S] int8: 1 where the key is visible (ADDITIVE: floats, 0 where visible, -inf hidden)
    m_ptr, l_ptr,  # [B, Hq, P] float32 out: running max and sum of each split
    acc_ptr,  # [B, Hq, P, D] float32 out: unnormalised weighted values
    pos_ptr,  # int64 [B]: the index of each row's newest key among its S (POS only)
    S, D, scale,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_mb, stride_slb,
    G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT_LEN: tl.constexpr, P: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
    POS: tl.constexpr, ADDITIVE: tl.constexpr,
):
    """Program (b, KV head h, split p): its share of row b's keys for the G query heads of
    KV head h, its two products on the tensor cores: the G query heads padded to G_PAD >= 16
    rows make [G_PAD, D] x [D, BLOCK_S] and [G_PAD, BLOCK_S] x [BLOCK_S, D] dots, where a
    broadcast-and-sum form would keep [G, BLOCK_S, D] products in registers. Keys are
    gathered row by row through the slots, read in place, and enter the products in the
    cache's dtype (float32 where ``UPCAST``: the interpreter, or a float32 cache, which takes
    full-precision dots, IEEE); the scale is applied to the scores. The loop over a split's
    blocks is software pipelined (``STAGES`` stages): hidden keys are masked out of the
    loads, not skipped, so a block's loads never wait on the one before. With ``POS`` a
    row's keys 0 .. pos[b] are split over the P programs by the row's own length, not by S:
    keys past it (the rest of the step's key bucket) are never walked."""
    b, h, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo, hi = _key_range(pos_ptr, b, p, S, SPLIT_LEN, P, BLOCK_S, POS)
    KT: tl.constexpr = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok, d_ok = g < G, d < D
    heads = h * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(KT)  # [G_PAD, D]
    m = tl.full([G_PAD], -1e30, tl.float32)  # finite: a block with no visible key leaves it as it was
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for s0 in tl.range(lo, hi, BLOCK_S, num_stages=STAGES):
        s = s0 + tl.arange(0, BLOCK_S)
        visible = mask_visible(mask_ptr + b * stride_mb, s, s < hi, ADDITIVE)
        rows = tl.load(slot_ptr + b * stride_slb + s, mask=visible, other=0)
        kv_ok = visible[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + h * stride_kh + rows[:, None] * stride_kn + d[None, :], mask=kv_ok, other=0.0).to(KT)
        v = tl.load(v_ptr + h * stride_vh + rows[:, None] * stride_vn + d[None, :], mask=kv_ok, other=0.0).to(KT)
        scores = _dot(q, tl.trans(k), IEEE) * scale  # [G_PAD, BLOCK_S]
        m, l, acc = _softmax_block(scores, visible, v, m, l, acc, IEEE)
    row = (b * (tl.num_programs(1) * G) + heads) * P + p
    tl.store(m_ptr + row, tl.where(l > 0, m, float("-inf")), mask=g_ok)  # -inf: the combine weighs it 0
    tl.store(l_ptr + row, l, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                                  visible: torch.Tensor, scale: float | None = None, splits: int | None = None,
                                  block_s: int = 32, sinks: torch.Tensor | None = None, *,
                                  positions: torch.Tensor | None = None, stages: int = 3,
                                  warps: int = 2) -> torch.Tensor:
    """Decode attention over a paged cache, read in place: q [B, Hq, D], k / v pools
    [N, Hkv, D], slots [B, S] int64 (the pool row of each row's key s), visible [B, S] bool,
    or an additive mask of 0 / -inf floats (read as it is: a step builds it once for every
    layer) -> out [B, Hq, D]. ``sinks`` [Hq]: a logit per head in the softmax, no value
    (GPT-OSS), joined in the combine. ``positions`` [B] int64, where given: the index of
    each row's newest key among its S (a decode step's position); keys after it are
    hidden, and are never walked. ``splits``, ``block_s``, ``stages`` and ``warps`` shape
    the launch."""
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks {list(sinks.shape)}: expected one logit per query head, [{q.shape[1]}]")
    parts = _splits(q, k, v, slots, visible, scale, splits, block_s, positions, stages, warps)
    return _combine(*parts, q.dtype, sinks)


def merge_partials_triton(parts: torch.Tensor, sinks: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.attention.reference.merge_partials_ref`` in one launch: parts [P, H, B, T,
    Dv + 1] float32 (contiguous) -> [B, H, T, Dv] in ``dtype``."""
    p, h, b, t, width = parts.shape
    if parts.dtype != torch.float32 or not parts.is_contiguous() or width < 2:
        raise ValueError(f"parts {list(parts.shape)} {parts.dtype}: expected contiguous float32 [P, H, B, T, Dv + 1]")
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks {list(sinks.shape)}: expected one logit per head, [{h}]")
    d = width - 1
    out = torch.empty(b, h, t, d, dtype=dtype, device=parts.device)
    _merge_kernel[(b * t, h)](parts, sinks if sinks is not None else parts, out, h, b * t, t, d, P=p,
                              P_PAD=max(2, triton.next_power_of_2(p)), D_PAD=triton.next_power_of_2(d),
                              HAS_SINK=sinks is not None, num_warps=1 if d <= 128 else 4)
    return out


def paged_decode_partial_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                                visible: torch.Tensor, scale: float | None = None, splits: int | None = None,
                                block_s: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode_attention_triton`` over the visible keys, for a caller that merges it
    with attention over other keys (a cache split over ranks by tokens) -> (out [B, Hq, D]
    normalized over these keys, zero where none is visible; lse [B, Hq] float32, the log of
    the softmax's denominator over them, -inf where none is)."""
    m, l, acc = _splits(q, k, v, slots, visible, scale, splits, block_s)
    lse = torch.empty(m.shape[:2], dtype=torch.float32, device=q.device)
    return _combine(m, l, acc, q.dtype, lse=lse), lse


def _splits(q, k, v, slots, visible, scale, splits, block_s, positions=None, stages=3,
            warps=2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split kernel's launch (operands as ``paged_decode_attention_triton`` takes them)
    -> each split's (m, l [B, Hq, P], acc [B, Hq, P, D])."""
    b, hq, d = q.shape
    _, hkv, _ = k.shape
    s = slots.shape[1]
    if hq % hkv or v.shape != k.shape or visible.shape != (b, s) or slots.shape[0] != b:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, slots {list(slots.shape)}, "
                         f"visible {list(visible.shape)}: expected [B, Hq, D], [N, Hkv, D] twice with Hkv dividing "
                         "Hq, and [B, S] twice")
    if slots.dtype != torch.int64 or slots.stride(1) != 1:
        raise ValueError(f"slots: expected contiguous int64 rows, got {slots.dtype} with strides {slots.stride()}")
    positions = _row_positions(positions, b)
    g = hq // hkv
    if splits is None:  # short splits: many programs in flight hide the gathered loads' latency
        splits = min(16, 1 << (triton.cdiv(s, block_s).bit_length() - 1))
    split_len = triton.cdiv(triton.cdiv(s, splits), block_s) * block_s
    mask, additive = mask_bytes(visible)
    m = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    _paged_split_kernel[(b, hkv, splits)](
        q, k, v, slots, mask, m, l, acc, positions if positions is not None else slots, s, d,
        scale if scale is not None else 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), mask.stride(0), slots.stride(0),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_S=block_s,
        SPLIT_LEN=split_len, P=splits, IEEE=k.dtype == torch.float32,
        UPCAST=q.device.type == "cpu" or k.dtype == torch.float32, STAGES=stages, POS=positions is not None,
        ADDITIVE=additive, num_warps=warps)
    return m, l, acc


def _row_positions(positions: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """A step's positions as the split kernels take them: one int64 index a row, [B]."""
    if positions is None:
        return None
    if positions.numel() != b or positions.dtype != torch.int64:
        raise ValueError(f"positions {list(positions.shape)} {positions.dtype}: expected one int64 index a row, [{b}]")
    return positions.reshape(b).contiguous()


def _combine(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype,
             sinks: torch.Tensor | None = None, lse: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The splits' partial results [B, Hq, P] (m, l) and [B, Hq, P, D] (acc), and each head's
    sink logit where given -> [B, Hq, D]; ``lse`` [B, Hq] float32 receives the log of each
    softmax denominator (a row with no visible key: zeros and -inf)."""
    b, hq, splits, d = acc.shape
    out = torch.empty(b, hq, d, dtype=dtype, device=acc.device)
    _combine_kernel[(b, hq)](m, l, acc, sinks if sinks is not None else m, out, lse if lse is not None else m, d,
                             out.stride(0), out.stride(1), hq, P=splits, P_PAD=max(2, triton.next_power_of_2(splits)),
                             D_PAD=triton.next_power_of_2(d), HAS_SINK=sinks is not None, WRITE_LSE=lse is not None,
                             num_warps=1 if d <= 128 else 4, **pdl_launch(acc.device, pdl))
    return out


@triton.jit
def _latent_split_kernel(
    q_ptr,  # [B, Hq, C + R]: each head's absorbed query (latent part, then rotary part)
    kv_ptr,  # pool [N, C + R]: each token's latent (its value too), then its rotary key
    slot_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr,  # as in _paged_split_kernel, acc [B, Hq, P, C]
    pos_ptr,  # int64 [B]: the index of each row's newest key among its S (POS only)
    S, scale, stride_qb, stride_qh, stride_kn, stride_mb, stride_slb,
    HQ: tl.constexpr, HB: tl.constexpr, C: tl.constexpr, C_PAD: tl.constexpr, R: tl.constexpr,
    R_PAD: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT_LEN: tl.constexpr, P: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, STAGES: tl.constexpr, POS: tl.constexpr, ADDITIVE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, head block, split p): its share of row b's keys for HB >= 16 query heads
    (padding heads masked). Each key block is read once as [BLOCK_S, C] latents and
    [BLOCK_S, R] rotary keys; scores are the two parts' dots, and the latents weigh into
    the [HB, C] accumulator (the values are the latents). Queries and keys enter the
    products in the model dtype (float32 where ``UPCAST``: the interpreter, or a float32
    cache), which keeps a [BLOCK_S, C] block at half the registers of float32 and the
    products at the tensor cores' bf16 rate. The loop over a split's blocks is software
    pipelined (``STAGES`` stages): hidden keys are masked out of the loads, not
    skipped, so a block's loads never wait on the one before. With ``POS`` a row's keys
    0 .. pos[b] are split over the P programs by the row's own length, not by S: keys past
    it (the rest of the step's key bucket) are never walked."""
    b, hb, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo, hi = _key_range(pos_ptr, b, p, S, SPLIT_LEN, P, BLOCK_S, POS)  # (before the wait: a step's input)
    pdl_enter(PDL)
    KT: tl.constexpr = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    heads = hb * HB + tl.arange(0, HB)
    h_ok = heads < HQ
    c = tl.arange(0, C_PAD)
    r = tl.arange(0, R_PAD)
    c_ok, r_ok = c < C, r < R
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0).to(KT)
    q_r = tl.load(q_row + C + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(KT)
    m = tl.full([HB], -1e30, tl.float32)  # finite: a block with no visible key leaves it as it was
    l = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, C_PAD], tl.float32)
    for s0 in tl.range(lo, hi, BLOCK_S, num_stages=STAGES):
        s = s0 + tl.arange(0, BLOCK_S)
        visible = mask_visible(mask_ptr + b * stride_mb, s, s < hi, ADDITIVE)
        rows = tl.load(slot_ptr + b * stride_slb + s, mask=visible, other=0)
        base = kv_ptr + rows[:, None] * stride_kn
        kc = tl.load(base + c[None, :], mask=visible[:, None] & c_ok[None, :], other=0.0).to(KT)
        kr = tl.load(base + C + r[None, :], mask=visible[:, None] & r_ok[None, :], other=0.0).to(KT)
        scores = _dot(q_c, tl.trans(kc), IEEE) + _dot(q_r, tl.trans(kr), IEEE)  # [HB, BLOCK_S]
        m, l, acc = _softmax_block(scores * scale, visible, kc, m, l, acc, IEEE)
    row = (b * HQ + heads) * P + p
    tl.store(m_ptr + row, tl.where(l > 0, m, float("-inf")), mask=h_ok)
    tl.store(l_ptr + row, l, mask=h_ok)
    tl.store(acc_ptr + row[:, None] * C + c[None, :], acc, mask=h_ok[:, None] & c_ok[None, :])


def paged_latent_decode_triton(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                               latent: int, scale: float | None = None, splits: int | None = None,
                               block_s: int | None = None, pdl: bool = True, *, stages: int = 3,
                               warps: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of multi-head latent attention over a paged cache read in place:
    q [B, Hq, C + R] (absorbed queries), kv pool [N, C + R] or [N, 1, C + R] (each token's
    latent, which is also its value, then its rotary key; ``latent`` = C), slots [B, S]
    int64, visible [B, S] bool or additive 0 / -inf -> out [B, Hq, C], the softmax-weighted
    latents. ``positions`` [B] int64, where given: the index of each row's newest key among
    its S (a decode step's position); keys after it are hidden, and are never walked.
    ``splits``, ``block_s``, ``stages`` and ``warps`` shape the launch (the keys' splits, a
    block's keys, blocks in flight, warps a program); left out, they follow the batch and
    the cache length."""
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"kv {list(kv.shape)}: expected one latent row a slot, [N, 1, C + R]")
        kv = kv[:, 0]
    b, hq, width = q.shape
    s = slots.shape[1]
    if (kv.dim() != 2 or kv.shape[1] != width or not 0 < latent < width or visible.shape != (b, s)
            or slots.shape[0] != b or kv.stride(1) != 1 or q.stride(2) != 1):
        raise ValueError(f"q {list(q.shape)}, kv {list(kv.shape)}, latent {latent}, slots {list(slots.shape)}, "
                         f"visible {list(visible.shape)}: expected [B, Hq, C + R], [N, C + R] (rows contiguous), "
                         "0 < C < C + R, and [B, S] twice")
    if slots.dtype != torch.int64 or slots.stride(1) != 1:
        raise ValueError(f"slots: expected contiguous int64 rows, got {slots.dtype} with strides {slots.stride()}")
    positions = _row_positions(positions, b)
    rope = width - latent
    hb = 16
    sms, programs = tuning.sm_count(q.device), b * triton.cdiv(hq, hb)  # programs before the splits
    if splits is None:
        # One cached row serves every head, so at batch 1 B x head blocks is a few programs:
        # splits double (to 64, and to 16 keys a split) while the grid has fewer than two
        # programs an SM. Not past that: each split's partials (Hq x C floats a row) are
        # written and read back by the combine, which at a large batch and a long cache
        # would outweigh the cache itself.
        splits = 1
        while splits < 64 and splits * 16 < s and programs * splits < 2 * sms:
            splits *= 2
    if block_s is None:  # 16 keys where a split has no more, else blocks of 32, several in flight
        block_s = 16 if triton.cdiv(s, splits) <= 16 else 32
    if warps is None:  # more warps a program only where the grid leaves SMs idle (batch 1, long caches)
        warps = 8 if block_s > 16 and programs * splits < sms else 4
    split_len = triton.cdiv(triton.cdiv(s, splits), block_s) * block_s
    mask, additive = mask_bytes(visible)
    m = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(b, hq, splits, latent, dtype=torch.float32, device=q.device)
    _latent_split_kernel[(b, triton.cdiv(hq, hb), splits)](
        q, kv, slots, mask, m, l, acc, positions if positions is not None else slots, s,
        scale if scale is not None else 1.0 / math.sqrt(width),
        q.stride(0), q.stride(1), kv.stride(0), mask.stride(0), slots.stride(0),
        HQ=hq, HB=hb, C=latent, C_PAD=max(16, triton.next_power_of_2(latent)), R=rope,
        R_PAD=max(16, triton.next_power_of_2(rope)), BLOCK_S=block_s, SPLIT_LEN=split_len, P=splits,
        IEEE=kv.dtype == torch.float32, UPCAST=q.device.type == "cpu" or kv.dtype == torch.float32, STAGES=stages,
        POS=positions is not None, ADDITIVE=additive, num_warps=warps, **pdl_launch(q.device, pdl))
    return _combine(m, l, acc, q.dtype, pdl=pdl)
