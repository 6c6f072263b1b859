"""Models larger than the device: the experts hit most on it, the rest in host memory, read
from there by the device, copied in for the call or run by the CPU (``engine.gpu_memory_gb``,
``engine.offload``).

Shape letters: T tokens, k slots, H hidden, F expert width, E experts, P pairs.

The planner keeps every weight that is not a routed expert on the device (attention,
norms, routers, embeddings, shared experts, dense layers), then as many experts as the
budget holds, those hit most first (routing counts where given, else the same number in
every layer). ``OffloadedExperts`` takes a layer's place: the pairs routed to its device
experts run the fused kernel there. The others ("cold") run in one of three ways:
- in place (decode sizes, modes "auto" and "stream"): the same launches that read the
  device experts read the cold experts' weights where they lie, in pinned host memory,
  which the GPU addresses directly: no host wait and no copy step, so decode steps replay
  as CUDA graphs and each cold expert a step meets crosses the bus once;
- copied into a device staging area first (larger calls: a prefill's experts each serve
  many rows, and one copy serves them all);
- on the CPU over the host copies.
For calls past decode sizes, "auto" takes the CPU or the staging area, whichever the
machine's measured figures say is faster for the call's size (``ColdCost``); those calls
wait for the host once (which experts are cold; the CPU's way then also for its rows).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

import kernels
from kernels.moe.reference import dequantize_ref, expert_ffn_ref
from moe_infer.config import ConfigError
from moe_infer.experts import Experts

GB = 1e9
MODES = ("auto", "cpu", "stream")
WAYS = ("cpu", "stream")  # where auto may run a call's cold pairs
AREAS = 2  # the staging area's parts a streamed call's rounds take in turn (one copies while one computes)
STAGING = 8  # experts the staging area a model's layers share holds
STATS = ("pairs", "cold_pairs", "cold_experts", "cpu", "stream")  # what a layer's calls met (``tally``)


@dataclass(frozen=True)
class MachineProfile:
    """What cold experts cost on this machine: bytes a second copied from pinned host memory
    to the device, bytes of expert weights a second the CPU's matmuls read at decode sizes,
    and the CPU's matmul rate (FLOP/s) where a call has many tokens."""

    h2d_bytes_s: float
    cpu_bytes_s: float
    cpu_flops: float

    @classmethod
    def measure(cls, device: torch.device, dtype: torch.dtype, hidden: int, width: int) -> "MachineProfile":
        """Probes this machine once (a fraction of a second): a pinned copy to ``device``
        (on a CPU "device": a copy in host memory), and the CPU's matmuls on expert-sized
        weights in ``dtype``: at one token over enough of them that they come from memory, not
        from the CPU's caches, as cold experts do; at 256 tokens on one."""
        w = torch.randn(2 * width, hidden).to(dtype)
        weights = [w.clone() for _ in range(max(1, (256 << 20) // _bytes([w])))]
        mb = 64 << 20
        src = torch.empty(mb, dtype=torch.uint8, pin_memory=device.type == "cuda")
        dst = torch.empty(mb, dtype=torch.uint8, device=device)

        def best(fn, reps=5):
            fn()
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t)
            return min(times)

        h2d = mb / best(lambda: dst.copy_(src, non_blocking=True))
        one, many = torch.randn(1, hidden).to(dtype), torch.randn(256, hidden).to(dtype)
        cpu_bytes = _bytes(weights) / best(lambda: [one @ v.t() for v in weights], reps=3)
        flops = 2 * 256 * w.numel() / best(lambda: many @ w.t())
        return cls(h2d, cpu_bytes, flops)


@dataclass
class ColdCost:
    """Which way the cold pairs of a call run (``engine.offload: auto``). Each way's time is
    predicted from the profile and the bytes and FLOPs of the experts the call hits, then
    scaled by what that way has cost here: the smallest ratio of a call's measured time
    (from its start to its output, read once done) to its prediction over the way's last
    ``WINDOW`` calls. A probe of the bare rates misses the rest of each path (host copies,
    launches, the CPU's loop over experts, other load on the host), which decides between
    close ways. One-time costs (a kernel compiled for a new shape, host pages touched
    first, the CPU's thread pool starting) only ever make a call slower, by up to a
    thousand times a call: the smallest recent ratio passes over them, and a lasting change
    shows once it fills the window. The way not taken is tried again, so its figure follows
    the machine too, once the calls since its last try have cost ``RETRY`` times what a try
    of it is expected to: retries take at most about 1 / ``RETRY`` of the time however much
    slower that way is. Until a way has ``WINDOW`` measured calls, a try of it is expected
    to cost no more than the profile says, so one-time costs in its first calls cannot keep
    auto off it."""

    profile: MachineProfile
    expert_bytes: int  # one expert's weights as stored
    expert_flops: int  # per token routed to one expert (2 x its weights)
    RETRY = 32  # the time between tries of the way not taken, in tries of it
    WINDOW = 8  # measured calls of a way its figure is taken over
    ratios: dict = field(default_factory=lambda: {m: deque(maxlen=ColdCost.WINDOW) for m in WAYS})
    since: dict = field(default_factory=lambda: dict.fromkeys(WAYS, 0))  # calls since each way was taken
    pending: list = field(default_factory=list)  # (way, predicted s, start, end): calls not yet read

    def predict(self, mode: str, cold_pairs: int, cold_experts: int) -> float:
        """Seconds the profile gives ``mode`` for a call's cold pairs."""
        moved = cold_experts * self.expert_bytes
        if mode == "stream":
            return moved / self.profile.h2d_bytes_s
        return max(moved / self.profile.cpu_bytes_s, cold_pairs * self.expert_flops / self.profile.cpu_flops)

    def scale(self, mode: str) -> float:
        """What ``mode``'s calls have cost here over what the profile said (1 before any)."""
        return min(self.ratios[mode], default=1.0)

    def mode(self, cold_pairs: int, cold_experts: int) -> str:
        if cold_pairs == 0:
            return "cpu"
        self._read()
        profile = {m: self.predict(m, cold_pairs, cold_experts) for m in WAYS}
        cost = {m: profile[m] * self.scale(m) for m in WAYS}
        best = min(cost, key=cost.get)
        other = "stream" if best == "cpu" else "cpu"
        trial = cost[other] if len(self.ratios[other]) == self.WINDOW else min(cost[other], profile[other])
        way = other if self.since[other] * cost[best] >= self.RETRY * trial else best
        for m in self.since:
            self.since[m] = 0 if m == way else self.since[m] + 1
        return way

    def observe(self, mode: str, predicted_s: float, seconds: float) -> None:
        """One call of ``mode`` took ``seconds`` where the profile said ``predicted_s``."""
        if predicted_s > 0:
            self.ratios[mode].append(seconds / predicted_s)

    def timed(self, mode: str, cold_pairs: int, cold_experts: int, device: torch.device):
        """-> a function that ends the timing of this call (at its output): on a GPU, events
        on the stream, read at a later call once they have run; elsewhere the host's clock."""
        predicted = self.predict(mode, cold_pairs, cold_experts)
        if device.type != "cuda":
            start = time.perf_counter()
            return lambda: self.observe(mode, predicted, time.perf_counter() - start)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()

        def done():
            end.record()
            self.pending.append((mode, predicted, begin, end))
        return done

    def _read(self) -> None:
        while self.pending and self.pending[0][3].query():
            mode, predicted, begin, end = self.pending.pop(0)
            self.observe(mode, predicted, begin.elapsed_time(end) / 1e3)


@dataclass(frozen=True)
class Placement:
    """Per MoE layer (in model order), the experts kept on the device; and the bytes."""

    hot: list[list[int]]
    device_bytes: int  # everything kept on the device
    expert_bytes: int  # one expert


def expert_layers(model: nn.Module) -> list[tuple[nn.Module, str, Experts]]:
    """(parent, attribute, experts) of every routed-expert module, in model order."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, Experts)]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_bytes(experts: Experts) -> int:
    """One expert's weights (and int8 scales) as this module stores them."""
    return _bytes([experts.w13, experts.w2, *experts.scales().values()]) // experts.w13.shape[0]


def plan(model: nn.Module, budget_bytes: float, counts: list[list[int]] | None = None) -> Placement:
    """The experts to keep on the device within ``budget_bytes`` of weights. Everything that
    is not a routed expert stays there first: a budget below it fails with one line saying
    what fits. ``counts``: per layer, how often each expert was routed to (the most routed
    first); without, every layer keeps the same number (the first ones)."""
    layers = expert_layers(model)
    inside = {id(t) for _, _, e in layers for t in (*e.parameters(), *e.buffers())}
    fixed = _bytes([t for t in (*model.parameters(), *model.buffers()) if id(t) not in inside])
    if fixed > budget_bytes:
        total = fixed + sum(_bytes([*e.parameters(), *e.buffers()]) for _, _, e in layers)
        raise ConfigError(f"engine.gpu_memory_gb={budget_bytes / GB:g}: the weights that are not routed experts "
                          f"(attention, norms, routers, embeddings, shared experts, dense layers) need "
                          f"{fixed / GB:.2f} GB on the device; expected at least that ({total / GB:.2f} GB holds "
                          f"every expert too)")
    if not layers:
        return Placement([], fixed, 0)
    one = expert_bytes(layers[0][2])
    slots = int((budget_bytes - fixed) // one) if one else 0
    hot = pick([e.w13.shape[0] for _, _, e in layers], slots, counts)
    return Placement(hot, fixed + sum(map(len, hot)) * one, one)


def pick(num: list[int], slots: int, counts: list[list[float]] | None = None) -> list[list[int]]:
    """``slots`` experts over layers of ``num`` experts each: the most routed first
    (``counts`` per layer), ties round the layers, so even counts spread evenly -> per
    layer, its picked experts in order."""
    if counts is None:
        counts = [[0] * n for n in num]
    order = sorted((-counts[layer][e], e, layer) for layer, n in enumerate(num) for e in range(n))
    hot = [[] for _ in num]
    for _, e, layer in order[:slots]:
        hot[layer].append(e)
    return [sorted(h) for h in hot]


def rebalance(model: nn.Module, decay: float = 0.5) -> int:
    """Moves experts between the device and host memory by the routing counts the
    offloaded layers gathered: in each layer its most routed, as many as its placement
    keeps on the device (the kernels specialise on a layer's expert count: a count that
    changed would compile new variants inside decode steps), an expert on the device
    staying where counts tie. Then weighs the counts by ``decay``, so later traffic counts
    more -> experts moved in."""
    moved = 0
    for m in (m for m in model.modules() if isinstance(m, OffloadedExperts)):
        counts = m.routed.tolist()  # one wait for the host per layer
        here = set(m.hot)
        keep = sorted(range(len(counts)), key=lambda e: (-counts[e], e not in here, e))[:len(m.hot)]
        moved += len(set(keep) - here)
        m.set_hot(keep)
        m.routed.mul_(decay)
    return moved


class Staging:
    """The device staging area a model's offloaded layers share (they run one after another):
    ``AREAS`` parts of ``round_size`` experts each (``staging`` experts in all, for
    layers of ``experts``), which the rounds of every layer's streamed calls take in
    turn; a copy stream (on a GPU); and for each part the event of the kernels that read
    it last, which a copy into it waits for. Made whole at the first streamed call (the
    experts' tensors as the host holds them). Shared, it costs ``AREAS x round_size``
    experts of device memory whatever the layers, and a layer's first copies run while
    the layer before computes its last round."""

    def __init__(self, experts: int, staging: int = STAGING):
        self.round_size = self.round_size_of(experts, staging)
        self.tensors: dict[str, torch.Tensor] = {}
        self.copies: torch.cuda.Stream | None = None
        self.free: list = [None] * AREAS
        self.turn = 0  # the part the next round takes

    @staticmethod
    def round_size_of(experts: int, staging: int = STAGING) -> int:
        """Experts a round holds for a layer of ``experts``: ``staging`` (at most the layer's
        experts) over the ``AREAS`` parts, at least one."""
        return max(1, min(staging, experts) // AREAS)

    def take(self, host: dict[str, torch.Tensor], device: torch.device) -> int:
        """-> the first slot of the part the next round copies into (the tensors made at the
        first call, shaped as ``host``'s experts)."""
        if not self.tensors:
            self.tensors = {k: torch.empty((self.round_size * AREAS, *v.shape[1:]), dtype=v.dtype, device=device)
                            for k, v in host.items()}
            self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        part = self.turn % AREAS
        self.turn += 1
        return part * self.round_size


def staging_bytes(model: nn.Module, dtype: torch.dtype, staging: int = STAGING) -> int:
    """Device bytes of the staging areas ``apply`` gives ``model``'s layers (each expert's
    weights in ``dtype``, before any quantization: at most what they take after)."""
    kinds = {(tuple(e.w13.shape), tuple(e.w2.shape)) for _, _, e in expert_layers(model)}
    return sum(Staging.round_size_of(w13[0], staging) * AREAS * (math.prod(w13[1:]) + math.prod(w2[1:]))
               * dtype.itemsize for w13, w2 in kinds)


class OffloadedExperts(nn.Module):
    """One layer's experts split by a ``Placement``: ``w13`` / ``w2`` hold the device
    experts (in the order of ``hot``), the host tensors every expert (pinned where the
    device is a GPU). ``mode``: "cpu" (cold pairs run on the CPU), "stream" (their experts
    are copied into a device staging area of ``staging`` experts, as many rounds as needed,
    each round into one of its ``AREAS`` parts in turn; ``area``: a ``Staging`` shared with
    the model's other layers instead), or "auto" (``ColdCost`` chooses per call).
    ``in_place``: calls of at most that many tokens read their cold experts in place (modes
    "stream" and "auto"; 0: none)."""

    def __init__(self, experts: Experts, hot: list[int], device: torch.device, mode: str, cost: ColdCost,
                 staging: int = STAGING, in_place: int = 0, area: Staging | None = None):
        super().__init__()
        self.activation, self.options = experts.activation, experts.options
        self.weighted_input = experts.weighted_input  # (Llama 4: the weight on the expert's input)
        self.mode, self.cost = mode, cost
        self.in_place = in_place if mode != "cpu" else 0
        pinned = device.type == "cuda"
        e = experts.w13.shape[0]

        def host(t):
            t = t.detach()
            mapped = getattr(t.untyped_storage(), "filename", None) is not None  # engine.offload_dir: stays on disk
            return t.pin_memory() if pinned and not t.is_pinned() and not mapped else t

        # (int8 scales and GPT-OSS's biases: per expert, beside its weights)
        extras = {**experts.scales(), **{k: v for k, v in experts.biases().items() if v is not None}}
        self.host = {"w13": host(experts.w13), "w2": host(experts.w2), **{k: host(v) for k, v in extras.items()}}
        if pinned and not all(t.is_pinned() for t in self.host.values()):
            self.in_place = 0  # memory-mapped from files: the device cannot address them
        self.register_buffer("slot", torch.full((e,), -1, dtype=torch.long, device=device),
                             persistent=False)  # expert -> device slot, -1: cold
        # Routed pairs per expert, weighed down at each ``rebalance``.
        self.register_buffer("routed", torch.zeros(e, dtype=torch.float32, device=device), persistent=False)
        self.w13 = self.w2 = None
        self.set_hot(hot)
        # Experts a streamed round holds (a rebalance may cool any): the staging area holds
        # AREAS rounds.
        self.area = area or Staging(e, staging)
        # What the calls met (``STATS``; in-place calls count as streamed: their cold experts
        # cross the bus), summed on the device so that graph replays count too.
        self.register_buffer("tally", torch.zeros(len(STATS), dtype=torch.float64, device=device),
                             persistent=False)
        self._side: dict = {}  # device -> the stream in-place calls count on

    def set_hot(self, hot: list[int]) -> None:
        """Keeps experts ``hot`` on the device, copied from the host copies. As many as
        now (a rebalance): only the experts that come in are copied, each into the place
        of one that leaves, so the device tensors keep their shapes; otherwise they are
        made anew. ``self.hot``: the expert in each place."""
        device = self.slot.device
        if self.w13 is not None and set(hot) == set(self.hot):
            return
        if self.w13 is not None and len(hot) == len(self.hot):
            new, now = set(hot), set(self.hot)
            leaving = [i for i, e in enumerate(self.hot) if e not in new]
            coming = [e for e in hot if e not in now]
            for i, e in zip(leaving, coming):
                for name, t in (("w13", self.w13), ("w2", self.w2), *self.device_extras.items()):
                    t.data[i].copy_(self.host[name][e], non_blocking=True)  # (pinned on a GPU host)
                self.hot[i] = e
        else:
            index = torch.tensor(sorted(hot), dtype=torch.long)
            self.w13 = nn.Parameter(self.host["w13"][index].to(device), requires_grad=False)
            self.w2 = nn.Parameter(self.host["w2"][index].to(device), requires_grad=False)
            self.device_extras = {k: self.host[k][index].to(device) for k in self.host if k not in ("w13", "w2")}
            self.hot = index.tolist()
        slot = torch.full(self.slot.shape, -1, dtype=torch.long)
        slot[torch.tensor(self.hot, dtype=torch.long)] = torch.arange(len(self.hot))
        self.slot.copy_(slot)

    @property
    def stats(self) -> dict[str, float]:
        """The calls' ``tally`` by name (a wait for the device)."""
        return dict(zip(STATS, self.tally.tolist()))

    def waits_for_host(self, num_tokens: int) -> bool:
        """Whether a call of ``num_tokens`` tokens waits for the host (so no CUDA graph holds it)."""
        return num_tokens > self.in_place

    @property
    def num_cold(self) -> int:
        return len(self.slot) - len(self.hot)

    def scales(self) -> dict:
        return {k: v for k, v in self.device_extras.items() if k.endswith("_scale")}

    def pairs_from_ids(self, x: torch.Tensor, top_k: int) -> bool:
        return True  # no maps: the pairs are split here

    def fused(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
              capacity: int | None = None, maps: tuple | None = None, masked: bool = False,
              first_expert: int = 0) -> torch.Tensor:
        """x [T, H], ids and weights [T, k] -> the weighted sum of each token's experts [T, H]
        (dropless: ``capacity`` must be None; ``masked``: the ids count from
        ``first_expert``, experts not here add nothing)."""
        if capacity is not None:
            raise ValueError("offloaded experts run dropless: moe.capacity_factor must be null")
        first = first_expert if masked else 0
        if not self.waits_for_host(x.shape[0]):
            return self._in_place(x, expert_ids, weights, masked, first)
        # Each pair's device slot (-1: cold, -2: not here), its cold expert and each expert's
        # cold pairs, counted on the device in one launch.
        slot, cold, met = kernels.cold_pairs(expert_ids, self.slot, self.routed, self.tally, None, first,
                                             pdl=self.options.pdl)
        counts = met.tolist()  # the call's one wait for the host
        used = [e for e, n in enumerate(counts) if n]
        run = dict(pdl=self.options.pdl, weighted_input=self.weighted_input)
        if not used:
            if not self.hot:  # no expert here at all (every pair is elsewhere): the kernels take none
                return torch.zeros_like(x)
            return kernels.fused_moe(x, self.w13, self.w2, weights, slot, self.activation, masked=masked, **run,
                                     **self.device_extras)
        n_cold = sum(counts)
        mode = self.mode if self.mode != "auto" else self.cost.mode(n_cold, len(used))
        timed = self.cost.timed(mode, n_cold, len(used), x.device) if self.mode == "auto" else None
        self.tally[STATS.index(mode)] += 1  # the way this call's cold pairs take
        # The cold experts' first copies (stream) start before the device experts run; the
        # CPU's work (cpu) runs while they do.
        size = self.area.round_size
        rounds = [used[lo:lo + size] for lo in range(0, len(used), size)]
        copies = [self._stage_round(chunk) for chunk in rounds[:AREAS]] if mode == "stream" else []
        if mode == "cpu":  # the cold pairs' rows to the host before the device experts are queued
            cold_t, cold_s = (cold >= 0).nonzero(as_tuple=True)
            pairs = [t.cpu() for t in (x[cold_t], cold[cold_t, cold_s], weights[cold_t, cold_s].float())]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if self.hot:  # cold pairs and pairs elsewhere are masked (negative slots)
            out += kernels.fused_moe(x, self.w13, self.w2, weights, slot, self.activation, masked=True, **run,
                                     **self.device_extras)
        if mode == "cpu":
            out.index_add_(0, cold_t, self._on_cpu(*pairs, used).to(x.device, non_blocking=True))
        else:
            self._streamed(x, weights, cold, met, rounds, copies, out)
        if timed is not None:
            timed()
        return out.to(x.dtype)

    def _in_place(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, masked: bool,
                  first: int) -> torch.Tensor:
        """Every pair on the device, no wait for the host: the kernels read the device
        experts, and the host copies of the others where they lie (pinned host memory is in
        the device's address space; each cold expert crosses the bus once per row tile of
        its pairs: once at decode sizes), in one launch each where they can (``fused_moe``'s
        ``far`` and ``slots``: the layer's table of device slots). The call's counters
        (``cold_pairs``, its cold pairs counted as streamed) run beside them on a second
        stream: nothing but the layer's output waits for them -> [T, H] in x's dtype."""
        side = None
        if x.is_cuda:
            side = self._side.get(x.device)
            if side is None:
                side = self._side[x.device] = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))  # the ids are ready
            ids.record_stream(side)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            kernels.cold_pairs(ids, self.slot, self.routed, self.tally, STATS.index("stream"), first, pdl=False)
        run = dict(pdl=self.options.pdl, masked=masked, first_expert=first, weighted_input=self.weighted_input)
        if self.hot:
            out = kernels.fused_moe(x, self.w13, self.w2, weights, ids, self.activation, **run, **self.device_extras,
                                    far=self.host, slots=self.slot)
        else:
            extras = {k: v for k, v in self.host.items() if k not in ("w13", "w2")}
            out = kernels.fused_moe(x, self.host["w13"], self.host["w2"], weights, ids, self.activation, **run,
                                    **extras)
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        return out

    def _on_cpu(self, xc: torch.Tensor, ids_c: torch.Tensor, wc: torch.Tensor, used: list[int]) -> torch.Tensor:
        """The cold pairs (rows xc [P, H], experts ids_c [P], weights wc [P] float32, in host
        memory) on the CPU, expert by expert over the host weights -> their weighted outputs
        [P, H] float32 in host memory."""
        dtype = xc.dtype if self.host["w13"].dtype in (torch.int8, torch.uint8) else self.host["w13"].dtype
        yc = torch.zeros(xc.shape, dtype=torch.float32)
        s13, s2 = self.host.get("w13_scale"), self.host.get("w2_scale")  # int8 / MXFP4 only
        b13, b2 = self.host.get("b13"), self.host.get("b2")  # GPT-OSS only
        for e in used:
            rows = (ids_c == e).nonzero(as_tuple=True)[0]
            w13 = dequantize_ref(self.host["w13"][e], None if s13 is None else s13[e], dtype)
            w2 = dequantize_ref(self.host["w2"][e], None if s2 is None else s2[e], dtype)
            xr, wr = xc[rows].float(), wc[rows, None]
            if self.weighted_input:
                xr, wr = xr * wr, torch.ones_like(wr)
            y = expert_ffn_ref(xr.to(dtype), w13, w2, self.activation, None if b13 is None else b13[e].to(dtype),
                               None if b2 is None else b2[e].to(dtype))
            yc.index_add_(0, rows, y.float() * wr)
        return yc

    def _stage_round(self, chunk: list[int]) -> tuple[int, torch.cuda.Event | None]:
        """Copies experts ``chunk`` into the staging area's next part (on its copy stream on a
        GPU, once the kernels of the round that read that part last are done) -> (the part's
        first slot, the copies' event: None on CPU)."""
        area = self.area
        base = area.take(self.host, self.w13.device)
        if area.copies is None:
            for j, e in enumerate(chunk):
                for k, v in self.host.items():
                    area.tensors[k][base + j].copy_(v[e])
            return base, None
        with torch.cuda.stream(area.copies):
            if area.free[base // area.round_size] is not None:
                area.copies.wait_event(area.free[base // area.round_size])
            for j, e in enumerate(chunk):
                for k, v in self.host.items():
                    area.tensors[k][base + j].copy_(v[e], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return base, done

    def _streamed(self, x: torch.Tensor, weights: torch.Tensor, cold: torch.Tensor, met: torch.Tensor,
                  rounds: list[list[int]], copies: list, out: torch.Tensor) -> None:
        """Adds the cold pairs' outputs to ``out`` [T, H] float32: their experts (``met``'s,
        in ``rounds``) copied into the staging area a round at a time, its parts taken in
        turn, so that a round's copies run while the round before computes (the first
        ``AREAS`` rounds' copies already queued: ``copies``, their parts and events). Each
        round's kernel takes every pair, those of other rounds masked: no wait for the host."""
        # Each cold pair's place among the call's cold experts (``rounds`` in order), -1 elsewhere.
        rank = torch.cumsum(met > 0, 0) - 1
        place = torch.where(cold >= 0, rank[cold.clamp(min=0)], -1)
        area = self.area
        # The kernels take the whole staging area, however few experts a round holds: they
        # specialise on the expert count, and a count a round would compile a variant each.
        extras = {k: area.tensors[k] for k in self.host if k not in ("w13", "w2")}
        stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
        lo = 0
        for i, chunk in enumerate(rounds):
            base, done = copies[i] if i < len(copies) else self._stage_round(chunk)
            if done is not None:
                stream.wait_event(done)
            here = place - lo
            slots = torch.where((here >= 0) & (here < len(chunk)), here + base, -1)
            out += kernels.fused_moe(x, area.tensors["w13"], area.tensors["w2"], weights, slots, self.activation,
                                     pdl=self.options.pdl, masked=True, weighted_input=self.weighted_input, **extras)
            if stream is not None:  # the part is free for a later round's copies once these kernels are done
                area.free[base // area.round_size] = stream.record_event()
            lo += len(chunk)


def apply(model: nn.Module, placement: Placement, device: torch.device, mode: str, cost: ColdCost,
          in_place: int = 0, staging: int = STAGING) -> None:
    """Replaces every layer's experts by its ``OffloadedExperts``; the layers whose experts
    have the same shapes and dtypes share one ``Staging`` area of ``staging`` experts."""
    areas: dict = {}
    for (parent, name, experts), hot in zip(expert_layers(model), placement.hot):
        tensors = {"w13": experts.w13, "w2": experts.w2, **experts.scales(), **experts.biases()}
        kind = tuple((k, tuple(v.shape), v.dtype) for k, v in tensors.items() if v is not None)
        area = areas.setdefault(kind, Staging(experts.w13.shape[0], staging))
        setattr(parent, name, OffloadedExperts(experts, hot, device, mode, cost, in_place=in_place, area=area))


def offload_experts(model: nn.Module, cfg, device: torch.device, dtype: torch.dtype) -> Placement:
    """The loader's last step for ``engine.gpu_memory_gb``: plans the placement of the
    loaded model (its experts in host memory), measures this machine, and puts each
    layer's ``OffloadedExperts`` in place -> the placement. Calls up to a decode step's
    largest bucket (``engine.max_batch_size`` rows, to a power of two) read cold experts in
    place (modes "auto" and "stream"; a layer whose host copies are memory-mapped from
    files cannot), so decode steps never wait for the host and run as CUDA graphs; not
    under expert parallelism, where a layer takes other ranks' rows too."""
    engine_cfg, p = cfg.engine, cfg.parallel
    placement = plan(model, engine_cfg.gpu_memory_gb * GB)
    layers = expert_layers(model)
    if layers:
        first = layers[0][2]
        packs = 2 if first.w13.dtype == torch.uint8 else 1  # MXFP4: two weights a byte
        f, h = first.w2.shape[2] * packs, first.w2.shape[1]
        quantized = first.w13.dtype in (torch.int8, torch.uint8)
        profile = MachineProfile.measure(device, dtype if quantized else first.w13.dtype, h, f)
        per_token = 2 * packs * (first.w13[0].numel() + first.w2[0].numel())
        rows = 1 << (engine_cfg.max_batch_size - 1).bit_length() if p.ep * p.expert_slicing == 1 else 0
        apply(model, placement, device, engine_cfg.offload, ColdCost(profile, placement.expert_bytes, per_token), rows)
    return placement
