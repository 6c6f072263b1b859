"""Next-token sampling: greedy, temperature, top-k and top-p, seeded; the OpenAI / vLLM
logit processors (presence, frequency and repetition penalties, logit bias) that run
before it.

Shape letters: B batch, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (below 1e-5): greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI: logits[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty,
    # count over the generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL / Hugging Face, over prompt and generated tokens: a seen token's positive logit is
    # divided by it, a negative one multiplied (1: off).
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), as OpenAI's

    SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts (end exclusive)

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
        lo, hi = self.SEED_RANGE
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not lo <= self.seed < hi):
            bad("seed", self.seed, "an integer in [-2**63, 2**64) or None")
        # Bounded so that no processed logit can overflow float32 (an inf, then a NaN softmax,
        # would fail every request of the step): OpenAI's ranges, and a repetition penalty
        # that scales a logit by at most 100.
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 0.01, 100.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                bad(name, v, f"a number in [{lo:g}, {hi:g}]")
        for pair in self.logit_bias:
            ok = isinstance(pair, tuple) and len(pair) == 2
            if not ok or isinstance(pair[0], bool) or not isinstance(pair[0], int) or pair[0] < 0 \
                    or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float)) \
                    or not -100 <= pair[1] <= 100:
                bad("logit_bias", self.logit_bias, "(token id >= 0, bias in [-100, 100]) pairs")

    @property
    def greedy(self) -> bool:
        # Below this, dividing by the temperature overflows float32 logits to inf (and the
        # softmax to NaN); the distribution is a one-hot of the argmax anyway (vLLM's _SAMPLING_EPS).
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens seen so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """The penalties of a batch, in vLLM's order (repetition, then frequency and presence):
    logits [B, V] float32; counts [B, V] of each token in the generated text; seen [B, V]
    bool, in the prompt or generated; presence, frequency, repetition [B, 1] -> [B, V]."""
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, scaled, logits)
    return logits - counts * frequency - (counts > 0).float() * presence


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None, *, pdl: bool = True) -> torch.Tensor:
    """logits [B, V] -> token ids [B], every row by ``params``, the noise drawn from
    ``generator``; without a host sync (``sample_rows`` with one set of parameters)."""
    return sample_rows(logits, [params] * logits.shape[0], [None] * logits.shape[0], shared=generator, pdl=pdl)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                shared: torch.Generator | None = None, *, pdl: bool = True) -> torch.Tensor:
    """logits [B, V], each row with its own parameters -> token ids [B], batched on the
    device with no host sync: one sort for every sampled row's top-k and top-p, then an
    exponential race (argmax of probs / Exp(1) noise, a draw from probs). A row with a
    generator draws its noise from it alone, so a seeded request samples the same tokens
    whatever else shares its batch; the other rows share one draw (from ``shared``)."""
    ids = kernels.argmax(logits, pdl=pdl)  # greedy rows keep these
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return ids
    dev, vocab = logits.device, logits.shape[-1]
    picked = [params[i] for i in rows]
    knobs = torch.tensor([[p.temperature, p.top_k or vocab, p.top_p] for p in picked]).to(dev, non_blocking=True)
    index = torch.tensor(rows).to(dev, non_blocking=True)
    x = logits.index_select(0, index).float() / knobs[:, 0:1]  # [R, V]
    x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)
    x = x.masked_fill(rank[None, :] >= knobs[:, 1:2], float("-inf"))  # top-k (0: every token)
    probs = x.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    x = x.masked_fill(probs.cumsum(dim=-1) - probs >= knobs[:, 2:3], float("-inf"))
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs)
    if any(generators[i] is None for i in rows):
        noise.exponential_(generator=shared)  # one draw for every row without a generator of its own
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    choice = (probs / noise).argmax(dim=-1, keepdim=True)  # [R, 1], a position in the sorted row
    return ids.index_copy(0, index, order.gather(1, choice)[:, 0])
