#!/usr/bin/env python
"""Does the batch-1 decode step's replay time depend on how long it has been replayed, or on
the capture? (The first captures of a process measured 1-2.5% slower than later ones in
``diag_decode_ab.py --alternate``.)

One model; the step captured by ``Engine.generate``, then timed in ``--blocks`` blocks of
``--reps`` replays back to back (clocks settle over the blocks if that is the cause); then,
``--captures`` times, the captured step dropped, captured again by the same generate() call
and timed in two blocks. Prints one line a block: capture, block, median replay ms; and a
line a capture with the addresses of the step's own KV cache (keys, values) and logits.

The cause was found with diag_capture_order.py: the first two CUDA graphs a process makes
replay slower, whatever they hold. The engine now makes two one-kernel graphs before its
first decode step's, so every capture here is a fast one.

    PYTHONPATH=. python scripts/diag_replay_settle.py --model olmoe-1b-7b
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import bench_decode  # noqa: E402
import moe_infer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a preset name or config YAML (default: the embedded model)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=10, help="timed blocks after the first capture")
    ap.add_argument("--reps", type=int, default=200, help="replays a block")
    ap.add_argument("--captures", type=int, default=3, help="fresh captures after the first")
    ap.add_argument("--quantize", choices=["int8"], default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_replay_settle.py: needs a GPU (the step is replayed as a CUDA graph)")
    engine = moe_infer.load(args.model, device="cuda", progress=False, quantize=args.quantize)
    engine.decode_mode = "graph"
    prompt = torch.randint(0, engine.config.model.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
    print(f"{args.model or 'default'}{' int8' if args.quantize else ''}: copy "
          f"{bc.measure_copy_bandwidth(engine.device):.0f} GB/s; {args.reps} replays a block", flush=True)
    for capture in range(args.captures + 1):
        if capture:
            engine._decoders.clear()
        engine.generate([prompt.tolist()], max_new_tokens=args.new_tokens)
        step = bench_decode.captured_step(engine, 1)
        decoder = next(d for d in engine._decoders.values() if d.graph is not None and d.batch >= 1)
        where = {"keys": decoder.cache.k, "values": decoder.cache.v, "logits": decoder.out[0]}
        print(f"capture {capture}: " + ", ".join(f"{name} {t.data_ptr():#x} ({t.nbytes / 2**20:.1f} MiB)"
                                                 for name, t in where.items()), flush=True)
        for block in range(args.blocks if capture == 0 else 2):
            ms = bc.time_fn(step, warmup=0, reps=args.reps, device=engine.device) / 1e3
            print(f"capture {capture} block {block}: replay {ms:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
