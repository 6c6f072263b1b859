"""Kernels: each public op sits behind one function; ``*_ref`` is the plain-torch math it
must match. Until a fast backend (Triton, CuPy) exists for an op on a device, the
reference is what runs. This package depends on nothing else of ours.
"""
from __future__ import annotations

import torch

from kernels.moe_ref import (ACTIVATIONS, expert_ffn_ref, fused_moe_ref, gather_rows_ref,
                             grouped_ffn_ref, scatter_rows_ref, token_maps_ref, topk_gating_ref)

topk_gating = topk_gating_ref
token_maps = token_maps_ref
scatter_rows = scatter_rows_ref
gather_rows = gather_rows_ref
grouped_ffn = grouped_ffn_ref


def _check_moe_args(x, w13, w2, topk_weights, topk_ids, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, H], got shape {list(x.shape)}")
    t, h = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 / w2: expected [E, 2F, H] / [E, H, F], got "
                         f"{list(w13.shape)} / {list(w2.shape)}")
    e, f = w2.shape[0], w2.shape[2]
    rows13 = 2 * f if activation == "silu" else f
    if tuple(w13.shape) != (e, rows13, h) or w2.shape[1] != h:
        raise ValueError(f"w13 {list(w13.shape)} / w2 {list(w2.shape)}: expected "
                         f"[E, {'2F' if activation == 'silu' else 'F'}, H={h}] / [E, H={h}, F]")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} / topk_weights "
                         f"{list(topk_weights.shape)}: expected both [T={t}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected int32 or int64, got {topk_ids.dtype}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu") -> torch.Tensor:
    """MoE expert computation on one device: x [T, H] -> [T, H].

    w13 [E, 2F, H] holds each expert's gate rows then up rows (Hugging Face / vLLM layout;
    [E, F, H] for the plain GeLU experts of GPT-style models), w2 [E, H, F].
    """
    _check_moe_args(x, w13, w2, topk_weights, topk_ids, activation)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, activation)


__all__ = ["fused_moe", "fused_moe_ref", "topk_gating", "topk_gating_ref", "token_maps",
           "token_maps_ref", "scatter_rows", "scatter_rows_ref", "gather_rows", "gather_rows_ref",
           "grouped_ffn", "grouped_ffn_ref", "expert_ffn_ref"]
