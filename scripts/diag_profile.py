#!/usr/bin/env python
"""Runs the MoE experts of one shape at a decode size, eagerly and a fixed number of times,
so that a profiler (Nsight Compute) records their kernels: the launch configurations of the
tuning table, or the ones given. Without ``--no-graph`` it first prints the pair's graph
time (as tune_moe.py times it), which a profiler's serialised replay does not show.

    python scripts/diag_profile.py --shape qwen3 --tokens 1 --dtype int8 [--up JSON] [--down JSON]
    ncu --clock-control none -k regex:moe_ --launch-skip 8 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats ... \\
        python scripts/diag_profile.py --no-graph --shape qwen3 --tokens 1 --dtype int8

Each call rotates over 8 input sets (different experts), as tune_moe.py does.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import kernels  # noqa: E402
from kernels.moe_triton import fused_moe_triton, launch_config  # noqa: E402
from tune_moe import SHAPES, expert_weights, time_graph  # noqa: E402

SETS = 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help=f"one of {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=int, default=1, help="T (default 1)")
    p.add_argument("--dtype", default="int8", help="bf16 or int8 weights (default int8)")
    p.add_argument("--up", type=json.loads, help="the up kernel's launch configuration as JSON (default: the table's)")
    p.add_argument("--down", type=json.loads, help="the down kernel's, as JSON (default: the table's)")
    p.add_argument("--calls", type=int, default=16, help="eager calls (default 16)")
    p.add_argument("--no-graph", action="store_true", help="skip the graph timing (under a profiler)")
    args = p.parse_args(argv)
    if args.shape not in SHAPES:
        p.error(f"--shape: expected one of {list(SHAPES)}, got {args.shape!r}")
    if args.dtype not in ("bf16", "int8"):
        p.error(f"--dtype: expected bf16 or int8, got {args.dtype!r}")
    if args.tokens < 1 or args.calls < 1:
        p.error("--tokens and --calls must be >= 1")
    if not torch.cuda.is_available():
        p.error("no CUDA device: this script drives a GPU profiler")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    h, f, e, topk, act = SHAPES[args.shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13, w2, scales = expert_weights(args.shape, args.dtype, dev, gen)
    rows13 = w13.shape[1]
    t = args.tokens
    inputs = []
    for _ in range(SETS):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
        ids, w = kernels.topk_gating_ref(torch.randn(t, e, device=dev, generator=gen), topk)
        inputs.append((x, w, ids))
    up = args.up or launch_config("up", dev, t, e, rows13, h, w13.dtype, topk)
    down = args.down or launch_config("down", dev, t, e, h, f, w2.dtype, topk)
    fns = [lambda x=x, w=w, ids=ids: fused_moe_triton(x, w13, w2, w, ids, act, configs=(up, down), **scales)
           for x, w, ids in inputs]
    if not args.no_graph:
        us = time_graph(fns, 50)
        print(f"{args.shape} {args.dtype} T={t}: up {up} down {down}: {us:.2f} us a pair (graph)", flush=True)
    for i in range(args.calls):
        fns[i % SETS]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
