#!/usr/bin/env python
"""Pipeline stages against tensor and expert parallelism on the same ranks: generate() as a
user runs it, under ``scripts/launch.sh -n P``.

    scripts/launch.sh -n 2 -- python scripts/bench_pipeline.py --model mixtral-8x7b
    scripts/launch.sh -n 2 -- python scripts/bench_pipeline.py --smoke      # tiny-moe, CPU ranks (gloo)

Per batch: decode ms per step and tokens/s (``bench_decode.decode_step_ms``: generate()'s
own clock over the decode steps) for pp P with the re-queueing schedule (P micro-batches), pp P
draining the pipeline every token (1 micro-batch), and the tp P and ep P layouts; the
pipeline's bubble, 1 - (summed stage busy time) / (stages x wall time), of each schedule's
last timed run. Prompt processing: ``--prompts`` prompts of ``--prompt-len`` tokens, one new
token, with the hybrid micro-batch counts (``--hybrid``: multiples of P, by default 4 P, the
default of ``parallel.prompt_micro_batches``) and with equal counts (P), seconds and bubble.
Writes bench/results/pipeline-<model>-<P>ranks-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import moe_infer  # noqa: E402
from bench_decode import decode_step_ms  # noqa: E402
from moe_infer import ParallelConfig  # noqa: E402
from moe_infer.loader import resolve_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mixtral-8x7b", help="a preset name or config YAML (random weights)")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the decode rows")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16, help="prompts of the prompt-processing rows")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of each of those prompts")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hybrid", default="4",
                    help="comma list: prompt micro-batch counts to time, as multiples of the stage count P")
    ap.add_argument("--peers", default="tp,ep", help="comma list of the other layouts to run (tp, ep)")
    ap.add_argument("--smoke", action="store_true", help="tiny-moe on CPU ranks, few tokens")
    ap.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.batches, args.prompt_len, args.new_tokens = "tiny-moe", "2,4", 8, 4
        args.prompts, args.prompt_tokens, args.reps = 4, 16, 1
    batches = [int(b) for b in args.batches.split(",")]

    from comm import bootstrap, shutdown
    info = bootstrap(backend="gloo" if args.smoke else None)
    world, rank = info.world_size, dist.get_rank()

    def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]

    def load(**kw):
        engine = moe_infer.load(args.model, parallel=ParallelConfig(**kw), progress=False,
                                device="cpu" if args.smoke else None)
        engine.eos = set()  # every row runs all its tokens (decode_step_ms needs it)
        engine.config.engine.max_batch_size = max(batches + [args.prompts])
        engine.config.engine.max_seq_len = max(args.prompt_len + args.new_tokens + 2, args.prompt_tokens + 2)
        return engine

    def timed(engine, ps, new):
        bc.synchronize(engine.device)
        t = time.perf_counter()
        engine.generate(ps, max_new_tokens=new)
        bc.synchronize(engine.device)
        return time.perf_counter() - t

    def say(line):
        if rank == 0:
            print(line, flush=True)

    layouts = [("pp", dict(pp=world)), ("pp-drain", dict(pp=world, micro_batches=1))]
    layouts += [(p, dict(tp=world) if p == "tp" else dict(dp=world, ep=world))
                for p in args.peers.split(",") if p in ("tp", "ep")]
    decode, prompt_rows = [], []
    for name, kw in layouts:
        engine = load(**kw)
        vocab = engine.config.model.vocab_size
        for b in batches:
            ps = prompts(b, args.prompt_len, b, vocab)
            ms = decode_step_ms(engine, ps, args.new_tokens, args.reps)
            bubble = engine.last_timeline.bubble if engine.last_timeline is not None else None
            decode.append({"layout": f"{name}{world}", "parallel": kw, "batch": b, "ms_per_step": ms,
                           "tokens_per_s": 1e3 * b / ms if ms > 0 else None, "bubble": bubble})
            say(f"{name}{world} batch {b}: {ms:.3f} ms a step"
                + (f", bubble {bubble:.1%}" if bubble is not None else ""))
        if name == "pp":  # prompt processing: hybrid against equal micro-batch counts
            ps = prompts(args.prompts, args.prompt_tokens, 7, vocab)
            counts = [("hybrid", int(m) * world) for m in args.hybrid.split(",")] + [("equal", world)]
            for label, count in counts:
                engine.config.parallel.prompt_micro_batches = count
                timed(engine, ps, 1)  # warm-up at these sizes
                s = statistics.median(timed(engine, ps, 1) for _ in range(args.reps))
                prompt_rows.append({"schedule": label, "micro_batches": count, "seconds": s,
                                    "tokens_per_s": args.prompts * args.prompt_tokens / s,
                                    "bubble": engine.last_timeline.bubble})
                say(f"prompts {label} ({count} micro-batches): {s * 1e3:.1f} ms, bubble "
                    f"{engine.last_timeline.bubble:.1%}")
        del engine
        bc.empty_cache(info.device)
    if rank == 0:
        run = bc.run_info(info.device)
        print(f"device {run['device']} x {world} ranks | date {run['date']} | commit {run['commit']} | model "
              f"{args.model}, random weights | decode: prompts of {args.prompt_len} tokens, {args.new_tokens} new")
        base = {d["batch"]: d["tokens_per_s"] for d in decode if d["layout"] == f"tp{world}"}
        print(bc.format_table(["layout", "batch", "ms/step", "tokens/s", f"x tp{world}", "bubble"], [
            [d["layout"], d["batch"], f"{d['ms_per_step']:.3f}", f"{d['tokens_per_s']:.1f}" if d["tokens_per_s"] else "-",
             f"{d['tokens_per_s'] / base[d['batch']]:.2f}" if base.get(d["batch"]) and d["tokens_per_s"] else "-",
             f"{d['bubble']:.1%}" if d["bubble"] is not None else "-"] for d in decode]))
        print(f"prompt processing, pp{world}: {args.prompts} prompts x {args.prompt_tokens} tokens")
        print(bc.format_table(["schedule", "micro-batches", "ms", "tokens/s", "bubble"], [
            [r["schedule"], r["micro_batches"], f"{r['seconds'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
             f"{r['bubble']:.1%}"] for r in prompt_rows]))
        for r in prompt_rows[:-1]:  # (the last row: equal counts)
            print(f"hybrid ({r['micro_batches']}) / equal: {r['seconds'] / prompt_rows[-1]['seconds']:.2f}")
        if not args.no_json:
            bc.write_results(f"pipeline-{Path(args.model).stem}-{world}ranks", info.device,
                             {"run": run, "model": args.model, "args": vars(args), "decode": decode,
                              "prompts": prompt_rows,
                              "kernel_options": dataclasses.asdict(
                                  resolve_config(args.model).engine.kernel_options())})
    shutdown()


if __name__ == "__main__":
    main()
