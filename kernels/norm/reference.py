"""Plain-torch references for RMSNorm, alone and as the MoE layer's entry (the norm, the
residual add before it and the router GEMM). The Triton kernels (``kernels.norm.triton``)
must match these functions, and they are what ``kernels.rms_norm`` /
``kernels.rms_norm_router`` run on a CPU.

Shape letters: T tokens, H features, E experts, k slots per token.
"""
from __future__ import annotations

import torch

from kernels.routing.reference import topk_gating_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """norm(x) [.., H], or with ``residual``: (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed  # cast before scaling: the Llama-family order
    return (out, x) if residual is not None else out


def rms_norm_router_ref(x, residual, norm_w, eps, router_w, gating: tuple | None = None):
    """x, residual [T, H]; router_w [E, H] -> (h = norm(x + residual) [T, H], x + residual,
    router logits h @ router_w.T [T, E] in the input dtype); with ``gating`` (k, score,
    renormalize) also the top-k table of those logits (``topk_gating_ref``)."""
    h, summed = rms_norm_ref(x, norm_w, eps, residual)
    logits = h @ router_w.t()
    return (h, summed, logits) if gating is None else (h, summed, logits, *topk_gating_ref(logits, *gating))
