#!/usr/bin/env python
"""Clocks under sustained load (GPU): the bf16 matmul rate and the OLMoE / Qwen3-30B-A3B MoE
layer at T = 4096, each timed short (a burst) and sustained (a long graph), with the SM
clock, power and throttle reasons nvidia-smi reports after each timing. It showed that
bench_moe's long graph timings ran at the power-limited clock while its matmul ceiling was a
burst (docs/performance.md, eighteenth session).

    PYTHONPATH=. python scripts/diag_sustained.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import bench_common as bc  # noqa: E402
import bench_moe as bm  # noqa: E402
import kernels  # noqa: E402


def clocks() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,"
                           "clocks_throttle_reasons.active", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("diag_sustained.py needs a CUDA GPU")
    dev = torch.device("cuda")
    n = 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=dev) for _ in range(2))
    out = torch.empty(n, n, dtype=torch.bfloat16, device=dev)

    def matmul():
        return torch.matmul(a, b, out=out)

    for reps in (10, 100, 400):
        us = bc.time_fn(matmul, warmup=3, reps=reps, device=dev)
        print(f"matmul eager reps {reps}: {2 * n ** 3 / us / 1e6:.1f} TFLOP/s | {clocks()}", flush=True)
    for reps in (5, 50):
        us = bc.time_graph(lambda: [matmul() for _ in range(8)], reps=reps, device=dev) / 8
        print(f"matmul graph x8 reps {reps}: {2 * n ** 3 / us / 1e6:.1f} TFLOP/s | {clocks()}", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    t = 4096
    for name in ("olmoe", "qwen3-30b-a3b"):
        shape = bm.SHAPES[name]
        w13, w2 = bm.make_weights(shape, dev, gen)
        inputs = bm.make_inputs(shape, t, bm.n_input_sets(shape, t), dev, gen)

        def layer(inp, w13=w13, w2=w2, shape=shape):
            return kernels.fused_moe(inp.x, w13, w2, inp.weights, inp.ids, activation=shape.activation)

        for _ in range(2):
            for reps in (10, 100):
                us = bc.time_fn(layer, warmup=3, reps=reps, inputs=inputs, device=dev)
                print(f"{name} T={t} eager reps {reps}: {us:.1f} us {shape.flops(t) / us / 1e6:.1f} TFLOP/s | "
                      f"{clocks()}", flush=True)
            for reps in (3, 50):
                us = bc.time_graph(lambda: [layer(i) for i in inputs], reps=reps, device=dev) / len(inputs)
                print(f"{name} T={t} graph x{len(inputs)} reps {reps}: {us:.1f} us "
                      f"{shape.flops(t) / us / 1e6:.1f} TFLOP/s | {clocks()}", flush=True)
        w13 = w2 = inputs = None  # freed before the next shape
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
