"""Measuring helpers shared by the benchmarks in scripts/.

What a run records about itself (device kind, commit, date), the two machine ceilings a
kernel is compared with (device copy bandwidth, bf16 matmul rate), timers for eager calls
and CUDA-graph replays, a fixed-width table printer and the JSON writer for
``bench/results/<name>-<device-slug>-<date>.json``.

Every timer returns the median in microseconds. On CUDA each call is bracketed by its own
pair of events (so host syncs inside the timed function are fine); on CPU it is
``time.perf_counter``.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from moe_infer.graphs import prime_cuda_graphs

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"


# --- what ran, where, when -------------------------------------------------------------

def device_kind(device: torch.device | str) -> str:
    """'NVIDIA H100 80GB HBM3' on a GPU, 'cpu' otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def device_slug(kind: str) -> str:
    """A file-name-safe form of the device kind: 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


def git_commit() -> str:
    """Short hash of HEAD, with '+dirty' when the working tree has changes.

    ``$MOE_INFER_COMMIT``, when the launching command sets it, wins: the GPU hosts get a
    copy of the working tree whose .git (if any) is not this checkout's. Else 'unknown'."""
    if os.environ.get("MOE_INFER_COMMIT"):
        return os.environ["MOE_INFER_COMMIT"]
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def iso_date() -> str:
    """Today's date, ISO 8601 (YYYY-MM-DD), local time."""
    return datetime.date.today().isoformat()


def run_info(device: torch.device | str) -> dict[str, str]:
    """Everything needed to tell two result files apart."""
    info = {"device": device_kind(device), "date": iso_date(),
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit(), "torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def free_memory_bytes(device: torch.device | str) -> int:
    """Bytes that can still be allocated on the device (host RAM for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def empty_cache(device: torch.device | str) -> None:
    """Return cached blocks between cases, so one shape's weights don't crowd the next (the
    pinned host blocks too: an offloaded model's experts would keep host memory). Collects
    garbage first: a dropped engine's modules and steps hold their memory in reference
    cycles."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):  # named per torch version
            if hasattr(torch._C, name):
                getattr(torch._C, name)()
                break


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --- timers ----------------------------------------------------------------------------

def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    # Zeroing twice the L2 size evicts whatever the previous call left there.
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    return torch.empty(2 * l2, dtype=torch.int8, device=device)


def time_fn(fn: Callable[..., Any], warmup: int = 3, reps: int = 20, *,
            inputs: Sequence[Any] | None = None, flush_l2: bool = False,
            device: torch.device | str | None = None) -> float:
    """Median time of one call of ``fn`` in microseconds.

    With ``inputs``, call ``i`` runs ``fn(inputs[i % len(inputs)])``: rotating among
    several input sets keeps a small case from re-reading what the previous call left in
    L2 (and, for MoE, makes each call hit other experts). ``flush_l2`` (CUDA) zeroes a
    buffer of twice the L2 size before each call, outside the timed interval.
    """
    device = torch.device(device) if device is not None else _default_device()
    calls = [(lambda a=a: fn(a)) for a in inputs] if inputs else [fn]
    for i in range(warmup):
        calls[i % len(calls)]()
    if device.type != "cuda":
        times = []
        for i in range(reps):
            start = time.perf_counter()
            calls[i % len(calls)]()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    flush = _l2_flush_buffer(device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize(device)
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


_PRIMED: set[int] = set()  # CUDA devices whose first (slower-replaying) graphs are made


def prime_graphs(device: torch.device | str) -> None:
    """Once per device and process: the first CUDA graphs a process makes replay slower
    than later ones (``moe_infer.graphs.prime_cuda_graphs``), so one-kernel graphs take
    those places before anything is timed."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PRIMED:
        prime_cuda_graphs(torch.device("cuda", index))
        _PRIMED.add(index)


def timeline_shares(spans: Sequence[tuple[float, float]]) -> list[float]:
    """What each (start, end) span of a device's kernels adds to the timeline they cover, in
    the spans' order: taken in start order, each from the later of its start and the latest
    end before it to its own end. A kernel launched early (programmatic dependent launch)
    waits inside its span for the one before; summed spans would count that wait twice."""
    shares, front = [0.0] * len(spans), None
    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        start, end = spans[i]
        shares[i] = max(0.0, end - (start if front is None else max(start, front)))
        front = end if front is None else max(front, end)
    return shares


def time_graph(fn: Callable[[], Any], reps: int = 20, warmup: int = 3, *,
               device: torch.device | str | None = None) -> float:
    """Median time of one replay of ``fn`` captured in a CUDA graph, in microseconds.

    ``fn`` runs ``warmup`` times on a side stream first (lazy init and autotuning must not
    happen during capture). Raises if ``fn`` cannot be captured (e.g. it syncs the host).
    """
    device = torch.device(device) if device is not None else _default_device()
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    prime_graphs(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        graph.replay()  # the first replay uploads the graph; keep it out of the timings
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda.synchronize(device)
        for i in range(reps):
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    finally:
        del graph  # frees the graph's private memory pool


def single_run_s(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Wall time of one call including the device finishing it, in seconds."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def adaptive_reps(single_s: float, budget_s: float, max_reps: int, min_reps: int = 5) -> int:
    """As many repeats as fit in ``budget_s``, within [min_reps, max_reps]: slow cases get
    few repeats so a whole sweep keeps to its time budget."""
    fit = int(budget_s / max(single_s, 1e-9))
    return max(1, min(max_reps, max(min(min_reps, max_reps), fit)))


# --- machine ceilings ------------------------------------------------------------------

def measure_copy_bandwidth(device: torch.device | str, nbytes: int | None = None,
                           reps: int = 10) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written.

    1 GiB on a GPU (far past L2, so it is a DRAM rate); 256 MiB on a CPU."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touched: no lazy pages on CPU
    dst = torch.empty_like(src)
    us = time_fn(lambda: dst.copy_(src), warmup=2, reps=reps, device=device)
    return 2 * nbytes / (us * 1e-6) / 1e9


def measure_matmul_tflops(device: torch.device | str, n: int | None = None,
                          reps: int = 10, sustained: bool = False) -> float:
    """bf16 n×n×n matmul rate in TFLOP/s (n = 8192 on a GPU; 256 on a CPU, where one
    without bf16 units takes seconds at 1024).

    Random operands: all-zero inputs draw less power and overstate the sustained rate.
    By default a burst of ``reps`` calls, at the clock a GPU boosts to when it starts from
    idle. ``sustained`` (CUDA): the median replay of a graph of 8 calls replayed 50 times
    (0.5 s on an H100), the way the benchmarks time large kernels in graphs. Under such a
    load an H100 settles at its power limit with a lower SM clock: about 720 against 800
    TFLOP/s for the burst (docs/performance.md, eighteenth session), so a kernel timed in
    a long graph is compared with this rate, not the burst's."""
    device = torch.device(device)
    if n is None:
        n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    if sustained and device.type == "cuda":
        us = time_graph(lambda: [torch.matmul(a, b, out=out) for _ in range(8)], reps=50, device=device) / 8
    else:
        us = time_fn(lambda: torch.matmul(a, b, out=out), warmup=3, reps=reps, device=device)
    return 2 * n ** 3 / (us * 1e-6) / 1e12


# --- output ----------------------------------------------------------------------------

def read_json_object(path: str, option: str, what: str) -> dict:
    """The non-empty JSON object in the file ``path`` that a script's ``option`` names;
    otherwise SystemExit naming the option, the file and ``what`` was expected."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{option} {path}: {exc}") from None
    if not isinstance(spec, dict) or not spec:
        raise SystemExit(f"{option} {path}: expected a JSON object of {what}")
    return spec


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Fixed-width columns, each as wide as its widest cell; text left, numbers right."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in rows if r[i] not in (None, "")) for i in
               range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(r, widths, numeric)).rstrip()
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _is_number(value: Any) -> bool:
    if isinstance(value, (int, float)):
        return True
    try:
        float(str(value).rstrip("%x"))
        return True
    except ValueError:
        return False


def first_layers(cfg, n: int):
    """``cfg`` (a ``moe_infer.config.Config``) with only its first ``n`` layers: a model of the
    real layer shapes that fits one GPU where the whole one does not."""
    m, e = cfg.model, cfg.moe
    if not 0 < n <= m.num_layers:
        raise SystemExit(f"--layers {n}: expected 1 .. {m.num_layers} (the model's layers)")
    kept = {f: tuple(i for i in getattr(m, f) if i < n) for f in ("sliding_layers", "chunked_layers", "nope_layers")}
    model = dataclasses.replace(m, num_layers=n, **kept)
    moe = e and dataclasses.replace(e, dense_layers=tuple(i for i in e.dense_layers if i < n))
    return dataclasses.replace(cfg, model=model, moe=moe)


def results_path(name: str, device: torch.device | str, date: str | None = None) -> Path:
    """bench/results/<name>-<device-slug>-<date>.json (today's by default)."""
    return RESULTS_DIR / f"{name}-{device_slug(device_kind(device))}-{date or iso_date()}.json"


def write_results(name: str, device: torch.device | str, payload: dict[str, Any],
                  date: str | None = None) -> Path:
    """Writes ``payload`` to ``results_path(name, device, date)``; returns the path.

    A later run on the same day and device replaces the earlier file."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = results_path(name, device, date)
    text = json.dumps(payload, indent=1, default=str)
    # each list of plain numbers on one line (a routing record's thousands of counts)
    text = re.sub(r"\[\n\s+(-?[\d.eE+-]+(?:,\n\s+-?[\d.eE+-]+)*)\n\s+\]",
                  lambda m: "[" + re.sub(r",\n\s+", ", ", m.group(1)) + "]", text)
    path.write_text(text + "\n")
    return path
