"""A decode step's attention in one launch: the QKV epilogue (q / k norms, clip, rotary,
the KV-cache append) and the attention over the cache, with its split combine
(DeepSpeed-Inference III-A's deep fusion, on the decode path).

Shape letters: B rows, Hq / Hkv query / KV heads, G = Hq / Hkv query heads per KV head,
D head dim, S key slots per row, P key splits, N pool rows of the paged cache.

One token per row over a paged pool (``dense.attention.PagedKVCache``, [N, Hkv, D] shared
by every row): row b's key s lies at pool row ``read_slots[b, s]`` and is read in place;
its new key sits at index ``positions[b]`` (its position: a row's keys are its tokens in
order) and is stored at pool row ``slot[b]``. Every operand is a device tensor, so the step
is captured in a CUDA graph and replayed for every step. Program (b, KV head h, split p):
- computes its G query heads' q and KV head h's new k and v from the QKV GEMM's output
  row (each program recomputes the all-heads norm where the model has one: a row is a few
  KB; with heads split over ranks, the row also holds the other ranks' q and k after v,
  whose squares join that norm); program p = 0 writes k and v into the pool. Every load after the PDL wait (the
  row's blocks, the rotary rows, the mask) is issued before any arithmetic: one round trip
  to L2, not one per step of the epilogue. q's norm and rotation run on its G rows only;
- attends over its share of the row's keys 0 .. positions[b], the visible keys split
  evenly over the P programs by the row's own length, not by S (a short row among long
  ones still spreads over every program); blocks with no visible key cost no K / V reads.
  The query heads are the rows of two tensor-core products per block of keys (q K^T, then
  the softmax weights times V; q's rows repeated to 16), so no program sums [G, keys, D]
  products on its CUDA cores. Where P blocks of keys cover S (batch 1 with a short
  context), each program has one block and loads its keys and values before the PDL wait:
  the step's slots and positions and the row's earlier keys are no output of the kernels
  just before it (the slots are written before the first layer, those keys by earlier
  steps), so their DRAM round trip overlaps the QKV GEMM's tail instead of following it.
  The new key and value enter the block of the program that holds them from its
  registers: the query always sees its own key, as ``StepContext.paged`` and
  ``kernels.attention.paged_context`` make the mask;
- keeps the running max, sum and weighted value sum in float32 (flash-decoding). With
  P > 1 each program writes its partials and takes a ticket from a per-(b, h) counter; the
  last of the P programs merges them and resets the counter, so there is no second launch.
  GPT-OSS's sinks (a logit per query head that joins the softmax and adds no value) are
  the starting state of split 0: running max the sink, sum 1, value sum 0.

The mask, built once a step, is [B, S] in either form (each launch says which,
``ADDITIVE``): additive 0 / -inf floats, or a bool mask read as bytes.

Replaces two launches (``qkv_decode`` and SDPA), and unlike SDPA it takes part in
programmatic dependent launch: the output projection's blocks are resident, their first
weights in flight, while the attention runs. It pays where the grid is small (batch 1, a
short cache); ``fits`` says where, from the measurements in its docstring.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attention.decode import mask_bytes, mask_visible
from kernels.attention.reference import QK_NORMS, check_qkv_attention
from kernels.pdl import pdl_enter, pdl_launch, ticket_counters
from kernels.attention.qkv_decode_triton import (_load_all, _load_heads, _norm_rotate, _norm_weights, _rotary,
                                                  _rstd_all, rotary_tables)

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _rstd_all2(x, y, eps, H: tl.constexpr, D: tl.constexpr):
    """1 / RMS over two ``_load_all`` tiles that hold H heads between them."""
    sq = tl.sum(tl.sum(x * x, axis=1), axis=0) + tl.sum(tl.sum(y * y, axis=1), axis=0)
    return tl.math.rsqrt(sq / (H * D) + eps)


@triton.jit
def _attend_block(q, k, v, visible, scale, m, l, acc, UPCAST: tl.constexpr, DT: tl.constexpr):
    """One block of keys into the running max m, sum l and weighted value sum acc
    (flash-decoding, float32), on the tensor cores: q [G_M, D], k / v [BLOCK_S, D], all in
    the model dtype DT (q's values are already rounded to it), visible [BLOCK_S]. The
    softmax weights go into the second product in DT, as flash attention rounds them.
    ``UPCAST`` (the interpreter, or float32): q, k, v are float32 and both products too.
    A block with no visible key changes nothing (its weights are 0, never NaN)."""
    if UPCAST:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))  # [G_M, BLOCK_S] float32
    scores = tl.where(visible[None, :], scores * scale, NEG_INF)
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_ref = tl.where(m_new > NEG_INF, m_new, 0.0)
    alpha = tl.exp(m - m_ref)
    w = tl.exp(scores - m_ref[:, None])
    if UPCAST:
        pv = tl.dot(w, v, input_precision="ieee")
    else:
        pv = tl.dot(w.to(DT), v)
    return m_new, l * alpha + tl.sum(w, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _qkv_attention_kernel(
    qkv_ptr,  # [B, (Hq + 2 Hkv) * D] the QKV GEMM's output
    qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr,  # q / k norm weights, rotary tables [B, D]
    kc_ptr, vc_ptr,  # this layer's pools [N, Hkv, D]
    slot_ptr,  # int64 [B]: each row's pool row for the new k, v
    read_ptr,  # int64 [B, S]: the pool row of each row's key s
    pos_ptr,  # int64 [B]: the index of each row's new key among its S (its position)
    bias_ptr,  # [B, S] additive mask (0 / -inf) in any float dtype, or (not ADDITIVE) bytes, 1 where visible
    sink_ptr,  # [Hq] the heads' sink logits (SINKS)
    out_ptr,  # [B, Hq, D]
    m_ptr, l_ptr, acc_ptr,  # float32 partials [B, Hkv, G_M, P] (and [.., D]) when P > 1
    count_ptr,  # int32 [B * Hkv] counters, zero between calls
    eps, clip, scale, stride_qkv, stride_cos,
    stride_kh, stride_kn, stride_vh, stride_vn,  # the pools' head and row strides
    stride_bias, stride_read, stride_pos,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr,
    HQ_O: tl.constexpr, HKV_O: tl.constexpr, HQ_OP: tl.constexpr, HKV_OP: tl.constexpr, G: tl.constexpr,
    G_P: tl.constexpr, G_M: tl.constexpr, D: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr,
    CLIP: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_S: tl.constexpr, P: tl.constexpr, P_CHUNK: tl.constexpr, PRE_KV: tl.constexpr, UPCAST: tl.constexpr,
    ADDITIVE: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h, p = tl.program_id(1), tl.program_id(2)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    KT: tl.constexpr = tl.float32 if UPCAST else DT  # q, k and v as the products take them
    # slot: the new key's index among the row's keys; new_row: where its k and v are stored.
    read_row = read_ptr + b * stride_read
    slot = tl.load(pos_ptr + b * stride_pos)
    new_row = tl.load(slot_ptr + b)
    d = tl.arange(0, D)
    partner = tl.where(d < R, (d + R // 2) % R, d)  # (``_rotary``'s)
    k_rows = kc_ptr + h * stride_kh
    v_rows = vc_ptr + h * stride_vh
    # Where P blocks cover the keys: this program's keys and values, loaded before the wait.
    s_pre = p * BLOCK_S + tl.arange(0, BLOCK_S)
    old_pre = (s_pre < slot) & PRE_KV  # its keys before the fresh one (that one comes from registers)
    r_pre = tl.load(read_row + s_pre, mask=old_pre, other=0)  # their pool rows (0 where not loaded)
    k_pre = tl.load(k_rows + r_pre[:, None] * stride_kn + d[None, :], mask=old_pre[:, None], other=0.0).to(KT)
    v_pre = tl.load(v_rows + r_pre[:, None] * stride_vn + d[None, :], mask=old_pre[:, None], other=0.0).to(KT)
    # The q / k norm weights: no kernel's output either.
    gq = tl.arange(0, G_P)
    q_heads = tl.where(gq < G, h * G + gq, HQ)  # this KV head's query heads (HQ: padding, masked)
    k_head = h + tl.zeros([1], tl.int32)  # k and v of head h as a 1-row block
    qw, qwp = _norm_weights(qn_w_ptr, q_heads, d, partner, HQ, D, QK_NORM)
    kw, kwp = _norm_weights(kn_w_ptr, k_head, d, partner, HKV, D, QK_NORM)
    pdl_enter(PDL)
    # Every load of the QKV row, the rotary tables and the mask is issued here, before any
    # arithmetic: one round trip after the wait, not one per step of the epilogue.
    row = qkv_ptr + b * stride_qkv
    d, partner, sign, cos, sin = _rotary(cos_ptr, sin_ptr, b, stride_cos, D, R, ROPE)
    qx, qxp = _load_heads(row, q_heads, d, partner, HQ, D)  # [G_P, D]
    kx, kxp = _load_heads(row + HQ * D, k_head, d, partner, HKV, D)  # [1, D]
    v_new = tl.load(row + (HQ + HKV) * D + k_head[:, None] * D + d[None, :]).to(tl.float32)  # [1, D]
    visible_pre = mask_visible(bias_ptr + b * stride_bias, s_pre, old_pre, ADDITIVE)
    rstd_q = 1.0
    rstd_k = 1.0
    if QK_NORM == 2:  # the all-heads rows: both loaded before either is reduced
        q_all = _load_all(row, HQ, HQ_P, D)
        k_all = _load_all(row + HQ * D, HKV, HKV_P, D)
        if HQ_O + HKV_O > 0:  # other ranks' heads after v: their squares join the sums
            others = row + (HQ + 2 * HKV) * D
            q_o = _load_all(others, HQ_O, HQ_OP, D)
            k_o = _load_all(others + HQ_O * D, HKV_O, HKV_OP, D)
            rstd_q = _rstd_all2(q_all, q_o, eps, HQ + HQ_O, D)
            rstd_k = _rstd_all2(k_all, k_o, eps, HKV + HKV_O, D)
        else:
            rstd_q = _rstd_all(q_all, eps, HQ, D)
            rstd_k = _rstd_all(k_all, eps, HKV, D)
    q = _norm_rotate(qx, qxp, qw, qwp, cos, sin, sign, eps, clip, rstd_q, D, QK_NORM, CLIP, ROPE, DT)
    k_new = _norm_rotate(kx, kxp, kw, kwp, cos, sin, sign, eps, clip, rstd_k, D, QK_NORM, CLIP, ROPE, DT)
    if CLIP:
        v_new = tl.minimum(tl.maximum(v_new, -clip), clip)
    k_new = k_new.to(DT)  # [1, D]: the values the cache keeps and the products see
    v_new = v_new.to(DT)
    if p == 0:
        tl.store(k_rows + new_row * stride_kn + d[None, :], k_new)
        tl.store(v_rows + new_row * stride_vn + d[None, :], v_new)
    qk = q.to(DT).to(KT)
    if G_P < G_M:  # the G_M rows of a tensor-core product: q's rows repeated (only rows < G are stored)
        qk = tl.reshape(tl.broadcast_to(qk[None, :, :], (G_M // G_P, G_P, D)), (G_M, D))

    m = tl.full([G_M], NEG_INF, tl.float32)
    l = tl.zeros([G_M], tl.float32)
    acc = tl.zeros([G_M, D], tl.float32)
    if SINKS:
        if p == 0:  # the sink as a key of value 0 seen first: exp(sink - m) = 1
            gs = tl.arange(0, G_M)
            m = tl.load(sink_ptr + h * G + gs % G_P, mask=gs % G_P < G, other=0.0).to(tl.float32)
            l = tl.full([G_M], 1.0, tl.float32)
    # Keys 0 .. slot over the P programs. The new key and value are the fresh ones, put
    # into the block from registers (the program that holds index ``slot``; the mask always
    # leaves a row's own key visible). A hidden key before it may be read but weighs 0: the
    # pool must hold finite values there (the row's own earlier tokens). Keys after it are
    # never read (their read slots point at the pool's trash row).
    if PRE_KV:  # the one block, loaded before the wait
        fresh = s_pre == slot
        k_blk = tl.where(fresh[:, None], k_new.to(KT), k_pre)
        v_blk = tl.where(fresh[:, None], v_new.to(KT), v_pre)
        m, l, acc = _attend_block(qk, k_blk, v_blk, visible_pre | fresh, scale, m, l, acc, UPCAST, DT)
    else:
        span = tl.cdiv(tl.cdiv(slot + 1, P), BLOCK_S) * BLOCK_S
        lo = p * span
        hi = tl.minimum(lo + span, slot + 1)
        for s0 in range(lo, hi, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            old = s < tl.minimum(hi, slot)
            fresh = s == slot
            visible = mask_visible(bias_ptr + b * stride_bias, s, old, ADDITIVE) | fresh
            if tl.sum(visible.to(tl.int32)) > 0:  # a block with no visible key costs no K / V reads
                ld = visible & old
                rows = tl.load(read_row + s, mask=ld, other=0)
                k = tl.load(k_rows + rows[:, None] * stride_kn + d[None, :], mask=ld[:, None], other=0.0).to(KT)
                v = tl.load(v_rows + rows[:, None] * stride_vn + d[None, :], mask=ld[:, None], other=0.0).to(KT)
                k = tl.where(fresh[:, None], k_new.to(KT), k)
                v = tl.where(fresh[:, None], v_new.to(KT), v)
                m, l, acc = _attend_block(qk, k, v, visible, scale, m, l, acc, UPCAST, DT)

    g = tl.arange(0, G_M)
    g_ok = g < G
    out_rows = out_ptr + (b * HQ + h * G + g)[:, None] * D + d[None, :]
    if P == 1:
        tl.store(out_rows, (acc / l[:, None]).to(DT), mask=g_ok[:, None])
    else:
        part = ((b * HKV + h) * G_M + g) * P + p  # [G_M] index into [B, Hkv, G_M, P]
        tl.store(m_ptr + part, m)
        tl.store(l_ptr + part, l)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)
        tl.debug_barrier()  # every thread's partials are written before the ticket is taken
        ticket = tl.atomic_add(count_ptr + b * HKV + h, 1, sem="acq_rel")
        if ticket == P - 1:  # the last of the P programs: merge them, P_CHUNK splits at a time
            base = ((b * HKV + h) * G_M + g[:, None]) * P  # [G_M, 1]
            ps = tl.arange(0, P)
            m_all = tl.max(tl.load(m_ptr + base + ps[None, :], cache_modifier=".cg"), axis=1)  # [G_M]
            o = tl.zeros([G_M, D], tl.float32)
            den = tl.zeros([G_M], tl.float32)
            for c in range(0, P, P_CHUNK):
                pc = c + tl.arange(0, P_CHUNK)
                parts = base + pc[None, :]  # [G_M, P_CHUNK]
                mm = tl.load(m_ptr + parts, cache_modifier=".cg")
                ll = tl.load(l_ptr + parts, cache_modifier=".cg")
                aa = tl.load(acc_ptr + parts[:, :, None] * D + d[None, None, :], cache_modifier=".cg")
                wp = tl.where(mm > NEG_INF, tl.exp(mm - m_all[:, None]), 0.0)  # splits with no key weigh 0
                o += tl.sum(wp[:, :, None] * aa, axis=1)
                den += tl.sum(wp * ll, axis=1)
            tl.store(out_rows, (o / den[:, None]).to(DT), mask=g_ok[:, None])
            tl.atomic_xchg(count_ptr + b * HKV + h, 0)  # ready for the next call (or graph replay)


MAX_KEYS = 128  # cache slots one program may have to walk (its share of S)


def default_splits(b: int, hkv: int, s: int, block_s: int, sms: int) -> int:
    """P: a power of two, at most 64, no more doubling once P blocks cover S; doubled while the
    grid has fewer than two programs per SM or a split would walk more than ``MAX_KEYS``
    slots. A program walks its keys one block after another, so long contexts need many
    splits (with too few, long prompts at batch 8 measured much slower than SDPA)."""
    p = 1
    while p < 64 and p * block_s < s and (b * hkv * p < 2 * sms or -(-s // p) > MAX_KEYS):
        p *= 2
    return p


def fits(b: int, hq: int, hkv: int, d: int, s: int, sms: int) -> bool:
    """Whether the one-launch kernel suits this step (S: the key slots per row,
    ``read_slots``' width): every split walks at most
    ``MAX_KEYS`` slots, in a grid of at most one program per SM (every program recomputes
    the row's q / k prologue, so a larger grid costs more than the launch it saves), and the
    head dim is at least 16 (a tensor-core product's). Against the epilogue launch and
    SDPA, the one launch measured faster with a grid of about one program per SM and
    slower with several per SM (a larger batch, or a long cache)."""
    p = default_splits(b, hkv, s, _block_s(s, d), sms)
    return d >= 16 and -(-s // p) <= MAX_KEYS and b * hkv * p <= sms


def _block_s(s: int, d: int) -> int:
    """Keys per block: a power of two from 16 (a tensor-core product's least) to 128 (64
    above D = 128: K and V blocks of BLOCK_S x D stay 16K values a program), covering S
    where it can."""
    return min(128 if d <= 128 else 64, max(16, triton.next_power_of_2(s)))


def qkv_attention_triton(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos=None, sin=None,
                         qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, scale=None,
                         splits: int | None = None, pdl: bool = True, *, read_slots, positions, sinks=None,
                         other_heads=(0, 0)):
    """Same contract as ``qkv_attention_ref``, in one launch. The mask must leave each row's
    own key visible (``StepContext.paged`` and ``kernels.attention.paged_context`` do) and
    hide every key after it. Under PDL, ``slot``, ``read_slots``, ``positions`` and the pool
    rows of each row's keys before its new one may be read before the wait for the previous
    kernel: no kernel of the same step may write them (the step's slots and positions are
    written by its context launch, which must be complete: a launch without PDL, such as
    the embedding lookup, between it and the first layer makes sure of that).
    ``splits``: P, a power of two (default ``default_splits``). Each row's keys split by its
    own length (``positions``), not by S. ``sinks`` [Hq]: a logit per head in the softmax;
    ``other_heads``: other ranks' q and k heads after v, in the all-heads norm only."""
    b, s = check_qkv_attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, read_slots,
                               positions, qk_norm, other_heads)
    if qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm={qk_norm!r}: expected one of {list(QK_NORMS)}")
    hq, hkv, d = num_heads, num_kv_heads, head_dim
    hq_o, hkv_o = other_heads
    slot, positions = slot.reshape(b).contiguous(), positions.reshape(b)
    if d < 16:
        raise ValueError(f"head_dim {d}: expected at least 16 (the tensor-core products')")
    g = hq // hkv
    g_m = max(16, triton.next_power_of_2(g))  # query heads as the rows of a tensor-core product
    block_s = _block_s(s, d)
    if splits is None:
        sms = torch.cuda.get_device_properties(qkv.device).multi_processor_count if qkv.is_cuda else 4
        splits = default_splits(b, hkv, s, block_s, sms)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits={splits}: expected a power of two")
    # Where P blocks of keys cover S, each program loads its block before the PDL wait.
    pre_kv = splits * block_s >= s
    if not splits * block_s >= s:  # the splits walk their keys in steps: smaller blocks, fewer registers
        block_s = min(block_s, 64)
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    bias, additive = mask_bytes(bias.reshape(b, s))
    rope, rot = rotary_tables(cos, sin, b, d)
    if rope:
        cos, sin = rot
    out = torch.empty(b, hq, d, dtype=qkv.dtype, device=qkv.device)
    n_part = b * hkv * g_m * splits if splits > 1 else 1
    m = torch.empty(n_part, dtype=torch.float32, device=qkv.device)
    l = torch.empty_like(m)
    acc = torch.empty(n_part, d, dtype=torch.float32, device=qkv.device)
    _qkv_attention_kernel[(b, hkv, splits)](
        qkv, q_norm_w if q_norm_w is not None else qkv, k_norm_w if k_norm_w is not None else qkv,
        cos if rope else qkv, sin if rope else qkv, k_cache, v_cache, slot, read_slots, positions, bias,
        sinks if sinks is not None else qkv, out, m, l,
        acc, ticket_counters(qkv.device, b * hkv, "qkv_attention"), float(eps), float(clip or 0.0),
        scale if scale is not None else 1.0 / math.sqrt(d), qkv.stride(0), cos.stride(0) if rope else 0,
        k_cache.stride(1), k_cache.stride(0), v_cache.stride(1), v_cache.stride(0), bias.stride(0),
        read_slots.stride(0), positions.stride(0), HQ=hq, HKV=hkv, HQ_P=triton.next_power_of_2(hq),
        HKV_P=triton.next_power_of_2(hkv), HQ_O=hq_o, HKV_O=hkv_o, HQ_OP=triton.next_power_of_2(max(hq_o, 1)),
        HKV_OP=triton.next_power_of_2(max(hkv_o, 1)), G=g, G_P=triton.next_power_of_2(g), G_M=g_m, D=d,
        R=cos.shape[-1] if rope else d,
        QK_NORM=QK_NORMS[qk_norm], CLIP=clip is not None, ROPE=rope, BLOCK_S=block_s, P=splits,
        P_CHUNK=min(splits, 4), PRE_KV=pre_kv,
        UPCAST=qkv.device.type == "cpu" or qkv.dtype == torch.float32, ADDITIVE=additive, SINKS=sinks is not None,
        num_warps=4 if block_s * d <= 4096 else 8, **pdl_launch(qkv.device, pdl))
    return out
