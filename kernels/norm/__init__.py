"""RMSNorm over the last dimension, with the residual add in front fused in, and the MoE
layer's entry (the add, the norm and the router GEMM, optionally the top-k gating too) in
one launch.

Shape letters: T tokens (rows), H features, E experts, k slots per token.

Backends: a CPU tensor runs the plain-torch reference (``reference.py``); a CUDA tensor
runs the Triton kernels of ``triton.py``, imported at that first call. ``rms_norm_router``
takes its one launch for at most ``ROUTER_MAX_ROWS`` rows (decode steps) and the
reference's torch ops past that.
"""
from __future__ import annotations

from kernels.norm.reference import qk_norm_apply_ref, qk_sum_squares_ref, rms_norm_ref, rms_norm_router_ref

ROUTER_MAX_ROWS = 16  # the fused norm + router launch is for decode steps


def rms_norm(x, weight, eps, residual=None, *, pdl=True):
    """RMSNorm over the last dimension in one launch on a GPU; with ``residual`` the add
    before it is fused too: -> norm(x + residual), x + residual."""
    if x.is_cuda:
        from kernels.norm.triton import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual, pdl)
    return rms_norm_ref(x, weight, eps, residual)


def rms_norm_router(x, residual, norm_w, eps, router_w, gating=None, *, pdl=True):
    """The MoE layer's entry in one launch on a GPU (T <= 16 rows): h = RMSNorm(x + residual),
    the new residual stream x + residual, and the router logits h @ router_w.T. ``gating``
    (k, score, renormalize): also the top-k table of those logits (as ``topk_gating``),
    ids [T, k] and weights [T, k], from the same launch."""
    if x.is_cuda:
        from kernels.norm.triton import rms_norm_router_triton
        return rms_norm_router_triton(x, residual, norm_w, eps, router_w, gating, pdl)
    return rms_norm_router_ref(x, residual, norm_w, eps, router_w, gating)


def qk_sum_squares(qkv, q_width, k_width, *, pdl=True):
    """The float32 sums of squares of each row's q (its first q_width columns) and k (the
    next k_width) [.., 2] in one launch on a GPU: what an RMSNorm over q or k heads split
    across tensor-parallel ranks all-reduces (both in one collective)."""
    if qkv.is_cuda:
        from kernels.norm.triton import qk_sum_squares_triton
        return qk_sum_squares_triton(qkv, q_width, k_width, pdl)
    return qk_sum_squares_ref(qkv, q_width, k_width)


def qk_norm_apply(qkv, sq, q_weight, k_weight, q_count, k_count, eps, *, pdl=True):
    """q and k of qkv normed in place from their summed squares ``sq`` [.., 2] (mean square:
    sum / count) and scaled by this rank's weights, in one launch on a GPU -> qkv."""
    if qkv.is_cuda:
        from kernels.norm.triton import qk_norm_apply_triton
        return qk_norm_apply_triton(qkv, sq, q_weight, k_weight, q_count, k_count, eps, pdl)
    return qk_norm_apply_ref(qkv, sq, q_weight, k_weight, q_count, k_count, eps)


__all__ = ["qk_norm_apply", "qk_sum_squares", "rms_norm", "rms_norm_router"]
