#!/usr/bin/env python
"""Eager routing at decode sizes on the GPU: for each MoE shape of bench_moe, the layer's
routing call at T tokens (the gating launch alone where the experts run from the ids) timed
two ways, in alternating order over several rounds: CUDA events around each call (as
bench_moe's "routing µs" column), and the host's time per call in a loop that never waits.

    PYTHONPATH=. python scripts/diag_route_eager.py [--tokens 1] [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import bench_common as bc  # noqa: E402
import kernels  # noqa: E402
from diag_launch import host_us  # noqa: E402

SHAPES = {"mixtral": (8, 2, True), "qwen3-30b-a3b": (128, 8, True), "olmoe": (64, 8, False),
          "ds-moe-1.3b-e128": (128, 1, False)}  # E, k, renormalize


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("diag_route_eager.py needs a CUDA GPU")
    print(f"T = {args.tokens}; event-timed median of 200 calls over 8 logits sets / host µs per call")
    for r in range(args.rounds):
        names = list(SHAPES) if r % 2 == 0 else list(reversed(SHAPES))
        for name in names:
            e, k, renorm = SHAPES[name]
            sets = [torch.randn(args.tokens, e, device="cuda") for _ in range(8)]
            fn = lambda lg: kernels.topk_gating(lg, k, "softmax", renorm)  # noqa: E731
            events = bc.time_fn(fn, 10, 200, inputs=sets)
            host = host_us(lambda: fn(sets[0]))
            print(f"round {r}  {name:18s} events {events:6.1f} µs   host {host:6.1f} µs", flush=True)


if __name__ == "__main__":
    main()
