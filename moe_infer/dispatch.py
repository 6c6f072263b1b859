"""Getting tokens to their experts and back (steps 2-3 of the MoE layer and the inverse).

Shape letters: T tokens, H hidden, E experts, k slots.
A dispatcher owns where experts live. With all experts on this device the maps, the
layout transform, the experts and the combine run as one fused kernel sequence
(``kernels.fused_moe``); expert-parallel dispatchers keep this interface and put the
all-to-all between the layout transform and the experts.
"""
from __future__ import annotations

import math

import torch


class LocalDispatcher:
    """All experts on this device."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float | None = None):
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None  # dropless
        return max(1, math.ceil(num_tokens * self.top_k / self.num_experts * self.capacity_factor))

    def run(self, x: torch.Tensor, routing, experts) -> torch.Tensor:
        """x [T, H] and its Routing -> the weighted expert outputs [T, H]."""
        return experts.fused(x, routing.expert_ids, routing.weights, self.capacity(x.shape[0]),
                             routing.maps)
