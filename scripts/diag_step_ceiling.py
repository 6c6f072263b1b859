#!/usr/bin/env python
"""How close to its bandwidth floor can a decode step at batch 1 get at all, for a given
launch structure? (Issue 5's ≤ 1.2× target.)

The step is rebuilt from kernels that do nothing but read: each kernel of the real step
becomes the pure read of ``diag_read.py`` (16-byte streaming loads, PDL with the early
trigger, as the decode kernels launch) over exactly the bytes that kernel must read, on
the fastest grid for that size, with loads issued before its wait wherever the real
kernel could issue them (every weight but the routed experts' up rows, whose ids an
earlier kernel writes). No arithmetic, no dependence on data: a lower bound on the step
for that structure. Structures, all captured as one CUDA graph and replayed:

- ``now``: the launches of today's step, per layer: add + norm, QKV GEMM, attention
  (epilogue and cache in one launch), output GEMM, add + norm + router, gating, expert up,
  expert down; then the final norm, the LM head and the two-launch argmax;
- ``6 a layer``: the norm inside the QKV GEMM and the gating inside the up kernel (the
  fewest launches that still end each phase a later one depends on on the whole grid);
- ``1 a layer``: each layer's bytes in one launch (what a kernel per layer could reach
  if its phases cost nothing between them);
- ``one read``: every byte of the step in one pure read;
- ``empty``: today's launches, each reading nothing (one block): the chain's own latency.

Each row is ms per step and its ratio to the floor (bytes over the copy bandwidth
measured in the same run, as ``bench_decode.py``). If ``now`` is above 1.2× the floor,
no kernels launched this way can meet the target, however fast each is.

Where the real step loses against ``now``: each kernel's share of the critical path, from
a profile of back-to-back replays. Under PDL a kernel ends only after the one before it,
so the time from the previous kernel's end to its own end is what it adds to the step.
The skeleton's shares are printed per kind of launch; ``--real`` prints the real step's
(``moe_infer.load`` with random weights, the batch-1 graph ``Engine.generate`` captured),
per kernel name and grid, in the order of the step.

    PYTHONPATH=. python scripts/diag_step_ceiling.py [--models olmoe-1b-7b,qwen3-30b-a3b] [--context 48]
    PYTHONPATH=. python scripts/diag_step_ceiling.py --real --models olmoe-1b-7b [--quantize int8]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import bench_decode  # noqa: E402
import bench_dense  # noqa: E402
import diag_read  # noqa: E402
from moe_infer.config import load_preset  # noqa: E402

STRUCTURES = ("now", "6 a layer", "1 a layer", "one read", "empty")


def step_kernels(cfg, int8: bool, context: int) -> list[list[tuple[str, int, bool]]]:
    """The real step's launches at batch 1 as groups (one per layer, then the head):
    (name, bytes it must read, whether its loads may start before its wait)."""
    m, moe = cfg.model, cfg.moe
    h, d = m.hidden_size, m.head_dim or m.hidden_size // m.num_heads
    nkv = m.num_kv_heads or m.num_heads
    qkv_n = (m.num_heads + 2 * nkv) * d

    def linear(n: int, k: int) -> int:  # int8: a byte a weight and a float32 scale a row
        return n * (k + 4) if int8 else 2 * n * k

    row = 2 * h  # one bf16 activation row
    groups = [[("context", 64, False), ("embedding", row, False)]]
    for i in range(m.num_layers):
        layer = [("norm", 2 * row, False), ("qkv", linear(qkv_n, h), True),
                 ("attention", 2 * 2 * nkv * d * context + 2 * qkv_n, True), ("o", linear(h, m.num_heads * d), True)]
        if cfg.is_moe_layer(i):
            rows13 = 2 * moe.expert_hidden if m.activation == "swiglu" else moe.expert_hidden
            layer += [("norm+router", 2 * moe.num_experts * h + 2 * row, True), ("gating", 4 * moe.num_experts, False),
                      ("up", moe.top_k * linear(rows13, h), False), ("down", moe.top_k * linear(h, moe.expert_hidden), True)]
        else:
            rows13 = 2 * m.ffn_hidden if m.activation == "swiglu" else m.ffn_hidden
            layer += [("norm", 2 * row, False), ("up", linear(rows13, h), True), ("down", linear(h, m.ffn_hidden), True)]
        groups.append(layer)
    groups.append([("final norm", 2 * row, False), ("lm head", linear(m.vocab_size, h), True),
                   ("argmax", 2 * m.vocab_size, False), ("pick", 4096, False)])
    return groups


def structure(groups, name: str) -> list[tuple[int, bool]]:
    """(bytes, loads before the wait) of each launch of structure ``name``."""
    if name == "one read":
        return [(sum(b for g in groups for _, b, _ in g), True)]
    if name == "1 a layer":
        return [(sum(b for _, b, _ in g), True) for g in groups]
    if name == "empty":
        return [(16, False) for g in groups for _ in g]
    out = []
    for g in groups:
        carry = 0
        for kind, nbytes, pre in g:
            if name == "6 a layer" and kind in ("norm", "final norm", "gating"):
                carry += nbytes  # read by the next launch instead
                continue
            out.append((nbytes + carry, pre))
            carry = 0
    return out


def best_grids(sizes, device, sms: int, copies: int) -> dict:
    """(bytes, pre allowed) -> (blocks, threads, loads before the wait) of the fastest pure
    read of that size, timed back to back over rotating copies (diag_read.read_pdl_times)."""
    time = bench_dense.timer(device, copies)
    grids = {}
    for nbytes, pre_ok in sorted(set(sizes)):
        if nbytes <= 4096:
            grids[nbytes, pre_ok] = (1, 256, 0)
            continue
        bufs = [torch.empty(-(-nbytes // 16) * 16, dtype=torch.uint8, device=device) for _ in range(copies)]
        times = [t for t in diag_read.read_pdl_times(time, bufs, sms) if pre_ok or t[3] == 0]
        grids[nbytes, pre_ok] = times[0][1:]
        del bufs
    return grids


def critical_path(replay, reps: int, device) -> list[tuple[str, float]]:
    """(kernel name and grid, µs it adds to the step) for each kernel of one call of
    ``replay``, in order, averaged over ``reps`` back-to-back calls: its end minus the end of
    the kernel before it (the first kernel of the first call is left out)."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize(device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)
    kernels = sorted((e["ts"] + e["dur"], f"{e['name'][:48]} {tuple(e['args'].get('grid', ()))}")
                     for e in trace["traceEvents"] if e.get("cat") == "kernel")
    if len(kernels) % reps:
        raise RuntimeError(f"{len(kernels)} kernels over {reps} replays: not the same launches each time")
    per = len(kernels) // reps
    sums, counts = [0.0] * per, [0] * per
    for i in range(1, len(kernels)):
        sums[i % per] += kernels[i][0] - kernels[i - 1][0]
        counts[i % per] += 1
    return [(kernels[i][1], sums[i] / counts[i]) for i in range(per)]


def time_step(launches, grids, device, kinds=None) -> tuple[float, dict]:
    """(ms of one replay of the launches as one CUDA graph, each over buffers of its own;
    with ``kinds`` (each launch's name) the µs each kind adds to the critical path)."""
    bufs = [torch.empty(-(-nbytes // 16) * 16, dtype=torch.uint8, device=device) for nbytes, _ in launches]
    out = torch.empty(1 << 16, dtype=torch.int32, device=device)

    def step():
        for buf, key in zip(bufs, launches):
            diag_read._read_pdl(buf, grids[key], out)

    us = bc.time_graph(step, reps=30, device=device)
    shares = {}
    if kinds:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for kind, (_, inc) in zip(kinds, critical_path(graph.replay, 10, device)):
            shares[kind] = shares.get(kind, 0.0) + inc
    return us / 1e3, shares


def real_step(model: str, quantize: str | None, context: int) -> None:
    """The real batch-1 step's critical path, per kernel name and grid."""
    import moe_infer

    engine = moe_infer.load(model, device="cuda", progress=False, quantize=quantize)
    vocab = engine.config.model.vocab_size
    prompt = torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.generate([prompt], max_new_tokens=max(2, context - 16))
    replay = bench_decode.captured_step(engine, 1)
    us = bc.time_fn(replay, warmup=3, reps=50, device=engine.device)
    path = critical_path(replay, 10, engine.device)
    agg = {}
    for name, inc in path:
        slot = agg.setdefault(name, [0.0, 0])
        slot[0] += inc
        slot[1] += 1
    run = bc.run_info(engine.device)
    print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | {model} "
          f"{quantize or 'bf16'} | batch 1 | replay {us / 1e3:.3f} ms, critical path {sum(i for _, i in path) / 1e3:.3f} ms")
    print(bc.format_table(["kernel (grid)", "launches", "µs a step", "µs a launch"],
                          [[k, n, f"{v:.1f}", f"{v / n:.2f}"] for k, (v, n) in agg.items()]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--context", type=int, default=48,
                    help="cached tokens a step reads (bench_decode.py's 16-token prompt + 64 new / 2)")
    ap.add_argument("--copies", type=int, default=4, help="rotating copies when picking each size's grid")
    ap.add_argument("--real", action="store_true", help="the real step's critical path instead (first model)")
    ap.add_argument("--quantize", choices=["int8"], default=None, help="with --real")
    args = ap.parse_args()
    if args.real:
        real_step(args.models.split(",")[0], args.quantize, args.context)
        return
    device = torch.device("cuda")
    copy_gbs = bc.measure_copy_bandwidth(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for model in args.models.split(","):
        cfg = load_preset(model)
        for wdtype in ("bf16", "int8"):
            groups = step_kernels(cfg, wdtype == "int8", args.context)
            total = sum(b for g in groups for _, b, _ in g)
            floor_ms = total / copy_gbs / 1e6
            plans = {name: structure(groups, name) for name in STRUCTURES}
            grids = best_grids([key for p in plans.values() for key in p], device, sms, args.copies)
            for name, plan in plans.items():
                kinds = [kind for g in groups for kind, _, _ in g] if name == "now" else None
                ms, shares = time_step(plan, grids, device, kinds)
                rows.append(dict(model=model, wdtype=wdtype, structure=name, launches=len(plan),
                                 mb=total / 1e6, floor_ms=floor_ms, ms=ms, over_floor=ms / floor_ms))
                print(f"{model} {wdtype} {name}: {ms:.3f} ms ({ms / floor_ms:.2f}x floor)", flush=True)
                if shares:
                    rows[-1]["critical_us"] = shares
                    print("  critical path, µs a step: " + ", ".join(f"{k} {v:.1f}" for k, v in shares.items()))
    run = bc.run_info(device)
    print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | batch 1, "
          f"{args.context} cached tokens | copy {copy_gbs:.0f} GB/s")
    print(bc.format_table(["model", "weights", "structure", "launches", "floor MB", "floor ms", "pure-read step ms",
                           "x floor"],
                          [[r["model"], r["wdtype"], r["structure"], r["launches"], f"{r['mb']:.1f}",
                            f"{r['floor_ms']:.3f}", f"{r['ms']:.3f}", f"{r['over_floor']:.2f}"] for r in rows]))
    bc.write_results("step-ceiling", device, {"run": run, "copy_gbs": copy_gbs, "context": args.context,
                                              "rows": rows})


if __name__ == "__main__":
    main()
