#!/usr/bin/env python
"""Host-side cost of one call of each kernel wrapper (GPU): how much of an eager MoE step
is Python and the Triton launcher rather than device time.

    PYTHONPATH=. python scripts/diag_launch.py

Each line is the mean host time of one call over a loop of calls that never waits for the
device (launches queue up), so it is what the CPU spends per call.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402


@triton.jit
def _noop(x_ptr, n):
    pass


@triton.jit
def _noop_many(a, b, c, d, e, f, g, h, n1, n2, n3, n4, n5, n6, A: tl.constexpr, B: tl.constexpr,
               C: tl.constexpr, D: tl.constexpr, E: tl.constexpr, F: tl.constexpr, G: tl.constexpr):
    pass


def host_us(fn, n: int = 300) -> float:
    for _ in range(5):  # compile and warm up
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    per_call = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return per_call


def main():
    if not torch.cuda.is_available():
        sys.exit("diag_launch.py measures launches on a CUDA GPU")
    x = torch.randn(16, device="cuda")
    ts = [torch.randn(16, device="cuda") for _ in range(8)]
    t, e, k, h = 1, 8, 2, 4096
    logits = torch.randn(t, e, device="cuda")
    xx = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids, w, (_, rows, _) = kernels.route(logits, k)
    xs = kernels.scatter_rows(xx, rows)
    w13 = torch.randn(e, 2 * 64, h, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(e, h, 64, device="cuda", dtype=torch.bfloat16)
    cases = {
        "empty Triton kernel, 2 args": lambda: _noop[(1,)](x, 5),
        "empty Triton kernel, 14 args + 7 constexpr": lambda: _noop_many[(1,)](*ts, 1, 2, 3, 4, 5, 6, A=1, B=2, C=3,
                                                                              D=4, E=5, F=6, G=7),
        "torch.empty": lambda: torch.empty(16, 4096, device="cuda"),
        "torch.zeros": lambda: torch.zeros(16, 4096, device="cuda"),
        "kernels.topk_gating (the layer's routing at T = 1)": lambda: kernels.topk_gating(logits, k),
        "kernels.route": lambda: kernels.route(logits, k),
        "kernels.route_scatter": lambda: kernels.route_scatter(xx, logits, k),
        "kernels.token_maps": lambda: kernels.token_maps(ids, e),
        "kernels.scatter_rows": lambda: kernels.scatter_rows(xx, rows),
        "kernels.gather_rows": lambda: kernels.gather_rows(xs, rows, w),
        "kernels.fused_moe (tiny experts)": lambda: kernels.fused_moe(xx, w13, w2, w, ids),
    }
    cases.update(direct_cases(x, ts))
    for name, fn in cases.items():
        print(f"{name:44s} {host_us(fn):8.1f} us")


def direct_cases(x, ts) -> dict:
    """The floor under the JIT's launch: the compiled kernel launched straight through its
    launcher (no argument binding, no cache-key hashing), the stream handle, and one replay
    of a captured graph of one kernel."""
    from triton import knobs

    k2 = _noop[(1,)](x, 5)
    k14 = _noop_many[(1,)](*ts, 1, 2, 3, 4, 5, 6, A=1, B=2, C=3, D=4, E=5, F=6, G=7)
    stream = torch.cuda.current_stream().cuda_stream
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _noop[(1,)](x, 5)
        with torch.cuda.graph(graph, stream=side):
            _noop[(1,)](x, 5)
    torch.cuda.current_stream().wait_stream(side)
    return {
        "compiled kernel .run, 2 args": lambda: k2.run(1, 1, 1, stream, k2.function, k2.packed_metadata, None,
                                                       *hooks, x, 5),
        "compiled kernel .run, 14 args + 7 constexpr": lambda: k14.run(
            1, 1, 1, stream, k14.function, k14.packed_metadata, None, *hooks, *ts, 1, 2, 3, 4, 5, 6,
            1, 2, 3, 4, 5, 6, 7),
        "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "CUDAGraph.replay, one kernel": graph.replay,
    }


if __name__ == "__main__":
    main()
