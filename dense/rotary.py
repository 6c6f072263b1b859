"""Rotary position embedding (rotate-half convention of the Llama / Mixtral checkpoints),
with the scaled variants of longer-context checkpoints (``moe_infer.config.RopeScaling``),
each as transformers defines it:
- linear: every frequency divided by ``factor``;
- dynamic (NTK): once a forward's positions pass ``max_position`` (its longest row, as
  transformers takes the batch's largest position id), the base grows to
  base (factor L / max_position - (factor - 1)) ^ (D / (D - 2)) for L positions;
- yarn: frequencies blended between interpolated (/ factor) and original ones along a ramp
  over the dimensions between ``beta_fast`` and ``beta_slow`` rotations within the original
  context; cos and sin scaled by the attention factor (0.1 ln(factor) + 1, or from mscale);
- llama3: long wavelengths divided by ``factor``, short ones kept, a smooth blend between;
- longrope: each frequency divided by its ``short_factor``, or its ``long_factor`` once a
  forward's positions pass the original context; cos and sin scaled by
  sqrt(1 + ln(factor) / ln(original context)).
The dynamic and longrope frequencies depend on the forward's positions: they are computed
on the device from them (no host sync), so a captured decode step follows them too.

Shape letters: B batch, T tokens per step, D head dim.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling=None, max_position: int = 4096):
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_position = head_dim, theta, scaling, max_position
        kind = scaling.rope_type if scaling is not None else "default"
        self.kind = kind
        # Frequencies that follow the forward's positions (no fixed table per position).
        self.per_step = kind in ("dynamic", "longrope")
        self.attention_factor = self._attention_factor()

    def _exponents(self, device) -> torch.Tensor:
        return torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim  # [D/2]

    def _attention_factor(self) -> float:
        s = self.scaling
        if s is None or s.rope_type not in ("yarn", "longrope"):
            return 1.0
        if s.attention_factor is not None:
            return s.attention_factor
        factor = self._factor()
        if s.rope_type == "longrope":
            orig = s.original_max_position_embeddings
            return math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0

        def mscale(scale: float, m: float = 1.0) -> float:
            return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0
        if s.mscale and s.mscale_all_dim:
            return mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
        return mscale(factor)

    def _factor(self) -> float:
        s = self.scaling
        return s.factor if s.factor is not None else self.max_position / s.original_max_position_embeddings

    def inv_freq(self, device, longest: torch.Tensor | None = None) -> torch.Tensor:
        """The D / 2 frequencies; ``longest`` (a 0-dim tensor: the forward's largest
        position + 1) for the kinds that follow it."""
        e = self._exponents(device)
        s, kind = self.scaling, self.kind
        if kind == "dynamic":
            length = torch.clamp(longest.float(), min=self.max_position)
            base = self.theta * (s.factor * length / self.max_position - (s.factor - 1)) ** (
                self.head_dim / (self.head_dim - 2))
            return 1.0 / base ** e
        if kind == "longrope":
            short, long = (torch.tensor(f, dtype=torch.float32, device=device) for f in (s.short_factor,
                                                                                         s.long_factor))
            ext = torch.where(longest > s.original_max_position_embeddings, long, short)
            return 1.0 / (ext * self.theta ** e)
        inv = 1.0 / self.theta ** e
        if kind == "linear":
            return inv / s.factor
        if kind == "llama3":
            orig, lo, hi = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > orig / lo, inv / s.factor, inv)
            smooth = (orig / wavelen - lo) / (hi - lo)
            blend = (1 - smooth) * scaled / s.factor + smooth * scaled
            medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
            return torch.where(medium, blend, scaled)
        if kind == "yarn":
            return self._yarn(self.theta ** e, device)
        return inv

    def _yarn(self, wave: torch.Tensor, device) -> torch.Tensor:
        """``wave``: base ^ (2i / D), the inverse of each original frequency."""
        s, d = self.scaling, self.head_dim
        factor, orig = self._factor(), s.original_max_position_embeddings
        fast = s.beta_fast if s.beta_fast is not None else 32.0
        slow = s.beta_slow if s.beta_slow is not None else 1.0

        def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times in orig positions
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))
        low, high = dim_of(fast), dim_of(slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: the original frequency (extrapolated), 0: interpolated
        return 1.0 / (factor * wave) * (1 - keep) + 1.0 / wave * keep

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, longest: torch.Tensor | None = None):
        """positions [B, T] -> cos, sin [B, T, D] in ``dtype``. ``longest``: for the kinds
        whose frequencies follow the forward (``per_step``), its largest real position + 1
        (default: of ``positions``, padding included)."""
        # Computed per step rather than stored: D/2 values, and no buffer to materialise
        # when the model is built on the meta device.
        if self.per_step and longest is None:
            longest = positions.max() + 1 if positions.numel() else torch.zeros((), dtype=torch.long,
                                                                                 device=positions.device)
        inv_freq = self.inv_freq(positions.device, longest)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def table(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, D] for positions 0 .. length - 1, as ``forward`` computes them:
        looked up by position in a paged decode step (``kernels.attention.paged_context``).
        Not for frequencies that follow the forward's positions (``per_step``)."""
        if self.per_step:
            raise ValueError(f"rope_type {self.kind}: its frequencies follow each forward's positions, no table")
        cos, sin = self.forward(torch.arange(length, device=device)[None], dtype)
        return cos[0], sin[0]


def pairs_to_halves(rows: torch.Tensor, head_dim: int, first: int, width: int) -> torch.Tensor:
    """Rows of a projection whose heads of ``head_dim`` rows rotate dimensions (2i, 2i + 1)
    as pairs (Llama 4, DeepSeek) -> the same heads' rows with rotary dimensions i and
    i + width / 2 as the pairs, the halves ``apply_rotary`` turns: within each head, rows
    first .. first + width - 1 (the rotary ones) reordered evens first, then odds. A query
    and a key both reordered keep their dot product; so does their rotation."""
    order = torch.arange(rows.shape[0], device=rows.device).view(-1, head_dim)
    part = order[:, first:first + width]
    order[:, first:first + width] = torch.cat([part[:, 0::2], part[:, 1::2]], dim=1)
    return rows[order.reshape(-1)]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos, sin [B, T, R]: the first R <= D dimensions of each head
    turn (partial rotary, GLM-4.5), the rest pass as they are."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rotary_all(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    return apply_rotary_all(x, cos, sin)


def apply_rotary_all(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
