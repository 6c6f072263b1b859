"""Plain-torch references for routing (DeepSpeed-Inference V-C, step 1): router logits ->
the token-to-expert table. The gating kernels (``kernels.routing.gating``) must match these
functions, and they are what ``kernels.topk_gating`` / ``kernels.grouped_topk`` run on a
CPU. Beside them: the gating operands' checks, which every device shares.

Shape letters: T tokens, E experts, k slots per token, G expert groups.

  topk_gating   logits [T, E]           -> expert_ids [T, k] int32, weights [T, k] float32
  grouped_topk  logits [T, E], bias [E] -> expert_ids [T, k] int32, weights [T, k] float32

Both take ``shared`` = n: the table gets n more slots a token, ids E .. E + n - 1 with weight
1, after the top-k: shared experts held as experts after the routed ones, so that one pass of
the fused MoE kernels runs both (``MoELayer.fold_shared``).
"""
from __future__ import annotations

import torch

from kernels.moe.reference import here_or_past

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


def check_shared(shared: int) -> None:
    """The number of fixed shared slots a table takes (ValueError unless a small int >= 0)."""
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared <= MAX_K:
        raise ValueError(f"shared={shared!r}: expected an int with 0 <= shared <= {MAX_K}")


def with_shared_ref(ids: torch.Tensor, weights: torch.Tensor, e: int, shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k table [T, k] of E experts -> [T, k + shared]: slots of ids E, E + 1, ... and
    weight 1 appended to every row."""
    check_shared(shared)
    if not shared:
        return ids, weights
    t = ids.shape[0]
    fixed = torch.arange(e, e + shared, dtype=ids.dtype, device=ids.device).expand(t, shared)
    return torch.cat([ids, fixed], dim=1), torch.cat([weights, weights.new_ones(t, shared)], dim=1)


def topk_gating_ref(logits: torch.Tensor, k: int, score: str = "softmax",
                    renormalize: bool = True, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the router scores: ids [T, k] int32 and weights [T, k] float32 (each with
    ``shared`` fixed slots after them)."""
    scores = router_scores_ref(logits, score)  # [T, E]
    weights, ids = torch.topk(scores, k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return with_shared_ref(ids.to(torch.int32), weights, logits.shape[1], shared)


def grouped_topk_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
                     topk_group: int, score: str = "sigmoid", renormalize: bool = True,
                     routed_scaling_factor: float = 1.0, group_max: bool = False,
                     shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: ids [T, k] int32 and weights [T, k] float32 (each with
    ``shared`` fixed slots after them).

    ``choice = scores + bias`` picks the experts (the bias is the e_score_correction_bias); the
    E experts form ``n_group`` contiguous groups, a group's score is the sum of its two best
    choices (its only one for groups of one expert; ``group_max``: its best alone, DeepSeek-V2's
    group-limited greedy routing), and only the ``topk_group`` best groups
    stay eligible. ids are in descending choice order; the weights are the unbiased scores at
    those ids, renormalised if asked, then multiplied by ``routed_scaling_factor``.
    """
    scores = router_scores_ref(logits, score)  # [T, E]
    t, e = scores.shape
    if e % n_group:
        raise ValueError(f"n_group={n_group}: expected a divisor of E={e}")
    choice = (scores + bias.float()).view(t, n_group, e // n_group)  # [T, G, E / G]
    best = 1 if group_max else min(2, e // n_group)
    group_score = choice.topk(best, dim=-1).values.sum(dim=-1)  # [T, G]
    kept = group_score.topk(topk_group, dim=-1).indices  # [T, topk_group]
    dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, kept, False)
    # -inf, not 0 as in some ports: a negative bias can push a kept expert's choice below 0.
    choice = choice.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(t, e)
    ids = torch.topk(choice, k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return with_shared_ref(ids.to(torch.int32), weights * routed_scaling_factor, e, shared)


def cold_pairs_ref(ids: torch.Tensor, table: torch.Tensor, routed: torch.Tensor, tally: torch.Tensor,
                   way: int | None, first: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An offloaded layer's pairs split by where their experts lie, and its counters: ids
    [T, k] (int32 or int64) counted from ``first`` over the E experts of table [E] int64
    (each one's device slot, -1 where it lies in host memory) -> (slot [T, k] int64: each
    pair's device slot, -1 where its expert is in host memory, -2 where it is not among the
    E; cold [T, k] int64: the expert's index among the E where it is in host memory, else
    -1; met [E] int32: each expert's cold pairs). Adds the pairs of the E to ``routed`` [E]
    float32 (by expert) and to ``tally`` [>= 3] float64: those pairs, the cold ones, the
    cold experts the call met, and 1 at index ``way`` (None: none) where it met any
    (``moe_infer.offload.STATS``)."""
    e = table.numel()
    local = here_or_past(ids.long(), first, e)
    here = local < e
    index = torch.where(here, local, 0)
    slot = torch.where(here, table[index], -2)
    cold = slot == -1
    routed.index_add_(0, index.flatten(), here.flatten().to(routed.dtype))
    met = torch.bincount(local[cold], minlength=e).to(torch.int32)
    n = int(cold.sum())
    tally[0] += int(here.sum())
    tally[1] += n
    tally[2] += int((met > 0).sum())
    if way is not None:
        tally[way] += n > 0
    return slot, torch.where(cold, local, -1), met


def check_cold_pairs(ids, table, routed, tally, way: int | None) -> None:
    """``cold_pairs``' operands as every device takes them; ValueError naming them."""
    if ids.dtype not in (torch.int32, torch.int64) or table.dtype != torch.int64 or table.dim() != 1:
        raise ValueError(f"ids {ids.dtype}, table {table.dtype} {list(table.shape)}: expected int32 or int64 ids "
                         "and an int64 table [E]")
    if routed.shape != table.shape or routed.dtype != torch.float32 or tally.dtype != torch.float64 \
            or not (way is None or 3 <= way < tally.numel()) or not routed.is_contiguous() \
            or not tally.is_contiguous():
        raise ValueError(f"routed {routed.dtype} {list(routed.shape)}, tally {tally.dtype} {list(tally.shape)}, "
                         f"way {way}: expected float32 [E] and float64 counters with 3 <= way < their number "
                         "(or no way)")
