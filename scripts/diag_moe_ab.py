#!/usr/bin/env python
"""A/B runs of the MoE experts at decode sizes, in bench conditions: the tuning table's
(up, down) pair for each weight dtype against named variants of it, timed in alternating
rounds in one process (issue 3's int8 target at T = 1 is the bf16 pair's time over the
int8 pair's). Each variant replaces the up or the down configuration of the table's pair,
or both; each timing is tune_moe.py's: 8 input sets replayed in one CUDA graph, the
median over replays, per set.

    PYTHONPATH=. python scripts/diag_moe_ab.py --variants FILE [--tokens 1] [--rounds 3]

FILE is a JSON object {shape: {dtype: {name: {"up": CONFIG, "down": CONFIG}}}}, shape one
of tune_moe.py's (mixtral, qwen3, olmoe, dsmoe), dtype bf16 or int8, e.g.
{"dsmoe": {"int8": {"up bn 8": {"up": {"backend": "cuda", "bn": 8, "warps": 4,
"unroll": 1, "unit": true}}}}}; a configuration with "from_table": true is the table's with
the rest of it changed. Both dtypes' table pairs are always timed. Round 0 holds
the first compiles and captures and is printed but not summed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import kernels  # noqa: E402
import tune_moe  # noqa: E402
from kernels.moe_triton import fused_moe_triton, launch_config  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}


def load_variants(path: str) -> dict:
    """``--variants FILE`` -> {shape: {dtype: {name: {"up": ..., "down": ...}}}}, checked."""
    spec = bc.read_json_object(path, "--variants", "shapes")
    for shape, by_dtype in spec.items():
        if shape not in tune_moe.SHAPES:
            raise SystemExit(f"--variants {path}: shape {shape!r}: expected one of {', '.join(tune_moe.SHAPES)}")
        for dtype, named in (by_dtype.items() if isinstance(by_dtype, dict) else [("?", None)]):
            if dtype not in DTYPES or not isinstance(named, dict):
                raise SystemExit(f"--variants {path}: {shape}: expected {{bf16|int8: {{name: variant}}}}")
            for name, v in named.items():
                if not isinstance(v, dict) or not v or set(v) - {"up", "down"} or name == "table":
                    raise SystemExit(f"--variants {path}: {shape} {dtype} {name!r}: expected an object with "
                                     "'up' and/or 'down' configurations, named other than 'table'")
    return spec


def merged(cfg: dict | None, table: dict) -> dict:
    """A variant's configuration: ``cfg``, or the table's where it is absent; with
    ``"from_table": true`` the table's updated by the rest of ``cfg``."""
    if cfg is None:
        return table
    if cfg.get("from_table"):
        return {**table, **{k: v for k, v in cfg.items() if k != "from_table"}}
    return cfg


def run_shape(shape: str, variants: dict, t: int, rounds: int, reps: int) -> None:
    h, f, e, topk, act = tune_moe.SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = {}  # label -> the calls of one graph
    for dtype in DTYPES:
        w13, w2, scales = tune_moe.expert_weights(shape, dtype, dev, gen)
        inputs = []
        for _ in range(8):
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
            ids, w = kernels.topk_gating_ref(torch.randn(t, e, device=dev, generator=gen), topk)
            inputs.append((x, w, ids))
        table = (launch_config("up", dev, t, e, w13.shape[1], h, DTYPES[dtype], topk),
                 launch_config("down", dev, t, e, h, f, DTYPES[dtype], topk))
        print(f"{shape} {dtype} T={t} table: up {table[0]} down {table[1]}", flush=True)

        def calls(pair, w13=w13, w2=w2, scales=scales, inputs=inputs):
            return [lambda x=x, w=w, ids=ids: fused_moe_triton(x, w13, w2, w, ids, act, configs=pair, **scales)
                    for x, w, ids in inputs]
        cases[f"{dtype} table"] = calls(table)
        for name, v in variants.get(dtype, {}).items():
            cases[f"{dtype} {name}"] = calls((merged(v.get("up"), table[0]), merged(v.get("down"), table[1])))
    times = {label: [] for label in cases}
    for r in range(rounds + 1):
        for label, fns in cases.items():
            try:
                us = tune_moe.time_graph(fns, reps)
            except Exception as exc:  # a configuration the kernels refuse, or out of resources
                print(f"  round {r} {label}: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
                us = float("nan")
            print(f"  round {r} {label}: {us:.2f} us", flush=True)
            if r:
                times[label].append(us)
    bf16 = sorted(times["bf16 table"])[len(times["bf16 table"]) // 2]
    for label, ts in times.items():
        ts = sorted(ts)
        median = ts[len(ts) // 2]
        print(f"{shape:6s} T={t} {label:48s} {median:8.2f} us ({ts[0]:.2f}-{ts[-1]:.2f})  "
              f"bf16 table / this {bf16 / median:.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", required=True, metavar="FILE")
    ap.add_argument("--tokens", type=int, default=1, help="T (1 to 16: the CUDA decode kernels)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, after round 0")
    ap.add_argument("--reps", type=int, default=200, help="graph replays a timing")
    args = ap.parse_args()
    spec = load_variants(args.variants)
    if args.rounds < 1 or not 1 <= args.tokens <= 16:
        raise SystemExit(f"--rounds {args.rounds} / --tokens {args.tokens}: expected >= 1 / 1 to 16")
    if not torch.cuda.is_available():
        raise SystemExit("diag_moe_ab.py needs a CUDA GPU (the CUDA decode kernels, timed as graphs)")
    bc.prime_graphs("cuda")  # the first graphs a process makes replay slower
    print(f"device {torch.cuda.get_device_name()} | T = {args.tokens} | {args.rounds} rounds", flush=True)
    for shape, variants in spec.items():
        run_shape(shape, variants, args.tokens, args.rounds, args.reps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
