#!/usr/bin/env python
"""Benchmark of the single-device MoE layer kernels (``kernels.fused_moe`` and the routing
ops) against three torch baselines measured in the same run.

For every model shape and token count T it times our fused MoE (bf16, and int8 weights
from ``kernels.quantize_int8``), a Hugging Face style per-expert loop,
``torch._grouped_mm`` after a sort, and the GShard / DeepSpeed-v1 one-hot einsum; the
routing part as the layer runs it at that T (at decode sizes the gating launch alone, the
experts reading the pairs from the ids; past them gating and maps) eagerly and as a CUDA
graph. Graph times are per call, from one graph that replays every
input set (as a decode-step graph would hold the layer). Weight bytes read and FLOPs are
set against the copy bandwidth and bf16 matmul rate measured at the start. The %mm column
uses the matmul rate sustained in a long graph (``bench_common.measure_matmul_tflops``): the
graph times of large T run as long, at the power-limited clock; the burst rate is printed
beside it. One table is printed last; the same data goes to
bench/results/moe-<device>-<date>.json.

    python scripts/bench_moe.py                                # full sweep on the GPU
    python scripts/bench_moe.py --shapes mixtral --tokens 1,64 --dtypes bf16
    python scripts/bench_moe.py --device cpu --smoke           # tiny shapes, end to end

Shape letters: T tokens, H hidden, E experts, k slots per token, F expert width,
C capacity (rows per expert in the einsum baseline), R rows of w13 (2F for SwiGLU, F for GeLU).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]  # this working tree's kernels; bench_common
if not torch.cuda.is_available():  # before triton is imported: CPU Triton runs need the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bench_common as bc  # noqa: E402
import kernels  # noqa: E402
from kernels.moe.reference import fused_moe_ref  # noqa: E402
from kernels.moe.triton import pairs_from_ids  # noqa: E402


@dataclasses.dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int  # H
    ffn: int  # F
    experts: int  # E
    topk: int  # k
    activation: str  # "silu" (SwiGLU, w13 = gate rows then up rows) or "gelu" (plain)
    renormalize: bool  # whether the model renormalises its top-k softmax weights

    @property
    def rows13(self) -> int:  # R
        return 2 * self.ffn if self.activation == "silu" else self.ffn

    def expert_bytes(self, dtype: str) -> int:
        """Bytes of one expert's weights (int8: plus its float32 per-channel scales)."""
        params = (self.rows13 + self.ffn) * self.hidden
        if dtype == "int8":
            return params + 4 * (self.rows13 + self.hidden)
        return 2 * params

    def flops(self, t: int) -> int:
        return 2 * t * self.topk * self.hidden * self.rows13 + 2 * t * self.topk * self.ffn * self.hidden


SHAPES = {s.name: s for s in [
    MoeShape("mixtral", 4096, 14336, 8, 2, "silu", True),
    MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, "silu", True),
    MoeShape("olmoe", 2048, 1024, 64, 8, "silu", False),
    MoeShape("ds-moe-1.3b-e128", 2048, 8192, 128, 1, "gelu", False),
]}
SMOKE_SHAPES = {s.name: s for s in [
    MoeShape("tiny-silu", 128, 256, 8, 2, "silu", True),
    MoeShape("tiny-gelu", 128, 192, 16, 1, "gelu", False),
]}
TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384)
SMOKE_TOKENS = (1, 16, 256)
CHECK_TOKENS = (16,)  # T of the once-per-shape correctness checks (--check-tokens)
INPUT_SET_BYTES = 256 << 20  # rotating input sets per T share this much memory
MAX_INPUT_SETS = 8
TFLOPS_MIN_T = 256  # below this the layer is bandwidth-bound: FLOP rates mean little


@dataclasses.dataclass
class Timing:
    """A measured median (``us``) or why there is none (``cell`` for the table, ``note``)."""
    us: float | None = None
    cell: str = ""
    note: str = ""

    def text(self) -> str:
        return f"{self.us:.1f}" if self.us is not None else self.cell


@dataclasses.dataclass
class MoeInputs:
    x: torch.Tensor  # [T, H]
    logits: torch.Tensor  # [T, E] float32 router logits
    ids: torch.Tensor  # [T, k] int32
    weights: torch.Tensor  # [T, k] float32


# --- the three baselines ---------------------------------------------------------------

def _act(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


def loop_moe(x, w13, w2, weights, ids, activation):
    """Hugging Face eager Mixtral: for each expert hit, index its tokens, run its FFN,
    index_add_ the weighted result."""
    out = torch.zeros_like(x)  # [T, H]
    expert_mask = F.one_hot(ids.long(), w13.shape[0]).permute(2, 1, 0)  # [E, k, T]
    hit = (expert_mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist()  # a host sync
    for e in hit:
        slot, tok = torch.where(expert_mask[e])
        h = F.linear(_act(F.linear(x[tok], w13[e]), activation), w2[e])
        out.index_add_(0, tok, h * weights[tok, slot, None].to(x.dtype))
    return out


def grouped_mm_moe(x, w13, w2, weights, ids, activation):
    """Sort the (token, slot) pairs by expert, two ``torch._grouped_mm`` calls, un-permute."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # buffer row -> flat (token, slot) index
    token = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0, dtype=torch.int32)
    h = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs)  # [T*k, R]
    ys = torch._grouped_mm(_act(h, activation), w2.transpose(1, 2), offs=offs)  # [T*k, H]
    w = weights.reshape(-1)[order, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, ys.float() * w).to(x.dtype)


def einsum_capacity(ids: torch.Tensor, num_experts: int) -> int:
    """Dropless capacity as DeepSpeed v1 computes it when it drops no tokens: the largest
    per-expert count (a host sync). C = T*k is dropless too, but with uniform routing it is
    about E times that count, so the baseline would do ~E times the work of the real thing."""
    return int(torch.bincount(ids.reshape(-1).long(), minlength=num_experts).max())


def einsum_moe(x, w13, w2, weights, ids, activation):
    """GShard / DeepSpeed-v1 sparse einsum: one-hot [T, E, C] dispatch and combine masks."""
    t, k = ids.shape
    e = w13.shape[0]
    mask = F.one_hot(ids.long(), e)  # [T, k, E]
    # Position inside the expert's buffer: all first choices before any second choice,
    # as DeepSpeed's top2gating orders them.
    slot_major = mask.transpose(0, 1).reshape(k * t, e)
    locations = (torch.cumsum(slot_major, 0) - 1).reshape(k, t, e).transpose(0, 1)
    loc = (locations * mask).sum(-1)  # [T, k]
    capacity = einsum_capacity(ids, e)
    gates = mask.float() * weights.unsqueeze(-1)  # [T, k, E]
    combine = torch.einsum("tke,tkc->tec", gates, F.one_hot(loc, capacity).float())  # [T, E, C]
    dispatch = combine.bool().to(x.dtype)
    xe = torch.einsum("tec,th->ech", dispatch, x)  # [E, C, H]
    h = _act(torch.einsum("ech,erh->ecr", xe, w13), activation)  # [E, C, F]
    ye = torch.einsum("ecf,ehf->ech", h, w2)  # [E, C, H]
    return torch.einsum("tec,ech->th", combine.to(x.dtype), ye)


def einsum_bytes(shape: MoeShape, t: int, capacity: int) -> int:
    """Peak memory estimate of einsum_moe: the masks plus the expert buffers."""
    masks = t * shape.experts * capacity * (4 + 1 + 2 + 2)  # fp32 combine, bool, 2 x bf16
    one_hot = t * shape.topk * capacity * (8 + 4)
    buffers = shape.experts * capacity * (2 * shape.hidden + shape.rows13 + shape.ffn) * 2
    return masks + one_hot + buffers


BASELINES = {"loop": loop_moe, "grouped_mm": grouped_mm_moe, "einsum": einsum_moe}


# --- weights, inputs, checks -----------------------------------------------------------

def make_weights(shape: MoeShape, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 w13 [E, R, H], w2 [E, H, F], std 0.02 (never zeros: zero weights would
    flatter power-limited matmuls)."""
    w13 = torch.empty(shape.experts, shape.rows13, shape.hidden, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(shape.experts, shape.hidden, shape.ffn, dtype=torch.bfloat16, device=device)
    return w13.normal_(0.0, 0.02, generator=gen), w2.normal_(0.0, 0.02, generator=gen)


def make_inputs(shape: MoeShape, t: int, n_sets: int, device, gen) -> list[MoeInputs]:
    """Activations and random router logits routed by kernels.topk_gating, so the experts
    hit are as uniform as a real router's."""
    sets = []
    for _ in range(n_sets):
        x = torch.randn(t, shape.hidden, generator=gen, device=device).to(torch.bfloat16)
        logits = torch.randn(t, shape.experts, generator=gen, device=device)
        ids, weights = kernels.topk_gating(logits, shape.topk, score="softmax",
                                           renormalize=shape.renormalize)
        sets.append(MoeInputs(x, logits, ids, weights))
    return sets


def n_input_sets(shape: MoeShape, t: int) -> int:
    per_set = t * (2 * shape.hidden + 4 * shape.experts + 8 * shape.topk)
    return max(2, min(MAX_INPUT_SETS, INPUT_SET_BYTES // per_set))


def rel_errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative norm error, max abs error / max abs reference)."""
    diff = (y.float() - ref).abs()
    return (diff.norm() / ref.norm()).item(), (diff.max() / ref.abs().max()).item()


def reference_fp32(inp: MoeInputs, w13, w2, activation, s13=None, s2=None) -> torch.Tensor:
    """fused_moe_ref in float32 over only the experts hit (the full float32 copy
    of a 128-expert shape would take 17 GB). With scales, the dequantized int8 weights."""
    hit = inp.ids.unique()  # sorted
    ids = torch.searchsorted(hit, inp.ids).to(torch.int32)  # renumbered 0..len(hit)-1
    w13, w2 = w13[hit].float(), w2[hit].float()
    if s13 is not None:
        w13, w2 = w13 * s13[hit, :, None], w2 * s2[hit, :, None]
    return fused_moe_ref(inp.x.float(), w13, w2, inp.weights, ids, activation)


# --- measuring -------------------------------------------------------------------------

@dataclasses.dataclass
class Sweep:
    """Settings shared by every measurement of a run."""
    device: torch.device
    max_reps: int
    budget_s: float  # time to spend repeating one measurement
    cap_s: float  # baselines whose single run exceeds this are skipped


def _short(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:160]}"


def measure(sweep: Sweep, fn: Callable, inputs: list, capped: bool = False) -> Timing:
    """Median µs of ``fn`` rotating over ``inputs``, with adaptive repeats; failures and
    over-cap cases come back as a Timing without ``us``."""
    try:
        fn(inputs[0])  # first call: lazy init, Triton compilation and autotuning
        single = bc.single_run_s(lambda: fn(inputs[1 % len(inputs)]), sweep.device)
        if capped and single > sweep.cap_s:
            return Timing(cell="skip(>cap)", note=f"skipped: one run took {single * 1e3:.1f} ms "
                                                  f"(cap {sweep.cap_s * 1e3:g} ms)")
        reps = bc.adaptive_reps(single, sweep.budget_s, sweep.max_reps)
        return Timing(bc.time_fn(fn, min(reps, 3), reps, inputs=inputs, device=sweep.device))
    except torch.OutOfMemoryError as exc:  # the caller empties the cache once exc is gone
        return Timing(cell="n/a(OOM)", note=_short(exc))
    except Exception as exc:  # a failing case must not end a long sweep
        return Timing(cell="n/a", note=_short(exc))


def measure_graph(sweep: Sweep, fn: Callable[[], object]) -> Timing:
    if sweep.device.type != "cuda":
        return Timing(cell="n/a", note="CUDA graphs need a CUDA device")
    try:
        return Timing(bc.time_graph(fn, reps=max(3, min(sweep.max_reps, 50)), device=sweep.device))
    except Exception as exc:  # e.g. an op that syncs the host cannot be captured
        try:
            torch.cuda.synchronize(sweep.device)
        except Exception:
            pass
        return Timing(cell="n/a", note=_short(exc))


class Notes:
    """Reasons for n/a and skipped cells, grouped so each reason prints once."""

    def __init__(self):
        self.by_reason: dict[str, list[str]] = defaultdict(list)

    def add(self, where: str, timing: Timing) -> None:
        if timing.us is None and timing.note:
            self.by_reason[timing.note].append(where)

    def lines(self) -> list[str]:
        out = []
        for reason, where in self.by_reason.items():
            shown = ", ".join(where[:6]) + (f", ... ({len(where)} cases)" if len(where) > 6 else "")
            out.append(f"  {reason}  [{shown}]")
        return out


def routing_fn(shape: MoeShape, inp: MoeInputs, weights: dict) -> tuple[Callable[[MoeInputs], object], str]:
    """Routing on its own, router logits given, as the layer runs it at this T, and what
    that is. Where the experts take the pairs from the ids (``pairs_from_ids``: T <= 16
    with the CUDA decode kernels, or few pairs) it is the gating launch alone
    (``kernels.topk_gating``, what the model's router then calls): no maps, and no scatter
    or gather to time, as the up GEMM reads x by pair and the down GEMM sums the slots.
    Otherwise gating and maps (``kernels.route``, one launch at decode sizes), what the
    router calls before the experts, which read x in place through the maps and combine
    the slots themselves."""
    if pairs_from_ids(inp.x, weights["w13"], weights["w2"], shape.topk):
        return (lambda i: kernels.topk_gating(i.logits, shape.topk, score="softmax", renormalize=shape.renormalize),
                "gating")
    return (lambda i: kernels.route(i.logits, shape.topk, score="softmax", renormalize=shape.renormalize),
            "gating+maps")


def ours_fn(shape: MoeShape, w13, w2, s13=None, s2=None) -> Callable[[MoeInputs], torch.Tensor]:
    scales = {} if s13 is None else {"w13_scale": s13, "w2_scale": s2}  # bf16: the 5-arg call
    return lambda inp: kernels.fused_moe(inp.x, w13, w2, inp.weights, inp.ids,
                                         activation=shape.activation, **scales)


def baseline_fn(name: str, shape: MoeShape, w13, w2) -> Callable[[MoeInputs], torch.Tensor]:
    base = BASELINES[name]
    return lambda inp: base(inp.x, w13, w2, inp.weights, inp.ids, shape.activation)


# --- one shape -------------------------------------------------------------------------

def check_shape(shape: MoeShape, weights: dict, baselines: list[str], device, gen,
                check_tokens=CHECK_TOKENS) -> list[dict]:
    """Ours and each baseline once against fused_moe_ref in float32 at each T of
    ``check_tokens`` (at large T the table's tensor-core configurations run)."""
    return [row for t in check_tokens for row in check_at(shape, weights, baselines, device, gen, t)]


def check_at(shape: MoeShape, weights: dict, baselines: list[str], device, gen, t: int) -> list[dict]:
    inp = make_inputs(shape, t, 1, device, gen)[0]
    ref = reference_fp32(inp, weights["w13"], weights["w2"], shape.activation)
    cases = [("ours bf16", ours_fn(shape, weights["w13"], weights["w2"]), ref)]
    if "q13" in weights:
        ref_q = reference_fp32(inp, weights["q13"], weights["q2"], shape.activation,
                               weights["s13"], weights["s2"])
        cases.append(("ours int8", ours_fn(shape, weights["q13"], weights["q2"], weights["s13"],
                                           weights["s2"]), ref_q))
    cases += [(name, baseline_fn(name, shape, weights["w13"], weights["w2"]), ref) for name in baselines]
    results = []
    for what, fn, expected in cases:
        try:
            norm_err, max_err = rel_errors(fn(inp), expected)
            row = {"shape": shape.name, "what": what, "T": t, "rel_norm_err": norm_err, "max_rel_err": max_err}
            msg = f"rel norm err {norm_err:.2e}, max rel err {max_err:.2e}"
            if what == "ours int8":  # how far int8 moves the output from the bf16 weights'
                row["rel_norm_err_vs_bf16_weights"] = rel_errors(fn(inp), ref)[0]
                msg += f" (vs bf16 weights: {row['rel_norm_err_vs_bf16_weights']:.2e})"
        except Exception as exc:
            row, msg = {"shape": shape.name, "what": what, "T": t, "error": _short(exc)}, f"n/a: {_short(exc)}"
        print(f"  check {shape.name:<18} {what:<11} vs fp32 reference, T={t}: {msg}", flush=True)
        results.append(row)
    return results


def bench_tokens(shape: MoeShape, t: int, weights: dict, dtypes: list[str], baselines: list[str],
                 sweep: Sweep, ceilings: dict, notes: Notes, gen) -> list[dict]:
    """The table rows of one (shape, T): one per dtype."""
    inputs = make_inputs(shape, t, n_input_sets(shape, t), sweep.device, gen)
    distinct = sum(inp.ids.unique().numel() for inp in inputs) / len(inputs)  # experts hit
    where = f"{shape.name} T={t}"

    base: dict[str, Timing] = {}
    for name in baselines:
        if name == "einsum":
            need = einsum_bytes(shape, t, max(einsum_capacity(i.ids, shape.experts) for i in inputs))
            if need > 0.4 * bc.free_memory_bytes(sweep.device):
                base[name] = Timing(cell="skip(mem)", note=f"einsum skipped: needs ~{need / 2**30:.1f} "
                                                           "GiB, over 40% of free memory")
                notes.add(f"{where} einsum", base[name])
                continue
        base[name] = measure(sweep, baseline_fn(name, shape, weights["w13"], weights["w2"]), inputs,
                             capped=True)
        notes.add(f"{where} {name}", base[name])
        bc.empty_cache(sweep.device)
    route_fn, route_what = routing_fn(shape, inputs[0], weights)
    routing = measure(sweep, route_fn, inputs)
    routing.note = routing.note or route_what
    # As for ours-graph: every input set in one graph, time per set (inside a decode-step
    # graph routing does not pay a graph launch of its own).
    routing_graph = measure_graph(sweep, lambda: [route_fn(inp) for inp in inputs])
    if routing_graph.us is not None:
        routing_graph.us /= len(inputs)
    notes.add(f"{where} routing", routing)
    notes.add(f"{where} routing-graph", routing_graph)

    rows = []
    for dtype in dtypes:
        if dtype == "int8":
            fn = ours_fn(shape, weights["q13"], weights["q2"], weights["s13"], weights["s2"])
        else:
            fn = ours_fn(shape, weights["w13"], weights["w2"])
        ours = measure(sweep, fn, inputs)
        notes.add(f"{where} ours {dtype}", ours)
        # Device time without launch gaps: every input set replayed in one CUDA graph.
        ours_graph = measure_graph(sweep, lambda: [fn(inp) for inp in inputs])
        if ours_graph.us is not None:
            ours_graph.us /= len(inputs)
        notes.add(f"{where} ours-graph {dtype}", ours_graph)
        rows.append(make_row(shape, t, dtype, ours, ours_graph, base, routing, routing_graph, distinct,
                             ceilings))
    del inputs
    bc.empty_cache(sweep.device)
    return rows


def make_row(shape, t, dtype, ours, ours_graph, base, routing, routing_graph, distinct, ceilings) -> dict:
    """Derived rates; baseline and routing columns only on the bf16 row (int8's speedup is
    against the best bf16 baseline of the same case). Speedups compare eager with eager;
    GB/s and TFLOP/s use the CUDA-graph time (the device time of the kernels, as decode
    runs them) when it could be measured."""
    measured = [b.us for b in base.values() if b.us is not None]
    weight_bytes = distinct * shape.expert_bytes(dtype)
    row = {"shape": shape.name, "T": t, "dtype": dtype, "ours_us": ours.us, "ours_note": ours.note,
           "ours_graph_us": ours_graph.us, "ours_graph_note": ours_graph.note,
           "distinct_experts": distinct, "weight_MB": weight_bytes / 1e6, "flops": shape.flops(t),
           "speedup": None, "GBps": None, "pct_copy": None, "TFLOPs": None, "pct_mm": None}
    for name, timing in base.items():
        row[f"{name}_us"], row[f"{name}_note"] = timing.us, timing.note
    row.update(routing_us=routing.us, routing_note=routing.note,
               routing_graph_us=routing_graph.us, routing_graph_note=routing_graph.note)
    if ours.us is not None:
        row["speedup"] = min(measured) / ours.us if measured else None
    device_us = ours_graph.us if ours_graph.us is not None else ours.us
    if device_us is not None:
        row["GBps"] = weight_bytes / (device_us * 1e-6) / 1e9
        row["pct_copy"] = 100 * row["GBps"] / ceilings["copy_GBps"]
        row["TFLOPs"] = shape.flops(t) / (device_us * 1e-6) / 1e12
        row["pct_mm"] = 100 * row["TFLOPs"] / ceilings["matmul_TFLOPs"]
    row["_cells"] = {"ours": ours.text(), "ours_graph": ours_graph.text(), "routing": routing.text(),
                     "graph": routing_graph.text(),
                     **{name: timing.text() for name, timing in base.items()}}
    if dtype != "bf16":
        row["_cells"].update({k: "" for k in list(base) + ["routing", "graph"]})
    return row


def prepare_weights(shape: MoeShape, dtypes: list[str], device, gen) -> tuple[dict, list[str]]:
    """bf16 weights, and their int8 form when asked for; a quantizer failure drops int8 for
    this shape instead of ending the sweep."""
    w13, w2 = make_weights(shape, device, gen)
    weights = {"w13": w13, "w2": w2}
    print(f"{shape.name}: H={shape.hidden} F={shape.ffn} E={shape.experts} k={shape.topk} "
          f"{shape.activation}, weights {(w13.numel() + w2.numel()) * 2 / 1e9:.2f} GB bf16", flush=True)
    if "int8" in dtypes:
        try:
            weights["q13"], weights["s13"] = kernels.quantize_int8(w13)
            weights["q2"], weights["s2"] = kernels.quantize_int8(w2)
        except Exception as exc:
            print(f"  int8 rows skipped for {shape.name}: quantize_int8 failed: {_short(exc)}", flush=True)
            dtypes = [d for d in dtypes if d != "int8"]
            for key in ("q13", "s13", "q2", "s2"):
                weights.pop(key, None)
    return weights, dtypes


def bench_shape(shape: MoeShape, tokens, dtypes, baselines, sweep, ceilings, notes, seed, check_tokens=CHECK_TOKENS):
    gen = torch.Generator(device=sweep.device).manual_seed(seed)
    weights, dtypes = prepare_weights(shape, dtypes, sweep.device, gen)
    checks = check_shape(shape, weights, baselines, sweep.device, gen, check_tokens)
    rows = []
    for t in tokens:
        new = bench_tokens(shape, t, weights, dtypes, baselines, sweep, ceilings, notes, gen)
        for r in new:  # progress: a sweep takes minutes
            cells = r["_cells"]
            parts = [f"  T={t:<6} {r['dtype']:<5} ours {cells['ours']:>10} µs"]
            parts += [f"{n} {cells[n]}" for n in baselines if cells[n]]
            if cells["routing"]:
                parts.append(f"routing {cells['routing']} / graph {cells['graph']} ({r['routing_note']})")
            print("  ".join(parts), flush=True)
        rows += new
    del weights
    gc.collect()
    bc.empty_cache(sweep.device)
    return rows, checks


# --- output ----------------------------------------------------------------------------

COLUMNS = ["shape", "T", "dtype", "ours µs", "ours-graph µs", "loop µs", "grouped_mm µs", "einsum µs",
           "speedup", "weight MB", "GB/s", "%copy", "TFLOP/s", "%mm", "routing µs",
           "routing-graph µs"]


def table_row(row: dict) -> list[str]:
    cells = row["_cells"]

    def num(value, fmt):
        return "" if value is None else format(value, fmt)
    big = row["T"] >= TFLOPS_MIN_T
    return [row["shape"], str(row["T"]), row["dtype"], cells["ours"], cells["ours_graph"], cells.get("loop", ""),
            cells.get("grouped_mm", ""), cells.get("einsum", ""),
            num(row["speedup"], ".2f") + ("x" if row["speedup"] else ""),
            num(row["weight_MB"], ".1f"), num(row["GBps"], ".0f"), num(row["pct_copy"], ".0f"),
            num(row["TFLOPs"], ".1f") if big else "", num(row["pct_mm"], ".0f") if big else "",
            cells["routing"], cells["graph"]]


def header_line(info: dict, ceilings: dict) -> str:
    return (f"device {info['device']} | date {info['date']} | commit {info['commit']} | "
            f"copy {ceilings['copy_GBps']:.0f} GB/s | bf16 matmul {ceilings['matmul_TFLOPs']:.1f} TFLOP/s sustained "
            f"({ceilings['matmul_burst_TFLOPs']:.1f} in a burst)")


# --- command line ----------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when there is a GPU) or cpu")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny shapes ({', '.join(SMOKE_SHAPES)}), T in {SMOKE_TOKENS}, 3 repeats")
    p.add_argument("--shapes", help=f"comma list of {', '.join([*SHAPES, *SMOKE_SHAPES])} "
                                    "(default: all real shapes; the tiny ones with --smoke)")
    p.add_argument("--tokens", help=f"comma list of T (default {','.join(map(str, TOKENS))})")
    p.add_argument("--dtypes", default="bf16,int8", help="comma list of bf16, int8")
    p.add_argument("--no-baselines", action="store_true", help="time only our kernels")
    p.add_argument("--reps", type=int, help="most repeats per measurement (default 100; 3 with --smoke)")
    p.add_argument("--budget-ms", type=float, default=250.0,
                   help="time one measurement may spend repeating (sets the repeats of slow cases)")
    p.add_argument("--cap-ms", type=float, default=200.0,
                   help="skip a baseline at a T when one run of it takes longer than this")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, activations and router logits")
    p.add_argument("--check-tokens", default=",".join(map(str, CHECK_TOKENS)),
                   help="comma list of T at which ours (and each baseline) is checked against the float32 reference")
    p.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    args = p.parse_args(argv)

    all_shapes = {**SHAPES, **SMOKE_SHAPES}
    names = args.shapes.split(",") if args.shapes else list(SMOKE_SHAPES if args.smoke else SHAPES)
    unknown = [n for n in names if n not in all_shapes]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; expected names from {list(all_shapes)}")
    args.shapes = [all_shapes[n] for n in names]
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else \
        list(SMOKE_TOKENS if args.smoke else TOKENS)
    if any(t < 1 for t in args.tokens):
        p.error("--tokens: every T must be >= 1")
    try:
        args.check_tokens = [int(t) for t in args.check_tokens.split(",")]
    except ValueError:
        p.error(f"--check-tokens: expected a comma list of integers, got {args.check_tokens!r}")
    if any(t < 1 for t in args.check_tokens):
        p.error("--check-tokens: every T must be >= 1")
    args.dtypes = args.dtypes.split(",")
    if not args.dtypes or any(d not in ("bf16", "int8") for d in args.dtypes):
        p.error(f"--dtypes: expected a comma list of bf16, int8; got {args.dtypes}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu)")
    args.reps = args.reps or (3 if args.smoke else 100)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    baselines = [] if args.no_baselines else list(BASELINES)
    sweep = Sweep(device, args.reps, args.budget_ms / 1e3, args.cap_ms / 1e3)
    info = bc.run_info(device)
    ceilings = {"copy_GBps": bc.measure_copy_bandwidth(device),
                "matmul_burst_TFLOPs": bc.measure_matmul_tflops(device),
                "matmul_TFLOPs": bc.measure_matmul_tflops(device, sustained=True)}
    print(header_line(info, ceilings), flush=True)

    notes, rows, checks = Notes(), [], []
    for shape in args.shapes:
        shape_rows, shape_checks = bench_shape(shape, args.tokens, args.dtypes, baselines, sweep,
                                               ceilings, notes, args.seed, args.check_tokens)
        rows += shape_rows
        checks += shape_checks

    if not args.no_json:
        payload = {"benchmark": "moe", "run": info, **ceilings,
                   "args": {k: v for k, v in vars(args).items() if k != "shapes"},
                   "shapes": [dataclasses.asdict(s) for s in args.shapes], "checks": checks,
                   "rows": [{k: v for k, v in r.items() if k != "_cells"} for r in rows],
                   "notes": {reason: where for reason, where in notes.by_reason.items()}}
        print(f"wrote {bc.write_results('moe', device, payload, info['date'])}")
    if notes.by_reason:
        print("notes (n/a and skipped cells):")
        print("\n".join(notes.lines()))
    print(f"TFLOP/s and %mm shown for T >= {TFLOPS_MIN_T}." + (
        " int8 rows: speedup against the best bf16 baseline, %mm against the bf16 matmul rate."
        if "int8" in args.dtypes else ""))
    print()
    print(header_line(info, ceilings))
    print(bc.format_table(COLUMNS, [table_row(r) for r in rows]))


if __name__ == "__main__":
    main()
