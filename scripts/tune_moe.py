"""Chooses the fused-MoE launch configurations per shape and T on the GPU it runs on, and
merges them into that GPU's moe tables, kernels/moe/tables/<device>-<dtype>.json (one per
weight dtype; ``kernels.tuning``, docs/tuning.md). Nothing is tuned while serving.

    PYTHONPATH=. python scripts/tune_moe.py [--shapes mixtral,qwen3] [--tokens 1,8,64] [--out DIR]
    PYTHONPATH=. python scripts/tune_moe.py --shapes qwen3,olmoe --tokens 1,8,64 --int8-tokens "" --slices 2
    PYTHONPATH=. python scripts/tune_moe.py --shapes qwen3,olmoe --tokens 1,8,64 --int8-tokens "" --ep 2

``--ep`` / ``--slices`` tune a rank's share of each shape as the multi-GPU layouts run it,
for every (ep, slices) pair of the two lists: E / ep experts with the pairs routed elsewhere
masked (expert parallelism), each F / slices wide (expert-slicing, and the experts of a TP
layout); the tables key them by that share's E, N and K.

The up GEMM is tuned first with the default down configuration, then the down GEMM with
the best up configuration; each candidate is timed as device time: several input sets
replayed in one CUDA graph, median over replays. A ``pinned`` entry was chosen by timing
the decode step itself and stays (``merge``).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402
from kernels import tuning  # noqa: E402
from kernels.moe import cuda as moe_cuda  # noqa: E402
from kernels.moe.triton import default_config, fused_moe_triton, launch_config  # noqa: E402
from kernels.routing.reference import topk_gating_ref  # noqa: E402
from kernels.tuning import MoeCuda, MoeDequant, MoeEntry, MoeGroupedMm, MoeTriton  # noqa: E402
from moe_infer.graphs import prime_cuda_graphs  # noqa: E402

SHAPES = {  # name: H, F, E, k, activation
    "mixtral": (4096, 14336, 8, 2, "silu"),
    "qwen3": (2048, 768, 128, 8, "silu"),
    "olmoe": (2048, 1024, 64, 8, "silu"),
    "dsmoe": (2048, 8192, 128, 1, "gelu"),
    "gptoss": (2880, 2880, 32, 4, "swiglu_oai"),  # gpt-oss-20b (timed without its biases: same bytes, same grid)
    "glm45air": (4096, 1408, 128, 8, "silu"),
    "dsv2lite": (2048, 1408, 64, 6, "silu"),
    # the shared experts as one MLP every row takes (kernels.gated_mlp): E = 1, k = 1
    "dsv2lite-shared": (2048, 2816, 1, 1, "silu"),
    "glm45air-shared": (4096, 1408, 1, 1, "silu"),
    # the routed experts with the shared ones folded in (MoELayer.fold_shared): E + n, k + n
    "dsv2lite-folded": (2048, 1408, 66, 8, "silu"),
    "glm45air-folded": (4096, 1408, 129, 9, "silu"),
}
TOKENS = [1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384]
WARM_S = 0.03  # seconds of replays before each candidate's timed ones
CUDA_TOKENS = moe_cuda.MAX_T  # up to this T the CUDA decode kernels (moe_cuda) compete too
DEQUANT = MoeDequant()  # past it, for int8, the experts widened to bf16 before bf16's GEMMs
DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}  # --tokens / --int8-tokens: the weights' dtype


def candidates(phase: str, t: int, topk: int, e: int, wdtype: str, shape: tuple, up_backend: str | None = None,
               stored: MoeEntry | None = None, *, sms: int) -> list[MoeEntry]:
    """The Triton search space, plus the CUDA up kernel at small T and, for int8 past it,
    the dequantizing path (``DEQUANT``: the experts widened to bf16, then bf16's entries for
    both GEMMs). The down GEMM is searched within the chosen up GEMM's kind
    (``up_backend``, the up entry's ``kind``): the two come as a pair.
    With ``stored`` (``--cuda-only``), the table's entry stands for the Triton space. The
    heuristic that runs where the table has no entry (``default_config`` on ``sms`` SMs)
    competes too, so a tuned entry is never slower than none (OLMoE int8 at T = 256 had
    chosen 235 µs over the heuristic's 217)."""
    h, f, _, _, act = shape
    if phase == "down" and up_backend == "cuda":
        found = moe_cuda.candidates("down", t, wdtype == "int8")
        return ([stored] if isinstance(stored, MoeCuda) else []) + found
    if phase == "down" and up_backend == "dequant":  # the pair: bf16's own entries run both GEMMs
        return [DEQUANT]
    extra = moe_cuda.candidates("up", t, wdtype == "int8") if phase == "up" and t <= CUDA_TOKENS else []
    if phase == "up" and wdtype == "int8" and t > CUDA_TOKENS:
        extra = [DEQUANT]  # int8 widened to bf16 first, then bf16's GEMMs (kernels.moe.triton)
    if stored is not None:
        return [stored] + extra
    found = triton_candidates(phase, t, topk, e, wdtype)
    n, k = ((1 if act == "gelu" else 2) * f, h) if phase == "up" else (h, f)
    fallback = default_config(phase, t, e, n, k, topk, sms)
    return found + ([fallback] if fallback not in found else []) + extra


def triton_candidates(phase: str, t: int, topk: int, e: int, wdtype: str) -> list[MoeTriton]:
    """A small search space per regime (each new configuration costs a compile)."""
    rows = max(1, t * topk // e)
    if t <= 16 or rows <= 16:  # bandwidth-bound: one 16-row tile per expert
        # Narrow column tiles keep all SMs busy when few, small experts are active. int8
        # tiles also go twice as deep: the same bytes per stage as bf16's.
        depths = [128, 256] if phase == "up" else [128]
        grid = itertools.product([16], [32, 64, 128], [2 * d for d in depths] + depths[:1] if wdtype == "int8"
                                 else depths, [4], [3, 4])
        splits = [1, 2, 4] if phase == "down" else [1]
    elif rows <= 64:
        grid = itertools.product([32, 64], [64, 128], [64], [4, 8], [3])
        splits = [1, 2] if phase == "down" else [1]
    else:
        grid = itertools.product([64, 128], [128, 256] if phase == "down" else [64, 128], [64], [8], [3, 4])
        # Tile order (a launch argument, no recompile): row-major, or groups of 4 / 16 row tiles.
        # The down GEMM may also go to torch._grouped_mm (bf16 on Hopper; the tile sizes
        # stay for where it cannot).
        # Weight tiles by pointer loads or by TMA (a recompile). 128-row tiles also come with
        # sub_m 2: an expert's last tile at 64 rows where they fit (a recompile; 32 rows, on the
        # Ampere-style MMA, measured slower).
        cands = [MoeTriton(bm=bm, bn=bn, bk=bk, num_warps=w, num_stages=st, split_k=1, group_m=g, tma=tma,
                           sub_m=sub)
                 for bm, bn, bk, w, st in grid for tma in (False, True) for g in (0, 4, 16)
                 for sub in (1, 2) if bm == 128 or sub == 1]
        if phase == "down" and wdtype == "bf16":
            cands.append(MoeGroupedMm(**asdict(cands[-1])))
        return cands
    return [MoeTriton(bm=bm, bn=bn, bk=bk, num_warps=w, num_stages=st, split_k=sp)
            for bm, bn, bk, w, st in grid for sp in splits]


def time_graph(fns, reps: int) -> float:
    """Device time per call, microseconds: every input set's call captured in one CUDA graph
    and replayed (eager timing would measure the host's launch overhead at small T)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:  # compile outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    # Replays for WARM_S first: after a compile the GPU has idled, and its clocks come back
    # up over milliseconds (the first candidate timed used to read up to 12% slow).
    deadline = time.perf_counter() + WARM_S
    while time.perf_counter() < deadline:
        graph.replay()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(fns))
    times.sort()
    return times[len(times) // 2]


def rank_shape(name: str, ep: int = 1, slices: int = 1) -> tuple:
    """(H, F, E, k, activation) of one rank's experts of shape ``name``: E / ``ep`` of them,
    each F / ``slices`` wide."""
    h, f, e, topk, act = SHAPES[name]
    if e % ep or f % slices:
        raise SystemExit(f"--ep {ep} / --slices {slices}: {name} has E = {e} experts of F = {f}; expected "
                         f"divisors of them")
    return h, f // slices, e // ep, topk, act


def expert_weights(shape: tuple, wdtype: str, dev: torch.device, gen: torch.Generator) -> tuple:
    """Random w13 [E, R, H] and w2 [E, H, F] of ``shape`` (std 0.02), int8 with their
    scales where ``wdtype`` says so: (w13, w2, the scales as fused_moe's keyword arguments)."""
    h, f, e, _, act = shape
    rows13 = f if act == "gelu" else 2 * f
    w13 = torch.randn(e, rows13, h, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, h, f, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    if wdtype != "int8":
        return w13, w2, {}
    w13, s13 = kernels.quantize_int8(w13)
    w2, s2 = kernels.quantize_int8(w2)
    return w13, w2, dict(w13_scale=s13, w2_scale=s2)


def companion_down(up: MoeCuda) -> MoeCuda:
    """The CUDA down configuration a CUDA up candidate is timed with while the best down so
    far is Triton's: the CUDA kernels run as a pair, and the CUDA default down is neither
    pair-major nor one-permute, which hid what such an up kernel is worth (Qwen3 int8 at
    T = 8: 92.9 µs as a unit pair-major pair, against 103.0 µs for the table's Triton pair)."""
    return MoeCuda(bn=4, warps=4, unroll=2, split_k=1, unit=up.unit, pair_major=up.pair_major)


def tune_shape(name: str, tokens: list[int], wdtype: str, reps: int, cuda_only: bool = False,
               verbose: bool = False, only: str | None = None, ep: int = 1,
               slices: int = 1) -> dict[str, dict[int, MoeEntry]]:
    """The best (up, down) configurations per T, by shape key (``tuning.moe_shape``) and
    T, for one rank's share of shape ``name`` (``rank_shape``). ``cuda_only``: the table's
    current entries stand in for the Triton search; ``only``: of the candidates, time those
    with this option set (and the table's entry)."""
    shape = rank_shape(name, ep, slices)
    h, f, e, topk, act = shape
    experts = SHAPES[name][2]  # the model's: routing picks among all of them
    if ep > 1:
        name = f"{name}/ep{ep}"
    if slices > 1:
        name = f"{name}/slice{slices}"
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13, w2, scales = expert_weights(shape, wdtype, dev, gen)
    rows13 = w13.shape[1]
    table: dict[str, dict[int, MoeEntry]] = {}
    for t in tokens:
        # Several input sets per graph, so the active experts' weights are not served from L2.
        sets = max(1, min(8, 4096 // t))
        inputs = []
        for _ in range(sets):
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
            ids, w = topk_gating_ref(torch.randn(t, experts, device=dev, generator=gen), topk)
            if ep > 1:  # this rank holds the first E / ep experts; pairs routed elsewhere are masked
                ids = torch.where(ids < e, ids, -1)
            inputs.append((x, w, ids))
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        wd = DTYPES[wdtype]
        keys = {"up": tuning.moe_shape("up", e, rows13, h, topk), "down": tuning.moe_shape("down", e, h, f, topk)}
        stored = {phase: launch_config(phase, dev, t, e, *((rows13, h) if phase == "up" else (h, f)), wd, topk)
                  for phase in keys} if cuda_only else {}
        best_up = stored.get("up") or default_config("up", t, e, rows13, h, topk, sms)
        best_down = stored.get("down") or default_config("down", t, e, h, f, topk, sms)
        r = max(3, min(reps, int(2e5 / max(1, t * topk * h * f / 1e6))))
        for phase in ("up", "down"):
            results = []
            found = candidates(phase, t, topk, e, wdtype, shape, best_up.kind, stored.get(phase), sms=sms)
            for cfg in [c for c in found if only is None or getattr(c, only, False) or c is stored.get(phase)]:
                down = best_down if not isinstance(cfg, MoeCuda) or isinstance(best_down, MoeCuda) \
                    else companion_down(cfg)
                pair = (cfg, down) if phase == "up" else (best_up, cfg)
                fns = [lambda x=x, w=w, ids=ids: fused_moe_triton(x, w13, w2, w, ids, act, configs=pair,
                                                                  masked=ep > 1, **scales)
                       for x, w, ids in inputs]
                try:
                    us = time_graph(fns, r)
                except Exception as exc:  # e.g. out of shared memory for this tile shape
                    print(f"  {name} T={t} {phase} {cfg}: skipped ({type(exc).__name__})")
                    continue
                results.append((us, cfg))
                if verbose:
                    print(f"  {name} {wdtype} T={t} {phase} {us:9.1f} us  {cfg}", flush=True)
            if not results and phase == "down" and isinstance(best_up, MoeCuda):
                # ``only`` left no CUDA down to time: keep the pair the up kernel won with.
                results = [(float("nan"), best_down if isinstance(best_down, MoeCuda) else companion_down(best_up))]
            us, cfg = min(results, key=lambda p: p[0])
            if phase == "up":
                best_up = cfg
            else:
                best_down = cfg
            print(f"{name:8s} {wdtype:5s} T={t:6d} {phase:4s} {us:9.1f} us  {cfg}", flush=True)
            if stored.get(phase) and results and results[0][1] is stored[phase]:
                print(f"{'':8s} {'':5s} {'':8s} {phase:4s} {results[0][0]:9.1f} us  (the table's entry)", flush=True)
        table.setdefault(keys["up"], {})[t] = best_up
        table.setdefault(keys["down"], {})[t] = best_down
    return table


def merge(table: dict[int, MoeEntry], key: str, entries: dict[int, MoeEntry]) -> None:
    """This run's winners of ``key`` into its table entries (T bucket -> entry), keeping the
    T buckets not re-tuned and the ``pinned`` entries: chosen by timing the decode step
    itself, where the experts share DRAM with their neighbours."""
    for bucket, entry in entries.items():
        old = table.get(bucket)
        if old is not None and old.pinned:
            print(f"kept {key} T {bucket} (pinned); this run's pick: {entry}")
        else:
            table[bucket] = entry


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ep", default="1", help="comma list: also tune a rank's E / ep experts of each shape")
    ap.add_argument("--slices", default="1", help="comma list: also tune each shape's experts at F / slices wide")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--int8-tokens", default=",".join(map(str, TOKENS)), help="T values tuned for int8 weights")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cuda-only", action="store_true",
                    help="time the CUDA decode kernels (and, for int8 past T = 16, the dequantizing path) "
                         "against the table's current entries only")
    ap.add_argument("--only", help="time only the candidates with this option set (e.g. pipe), and the table's entry")
    ap.add_argument("--out", type=Path, default=tuning.TABLES_DIR,
                    help="the kernels package to write into (default: this tree's kernels/): writes "
                         "<out>/moe/tables/<device>-<dtype>.json")
    ap.add_argument("--verbose", action="store_true", help="print every candidate's time")
    args = ap.parse_args()
    try:
        shares = [(int(ep), int(sl)) for ep in args.ep.split(",") for sl in args.slices.split(",")]
    except ValueError:
        shares = []
    if not shares or min(min(pair) for pair in shares) < 1:
        ap.error(f"--ep {args.ep!r} / --slices {args.slices!r}: expected comma-separated whole numbers >= 1")
    unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: {', '.join(unknown)} unknown; expected some of {', '.join(SHAPES)}")
    for name in args.shapes.split(","):
        for ep, slices in shares:
            rank_shape(name, ep, slices)  # a share that does not divide the shape fails here, before any tuning
    if not torch.cuda.is_available():
        sys.exit("tune_moe.py needs a CUDA GPU")
    start = time.time()
    device = torch.device("cuda", torch.cuda.current_device())
    prime_cuda_graphs(device)  # the first graphs replay slower
    dev_name = tuning.device_name(device)
    tables = {}  # weight dtype -> shape -> T bucket -> entry: this device's tables, merged into
    for wdtype, dtype in DTYPES.items():
        path = tuning.table_path(args.out, "moe", dev_name, tuning.dtype_name(dtype))
        old = tuning.load_table(path).entries if path.is_file() else {}
        tables[wdtype] = {shape: dict(buckets) for shape, buckets in old.items()}
    tokens = {wdtype: toks for wdtype, toks in (("bf16", args.tokens), ("int8", args.int8_tokens)) if toks}
    for name in args.shapes.split(","):
        for (ep, slices), (wdtype, toks) in itertools.product(shares, tokens.items()):
            for t in toks.split(","):  # the table written after each T: a run a job limit cuts keeps what it tuned
                for key, entries in tune_shape(name, [int(t)], wdtype, args.reps, args.cuda_only, args.verbose,
                                               args.only, ep, slices).items():
                    merge(tables[wdtype].setdefault(key, {}), key, entries)
                table = tuning.Table("moe", dev_name, tuning.dtype_name(DTYPES[wdtype]), tables[wdtype])
                print(f"wrote {tuning.write_table(args.out, table)}", flush=True)
        torch.cuda.empty_cache()
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
