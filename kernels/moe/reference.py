"""Plain-torch references for the four MoE steps (DeepSpeed-Inference, section V-C).

Shape letters: T tokens, H hidden, E experts, k slots per token, F expert width,
N = T * k rows of the expert-major buffer.

  route     logits [T, E]            -> expert_ids [T, k] int32, weights [T, k] float32
  maps      expert_ids [T, k]        -> offsets [E + 1] int32, rows [T, k] int32
  scatter   x [T, H], rows           -> xs [N, H]   (grouped by expert)
  experts   xs [N, H], offsets       -> ys [N, H]
  gather    ys [N, H], rows, weights -> out [T, H]  (weighted sum over the k slots)

No one-hot tensors: the maps are a histogram and an exclusive prefix scan, and the
scatter / gather are row copies. The fast kernels must match these functions. Beside them:
the gating operands' checks and the int8 weight quantizer, which every device shares.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu")  # silu: SwiGLU, w13 holds gate rows then up rows; gelu: plain
# The gating kernels' limits, checked on every device so that a CPU run refuses what a GPU would.
LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SCORES = ("softmax", "sigmoid")
MAX_EXPERTS = 1024  # a row of scores lives in registers: at most 4 rows a program at E = 1024
MAX_K = 16  # the k rounds are unrolled


def router_scores_ref(logits: torch.Tensor, score: str) -> torch.Tensor:
    """float32 router scores [T, E]: softmax over experts, or an independent sigmoid each."""
    if score == "softmax":
        return logits.float().softmax(dim=-1)
    if score == "sigmoid":
        return logits.float().sigmoid()
    raise ValueError(f"score={score!r}: expected softmax or sigmoid")


def check_logits(logits: torch.Tensor, k: int, score: str) -> None:
    """The gating operands every device takes (ValueError naming the one that is not)."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [T, E], got shape {list(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"logits: expected one of {LOGIT_DTYPES}, got {logits.dtype}")
    e = logits.shape[1]
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"logits: expected 1 <= E <= {MAX_EXPERTS} experts, got E={e}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(e, MAX_K):
        raise ValueError(f"k={k!r}: expected an int with 1 <= k <= min(E={e}, {MAX_K})")
    if score not in SCORES:
        raise ValueError(f"score={score!r}: expected one of {SCORES}")


def topk_gating_ref(logits: torch.Tensor, k: int, score: str = "softmax",
                    renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the router scores: ids [T, k] int32 and weights [T, k] float32."""
    scores = router_scores_ref(logits, score)  # [T, E]
    weights, ids = torch.topk(scores, k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def grouped_topk_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
                     topk_group: int, score: str = "sigmoid", renormalize: bool = True,
                     routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: ids [T, k] int32 and weights [T, k] float32.

    ``choice = scores + bias`` picks the experts (the bias is the e_score_correction_bias); the
    E experts form ``n_group`` contiguous groups, a group's score is the sum of its two best
    choices (its only one for groups of one expert), and only the ``topk_group`` best groups
    stay eligible. ids are in descending choice order; the weights are the unbiased scores at
    those ids, renormalised if asked, then multiplied by ``routed_scaling_factor``.
    """
    scores = router_scores_ref(logits, score)  # [T, E]
    t, e = scores.shape
    if e % n_group:
        raise ValueError(f"n_group={n_group}: expected a divisor of E={e}")
    choice = (scores + bias.float()).view(t, n_group, e // n_group)  # [T, G, E / G]
    group_score = choice.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)  # [T, G]
    kept = group_score.topk(topk_group, dim=-1).indices  # [T, topk_group]
    dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, kept, False)
    # -inf, not 0 as in some ports: a negative bias can push a kept expert's choice below 0.
    choice = choice.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(t, e)
    ids = torch.topk(choice, k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights * routed_scaling_factor


def token_maps_ref(expert_ids: torch.Tensor, num_experts: int,
                   capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-major layout: ``offsets [E + 1]`` (exclusive scan of per-expert counts) and
    ``rows [T, k]``, the buffer row of each (token, slot); -1 where capacity dropped it.

    Within an expert, rows keep token order (slot order breaks ties), as a stable sort would.
    """
    flat = expert_ids.reshape(-1).long()  # [N]
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    offsets = F.pad(torch.cumsum(counts, 0), (1, 0))  # [E + 1]
    order = torch.argsort(flat, stable=True)  # buffer row -> flat index
    sorted_pos = torch.empty_like(order)
    sorted_pos[order] = torch.arange(n, device=flat.device)  # flat index -> buffer row
    if capacity is None:
        rows = sorted_pos
    else:
        rank = sorted_pos - offsets[flat]  # position of this pair inside its expert
        counts = counts.clamp(max=capacity)
        offsets = F.pad(torch.cumsum(counts, 0), (1, 0))
        rows = torch.where(rank < capacity, offsets[flat] + rank, torch.full_like(rank, -1))
    return offsets.to(torch.int32), rows.view(expert_ids.shape).to(torch.int32)


def row_pair_ref(rows: torch.Tensor) -> torch.Tensor:
    """The inverse map: the (token, slot) pair held by each buffer row ([T * k]; rows no
    pair maps to hold -1)."""
    flat = rows.reshape(-1).long()
    keep = flat >= 0
    row_pair = torch.full_like(flat, -1)
    row_pair[flat[keep]] = torch.arange(flat.numel(), device=rows.device)[keep]
    return row_pair.to(torch.int32)


def scatter_rows_ref(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copies token t's hidden state to buffer row rows[t, j] for every slot j.

    The buffer (``out`` when given) has T * k rows; rows past ``offsets[E]`` (dropped pairs)
    stay zero in a new buffer and untouched in ``out``."""
    t, k = rows.shape
    xs = x.new_zeros(t * k, x.shape[1]) if out is None else out  # [N, H]
    flat = rows.reshape(-1).long()
    keep = flat >= 0
    token = torch.arange(t, device=x.device).repeat_interleave(k)  # [N]
    xs[flat[keep]] = x[token[keep]]
    return xs


TAG_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # the integer a row's tag column is read as


def dispatch_rows_ref(x: torch.Tensor, rows: torch.Tensor, expert_ids: torch.Tensor, experts_per_rank: int,
                      out: torch.Tensor) -> torch.Tensor:
    """The send buffer of an expert-parallel all-to-all: x [T, H] copied to rows ``rows``
    [T, k * es] of ``out`` [N, H + pad] (es rows per pair), and in column H of each written
    row, read as an integer of the element's width, the pair's local expert
    ``expert_ids % experts_per_rank``."""
    t, units = rows.shape
    h = x.shape[1]
    scatter_rows_ref(x, rows, out=out[:, :h])
    local = (expert_ids % experts_per_rank).repeat_interleave(units // expert_ids.shape[1], dim=1)
    flat = rows.reshape(-1).long()
    keep = flat >= 0
    ints = TAG_INTS[out.element_size()]
    out.view(ints)[flat[keep], h] = local.reshape(-1)[keep].to(ints)
    return out


def gather_rows_ref(ys: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                    limit: int | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * ys[rows[t, j]], accumulated in float32; a row of -1,
    or at or past ``limit`` (rows not sent, so not in ys), adds nothing (ys may then have
    no rows at all)."""
    if not ys.shape[0]:
        return ys.new_zeros(rows.shape[0], ys.shape[1])
    flat = rows.long()
    if limit is not None:
        flat = torch.where(flat < limit, flat, -1)
    picked = ys[flat.clamp(min=0)].float()  # [T, k, H]
    w = torch.where(flat >= 0, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    return (picked * w.unsqueeze(-1)).sum(dim=1).to(ys.dtype)


def expert_ffn_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   activation: str = "silu") -> torch.Tensor:
    """One expert: x [n, H], w13 [2F or F, H], w2 [H, F] -> [n, H]."""
    h = x @ w13.t()
    if activation == "silu":
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    elif activation == "gelu":
        h = F.gelu(h)
    else:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    return h @ w2.t()


def grouped_ffn_ref(xs: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Grouped expert FFN over the expert-major buffer; only experts with rows run."""
    ys = torch.zeros_like(xs)  # [N, H]
    bounds = offsets.tolist()  # a host sync: fine for the reference
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            ys[lo:hi] = expert_ffn_ref(xs[lo:hi], w13[e], w2[e], activation)
    return ys


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int8 [E, N, K] with per-channel scales [E, N] -> ``dtype``; other weights pass through."""
    if scale is None:
        return q
    return (q.float() * scale.float()[..., None]).to(dtype)


def quantize_int8(w: torch.Tensor, max_elements: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8 with per-output-channel scales: w [E, N, K] -> (q int8, scale f32 [E, N]).

    Symmetric: scale = max|w| / 127 per row, q = round(w / scale). Done in blocks of rows
    of at most ``max_elements`` weights, in place on one float32 copy of the block, so the
    temporaries stay small beside a large model's weights (one Mixtral expert alone holds
    117M weights in w13)."""
    if w.dim() != 3:
        raise ValueError(f"w: expected expert weights [E, N, K], got shape {list(w.shape)}")
    e, n, k = w.shape
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(e, n, dtype=torch.float32, device=w.device)
    rows_w, rows_q, rows_s = w.contiguous().view(e * n, k), q.view(e * n, k), scale.view(e * n)
    step = max(1, max_elements // max(k, 1))
    for lo in range(0, e * n, step):
        wf = rows_w[lo:lo + step].to(torch.float32, copy=True)  # a copy even from float32: worked in place
        s = torch.linalg.vector_norm(wf, ord=float("inf"), dim=-1).clamp_(min=1e-12).div_(127.0)
        rows_q[lo:lo + step] = wf.div_(s[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        rows_s[lo:lo + step] = s
    return q, scale


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu", w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, capacity: int | None = None) -> torch.Tensor:
    """The single-device expert computation: maps, scatter, grouped FFN, gather."""
    w13, w2 = dequantize_ref(w13, w13_scale, x.dtype), dequantize_ref(w2, w2_scale, x.dtype)
    offsets, rows = token_maps_ref(topk_ids, w13.shape[0], capacity)
    xs = scatter_rows_ref(x, rows)
    ys = grouped_ffn_ref(xs, offsets, w13, w2, activation)
    return gather_rows_ref(ys, rows, topk_weights)
