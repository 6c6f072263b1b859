#!/usr/bin/env python
"""Decode latency per token: the fixed-shape decode step replayed as a CUDA graph against
eager decode (shapes that grow with the cache), through ``Engine.generate``.

    python scripts/bench_decode.py                          # the embedded model on the GPU
    python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 --new-tokens 64
    python scripts/bench_decode.py --device cpu --smoke      # static-shape step, eagerly, on the CPU

Per-token time = (time of generate() with N + 1 new tokens - time with 1 new token) / N:
the prefill and the first token cancel out, what is left is N decode steps including
sampling and the one host sync per token. Medians of ``--reps`` runs after a warm-up
(which also captures the graphs). The greedy tokens of both modes are compared.
Writes bench/results/decode-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import moe_infer  # noqa: E402


def timed_generate(engine, prompts, new_tokens, reps):
    times, out = [], None
    for _ in range(reps):
        bc.synchronize(engine.device)
        start = time.perf_counter()
        out = engine.generate(prompts, max_new_tokens=new_tokens)
        bc.synchronize(engine.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def per_token_ms(engine, prompts, n, reps):
    engine.generate(prompts, max_new_tokens=n + 1)  # warm-up: compiles, captures the graph bucket
    t_one, _ = timed_generate(engine, prompts, 1, reps)
    t_all, out = timed_generate(engine, prompts, n + 1, reps)
    return 1e3 * (t_all - t_one) / n, [o.token_ids for o in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a preset name or config YAML (default: the embedded model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny run (CPU: the static step without a graph)")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.new_tokens, args.reps = "1,3", 8, 2
    engine = moe_infer.load(args.model, device=args.device, progress=False)
    fast = "graph" if engine.decode_mode == "graph" else "static"
    vocab = engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in map(int, args.batches.split(",")):
        engine.config.engine.max_batch_size = max(engine.config.engine.max_batch_size, b)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(b)]
        engine.decode_mode = "eager"
        eager_ms, eager_tokens = per_token_ms(engine, prompts, args.new_tokens, args.reps)
        engine.decode_mode = fast
        fast_ms, fast_tokens = per_token_ms(engine, prompts, args.new_tokens, args.reps)
        same = sum(a == c for a, c in zip(eager_tokens, fast_tokens))
        rows.append({"batch": b, "eager_ms_per_token": eager_ms, f"{fast}_ms_per_token": fast_ms,
                     "speedup": eager_ms / fast_ms, "rows_with_equal_tokens": same})
    run = bc.run_info(engine.device)
    m = engine.config.model
    print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | {engine.dtype}")
    print(f"model {args.model or 'default (embedded)'}: H={m.hidden_size} layers={m.num_layers} | prompts "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens, greedy")
    print(bc.format_table(["batch", "eager ms/token", f"{fast} ms/token", "speedup", "same tokens"],
                          [[r["batch"], f"{r['eager_ms_per_token']:.3f}", f"{r[f'{fast}_ms_per_token']:.3f}",
                            f"{r['speedup']:.2f}x", f"{r['rows_with_equal_tokens']}/{r['batch']}"] for r in rows]))
    if not args.smoke:
        bc.write_results("decode", engine.device, {"run": run, "model": args.model or "default", "args": vars(args),
                                                   "rows": rows})


if __name__ == "__main__":
    main()
