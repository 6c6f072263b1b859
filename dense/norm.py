"""RMSNorm and LayerNorm, computed in float32 and cast back, as the reference models do.

``norm(x)`` returns norm(x); ``norm.add_and_norm(x, r)`` returns (norm(x + r), x + r), so a
block adds its residual and normalises in one step (one launch for RMSNorm on a GPU): two
methods, each with one return type."""
from __future__ import annotations

import torch
from torch import nn

import kernels
from comm import Group, all_reduce
from kernels.options import KernelOptions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, options: KernelOptions = KernelOptions()):
        super().__init__()
        self.eps, self.options = eps, options
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, pdl=self.options.pdl)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual)."""
        y, s = kernels.rms_norm(x, self.weight, self.eps, residual, pdl=self.options.pdl)
        return y, s


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(),
                                        self.bias.float(), self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual)."""
        s = x + residual
        return self(s), s


def make_norm(kind: str, dim: int, eps: float, options: KernelOptions = KernelOptions()) -> nn.Module:
    return RMSNorm(dim, eps, options) if kind == "rmsnorm" else LayerNorm(dim, eps)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features split across a tensor-parallel group: each rank holds
    ``local_dim`` of the ``total_dim`` features (``replicas`` ranks hold the same slice when
    KV heads are replicated). The mean square is all-reduced; the scale is this rank's slice."""

    def __init__(self, local_dim: int, total_dim: int, eps: float, group: Group, first: int, replicas: int = 1):
        super().__init__()
        self.eps, self.total, self.group, self.replicas = eps, total_dim, group, replicas
        self.weight = nn.Parameter(torch.ones(local_dim))
        self.shard_fns = {"weight": lambda full: full[first:first + local_dim]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sq = all_reduce(xf.pow(2).sum(-1, keepdim=True), self.group) / self.replicas
        return self.weight * (xf * torch.rsqrt(sq / self.total + self.eps)).to(x.dtype)
