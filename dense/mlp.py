"""The dense feed-forward block: SwiGLU (gate and up rows fused in one weight) or GeLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """x [.., H] -> [.., H]. ``up_proj`` is [2F, H] (gate rows, then up rows) for SwiGLU."""

    def __init__(self, hidden: int, width: int, activation: str, bias: bool = False):
        super().__init__()
        self.activation = activation
        rows = 2 * width if activation == "swiglu" else width
        self.up_proj = nn.Linear(hidden, rows, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.down_proj(h)
