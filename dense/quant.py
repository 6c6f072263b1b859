"""Weight-only int8 for the dense linear layers: per-output-channel scales, dequantisation
fused into the GEMM on GPUs (``kernels.dense_linear``).

``quantize_linears(model)`` swaps every ``nn.Linear``, ``ColumnParallelLinear``,
``RowParallelLinear`` and ``VocabParallelHead`` of a loaded model for ``Int8Linear`` in place
(bf16 weights in, int8 weights on the device); a row-parallel layer keeps its all-reduce, a
vocabulary-parallel head its all-gather. Layers named in
``skip`` (by default the MoE router and shared-expert gates, whose outputs pick experts)
and layers narrower than ``min_out`` stay as they are.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels
from comm import Group, all_reduce
from dense.parallel_linear import (ColumnParallelLinear, RowParallelLinear, VocabParallelHead, first_rows,
                                   gather_vocab)
from kernels.options import KernelOptions

LINEAR_TYPES = (nn.Linear, ColumnParallelLinear, RowParallelLinear, VocabParallelHead)


class Int8Linear(nn.Module):
    """y = x @ dequant(weight).T (+ the row-parallel all-reduce, or the vocabulary-parallel
    all-gather) + bias."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        q, scale = kernels.quantize_int8(linear.weight.detach()[None])
        self.weight = nn.Parameter(q[0], requires_grad=False)  # [O, I] int8
        self.register_buffer("scale", scale[0])  # [O] float32
        self.bias = linear.bias
        self.reduce: Group | None = linear.group if isinstance(linear, RowParallelLinear) else None
        self.gather: tuple[Group, int] | None = (linear.group, linear.vocab) \
            if isinstance(linear, VocabParallelHead) else None
        # The layer it replaces carries the model's options (a plain nn.Linear: the defaults).
        self.options: KernelOptions = getattr(linear, "options", KernelOptions())

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor, reduce: bool = True, *, rows: int | None = None) -> torch.Tensor:
        """``reduce`` False (a row-parallel layer): this rank's partial sum, as
        ``RowParallelLinear``'s; ``rows``: the first this many outputs alone, as ``Linear``'s."""
        w, scale = first_rows(self.weight, rows), first_rows(self.scale, rows)
        y = kernels.dense_linear(x, w, scale=scale, pdl=self.options.pdl)
        return self._finish(y, rows) if reduce else y

    def normed(self, x: torch.Tensor, residual: torch.Tensor, norm, *,
               rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``Linear.normed``: s = x + residual, this layer on rmsnorm(s) -> (y, s)."""
        y, s = kernels.norm_linear(x, residual, norm.weight, norm.eps, first_rows(self.weight, rows),
                                   scale=first_rows(self.scale, rows), pdl=self.options.pdl)
        return self._finish(y, rows), s

    def _finish(self, y: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        if self.reduce is not None:
            y = all_reduce(y, self.reduce)
        if self.gather is not None:
            y = gather_vocab(y, *self.gather)
        return y + first_rows(self.bias, rows) if self.bias is not None else y


# Not converted: the routers and gates (small, and their logits pick experts), and latent
# attention's kv_b_proj, whose weight is read as per-head matrices, not through a GEMM.
SKIP = ("router", "shared_gate", "kv_b_proj")


def linear_targets(model: nn.Module, skip: tuple[str, ...] = SKIP,
                   min_out: int = 16) -> list[tuple[nn.Module, str]]:
    """(parent, name) of the linear layers ``quantize_linears`` converts."""
    return [(parent, name) for parent_name, parent in model.named_modules()
            for name, child in parent.named_children()
            if isinstance(child, LINEAR_TYPES) and child.weight.shape[0] >= min_out
            and not any(s in f"{parent_name}.{name}".split(".") for s in skip)]


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = SKIP,
                     min_out: int = 16, device: torch.device | None = None, prepare=None) -> int:
    """Swaps the model's linear layers for ``Int8Linear`` in place (each moved to ``device``
    first, when given, then passed to ``prepare``); returns how many."""
    targets = linear_targets(model, skip, min_out)
    for parent, name in targets:  # pairs, not modules: each full-precision weight is freed as it goes
        linear = getattr(parent, name)
        if device is not None:
            linear.to(device)
        if prepare is not None:
            prepare(linear)
        setattr(parent, name, Int8Linear(linear))
    return len(targets)
