"""Step 1 of the MoE layer: the router GEMM and table-based top-k gating.

Shape letters: T tokens, H hidden, E experts, k slots per token.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels


class Router(nn.Module):
    """x [T, H] -> expert_ids [T, k] int32, weights [T, k] float32. No one-hot tensors."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, score: str, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.score, self.renormalize = top_k, score, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x @ self.weight.t()  # [T, E]
        return kernels.topk_gating(logits, self.top_k, self.score, self.renormalize)
