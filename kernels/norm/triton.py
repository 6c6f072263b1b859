"""RMSNorm in one launch, with the residual add fused in front of it.

Shape letters: R rows (every leading dimension flattened), H features.

The decode step's norms are latency-bound: a handful of rows, each a few KB. Written as
torch ops an RMSNorm is about eight kernels (cast, square, mean, add, rsqrt, two products,
cast back), plus one more for the residual add before it; here it is one. The arithmetic
follows the reference models: statistics in float32, the normalised value rounded to the
input dtype before the scale multiplies it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm import ROUTER_MAX_ROWS
from kernels.norm.reference import RouterEntry, rms_norm_ref, rms_norm_router_ref
from kernels.routing.gating import _check_logits_once, _outputs, _topk_table
from kernels.pdl import pdl_enter, pdl_launch, ticket_counters

MAX_FEATURES = 32768  # one program holds a whole row in registers up to this width


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
                     stride_x, stride_res, stride_out, stride_sum,
                     BLOCK_H: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:  # s = x + residual, rounded to the stream's dtype as torch's add rounds it
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, name: str, h: int) -> torch.Tensor:
    if t.shape[-1] != h:
        raise ValueError(f"{name} {list(t.shape)}: expected the last dimension to be {h}")
    t = t.reshape(-1, h)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    pdl: bool = True):
    """Same contract as ``rms_norm_ref``; one launch, one program per row."""
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight {list(weight.shape)}: expected [{h}] to match x {list(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {list(residual.shape)}: expected x's shape {list(x.shape)}")
    if h > MAX_FEATURES:
        return rms_norm_ref(x, weight, eps, residual)
    x2 = _rows(x, "x", h)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    r2 = _rows(residual, "residual", h) if residual is not None else x2
    s2 = summed.view(-1, h) if summed is not None else out.view(-1, h)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(rows,)](x2, r2, weight, out.view(-1, h), s2, h, eps, x2.stride(0), r2.stride(0),
                                  h, h, BLOCK_H=block, HAS_RES=residual is not None,
                                  num_warps=max(1, min(16, block // 512)), **pdl_launch(x2.device, pdl))
    return (out, summed) if residual is not None else out


@triton.jit
def _normed_rows(s, rstd, nw, pid, sum_ptr, h_ptr, rows, ks, m, H, DT: tl.constexpr):
    """h = norm(s) * weight for columns ks of the rows (s = x + residual, in DT); the
    programs of the first expert block (``pid`` 0) also store s and h there."""
    h = ((s.to(tl.float32) * rstd[:, None]).to(DT).to(tl.float32) * nw[None, :]).to(DT)
    if pid == 0:
        tl.store(sum_ptr + rows[:, None] * H + ks[None, :], s, mask=m)
        tl.store(h_ptr + rows[:, None] * H + ks[None, :], h, mask=m)
    return h


@triton.jit
def _rms_norm_router_kernel(x_ptr, res_ptr, nw_ptr, rw_ptr, h_ptr, sum_ptr, logits_ptr, T, H, E, eps,
                            stride_x, stride_res, stride_rw,
                            ids_ptr, weights_ptr, count_ptr,  # top-k outputs [T, K] and the ticket (K > 0)
                            BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                            K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
                            E_ALL: tl.constexpr, BLOCK_K: tl.constexpr, ONE: tl.constexpr, BT_ALL: tl.constexpr,
                            PDL: tl.constexpr):
    """Program (p, r): logits of experts p*BE .. for rows r*BT ..; programs (0, r) also write
    their rows' h and sum. Products are summed in float32 on the CUDA cores ([BT, BE, BK] per
    step): a decode step has too few rows for the tensor cores to pay, and each program's
    weights are a few KB. ONE: one step covers H (BK >= H); the norm and router weights are
    then loaded before the PDL wait, so their DRAM round trip overlaps the kernel before.
    Rows are split over programs so that one step does cover H: a program walking H in
    steps, twice (the norm, then the products), waits on each step's loads in turn. With
    K > 0 each program then takes a ticket, and the last one computes the top-k table of
    every row (BT_ALL: the rows, padded) from every program's (rounded) logits, as
    ``kernels.topk_gating`` would, and resets the counter: the MoE layer's gating without a
    launch of its own."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BT + tl.arange(0, BT)
    row_ok = rows < T
    experts = pid * BE + tl.arange(0, BE)
    e_ok = experts < E
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if ONE:  # the weights (no kernel's output) are loaded before the wait
        ks = tl.arange(0, BK)
        m = row_ok[:, None] & (ks < H)[None, :]
        nw = tl.load(nw_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)
        w = tl.load(rw_ptr + experts[:, None] * stride_rw + ks[None, :], mask=e_ok[:, None] & (ks < H)[None, :],
                    other=0.0).to(tl.float32)  # [BE, BK]
        pdl_enter(PDL)
        s = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=m, other=0.0).to(tl.float32)
        s += tl.load(res_ptr + rows[:, None] * stride_res + ks[None, :], mask=m, other=0.0).to(tl.float32)
        s = s.to(DT)
        sf = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=1) / H + eps)
        h = _normed_rows(s, rstd, nw, pid, sum_ptr, h_ptr, rows, ks, m, H, DT)
        acc = tl.sum(h.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    else:
        pdl_enter(PDL)
        ss = tl.zeros([BT], tl.float32)
        for k0 in range(0, H, BK):  # pass 1: each row's mean square of x + residual
            ks = k0 + tl.arange(0, BK)
            m = row_ok[:, None] & (ks < H)[None, :]
            s = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=m, other=0.0).to(tl.float32)
            s += tl.load(res_ptr + rows[:, None] * stride_res + ks[None, :], mask=m, other=0.0).to(tl.float32)
            s = s.to(DT).to(tl.float32)
            ss += tl.sum(s * s, axis=1)
        rstd = 1.0 / tl.sqrt(ss / H + eps)
        acc = tl.zeros([BT, BE], tl.float32)
        for k0 in range(0, H, BK):  # pass 2: normalise, scale, and multiply by the router rows
            ks = k0 + tl.arange(0, BK)
            m = row_ok[:, None] & (ks < H)[None, :]
            s = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=m, other=0.0).to(tl.float32)
            s += tl.load(res_ptr + rows[:, None] * stride_res + ks[None, :], mask=m, other=0.0).to(tl.float32)
            s = s.to(DT)
            nw = tl.load(nw_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)
            h = _normed_rows(s, rstd, nw, pid, sum_ptr, h_ptr, rows, ks, m, H, DT)
            w = tl.load(rw_ptr + experts[:, None] * stride_rw + ks[None, :], mask=e_ok[:, None] & (ks < H)[None, :],
                        other=0.0).to(tl.float32)  # [BE, BK]
            acc += tl.sum(h.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    tl.store(logits_ptr + rows[:, None] * E + experts[None, :], acc.to(DT), mask=row_ok[:, None] & e_ok[None, :])
    if K > 0:
        tl.debug_barrier()  # every thread's logits are written before the ticket is taken
        ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program: the top-k of all
            every = tl.arange(0, BT_ALL)
            top_ids, top_w = _topk_table(logits_ptr, every, every < T, E, E, 1, K, SOFTMAX, RENORMALIZE, E_ALL,
                                         BLOCK_K, True)
            slots = tl.arange(0, BLOCK_K)
            out = every[:, None] * K + slots[None, :]
            out_ok = (every < T)[:, None] & (slots[None, :] < K)
            tl.store(ids_ptr + out, top_ids, mask=out_ok)
            tl.store(weights_ptr + out, top_w, mask=out_ok)
            tl.atomic_xchg(count_ptr, 0)  # ready for the next call (or graph replay)


def _router_blocks(t: int, h: int, e: int) -> tuple[int, int, int]:
    """(BT, BE, BK): up to 4 experts a program, fewer when that leaves under 16 programs
    (Mixtral's 8 experts: one each); the rows (padded to a power of two) a program takes,
    as many as keep one K step over H within a [BT, BE, BK] product of 8K values (at least
    one); a K step that keeps the product at 8K values."""
    be = max(1, min(4, triton.next_power_of_2(e) // 16))
    bt = min(triton.next_power_of_2(max(t, 1)), max(1, 8192 // (be * triton.next_power_of_2(h))))
    bk = max(32, min(triton.next_power_of_2(h), 8192 // (bt * be)))
    return bt, be, bk


def rms_norm_router_triton(x, residual, norm_w, eps, router_w, gating: tuple | None = None, pdl: bool = True):
    """Same contract as ``rms_norm_router_ref`` for T <= 16 rows in one launch: the MoE
    layer's norm (with the residual add) and its router GEMM, which for a decode step is a
    few hundred KB of weights, too little for cuBLAS to spread over the SMs. ``gating``
    (k, score, renormalize): the top-k table of the logits too, from the same launch
    (-> RouterEntry)."""
    t, h = x.shape
    e = router_w.shape[0]
    if residual.shape != x.shape or tuple(norm_w.shape) != (h,) or router_w.shape[1] != h:
        raise ValueError(f"x {list(x.shape)}, residual {list(residual.shape)}, norm weight {list(norm_w.shape)}, "
                         f"router weight {list(router_w.shape)}: expected [T, H], [T, H], [H], [E, H]")
    k, score, renormalize = gating if gating is not None else (0, "softmax", False)
    if gating is not None:
        _check_logits_once(router_w[:, :1].t(), k, score)  # a [1, E] view: E, k and score as the gating checks them
    if t > ROUTER_MAX_ROWS or t == 0:
        return rms_norm_router_ref(x, residual, norm_w, eps, router_w, gating)
    x, residual = x.contiguous(), residual.contiguous()
    out_h = torch.empty_like(x)
    summed = torch.empty_like(x)
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
    ids = weights = logits  # K = 0: the top-k outputs are never written
    if gating is not None:
        ids, weights = _outputs(t, k, x.device)
    bt, be, bk = _router_blocks(t, h, e)
    # ONE: where one K step covers H, the router weights load before the PDL wait.
    _rms_norm_router_kernel[(triton.cdiv(e, be), triton.cdiv(t, bt))](
        x, residual, norm_w, router_w, out_h, summed, logits, t, h, e, eps, x.stride(0), residual.stride(0),
        router_w.stride(0), ids, weights, ticket_counters(x.device, 1, "rms_norm_router"),
        BT=bt, BE=be, BK=bk, K=k, SOFTMAX=score == "softmax", RENORMALIZE=bool(renormalize),
        E_ALL=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(max(k, 1)), ONE=bk >= h,
        BT_ALL=triton.next_power_of_2(t), num_warps=4,
        **pdl_launch(x.device, pdl))
    return RouterEntry(out_h, summed, logits, *((ids, weights) if gating is not None else ()))


QK_BLOCK = 1024  # columns a program handles at a time in the q / k norm kernels


@triton.jit
def _qk_sum_squares_kernel(x_ptr, out_ptr, QW, KW, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    acc_q = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, QW, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(base + cols, mask=cols < QW, other=0.0).to(tl.float32)
        acc_q += v * v
    acc_k = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, KW, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(base + QW + cols, mask=cols < KW, other=0.0).to(tl.float32)
        acc_k += v * v
    tl.store(out_ptr + row * 2, tl.sum(acc_q, axis=0))
    tl.store(out_ptr + row * 2 + 1, tl.sum(acc_k, axis=0))


@triton.jit
def _scale_part(base, w_ptr, width, rstd, BLOCK: tl.constexpr):
    """base[0:width] = w * round(base * rstd), in place."""
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < width
        x = tl.load(base + cols, mask=m, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(base.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(base + cols, (normed * w).to(base.dtype.element_ty), mask=m)


@triton.jit
def _qk_norm_apply_kernel(x_ptr, sq_ptr, qw_ptr, kw_ptr, QW, KW, stride_x, q_count, k_count, eps,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    rq = 1.0 / tl.sqrt(tl.load(sq_ptr + row * 2) / q_count + eps)
    rk = 1.0 / tl.sqrt(tl.load(sq_ptr + row * 2 + 1) / k_count + eps)
    _scale_part(base, qw_ptr, QW, rq, BLOCK)
    _scale_part(base + QW, kw_ptr, KW, rk, BLOCK)


def _qkv_rows(qkv: torch.Tensor, need: int) -> torch.Tensor:
    if qkv.shape[-1] < need:
        raise ValueError(f"qkv {list(qkv.shape)}: expected at least {need} columns (q and k)")
    if qkv.stride(-1) != 1 or not qkv.view(-1, qkv.shape[-1]).is_contiguous():
        raise ValueError(f"qkv {list(qkv.shape)}: expected rows laid out back to back")
    return qkv.view(-1, qkv.shape[-1])


def qk_sum_squares_triton(qkv: torch.Tensor, q_width: int, k_width: int, pdl: bool = True) -> torch.Tensor:
    """Same contract as ``qk_sum_squares_ref``; one launch, one program per row."""
    x2 = _qkv_rows(qkv, q_width + k_width)
    out = torch.empty(*qkv.shape[:-1], 2, dtype=torch.float32, device=qkv.device)
    if x2.shape[0]:
        _qk_sum_squares_kernel[(x2.shape[0],)](x2, out, q_width, k_width, x2.stride(0), BLOCK=QK_BLOCK,
                                               num_warps=4, **pdl_launch(x2.device, pdl))
    return out


def qk_norm_apply_triton(qkv: torch.Tensor, sq: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         q_count: float, k_count: float, eps: float, pdl: bool = True) -> torch.Tensor:
    """Same contract as ``qk_norm_apply_ref`` (in place); one launch, one program per row."""
    qw, kw = q_weight.shape[0], k_weight.shape[0]
    x2 = _qkv_rows(qkv, qw + kw)
    if sq.shape != (*qkv.shape[:-1], 2) or sq.dtype != torch.float32:
        raise ValueError(f"sq {list(sq.shape)} {sq.dtype}: expected float32 {[*qkv.shape[:-1], 2]}")
    if x2.shape[0]:
        _qk_norm_apply_kernel[(x2.shape[0],)](x2, sq.contiguous(), q_weight, k_weight, qw, kw, x2.stride(0),
                                              float(q_count), float(k_count), eps, BLOCK=QK_BLOCK, num_warps=4,
                                              **pdl_launch(x2.device, pdl))
    return qkv
