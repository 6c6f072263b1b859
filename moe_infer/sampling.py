"""Next-token sampling: greedy, temperature, top-k and top-p, seeded; the OpenAI / vLLM
logit processors (presence, frequency and repetition penalties, logit bias) that run
before it.

Each row's knobs (``knobs``: seed, counter, top-k, temperature, top-p) are device tensors
and its noise comes from a counter-based generator of its seed and counter, so the draw
runs inside a captured decode step, needs no per-row host work, and a seeded sequence
draws the same tokens whatever shares its batch.

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


# A row's sampling for one token, as the device takes it: (seed, counter, top_k, temperature,
# top_p); None for a greedy row. The counter is the number of tokens the sequence sampled
# before: with the seed it names the noise, so a sequence draws the same tokens whatever
# shares its batch, on any device.
Knobs = tuple[int, int, int, float, float]

_MASK64 = (1 << 64) - 1


def _int64(v: int) -> int:
    """``v`` modulo 2**64 as a signed 64-bit value (a seed of any accepted range)."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def knobs(params: SamplingParams, seed: int, counter: int) -> Knobs | None:
    """One row's sampling knobs for its next token (None: greedy)."""
    if params.greedy:
        return None
    return (_int64(seed), counter, params.top_k, float(params.temperature), float(params.top_p))


# splitmix64's constants (Steele et al.), as signed 64-bit values: torch's int64 products
# wrap modulo 2**64, and its right shifts are arithmetic, so each shift is masked.
_GOLDEN, _M1, _M2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def exponential_noise(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """Exp(1) noise [B, n] float32 of a counter-based generator (splitmix64 of seed, counter
    and position): seed, counter [B] int64. Elementwise torch ops of fixed shapes: it runs
    inside a captured CUDA graph, and gives the same values on every device."""
    j = torch.arange(n, device=seed.device)
    x = (seed[:, None] * _GOLDEN + counter[:, None]) * _M1 + j[None, :] * _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    u = (_shr(x, 40).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits, in (0, 1)
    return -torch.log(u)


def draw(logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, greedy_ids: torch.Tensor) -> torch.Tensor:
    """Each row's next token from its own distribution, on the device, without a host sync
    or a data-dependent shape (a captured step runs it): logits [B, V] float32; ints [B, 3]
    int64 (seed, counter, top_k; 0 keeps every token); floats [B, 2] float32 (temperature,
    top_p); greedy_ids [B], the argmax, which rows of temperature 0 keep -> ids [B].
    One sort gives every row's top-k and top-p; then an exponential race (argmax of probs /
    Exp(1) noise, a draw from probs) with ``exponential_noise`` of the row's seed and counter."""
    vocab = logits.shape[-1]
    temperature = floats[:, 0:1]
    greedy = temperature < 1e-5  # SamplingParams.greedy
    x = logits / torch.where(greedy, 1.0, temperature)
    x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    top_k = ints[:, 2:3]
    x = x.masked_fill((top_k > 0) & (rank[None, :] >= top_k), float("-inf"))
    probs = x.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    x = x.masked_fill(probs.cumsum(dim=-1) - probs >= floats[:, 1:2], float("-inf"))
    probs = x.softmax(dim=-1)
    choice = (probs / exponential_noise(ints[:, 0], ints[:, 1], vocab)).argmax(dim=-1, keepdim=True)
    return torch.where(greedy[:, 0], greedy_ids, order.gather(1, choice)[:, 0])


def knob_tensors(rows: list[Knobs | None], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Host knobs -> ``draw``'s (ints [B, 3], floats [B, 2]); greedy rows get temperature 0."""
    ints = [(k[0], k[1], k[2]) if k else (0, 0, 0) for k in rows]
    floats = [(k[3], k[4]) if k else (0.0, 1.0) for k in rows]
    return (torch.tensor(ints, dtype=torch.long).to(device, non_blocking=True),
            torch.tensor(floats, dtype=torch.float32).to(device, non_blocking=True))


def sample_rows(logits: torch.Tensor, rows: list[Knobs | None], *, pdl: bool = True) -> torch.Tensor:
    """logits [B, V] float32, each row's knobs -> token ids [B], on the device with no host
    sync (the argmax alone where every row is greedy)."""
    ids = kernels.argmax(logits, pdl=pdl)
    if all(k is None for k in rows):
        return ids
    return draw(logits.float(), *knob_tensors(rows, logits.device), ids)
