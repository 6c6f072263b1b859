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

from kernels.norm.reference import rms_norm_ref, rms_norm_router_ref

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


__all__ = ["rms_norm", "rms_norm_router"]
