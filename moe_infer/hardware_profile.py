"""What the cost model (``moe_infer.costmodel``) knows of a machine: a hardware profile
(``Hardware``: memory bandwidth, matmul rates by dtype and by a GEMM's rows, the MoE kernel's
read rate, the links and the collectives' measured times, the host link and the CPU), shipped
under ``moe_infer/hardware/`` from published figures or written by ``moe-infer calibrate``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from moe_infer.config import ConfigError

GB = 1e9
HARDWARE_DIR = Path(__file__).resolve().parent / "hardware"


@dataclass
class Link:
    """A point-to-point path between two GPUs: ``alpha_us`` per message, ``gbps`` GB/s one way."""

    alpha_us: float
    gbps: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_us * 1e-6 + nbytes / (self.gbps * GB)


@dataclass
class Hardware:
    """What the model needs to know of a machine. Rates are achievable ones (measured, or a
    published peak times the efficiency stated in ``source``). ``matmul_curve``: per weight
    dtype, the TFLOP/s a GEMM reached by its activation rows (measured by ``moe-infer
    calibrate`` over weights larger than the cache); where a dtype has none, every GEMM
    runs at ``matmul_tflops``. ``collectives``: measured times of an all-reduce, all-gather
    and all-to-all by group size and message bytes; a group size it lacks is priced from
    the links. ``moe_read``: the fraction of ``mem_gbps`` at which the fused MoE kernel
    reads experts of a size when each sees a number of rows (1 where not measured).
    ``moe_kernel``: the fused MoE kernel's time on the experts one rank of a model holds
    (``moe_kernel_key``) by the tokens of a call, where ``moe-infer calibrate --models``
    timed it; it stands in for ``moe_read``'s generic figure for that share. ``moe_skew``:
    the same kernel on one GPU's experts by the tokens of a call and the experts its routing
    hits (uniform routing's count among them), for a measured routing.
    ``attention_curve``: a prompt's attention (the SDPA kernels a forward runs) in TFLOP/s
    by the keys a prompt has, "causal" (a fresh prompt, no mask) and "masked", per
    "<query/key width>/<value width>" of a head (``attention_rate``), and "causal-graph" /
    "masked-graph" on the kernels a prefill replayed from a CUDA graph takes; without it a
    prompt's attention runs at the matmul rate. ``prefill_call_us``: what a generate()
    call's prompts cost beside their forwards' blocks and head, whatever their size (the
    host's set-up of the call, the graph's launch, the sampling and the sync before the
    first token), measured by ``moe-infer calibrate`` on a model too small to read or
    compute anything."""

    name: str
    memory_gb: float  # per GPU
    mem_gbps: float  # device memory read bandwidth, GB/s
    matmul_tflops: dict  # weight dtype ("bfloat16", "int8") -> dense matmul TFLOP/s
    nvlink: Link  # between GPUs of one node
    network: Link  # between nodes
    gpus_per_node: int = 8
    layer_overhead_us: float = 20.0  # a block's fixed cost at decode sizes (kernel latencies)
    h2d_gbps: float = 0.0  # pinned host-to-device, for offload terms
    cpu_matmul_gbps: float = 0.0  # host matmul weight-read rate, for CPU experts
    source: str = ""
    matmul_curve: dict = field(default_factory=dict)  # weight dtype -> {rows: TFLOP/s}
    collectives: dict = field(default_factory=dict)  # kind -> {ranks: {bytes: µs}}
    moe_read: dict = field(default_factory=dict)  # bytes of one expert -> {rows per expert: fraction of mem_gbps}
    moe_kernel: dict = field(default_factory=dict)  # moe_kernel_key -> {tokens of a call: µs}
    moe_skew: dict = field(default_factory=dict)  # moe_kernel_key -> {tokens: {experts hit: µs}}
    attention_curve: dict = field(default_factory=dict)  # "causal" / "masked" [-graph] -> {"dk/dv": {keys: TFLOP/s}}
    prefill_call_us: float = 0.0  # a generate() call's prompts' fixed cost beside their forwards (the host's)

    @classmethod
    def load(cls, name_or_path: str | Path) -> "Hardware":
        """A profile by name (``moe_infer/hardware/<name>.yaml``) or path."""
        import yaml

        path = Path(name_or_path)
        if not path.suffix:
            path = HARDWARE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
            raise ConfigError(f"--hardware {name_or_path}: no such profile (shipped: {known}; or a YAML path "
                              f"from moe-infer calibrate)")
        raw = yaml.safe_load(path.read_text())
        try:
            raw["nvlink"], raw["network"] = Link(**raw["nvlink"]), Link(**raw["network"])
            return cls(**raw)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"{path}: not a hardware profile ({e})") from None

    def dump(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(dataclasses.asdict(self), sort_keys=False))

    def matmul_rate(self, dtype: str, rows: float) -> float:
        """FLOP/s of a GEMM of ``rows`` activation rows: ``matmul_curve``, log-linear between
        its points, proportional to the rows below its first (a weight-bound GEMM's time
        does not shrink with them), its last point's rate beyond; ``matmul_tflops`` without
        one."""
        curve = sorted((int(m), float(t)) for m, t in self.matmul_curve.get(dtype, {}).items())
        if not curve:
            return self.matmul_tflops[dtype] * 1e12
        rows = max(rows, 1e-9)
        if rows <= curve[0][0]:
            return curve[0][1] * 1e12 * rows / curve[0][0]
        return _log_between(curve, rows) * 1e12

    def attention_rate(self, kind: str, qk_width: float, v_width: float, keys: float,
                       graphed: bool = False) -> float | None:
        """FLOP/s of a prompt's attention (``kind`` "causal" or "masked") whose heads are
        ``qk_width`` / ``v_width`` wide, over prompts of ``keys`` keys: ``attention_curve``'s
        nearest measured widths, log-linear in the keys between its points, the end points'
        rates beyond them; ``graphed``: a prefill replayed from a CUDA graph, on that kind's
        "-graph" curve where the profile has one. None where it has no such curve."""
        curves = (self.attention_curve.get(f"{kind}-graph") if graphed else None) or self.attention_curve.get(kind)
        if not curves:
            return None
        widths = {tuple(float(w) for w in name.split("/")): by for name, by in curves.items()}
        near = min(widths, key=lambda w: abs(w[0] - qk_width) + abs(w[1] - v_width))
        return _log_between(sorted((float(s), float(t)) for s, t in widths[near].items()), max(keys, 1.0)) * 1e12

    def expert_read(self, expert_bytes: float, rows: float) -> float:
        """Fraction of the memory bandwidth at which experts of ``expert_bytes`` each read by
        ``rows`` rows stream in: ``moe_read``, log-linear in both between the measured
        points and the nearest measured beyond them; 1 without a table."""
        if not self.moe_read:
            return 1.0
        by_size = [(float(b), _log_between(sorted((float(r), float(v)) for r, v in by.items()), max(rows, 1e-9)))
                   for b, by in self.moe_read.items()]
        return max(_log_between(sorted(by_size), expert_bytes), 1e-3)

    def moe_kernel_s(self, key: str, tokens: float) -> float | None:
        """Seconds of one fused MoE call over ``tokens`` tokens on the experts ``key`` names
        (``moe_kernel_key``), where calibrate timed that share: log-log between the measured
        token counts, the fewest's time below them. None past the most tokens measured (the
        generic terms take over there) and where the share was not timed."""
        table = self.moe_kernel.get(key)
        if not table:
            return None
        points = sorted((float(t), float(us)) for t, us in table.items())
        if tokens > points[-1][0]:
            return None
        at = max(tokens, points[0][0])
        for (t0, u0), (t1, u1) in zip(points, points[1:]):
            if at <= t1:
                return math.exp(math.log(u0) + math.log(u1 / u0) * math.log(at / t0) / math.log(t1 / t0)) * 1e-6
        return points[-1][1] * 1e-6

    def moe_skewed_s(self, key: str, tokens: float, hit: float) -> float | None:
        """Seconds of one fused MoE call over ``tokens`` tokens on the experts ``key`` names
        when its routing hits ``hit`` of them, where calibrate timed that share so
        (``moe_skew``): linear in the experts hit between the counts timed at a token count
        (the nearest count beyond them), log-log in the tokens between the counts timed.
        None outside the token counts timed and where the share was not."""
        table = self.moe_skew.get(key)
        if not table:
            return None
        import numpy as np

        by_tokens = sorted((float(t), sorted((float(h), float(us)) for h, us in by.items()))
                           for t, by in table.items())
        if not by_tokens[0][0] <= tokens <= by_tokens[-1][0]:
            return None
        # (np.interp holds the end points' values beyond them)
        curve = [(t, math.log(np.interp(hit, *zip(*points)))) for t, points in by_tokens]
        return math.exp(_log_between(curve, tokens)) * 1e-6

    def moe_rows_measured(self) -> float:
        """The most rows per expert ``moe_read`` measured the kernel at (0 without a table):
        up to there its figure is the kernel's whole time, compute included."""
        return max((float(r) for by in self.moe_read.values() for r in by), default=0.0)

    def collective_s(self, kind: str, nbytes: float, ranks: int) -> float | None:
        """Seconds of a measured ``kind`` collective of ``nbytes`` over ``ranks``: linear in
        the bytes between the measured sizes and on the last two's slope beyond them, the
        smallest's time below it (latency-bound). None where that group size was not measured."""
        table = {int(r): t for r, t in self.collectives.get(kind, {}).items()}.get(ranks)
        if not table:
            return None
        points = sorted((float(b), float(us) * 1e-6) for b, us in table.items())
        if nbytes <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if nbytes <= b1:
                break
        return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)

    def link(self, ranks: int) -> Link:
        """The link a group of ``ranks`` consecutive ranks spans."""
        return self.nvlink if ranks <= self.gpus_per_node else self.network


def moe_kernel_key(local: int, experts: int, hidden: int, width: int, top_k: int, activation: str) -> str:
    """The ``moe_kernel`` key of a rank's experts: ``local`` of the model's ``experts`` (the
    calls' routing picks among all of them), ``hidden`` wide, each ``width`` wide (its slice),
    ``top_k`` a token, the model's activation."""
    return f"E{local}/{experts}:H{hidden}:F{width}:k{top_k}:{activation}"


def _log_between(points: list[tuple[float, float]], at: float) -> float:
    """The value at ``at`` of the curve through ``points`` (sorted (x, y)), log-linear in x
    between them, the end points' values beyond them."""
    at = min(max(at, points[0][0]), points[-1][0])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if at <= x1:
            return y0 + (y1 - y0) * math.log(at / x0) / math.log(x1 / x0)
    return points[-1][1]


# Device names (torch.cuda.get_device_name) -> the shipped profile of that GPU.
DEVICE_PROFILES = {"NVIDIA H100 80GB HBM3": "nvidia-h100-sxm", "NVIDIA H200": "nvidia-h200",
                   "NVIDIA A100-SXM4-80GB": "nvidia-a100-sxm", "NVIDIA A100-SXM4-40GB": "nvidia-a100-40gb"}


def local_profile() -> str | None:
    """The shipped profile of this machine's GPU (None: no GPU, or one without a profile)."""
    import torch

    return DEVICE_PROFILES.get(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
