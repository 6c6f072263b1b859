"""Step 1 of the MoE layer: the router GEMM and table-based top-k gating.

Shape letters: T tokens, H hidden, E experts, k slots per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels
from kernels.options import KernelOptions


@dataclass
class Routing:
    """The gating table, and the expert-to-token maps when they came with it."""

    expert_ids: torch.Tensor  # [T, k] int32
    weights: torch.Tensor  # [T, k] float32
    maps: tuple | None = None  # (offsets [E + 1], rows [T, k], row_pair [T * k]), dropless


class Router(nn.Module):
    """x [T, H] -> Routing. No one-hot tensors."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, score: str, renormalize: bool,
                 with_maps: bool = True, options: KernelOptions = KernelOptions(), groups: tuple | None = None,
                 score_bias: bool = False, bias: bool = False):
        """``groups`` (n_group, topk_group, routed_scaling_factor, whether a group scores its
        best choice alone) with ``score_bias``: DeepSeek-V3 / GLM-4.5 routing, or V2's
        (``kernels.grouped_topk``); its maps come from the dispatcher."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.score_bias = nn.Parameter(torch.zeros(num_experts)) if score_bias else None
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None  # on the logits (GPT-OSS)
        self.top_k, self.score, self.renormalize = top_k, score, renormalize
        self.groups = groups
        # Fixed slots after the top-k, ids E.., weight 1: shared experts held after the routed
        # ones (``MoELayer.fold_shared``), which every token's table then names.
        self.shared = 0
        self.with_maps = with_maps and groups is None  # dropless maps built in the gating launch
        self.options = options

    @property
    def slots(self) -> int:
        """Slots a token's table has: the top-k and the shared ones."""
        return self.top_k + self.shared

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None, maps: bool = True) -> Routing:
        """``logits`` [T, E]: already computed (by the fused norm + router launch). ``maps``
        False: the caller's experts need none (ids and weights only, the gating launch)."""
        if logits is None:
            logits = x @ self.weight.t()  # [T, E]
        if self.bias is not None:  # (the fused norm + router launch computes x @ weight alone)
            logits = logits + self.bias
        if self.groups is not None:
            n_group, topk_group, scale, group_max = self.groups
            bias = self.score_bias if self.score_bias is not None else logits.new_zeros(logits.shape[1])
            return Routing(*kernels.grouped_topk(logits, bias, self.top_k, n_group, topk_group, self.score,
                                                 self.renormalize, scale, group_max, pdl=self.options.pdl,
                                                 shared=self.shared))
        if self.with_maps and maps and not self.shared:
            return Routing(*kernels.route(logits, self.top_k, self.score, self.renormalize, pdl=self.options.pdl))
        return Routing(*kernels.topk_gating(logits, self.top_k, self.score, self.renormalize, pdl=self.options.pdl,
                                            shared=self.shared))
