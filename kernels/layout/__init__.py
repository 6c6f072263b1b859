"""Layout: moving rows between token order and the expert-major buffer (DeepSpeed-Inference
V-C, steps 2, 3 and the inverse of 3), as row copies driven by maps, never one-hot einsums.

Shape letters: T tokens, H hidden, E experts, k slots per token, N = T * k buffer rows.

  token_maps     expert_ids [T, k]              -> offsets [E + 1], rows [T, k]
  scatter_rows   x [T, H], rows                 -> xs [N, H] (grouped by expert)
  gather_rows    ys [N, H], rows, weights       -> out [T, H] (weighted sum over the k slots)
  dispatch_rows  x, rows, expert_ids, out       -> the expert-parallel send buffer, tagged

Backends: a CPU tensor runs the plain-torch reference (``reference.py``); a CUDA tensor
runs the Triton kernels, imported at that first call: ``maps.py`` (the maps) and
``rows.py`` (the row copies).
"""
from __future__ import annotations

from kernels.layout.reference import dispatch_rows_ref, gather_rows_ref, scatter_rows_ref, token_maps_ref


def token_maps(expert_ids, num_experts, capacity=None, *, pdl=True):
    """-> offsets [E + 1], rows [T, k] (see ``token_maps_ref``)."""
    if expert_ids.is_cuda:
        from kernels.layout.maps import token_maps_triton
        return token_maps_triton(expert_ids, num_experts, capacity, pdl)[:2]
    return token_maps_ref(expert_ids, num_experts, capacity)


def scatter_rows(x, rows, out=None, *, pdl=True):
    if x.is_cuda:
        from kernels.layout.rows import scatter_rows_triton
        return scatter_rows_triton(x, rows, out, pdl)
    return scatter_rows_ref(x, rows, out)


def gather_rows(ys, rows, weights, limit=None, *, pdl=True):
    if ys.is_cuda:
        from kernels.layout.rows import gather_rows_triton
        return gather_rows_triton(ys, rows, weights, limit, pdl)
    return gather_rows_ref(ys, rows, weights, limit)


def dispatch_rows(x, rows, expert_ids, experts_per_rank, out, *, pdl=True):
    """The expert-parallel send buffer, each row tagged with its local expert (see
    ``dispatch_rows_ref``)."""
    if x.is_cuda:
        from kernels.layout.rows import dispatch_rows_triton
        return dispatch_rows_triton(x, rows, expert_ids, experts_per_rank, out, pdl)
    return dispatch_rows_ref(x, rows, expert_ids, experts_per_rank, out)


__all__ = ["token_maps", "scatter_rows", "gather_rows", "dispatch_rows"]
