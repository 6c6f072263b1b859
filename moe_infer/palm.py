"""The PaLM inference paper's partitioning layouts (Pope et al., 2022) as a cost model of a
dense decoder on a TPU-like torus: 1D and 2D weight-stationary and weight-gathered FFNs,
batch-sharded multiquery attention at decode. ``scripts/extrapolate.py`` carries it to the
paper's Table 2 and figures 6-7; the hardware profile is ``moe_infer.hardware_profile.Hardware``.

Shape letters: B rows, L tokens a row, E width, F FFN width, n chips.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moe_infer.config import ConfigError
from moe_infer.hardware_profile import GB, Hardware


@dataclass
class DenseShape:
    """A dense decoder for the PaLM layouts: L blocks of width E, FFN width F (SwiGLU),
    ``heads`` query heads of ``head_dim`` and ``kv_heads`` key/value heads (1: multiquery)."""

    layers: int
    width: int
    ffn: int
    heads: int
    head_dim: int
    kv_heads: int
    vocab: int

    @property
    def block_params(self) -> float:
        e, d = self.width, self.head_dim
        return 3 * e * self.ffn + e * d * (2 * self.heads + 2 * self.kv_heads)

    @property
    def params(self) -> float:
        return self.layers * self.block_params + self.vocab * self.width


# PaLM (Chowdhery et al., 2022): E, F = 4E, multiquery attention with 256-wide heads, a
# 256k vocabulary; 540B's 48 heads padded to 64 as the inference paper runs it.
PALM = {"palm-8b": DenseShape(32, 4096, 16384, 16, 256, 1, 256000),
        "palm-62b": DenseShape(64, 8192, 32768, 32, 256, 1, 256000),
        "palm-540b": DenseShape(118, 18432, 73728, 64, 256, 1, 256000)}
PALM_FFN_LAYOUTS = ("1d-weight-stationary", "2d-weight-stationary", "weight-gathered")


def palm_ffn_comm_s(layout: str, shape: DenseShape, tokens: float, chips: int, gbps: float, nbytes: float = 2.0) -> float:
    """One block's FFN communication on ``chips`` chips for ``tokens`` (B L) tokens, the
    inference paper's closed forms (its appendix A): 1D weight-stationary 2 BLE / bw
    (independent of the chip count); 2D weight-stationary 8 BLE / (sqrt(n) bw); weight-
    gathered 4 E sqrt(BLF) / (sqrt(n) bw), with the gather width N = sqrt(BL n / F) capped
    at n (below it, the 2D weight-stationary layout's cost)."""
    e, f, bw = shape.width, shape.ffn, gbps * GB
    if layout == "1d-weight-stationary":
        return 2 * tokens * e * nbytes / bw
    two_d = 8 * tokens * e * nbytes / (math.sqrt(chips) * bw)
    if layout == "2d-weight-stationary":
        return two_d
    if layout == "weight-gathered":
        if math.sqrt(tokens * chips / f) < 1:  # gathering over fewer than one chip: stay stationary
            return two_d
        return 4 * e * math.sqrt(tokens * f) * nbytes / (math.sqrt(chips) * bw)
    raise ConfigError(f"layout={layout!r}: expected one of {', '.join(PALM_FFN_LAYOUTS)}")


def palm_predict(shape: DenseShape, hw: Hardware, chips: int, layout: str, batch: int, new: int, context: int,
                 weight_bytes: float = 2.0, batch_sharded_kv: bool = True, peak_tflops: float | None = None) -> dict:
    """A PaLM-style forward of ``batch`` rows, ``new`` tokens each (a prefill: the prompt;
    a decode step: 1) over ``context`` keys on ``chips`` chips: per block the roofline of
    FLOPs over the chips' matmul rate and bytes (weights / chips, the KV: batch-sharded
    over the chips at decode, else each chip reads every row's single multiquery head)
    over their memory bandwidth, plus the FFN layout's communication (not overlapped).
    -> seconds, MFU (against ``peak_tflops``, default the profile's rate), the split."""
    tokens = batch * new
    peak = hw.matmul_tflops["bfloat16"] * 1e12  # TPU v4 runs int8 at the bf16 rate: int8 saves bytes
    bw = hw.mem_gbps * GB
    flops = 2 * shape.block_params * tokens + 4 * tokens * context * shape.heads * shape.head_dim
    kv = batch * context * 2 * shape.kv_heads * shape.head_dim * 2.0
    reads = shape.block_params * weight_bytes / chips + (kv / chips if batch_sharded_kv else kv)
    t_cmp, t_mem = flops / (chips * peak), reads / bw
    t_comm = palm_ffn_comm_s(layout, shape, tokens, chips, hw.network.gbps)
    # Each collective's latency: rings along the torus axes its chips span (k chips: three
    # axes of k^(1/3)), one hop a step, alpha each. 1D: an all-gather and a reduce-scatter
    # over all chips; 2D: two over X = sqrt(n) / 2 chips and two over YZ = 2 sqrt(n);
    # weight-gathered: those plus two gathers; batch-sharded attention at decode: two
    # all-to-alls over all chips.
    def hops(k: float) -> float:
        return 3 * (k ** (1 / 3) - 1) if k > 1 else 0.0
    x = max(1, round(math.sqrt(chips) / 2))
    steps = {"1d-weight-stationary": 2 * hops(chips),
             "2d-weight-stationary": 2 * hops(x) + 2 * hops(chips / x)}.get(layout, 2 * hops(x) + 4 * hops(chips / x))
    if batch_sharded_kv and new == 1:
        steps += 2 * hops(chips)
    t_comm += steps * hw.network.alpha_us * 1e-6
    block = max(t_cmp, t_mem) + t_comm
    head = max(2 * shape.vocab * shape.width * tokens / (chips * peak), shape.vocab * shape.width * weight_bytes
               / chips / bw)
    seconds = shape.layers * block + head
    rate = (peak_tflops or hw.matmul_tflops["bfloat16"]) * 1e12
    return {"seconds": seconds, "mfu": 2 * shape.params * tokens / (seconds * chips * rate),
            "compute_s": shape.layers * t_cmp, "memory_s": shape.layers * t_mem, "comm_s": shape.layers * t_comm}
