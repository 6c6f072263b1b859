"""Tensor-parallel linear layers (Megatron style). Each collective lives in exactly one
layer type: ``ColumnParallelLinear`` never communicates, ``RowParallelLinear`` ends in the
all-reduce. Each layer carries ``shard_fns``: for each parameter, the function that keeps
this rank's slice of the full tensor, which the checkpoint loader applies.

Shape letters: N rows, I input features, O output features, P = group size.
"""
from __future__ import annotations

import torch
from torch import nn

from comm import Group, all_gather, all_reduce
from kernels import dense_linear, norm_linear
from kernels.options import KernelOptions


class Linear(nn.Linear):
    """An unsplit linear layer whose GEMM is picked per shape (``kernels.dense_linear``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 options: KernelOptions = KernelOptions()):
        super().__init__(in_features, out_features, bias)
        self.options = options

    def forward(self, x: torch.Tensor, *, rows: int | None = None) -> torch.Tensor:
        """``rows``: the first this many output features alone (None: all)."""
        w, b = first_rows(self.weight, rows), first_rows(self.bias, rows)
        return dense_linear(x, w, b, pdl=self.options.pdl)

    def normed(self, x: torch.Tensor, residual: torch.Tensor, norm, *,
               rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """s = x + residual, then this layer (its first ``rows`` outputs) on ``norm`` (an
        RMSNorm) of s -> (y, s); at decode sizes one launch (``kernels.norm_linear``)."""
        w, b = first_rows(self.weight, rows), first_rows(self.bias, rows)
        return norm_linear(x, residual, norm.weight, norm.eps, w, b, pdl=self.options.pdl)


def first_rows(t: torch.Tensor | None, rows: int | None) -> torch.Tensor | None:
    """The first ``rows`` rows of a weight, bias or scale (a contiguous view; all of it for None)."""
    return t if t is None or rows is None else t[:rows]


def _split(total: int, group: Group, what: str) -> int:
    if total % group.size:
        raise ValueError(f"{what}={total}: expected a multiple of the tensor-parallel size {group.size}")
    return total // group.size


class ColumnParallelLinear(nn.Module):
    """x [N, I] -> this rank's O / P output columns; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group,
                 options: KernelOptions = KernelOptions()):
        super().__init__()
        self.group, self.options = group, options
        local = _split(out_features, group, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        first = group.rank * local

        def shard(full: torch.Tensor) -> torch.Tensor:  # the rows of a full [O] or [O, I] tensor kept here
            return full[first:first + local]
        # Plain closures, not bound methods: a module must not reference itself, or the int8
        # converter's swap leaves it (and its weight) to the garbage collector.
        self.shard_fns = {"weight": shard, "bias": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias, pdl=self.options.pdl)


class RowParallelLinear(nn.Module):
    """This rank's I / P input columns -> the full [N, O], summed over the group by one
    all-reduce; the bias is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group,
                 options: KernelOptions = KernelOptions()):
        super().__init__()
        self.group, self.options = group, options
        local = _split(in_features, group, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        first = group.rank * local
        # The columns of a full [O, I] weight kept here (the bias stays whole); a closure, as
        # in ColumnParallelLinear.
        self.shard_fns = {"weight": lambda full: full[:, first:first + local]}

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce`` False: this rank's partial sum (no all-reduce, no bias), for a caller
        that adds it to another partial sum over the same ranks before one all-reduce."""
        y = dense_linear(x, self.weight, pdl=self.options.pdl)
        if not reduce:
            return y
        y = all_reduce(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelHead(nn.Module):
    """The LM head split by vocabulary: each rank holds ceil(V / P) rows of the [V, I]
    weight (the last rank's rows past V are zero), computes those logits, and one
    all-gather joins them -> [N, V]. Each rank reads 1 / P of the head's bytes a step where
    a replicated head reads all of it on every rank."""

    def __init__(self, in_features: int, vocab: int, group: Group, options: KernelOptions = KernelOptions()):
        super().__init__()
        self.group, self.options, self.vocab = group, options, vocab
        local = -(-vocab // group.size)
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = None
        first = group.rank * local

        def shard(full: torch.Tensor) -> torch.Tensor:  # this rank's rows, zero past the vocabulary
            part = full[first:first + local]
            return part if part.shape[0] == local else torch.cat((part, part.new_zeros(local - part.shape[0],
                                                                                         *part.shape[1:])))
        self.shard_fns = {"weight": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(dense_linear(x, self.weight, pdl=self.options.pdl), self.group, self.vocab)


def gather_vocab(y: torch.Tensor, group: Group, vocab: int) -> torch.Tensor:
    """Every rank's logits of its vocabulary rows y [.., V / P] -> [.., V], in rank order
    (contiguous: collectives such as the pipeline's broadcast send it whole)."""
    full = all_gather(y.reshape(-1, y.shape[-1]), group, dim=-1)
    return full[:, :vocab].contiguous().view(*y.shape[:-1], vocab)
