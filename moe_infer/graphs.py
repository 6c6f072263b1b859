"""CUDA graph helpers shared by the runner and the benchmarks: capture a step, and prime a
process's first graphs."""
from __future__ import annotations

import torch

# The first two CUDA graphs a process instantiates measured slower in replay than the later
# ones: the same decode step (the same kernels in the same order on the same addresses)
# replayed faster as the process's third graph or later. Two one-kernel graphs made and
# dropped before it gave the fast time, and a third added nothing. The graphs and their
# memory were the same, so the cause lies below torch.
GRAPH_PRIMERS = 2

# While a capture runs, CUDA forbids other threads' "unsafe" calls unless the capture is
# relaxed, and such a call invalidates the capture: torch's NCCL watchdog polls, from its own
# thread, the events of point-to-point sends still in flight, which a pipeline stage has when
# it captures its first decode step. Relaxed mode still fails any stream-ordered wait (a copy
# to the host, a synchronize) made on the capturing stream itself.
CAPTURE_MODE = "relaxed"


def prime_cuda_graphs(device: torch.device, count: int = GRAPH_PRIMERS) -> None:
    """Captures, replays and drops ``count`` one-kernel CUDA graphs on ``device``, so the
    graphs captured after them are the process's third and later."""
    x = torch.zeros(32, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        x.add_(1)  # the kernel loaded outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    for _ in range(count):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
            x.add_(1)
        graph.replay()
    torch.cuda.synchronize(device)


def capture(step, device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Runs ``step()`` twice on a side stream (every kernel compiled and loaded outside the
    capture), then captures it in a CUDA graph -> (graph, the outputs its replays rewrite)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_MODE):
        out = step()
    return graph, out
