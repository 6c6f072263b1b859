"""Step 4: the experts' weights and the grouped FFN over the expert-major buffer.

Shape letters: E experts, H hidden, F expert width, N buffer rows.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels

_KERNEL_ACTIVATION = {"swiglu": "silu", "gelu": "gelu"}


class Experts(nn.Module):
    """w13 [E, 2F, H] (gate rows, then up rows; [E, F, H] for GeLU), w2 [E, H, F]."""

    def __init__(self, num_experts: int, hidden: int, width: int, activation: str):
        super().__init__()
        rows = 2 * width if activation == "swiglu" else width
        self.w13 = nn.Parameter(torch.empty(num_experts, rows, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.activation = _KERNEL_ACTIVATION[activation]

    def forward(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return kernels.grouped_ffn(xs, offsets, self.w13, self.w2, self.activation)  # [N, H]
