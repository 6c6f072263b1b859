"""Routing: router logits [T, E] -> the token-to-expert table (DeepSpeed-Inference V-C,
step 1), and with ``route`` also the dropless maps of that table (step 2).

Shape letters: T tokens, E experts, k slots per token.

Backends: a CPU tensor runs the plain-torch reference (``reference.py``); a CUDA tensor
runs the Triton kernels, imported at that first call: ``gating.py`` (top-k and DeepSeek-V3's
grouped top-k, one launch each) and ``route_triton.py`` (gating and maps in one launch at
decode sizes, else the gating launch followed by the maps of ``kernels.layout.maps``; not
``route.py``, whose import would rebind ``kernels.routing.route`` from the op to the module)
and ``cold_triton.py`` (an offloaded layer's split of its pairs, one launch).
"""
from __future__ import annotations

from kernels.layout.reference import row_pair_ref, token_maps_ref
from kernels.routing.reference import check_cold_pairs, cold_pairs_ref, grouped_topk_ref, topk_gating_ref


def topk_gating(logits, k, score="softmax", renormalize=True, *, pdl=True, shared=0):
    """-> expert ids [T, k + shared] int32, weights [T, k + shared] float32 (see
    ``topk_gating_ref``; ``shared`` fixed slots, of ids E.., after the top-k)."""
    if logits.is_cuda:
        from kernels.routing.gating import topk_gating_triton
        return topk_gating_triton(logits, k, score, renormalize, pdl, shared)
    return topk_gating_ref(logits, k, score, renormalize, shared)


def route(logits, k, score="softmax", renormalize=True, *, pdl=True):
    """Gating and dropless maps together (one launch at decode sizes on a GPU):
    -> ids [T, k], weights [T, k], maps = (offsets [E + 1], rows [T, k], row_pair [T * k])."""
    if logits.is_cuda:
        from kernels.routing.route_triton import route_triton
        return route_triton(logits, k, score, renormalize, pdl)
    ids, weights = topk_gating_ref(logits, k, score, renormalize)
    offsets, rows = token_maps_ref(ids, logits.shape[1])
    return ids, weights, (offsets, rows, row_pair_ref(rows))


def grouped_topk(logits, bias, k, n_group, topk_group, score="sigmoid", renormalize=True,
                 routed_scaling_factor=1.0, group_max=False, *, pdl=True, shared=0):
    """DeepSeek-V3's bias-corrected grouped top-k, or V2's group-limited greedy top-k
    (``group_max``; see ``grouped_topk_ref``; ``shared`` as ``topk_gating``'s)."""
    if logits.is_cuda:
        from kernels.routing.gating import grouped_topk_triton
        return grouped_topk_triton(logits, bias, k, n_group, topk_group, score, renormalize, routed_scaling_factor,
                                   pdl, group_max, shared)
    return grouped_topk_ref(logits, bias, k, n_group, topk_group, score, renormalize, routed_scaling_factor,
                            group_max, shared)


def cold_pairs(ids, table, routed, tally, way, first=0, *, pdl=True):
    """An offloaded layer's pairs split by where their experts lie, with its counters
    (``cold_pairs_ref``): ids [T, k] counted from ``first``, table [E] -> (slot [T, k],
    cold [T, k]) int64 and each expert's cold pairs, met [E] int32; one launch on a GPU."""
    check_cold_pairs(ids, table, routed, tally, way)
    if ids.is_cuda:
        from kernels.routing.cold_triton import cold_pairs_triton
        return cold_pairs_triton(ids, table, routed, tally, way, first, pdl)
    return cold_pairs_ref(ids, table, routed, tally, way, first)


__all__ = ["topk_gating", "grouped_topk", "route", "cold_pairs"]
