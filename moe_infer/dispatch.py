"""Steps 2-3 and the inverse of 3: expert-to-token maps, dispatch and combine.

Shape letters: T tokens, H hidden, E experts, k slots, N = T * k buffer rows.
The local dispatcher moves rows within one device; expert-parallel dispatchers keep the
same interface and add the all-to-all between the layout transform and the experts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernels


@dataclass
class Dispatched:
    """The expert-major buffer and what combine needs to undo the layout transform."""

    xs: torch.Tensor  # [N, H] token copies grouped by expert
    offsets: torch.Tensor  # [E + 1] int32: expert e owns rows offsets[e] .. offsets[e + 1]
    rows: torch.Tensor  # [T, k] int32: buffer row of each (token, slot), -1 if dropped


class LocalDispatcher:
    """All experts on this device."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float | None = None):
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None  # dropless
        return max(1, math.ceil(num_tokens * self.top_k / self.num_experts * self.capacity_factor))

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor) -> Dispatched:
        offsets, rows = kernels.token_maps(expert_ids, self.num_experts, self.capacity(x.shape[0]))
        return Dispatched(kernels.scatter_rows(x, rows), offsets, rows)

    def combine(self, ys: torch.Tensor, d: Dispatched, weights: torch.Tensor) -> torch.Tensor:
        return kernels.gather_rows(ys, d.rows, weights)  # [T, H]
