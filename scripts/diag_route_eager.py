#!/usr/bin/env python
"""Eager routing at decode sizes on the GPU: for each MoE shape of bench_moe, the layer's
routing call at T tokens (the gating launch alone where the experts run from the ids) timed
two ways, in alternating order over several rounds: CUDA events around each call (as
bench_moe's "routing µs" column), and the host's time per call in a loop that never waits.
``--parts`` adds the host time of each part of ``kernels.topk_gating``'s call (checks,
outputs, key, launch), what the event timing itself adds, and times the call with its two
outputs as views of one allocation (the form before 2026-11-25), alternating with the
library's two allocations.

    PYTHONPATH=. python scripts/diag_route_eager.py [--tokens 1] [--rounds 3] [--parts]
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
from kernels import gating  # noqa: E402

SHAPES = {"mixtral": (8, 2, True), "qwen3-30b-a3b": (128, 8, True), "olmoe": (64, 8, False),
          "ds-moe-1.3b-e128": (128, 1, False)}  # E, k, renormalize


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", action="store_true", help="host time by part, and the outputs' two forms A/B")
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
    if args.parts:
        parts(args.tokens, args.rounds)


def _one_allocation(t: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = torch.empty(2, t, k, dtype=torch.int32, device=device).unbind(0)
    return ids, weights.view(torch.float32)


def parts(t: int, rounds: int) -> None:
    """Host µs of each part of the gating call (Qwen3's E and k), then the whole call with
    the library's outputs and with views of one allocation, in alternating order."""
    e, k = 128, 8
    dev = torch.device("cuda", torch.cuda.current_device())
    logits = torch.randn(t, e, device=dev)
    kernels.topk_gating(logits, k)  # compile and cache the launch
    ids, weights = gating._outputs(t, k, dev)
    key = next(c for c in gating._gating.cache if c[2:7] == (t, e, k, "softmax", True))
    args = (logits, ids, weights, t, e, logits.stride(0), logits.stride(1))
    pieces = {
        "whole call": lambda: kernels.topk_gating(logits, k),
        "checks (cached)": lambda: gating._check_logits_once(logits, k, "softmax"),
        "outputs: two allocations (library)": lambda: gating._outputs(t, k, dev),
        "outputs: one allocation, unbind, view": lambda: _one_allocation(t, k, dev),
        "outputs: two new_empty from the logits": lambda: (logits.new_empty((t, k), dtype=torch.int32),
                                                           logits.new_empty((t, k), dtype=torch.float32)),
        "one allocation alone": lambda: torch.empty(2, t, k, dtype=torch.int32, device=dev),
        "cache key": lambda: (dev.type, dev.index, t, e, k, "softmax", True, logits.dtype, logits.stride(),
                              logits.data_ptr() % 16, gating.pdl_mod.EARLY_TRIGGER),
        "cached launch": lambda: gating._gating(key, args, None, dev),
    }
    for name, fn in pieces.items():
        print(f"host  {name:40s} {min(host_us(fn) for _ in range(5)):6.2f} µs", flush=True)
    # What the event timing itself adds on this host: events around nothing, around one
    # allocation, around the cached launch alone (outputs made beforehand).
    for name in ("nothing", "one allocation alone", "cached launch"):
        fn = pieces.get(name, lambda: None)
        times = sorted(bc.time_fn(lambda _: fn(), 10, 200, inputs=[None]) for _ in range(3))
        print(f"events {name:39s} {times[1]:6.2f} µs (median of 3 runs)", flush=True)
    sets = [torch.randn(t, e, device=dev) for _ in range(8)]
    library = gating._outputs
    for r in range(rounds):
        forms = [("library", library), ("one allocation", _one_allocation)]
        for form, outputs in forms[::1 - 2 * (r % 2)]:
            gating._outputs = outputs
            fn = lambda lg: kernels.topk_gating(lg, k)  # noqa: E731
            events = bc.time_fn(fn, 10, 200, inputs=sets)
            host = min(host_us(lambda: fn(sets[0])) for _ in range(3))
            print(f"round {r}  outputs {form:16s} events {events:6.1f} µs   host {host:6.1f} µs", flush=True)
    gating._outputs = library


if __name__ == "__main__":
    main()
