#!/usr/bin/env python
"""Where the large-T MoE layer spends its time: each kernel of ``kernels.fused_moe`` on its
own (maps, up GEMM, down GEMM, combine), next to the same two GEMMs done by
``torch._grouped_mm`` (CUTLASS) on our expert-major buffer.

    PYTHONPATH=. python scripts/diag_moe.py [--shapes qwen3-30b-a3b,olmoe] [--tokens 4096,16384]

Each part is device time: the call captured in a CUDA graph and replayed (median). Rates
are against the bf16 matmul and copy ceilings measured in the same run; ``floor`` is the
larger of the part's FLOPs at the matmul rate and its weight bytes at the copy rate.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
from bench_moe import SHAPES, make_inputs, make_weights  # noqa: E402
import kernels  # noqa: E402
from kernels.grouped_gemm import grouped_gemm  # noqa: E402
from kernels.layout import combine_rows_triton  # noqa: E402
from kernels.moe_triton import launch_config  # noqa: E402


def parts(shape, t: int, w13, w2, inp) -> dict:
    """name -> (callable, FLOPs, weight bytes) for one input set."""
    e, k, h, f = shape.experts, shape.topk, shape.hidden, shape.ffn
    n, gated = t * k, shape.activation == "silu"
    up_cfg = launch_config("up", inp.x.device, t, e, shape.rows13, h, w13.dtype, k)
    down_cfg = launch_config("down", inp.x.device, t, e, h, f, w2.dtype, k)
    offsets, rows, row_pair = kernels.token_maps_triton(inp.ids, e)
    pair_w = inp.weights.reshape(-1).float().contiguous()
    act = "gelu" if shape.activation == "gelu" else "none"
    hidden = grouped_gemm(inp.x, w13, offsets, row_pair, up_cfg, num_rows=n, topk=k, a_from_tokens=True,
                          gated=gated, act=act)[0]
    partial = grouped_gemm(hidden, w2, offsets, row_pair, down_cfg, num_rows=n, topk=k, a_from_tokens=False,
                           gated=False, pair_weights=pair_w, out_dtype=inp.x.dtype)
    xs = kernels.scatter_rows(inp.x, rows)
    ends = offsets[1:]  # _grouped_mm takes each group's end row
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    up_flops, down_flops = 2 * n * h * shape.rows13, 2 * n * f * h
    up_bytes, down_bytes = w13.numel() * 2, w2.numel() * 2

    def act_fn(y):
        if gated:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y)

    h_mm = act_fn(torch._grouped_mm(xs, w13_t, offs=ends))
    return {
        "maps": (lambda: kernels.token_maps_triton(inp.ids, e), 0, 0),
        "up GEMM": (lambda: grouped_gemm(inp.x, w13, offsets, row_pair, up_cfg, num_rows=n, topk=k,
                                         a_from_tokens=True, gated=gated, act=act), up_flops, up_bytes),
        "down GEMM": (lambda: grouped_gemm(hidden, w2, offsets, row_pair, down_cfg, num_rows=n, topk=k,
                                           a_from_tokens=False, gated=False, pair_weights=pair_w,
                                           out_dtype=inp.x.dtype), down_flops, down_bytes),
        "combine": (lambda: combine_rows_triton(partial, rows, None, inp.x.dtype, k), 0, 0),
        "fused_moe": (lambda: kernels.fused_moe(inp.x, w13, w2, inp.weights, inp.ids, shape.activation),
                      up_flops + down_flops, up_bytes + down_bytes),
        "scatter": (lambda: kernels.scatter_rows(inp.x, rows), 0, 0),
        "_grouped_mm up": (lambda: torch._grouped_mm(xs, w13_t, offs=ends), up_flops, up_bytes),
        "activation (torch)": (lambda: act_fn(torch._grouped_mm(xs, w13_t, offs=ends)), 0, 0),
        "_grouped_mm down": (lambda: torch._grouped_mm(h_mm, w2_t, offs=ends), down_flops, down_bytes),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,olmoe,mixtral")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("diag_moe.py needs a CUDA GPU")
    dev = torch.device("cuda")
    info = bc.run_info(dev)
    copy_gbs, mm_tflops = bc.measure_copy_bandwidth(dev), bc.measure_matmul_tflops(dev)
    print(f"{info['device']} | {info['date']} | commit {info['commit']} | bf16 | copy {copy_gbs:.0f} GB/s, "
          f"matmul {mm_tflops:.1f} TFLOP/s")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        w13, w2 = make_weights(shape, dev, gen)
        for t in (int(v) for v in args.tokens.split(",")):
            inp = make_inputs(shape, t, 1, dev, gen)[0]
            for part, (fn, flops, nbytes) in parts(shape, t, w13, w2, inp).items():
                us = bc.time_graph(fn, reps=args.reps, device=dev)
                floor = max(flops / (mm_tflops * 1e6), nbytes / (copy_gbs * 1e3))
                rows.append([name, t, part, f"{us:.1f}", f"{flops / us / 1e6:.1f}" if flops else "",
                             f"{100 * flops / us / 1e6 / mm_tflops:.0f}" if flops else "",
                             f"{floor:.1f}" if flops else ""])
            del inp
            torch.cuda.empty_cache()
        del w13, w2
    print(bc.format_table(["shape", "T", "part", "µs", "TFLOP/s", "%mm", "floor µs"], rows))


if __name__ == "__main__":
    main()
