"""Next-token sampling: greedy, temperature, top-k and top-p, seeded.

Shape letters: B batch, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        def bad(name, value, expected):
            raise ValueError(f"{name}={value!r}: expected {expected}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", self.temperature, "a number in [0, 100]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 disables it)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "a number in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", self.seed, "an integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B], without a host sync."""
    if params.greedy:
        return kernels.argmax(logits)
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
