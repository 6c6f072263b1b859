"""Rotary position embedding (rotate-half convention of the Llama / Mixtral checkpoints).

Shape letters: B batch, T tokens per step, D head dim.
"""
from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [B, T] -> cos, sin [B, T, D] in ``dtype``."""
        # Computed per step rather than stored: D/2 values, and no buffer to materialise
        # when the model is built on the meta device.
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / self.theta ** (exponent / self.head_dim)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, D] for positions 0 .. length - 1, as ``forward`` computes them:
        looked up by position in a paged decode step (``kernels.attention.paged_context``)."""
        cos, sin = self.forward(torch.arange(length, device=device)[None], dtype)
        return cos[0], sin[0]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos, sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
