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


def qk_sum_squares_ref(qkv: torch.Tensor, q_width: int, k_width: int) -> torch.Tensor:
    """qkv [.., W] (q's q_width columns, then k's k_width, then the rest) -> the float32
    sums of squares of each row's q and of its k [.., 2]."""
    q, k = qkv[..., :q_width].float(), qkv[..., q_width:q_width + k_width].float()
    return torch.stack((q.pow(2).sum(-1), k.pow(2).sum(-1)), dim=-1)


def qk_norm_apply_ref(qkv: torch.Tensor, sq: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      q_count: float, k_count: float, eps: float) -> torch.Tensor:
    """q and k of qkv [.., W] (widths those of ``q_weight`` and ``k_weight``) through RMSNorms
    whose mean squares are sq[.., 0] / q_count and sq[.., 1] / k_count (sums of squares
    taken over more features than a row holds here, e.g. all-reduced over tensor-parallel
    ranks), in place -> qkv. The normalised value is rounded to qkv's dtype before the
    scale multiplies it, as ``rms_norm_ref``."""
    qw, kw = q_weight.shape[0], k_weight.shape[0]
    for part, w, s, n in ((qkv[..., :qw], q_weight, sq[..., :1], q_count),
                          (qkv[..., qw:qw + kw], k_weight, sq[..., 1:], k_count)):
        part.copy_(w * (part.float() * torch.rsqrt(s / n + eps)).to(qkv.dtype))
    return qkv
