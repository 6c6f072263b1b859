"""Plain-torch references for RMSNorm, alone and as the MoE layer's entry (the norm, the
residual add before it and the router GEMM). The Triton kernels (``kernels.norm.triton``)
must match these functions, and they are what ``kernels.rms_norm`` /
``kernels.rms_norm_router`` run on a CPU.

Shape letters: T tokens, H features, E experts, k slots per token.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.routing.reference import topk_gating_ref


class RouterEntry(NamedTuple):
    """What the MoE layer's entry gives back, with or without the gating in it."""

    h: torch.Tensor  # norm(x + residual) [T, H]
    summed: torch.Tensor  # x + residual [T, H], the new residual stream
    logits: torch.Tensor  # h @ router_w.T [T, E], in the input dtype
    ids: torch.Tensor | None = None  # [T, k] int32, with gating
    weights: torch.Tensor | None = None  # [T, k] float32, with gating


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """norm(x) [.., H], or with ``residual``: (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed  # cast before scaling: the Llama-family order
    return (out, x) if residual is not None else out


def rms_norm_router_ref(x, residual, norm_w, eps, router_w, gating: tuple | None = None) -> RouterEntry:
    """x, residual [T, H]; router_w [E, H] -> RouterEntry: h = norm(x + residual), x +
    residual, the router logits; with ``gating`` (k, score, renormalize) also the top-k
    table of those logits (``topk_gating_ref``), else ids and weights None."""
    h, summed = rms_norm_ref(x, norm_w, eps, residual)
    logits = h @ router_w.t()
    return RouterEntry(h, summed, logits, *(topk_gating_ref(logits, *gating) if gating is not None else ()))
