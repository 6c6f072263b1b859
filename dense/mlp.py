"""The dense feed-forward block: SwiGLU (gate and up rows fused in one weight) or GeLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from comm import Group, all_reduce
from dense.parallel_linear import ColumnParallelLinear, RowParallelLinear
from kernels.options import KernelOptions


class MLP(nn.Module):
    """x [.., H] -> [.., H]. ``up_proj`` is [2F, H] (gate rows, then up rows) for SwiGLU.

    With a tensor-parallel group each rank holds F / P of the width: the up projection is
    column-parallel (its gate and up slices), the down projection row-parallel (one all-reduce)."""

    def __init__(self, hidden: int, width: int, activation: str, bias: bool = False,
                 tp: Group | None = None, options: KernelOptions = KernelOptions()):
        super().__init__()
        tp = tp or Group.alone()
        self.activation, self.tp, self.options = activation, tp, options
        gated = activation == "swiglu"
        # On a GPU a bias-free SwiGLU MLP runs as one op (kernels.gated_mlp: at decode sizes
        # the MoE decode kernels, the activation inside the up GEMM's launch).
        self.fused = gated and not bias
        self.up_proj = ColumnParallelLinear(hidden, 2 * width if gated else width, bias, tp, options)
        self.down_proj = RowParallelLinear(width, hidden, bias, tp, options)
        if gated:  # this rank's gate rows and its up rows, not a block of the fused [2F, H]
            n = width // tp.size
            pick = lambda full: torch.cat([full[tp.rank * n:(tp.rank + 1) * n],  # noqa: E731
                                           full[width + tp.rank * n:width + (tp.rank + 1) * n]])
            self.up_proj.shard_fns = {"weight": pick, "bias": pick}

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce`` False: this rank's partial sum (``RowParallelLinear``)."""
        if self.fused and x.is_cuda:
            up, down = self.up_proj, self.down_proj  # (int8 layers carry their scales)
            y = kernels.gated_mlp(x.reshape(-1, x.shape[-1]), up.weight, down.weight, getattr(up, "scale", None),
                                  getattr(down, "scale", None), pdl=self.options.pdl).view(*x.shape[:-1], -1)
            return all_reduce(y, self.tp) if reduce else y
        h = self.up_proj(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.down_proj(h, reduce)
