"""``moe-infer calibrate``: measures this machine into a cost-model hardware profile
(``moe_infer.hardware_profile.Hardware``): device memory bandwidth (a device copy, bytes
read and written), dense matmul rates (bf16, and int8 where the device has an int8 GEMM),
the bf16 rate by activation rows (``matmul_curve``: decode's GEMMs have few rows), pinned
host-to-device copies, the CPU's matmul weight-read rate, a prompt's attention rate by its
keys (``attention_curve``: causal and masked, at three head widths), the rate at which the
fused MoE kernel reads its experts by expert size and rows per expert (``moe_read``), with
``models`` the kernel's time on each share of those models' experts a rank holds by the
tokens of a call (``moe_kernel``) and, on the shares of one GPU's experts, by the experts
a call's routing hits (``moe_skew``), and, under ``scripts/launch.sh``, all-reduce latency
and bandwidth over the job's ranks, and the time of an all-reduce, all-gather and
all-to-all by message size over groups of 2, 4, ... of the job's ranks (``collectives``),
and a generate() call's fixed cost before its first token (``prefill_call_us``).
``smoke``: small sizes (CPU tests).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from moe_infer.closed_forms import distinct_experts
from moe_infer.hardware_profile import Hardware, Link, moe_kernel_key


def _seconds(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after two warm-ups."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _copy_gbps(device: torch.device, nbytes: int, reps: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds(lambda: dst.copy_(src), device, reps) / 1e9


def _matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, reps: int) -> float | None:
    if dtype == torch.int8:
        if device.type != "cuda":
            return None
        a = torch.randint(-8, 8, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-8, 8, (n, n), dtype=torch.int8, device=device).t()
        fn = lambda: torch._int_mm(a, b)  # noqa: E731
    else:
        a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
        fn = lambda: a @ b  # noqa: E731
    return 2 * n ** 3 / _seconds(fn, device, reps) / 1e12


CURVE_ROWS = (1, 8, 32, 128, 512, 2048, 8192)
CURVE_CALLS = 8  # GEMMs a timed call runs back to back: a host sync a GEMM would outlast a short one


def _matmul_curve(device: torch.device, k: int, rows: tuple[int, ...], reps: int) -> dict[int, float]:
    """bf16 TFLOP/s of (rows x k) @ (k x k) at each of ``rows``, over ``CURVE_CALLS`` weights
    (each read once a call; on a GPU their bytes pass its cache, as a step's layers do),
    through the dense GEMM kernels the model's layers run (at decode's few rows the
    weight-streaming kernels, which read faster than a library GEMV)."""
    from kernels import dense_linear

    weights = [torch.randn(k, k, dtype=torch.bfloat16, device=device) for _ in range(CURVE_CALLS)]
    out = {}
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        s = _seconds(lambda: [dense_linear(x, w) for w in weights], device, reps)
        out[m] = _figure(2 * m * k * k * CURVE_CALLS / s / 1e12)
    return out


# A prompt's attention: (query / key, value) head widths (most models', GPT-OSS's, a latent
# model's prompt path) by the keys a query attends, the tokens of a call held fixed.
ATTENTION_WIDTHS = ((128, 128), (64, 64), (192, 128))
ATTENTION_KEYS = (128, 512, 2048, 8192)
ATTENTION_TOKENS = 16384
ATTENTION_HEADS = 16


def _attention_curve(device: torch.device, widths: tuple, keys: tuple[int, ...], tokens: int, reps: int,
                     graphed: bool = False) -> dict:
    """-> {"causal" / "masked": {"<qk>/<v>": {keys: TFLOP/s}}}: a prompt's attention as the
    model's layers run it (``F.scaled_dot_product_attention`` with the kernels an eager
    forward enables, ``dense.attention.SDPA_BACKENDS``; ``graphed``: those of a forward
    replayed from a CUDA graph, ``GRAPH_SDPA_BACKENDS`` in that order, under the kinds
    "causal-graph" / "masked-graph"), ``tokens // keys`` prompts of ``keys``
    tokens, ``ATTENTION_HEADS`` heads. "causal": a fresh prompt over its own keys (no mask;
    the flash kernels skip the masked half, and the FLOPs count the half computed); "masked":
    with a boolean mask over every key (sinks, sliding windows, earlier chunks of a prompt:
    the kernel that takes a mask computes every query against every key, and the FLOPs count
    them all)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from dense.attention import GRAPH_SDPA_BACKENDS, SDPA_BACKENDS

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = GRAPH_SDPA_BACKENDS if graphed else SDPA_BACKENDS
    out = {"causal": {}, "masked": {}}
    for dk, dv in widths:
        for kind in out:
            out[kind][f"{dk}/{dv}"] = by_keys = {}
            for s in keys:
                b = max(1, tokens // s)
                q, k = (torch.randn(b, ATTENTION_HEADS, s, dk, dtype=dtype, device=device) for _ in range(2))
                v = torch.randn(b, ATTENTION_HEADS, s, dv, dtype=dtype, device=device)
                i = torch.arange(s, device=device)
                mask = (i[None, :] <= i[:, None]).expand(b, 1, s, s) if kind == "masked" else None

                def call(q=q, k=k, v=v, mask=mask):
                    with sdpa_kernel(backends, set_priority=graphed):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

                pairs = s * (s + 1) / 2 if kind == "causal" else s * s
                # (a graphed prefill's attention replays without the host's per-call work: timed so)
                seconds = (_step_seconds if graphed else _seconds)(call, device, reps)
                by_keys[s] = _figure(2 * b * ATTENTION_HEADS * (dk + dv) * pairs / seconds / 1e12)
                del q, k, v, mask
    return {f"{kind}-graph": by for kind, by in out.items()} if graphed else out


MOE_SHAPES = ((2048, 256), (2048, 1024), (4096, 3584), (4096, 14336))  # (H, F) of one expert (or its slice)
MOE_ROWS = (1, 4, 16, 64, 256, 1024)  # decode's few rows an expert to prefill's many (compute-bound)
MOE_EXPERTS = 16
MOE_BYTES = 256 << 20  # weights one timed step reads at least (a GPU's cache holds less)


def _moe_read(device: torch.device, shapes: tuple, rows: tuple[int, ...], reps: int,
              mem_gbps: float) -> dict[int, dict[int, float]]:
    """-> {bytes of one expert: {rows per expert: the fraction of ``mem_gbps`` at which
    ``kernels.fused_moe`` reads its weights}}: sets of ``MOE_EXPERTS`` bf16 SwiGLU experts of
    each shape (as many sets as ``MOE_BYTES`` takes), each expert routed the same number of
    rows (top-1), one call a set, replayed from a CUDA graph on a GPU as decode runs them.
    A decode step's experts are many and each sees a few rows; small experts and thin
    slices read below what one large copy reaches. With many rows an expert the kernel is
    bound by its math instead, and the figure falls below 1 for that: it stands for the
    kernel's whole time at each measured row count."""
    from kernels import fused_moe

    out = {}
    for h, f in shapes:
        one = 3 * h * f * 2
        sets = max(1, -(-MOE_BYTES // (one * MOE_EXPERTS))) if device.type == "cuda" else 1
        experts = [(torch.randn(MOE_EXPERTS, 2 * f, h, dtype=torch.bfloat16, device=device) * 0.02,
                    torch.randn(MOE_EXPERTS, h, f, dtype=torch.bfloat16, device=device) * 0.02) for _ in range(sets)]
        out[one] = by_rows = {}
        for r in rows:
            ids = torch.arange(MOE_EXPERTS, device=device, dtype=torch.int32).repeat(r)[:, None]
            x = torch.randn(len(ids), h, dtype=torch.bfloat16, device=device)
            weights = torch.ones(len(ids), 1, dtype=torch.float32, device=device)
            seconds = _step_seconds(lambda: [fused_moe(x, w13, w2, weights, ids) for w13, w2 in experts], device, reps)
            by_rows[r] = _figure(one * MOE_EXPERTS * sets / seconds / (mem_gbps * 1e9))
        del experts
    return out


MOE_KERNEL_TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 1024)  # a call's tokens: decode's batches to small prefills
# and on a GPU prefill forwards up to engine.prefill_tokens' default (a CPU's reference experts
# take minutes at these sizes: the generic terms price its prefills)
MOE_KERNEL_PREFILL_TOKENS = (4096, 16384)
# a call's tokens at which the kernel is also timed with its routing concentrated on fewer
# experts, as a measured routing may be (decode's few tokens meet few experts either way)
MOE_SKEW_TOKENS = (32, 128, 512, 2048, 8192)
_ACTIVATION = {"swiglu": "silu", "gelu": "gelu", "swiglu_oai": "swiglu_oai"}  # config's -> the kernel's name


def moe_shares(num_experts: int, width: int, ranks: tuple[int, ...]) -> list[tuple[int, int]]:
    """(experts over, width over) of the shares a rank of a layout over at most max(``ranks``)
    GPUs holds: experts split ``ep`` ways (expert parallelism), each expert's width split
    ``s`` ways (expert-slicing, tensor parallelism), both from ``ranks`` and dividing."""
    return [(ep, s) for ep in ranks for s in ranks
            if ep * s <= max(ranks) and num_experts % ep == 0 and width % s == 0]


def concentrated_ids(tokens: int, top_k: int, experts: list[int], device: torch.device) -> torch.Tensor:
    """A routing table [tokens, top_k] (int32) of ``top_k`` distinct ids a token from
    ``experts`` alone (at least ``top_k`` of them), the picks spread evenly over them."""
    n = len(experts)
    slots = (torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)[None, :]) % n
    return torch.tensor(experts, dtype=torch.int32)[slots].to(device)


def skew_counts(num_experts: int, top_k: int, tokens: int) -> list[int]:
    """The experts hit at which calibrate times a call of ``tokens`` tokens besides uniform
    routing: top_k, 2 top_k, 4 top_k, ... while fewer than uniform routing hits, and no more
    than the picks."""
    uniform, out, n = distinct_experts(num_experts, top_k, tokens), [], top_k
    while n < min(uniform, num_experts) and n <= tokens * top_k:
        out.append(n)
        n *= 2
    return out


def _moe_kernel(device: torch.device, models: list, ranks: tuple[int, ...], tokens: tuple[int, ...],
                reps: int, progress=None, skip=(), skew_tokens: tuple[int, ...] = ()) -> tuple[dict, dict]:
    """-> ({moe_kernel_key: {tokens: µs}}, {moe_kernel_key: {tokens: {experts hit: µs}}}):
    ``kernels.fused_moe`` on each share (``moe_shares``)
    of each model's experts (``models``: Configs), random weights of the model's sizes, each
    call's tokens routed top-k over all the model's experts (uniformly; ids of the other
    ranks' experts masked as expert-parallel ranks holding the same tokens do), several
    input sets a call, replayed from a CUDA graph on a GPU. A model whose shared experts
    the loader folds into the routed call on one GPU (``Config.folded_experts``) is also
    timed as it then runs: n more experts that every token takes with weight 1. The
    weights are bf16 on a GPU, float32 on the CPU (each one's inference dtype); biases are
    left out (their bytes are small beside the experts'). ``progress(line)``, where given,
    hears of each share timed (a run of several models takes minutes, most of it compiling
    each share's kernels). Shares whose key is in ``skip`` (timed already: two models may
    share a shape) are not timed again. The second table: the shares of one GPU's experts
    (every expert, any slicing) at ``skew_tokens`` tokens with the routed picks concentrated
    on a few experts (``skew_counts``; ``concentrated_ids``), and uniform routing beside them
    at its expected distinct experts: the kernel's tiles follow a call's tokens, not the
    rows each expert gets, so fewer experts hit save less than their reads."""
    from kernels import fused_moe, topk_gating
    from moe_infer.config import ParallelConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out, skew = {}, {}
    for cfg in models:
        m, e = cfg.model, cfg.moe
        act, gated = _ACTIVATION[m.activation], m.activation in ("swiglu", "swiglu_oai")
        shares = [(ep, s, 0) for ep, s in moe_shares(e.num_experts, e.expert_hidden, ranks)]
        folded = cfg.folded_experts(ParallelConfig())
        if folded and (1, 1, 0) in shares:
            shares.append((1, 1, folded))
        for ep, s, n in shares:
            local, width = e.num_experts // ep, e.expert_hidden // s
            key = moe_kernel_key(local + n, e.num_experts + n, m.hidden_size, width, e.top_k + n, m.activation)
            if key in out or key in skip:
                continue
            w13 = torch.randn(local + n, (2 if gated else 1) * width, m.hidden_size, device=device,
                              dtype=dtype) * 0.02
            w2 = torch.randn(local + n, m.hidden_size, width, device=device, dtype=dtype) * 0.02

            def timed(t: int, hit: int | None = None) -> float:
                calls = []
                for _ in range(max(1, min(8, 4096 // t)) if device.type == "cuda" else 1):
                    # (n: the folded shared experts, ids E.. in every token's table with weight 1)
                    ids, w = topk_gating(torch.randn(t, e.num_experts, device=device), e.top_k, shared=n)
                    if hit is not None:  # the routed slots' ids from ``hit`` experts alone
                        chosen = torch.randperm(e.num_experts)[:hit].tolist()
                        ids[:, :e.top_k] = concentrated_ids(t, e.top_k, chosen, device)
                    calls.append((torch.randn(t, m.hidden_size, device=device, dtype=dtype), ids, w))
                step = lambda: [fused_moe(x, w13, w2, w, ids, act, masked=ep > 1) for x, ids, w in calls]  # noqa: E731
                return _figure(_step_seconds(step, device, reps) / len(calls) * 1e6)

            out[key] = by_tokens = {t: timed(t) for t in tokens}
            lines = [", ".join(f"{t} tokens {us:g} us" for t, us in by_tokens.items())]
            for t in skew_tokens if ep == 1 else ():
                uniform = _figure(distinct_experts(e.num_experts, e.top_k, t))
                skew.setdefault(key, {})[t] = by_hit = {**{h: timed(t, h) for h in skew_counts(
                    e.num_experts, e.top_k, t)}, uniform: by_tokens.get(t) or timed(t)}
                lines.append(f"{t} tokens over " + ", ".join(f"{h:g} experts {us:g} us" for h, us in by_hit.items()))
            del w13, w2
            if progress is not None:
                progress(f"moe kernel {key}: " + "; ".join(lines))
    return out, skew


CALL_PROMPT = 16  # tokens of the prompt whose time to the first token gives a call's fixed cost


def _prefill_call_us(device: torch.device, hw: Hardware, reps: int) -> float:
    """``Hardware.prefill_call_us``: the embedded model (a few MB: nothing to read or compute)
    run as a user's generate() runs it on ``device``, the median time to the first token of
    a CALL_PROMPT-token prompt over ``reps`` calls (after one that compiles and captures),
    less what the cost model gives its forward on ``hw``."""
    from moe_infer.config import ParallelConfig
    from moe_infer.costmodel import CostModel
    from moe_infer.loader import load, resolve_config

    cfg = resolve_config(None)
    engine = load(cfg, device=device, progress=False)
    prompt = [list(range(1, CALL_PROMPT + 1))]
    engine.generate(prompt, max_new_tokens=1)
    first = statistics.median(engine.generate(prompt, max_new_tokens=1)[0].time_to_first_token_s
                              for _ in range(reps))
    bare = dataclasses.replace(hw, prefill_call_us=0.0)
    forward = CostModel(cfg, bare).predict(ParallelConfig(), "prefill", 1, CALL_PROMPT, prompt=CALL_PROMPT).ms
    return _figure(max(0.0, first * 1e6 - forward * 1e3))


def _step_seconds(step, device: torch.device, reps: int) -> float:
    """Median seconds of ``step()``: replayed from a CUDA graph on a GPU (no launch costs,
    as a captured decode step), else called."""
    if device.type == "cuda":
        from moe_infer.graphs import capture

        graph, _ = capture(step, device)
        return _seconds(graph.replay, device, reps)
    return _seconds(step, device, reps)


def _h2d_gbps(device: torch.device, nbytes: int, reps: int) -> float:
    if device.type != "cuda":
        return 0.0
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _seconds(lambda: dev.copy_(host, non_blocking=True), device, reps) / 1e9


def _cpu_matmul_gbps(rows: int, cols: int, reps: int) -> float:
    """A one-token GEMV over bf16 weights on the CPU: weight bytes read a second."""
    w = torch.randn(rows, cols, dtype=torch.bfloat16)
    x = torch.randn(1, cols, dtype=torch.bfloat16)
    return w.numel() * 2 / _seconds(lambda: x @ w.t(), torch.device("cpu"), reps) / 1e9


def _link(device: torch.device, small: int, large: int, reps: int) -> tuple[Link, str] | None:
    """All-reduce over the job's ranks -> the link and how its latency was measured. A
    small tensor's time is the latency: the sum a decode step makes (the tensor-parallel
    group's own all-reduce; ``_timed_calls``: replayed from a CUDA graph on GPUs, where
    every rank can capture it). A large one's ring time 2 (p - 1) (alpha + n / (p beta))
    over the process group gives the bandwidth beta."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from comm import ParallelGroups, all_reduce
    from moe_infer.config import ParallelConfig

    p = dist.get_world_size()
    group = ParallelGroups.build(ParallelConfig(tp=p), dist.get_rank(), p).tp
    x = torch.ones(small // 2, dtype=torch.bfloat16, device=device)
    alpha, captured = _timed_calls(lambda: all_reduce(x, group), device, reps)
    how = "all-reduces replayed from a CUDA graph, as decode steps make them" if captured else "eager all-reduces"
    y = torch.ones(large // 4, dtype=torch.float32, device=device)
    dist.barrier()
    t_large = _slowest(_seconds(lambda: dist.all_reduce(y), device, reps), device)
    steps = 2 * (p - 1)
    beta = steps * large / p / max(t_large - steps * alpha, 1e-9) / 1e9
    return Link(alpha_us=_figure(alpha * 1e6), gbps=_figure(beta)), how


COLLECTIVE_BYTES = (8 << 10, 64 << 10, 512 << 10, 4 << 20, 32 << 20)
COLLECTIVE_CALLS = 16  # calls a timed graph (or eager call) runs back to back


def _collectives(device: torch.device, sizes: tuple[int, ...], reps: int) -> dict:
    """-> {kind: {ranks: {bytes: µs}}}: one all-reduce (``bytes`` summed; as the layers sum,
    and NCCL's own, "all_reduce_nccl", as ``parallel.all_reduce: nccl`` sums), all-gather
    (each rank's part) and all-to-all (each rank's send buffer), over groups of 2, 4, ... up
    to the job's consecutive ranks, every group of a size at once (as a layout's TP groups
    run). On GPUs each call is timed as decode steps make it, replayed from a CUDA graph
    (small sums take the symmetric-memory kernel where the GPUs reach each other); the
    slowest rank's median."""
    from comm import ParallelGroups, all_reduce
    from moe_infer.config import ParallelConfig

    p, rank = dist.get_world_size(), dist.get_rank()
    out = {"all_reduce": {}, "all_reduce_nccl": {}, "all_gather": {}, "all_to_all": {}}
    g = 2
    while g <= p and p % g == 0:
        group = ParallelGroups.build(ParallelConfig(tp=g, dp=p // g), rank, p).tp
        for nbytes in sizes:
            x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
            gathered = torch.empty(g * x.numel(), dtype=x.dtype, device=device)
            received = torch.empty_like(x)
            calls = {"all_reduce": lambda: all_reduce(x, group),
                     "all_reduce_nccl": lambda: dist.all_reduce(x, group=group.group),
                     "all_gather": lambda: dist.all_gather_into_tensor(gathered, x, group=group.group),
                     "all_to_all": lambda: dist.all_to_all_single(received, x, group=group.group)}
            for kind, call in calls.items():
                seconds, _ = _timed_calls(call, device, reps)
                out[kind].setdefault(g, {})[nbytes] = _figure(seconds * 1e6)
        g *= 2
    return out


def _timed_calls(call, device: torch.device, reps: int) -> tuple[float, bool]:
    """Seconds of one ``call()`` (a collective every rank makes), the slowest rank's: from a
    CUDA graph of ``COLLECTIVE_CALLS`` calls where every rank can capture it, else eager
    -> (seconds, whether replayed from a graph)."""
    graph = None
    if device.type == "cuda":
        try:
            call()  # outside the capture: buffers and communicators made, collectively
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(COLLECTIVE_CALLS):
                    call()
        except Exception:  # a backend that cannot be captured: eager calls on every rank
            graph = None
    ok = torch.tensor([graph is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.barrier()
    captured = bool(ok.item())
    step = graph.replay if captured else (lambda: [call() for _ in range(COLLECTIVE_CALLS)])
    return _slowest(_seconds(step, device, reps), device) / COLLECTIVE_CALLS, captured


def _figure(x: float) -> float:
    """A measured figure to three significant digits: a slow machine's rates stay above zero."""
    return float(f"{x:.3g}")


def _slowest(value: float, device: torch.device) -> float:
    """The largest of the ranks' ``value``."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(device: torch.device, smoke: bool = False, name: str | None = None, models: list = (),
            moe_ranks: tuple[int, ...] | None = None, moe_tokens: tuple[int, ...] | None = None, progress=None,
            reached=None) -> Hardware:
    """This machine (one GPU, or the CPU) as a hardware profile; with ``models`` (Configs of
    MoE models) also the MoE kernel on their shares for layouts of up to max(``moe_ranks``)
    GPUs (default: 1, 2, 4, ... up to the job's ranks), by the tokens of a call
    (``moe_tokens``; default ``MOE_KERNEL_TOKENS``, and on GPUs ``MOE_KERNEL_PREFILL_TOKENS``
    too), each share told to ``progress``. ``reached(profile)``, where given, hears of the
    profile measured so far: once the machine's figures are in, then after each model's
    shares (a run of several models takes minutes; a job limit that cuts it short keeps
    what it reached)."""
    reps = 3 if smoke else 10
    big = (16 << 20) if smoke else ((1 << 30) if device.type == "cuda" else (256 << 20))
    n = 256 if smoke else (8192 if device.type == "cuda" else 1024)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        memory_gb, kind = props.total_memory / 1e9, props.name
    else:
        memory_gb, kind = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, "cpu"
    bf16 = _matmul_tflops(device, n, torch.bfloat16, reps)
    int8 = _matmul_tflops(device, n, torch.int8, reps)
    if smoke:
        curve = _matmul_curve(device, 256, CURVE_ROWS[:3], reps)
    elif device.type == "cuda":
        curve = _matmul_curve(device, 8192, CURVE_ROWS, reps)
    else:  # a CPU's GEMMs of thousands of rows would take the run's minutes
        curve = _matmul_curve(device, 1024, CURVE_ROWS[:5], reps)
    mem_gbps = _figure(_copy_gbps(device, big, reps))
    if smoke:
        shapes = (((32, 32),), (16, 64), 256)
    elif device.type == "cuda":
        shapes = (ATTENTION_WIDTHS, ATTENTION_KEYS, ATTENTION_TOKENS)
    else:  # a CPU's prompts of thousands of keys would take the run's minutes
        shapes = (ATTENTION_WIDTHS[:1], ATTENTION_KEYS[:2], 1024)
    attention = _attention_curve(device, *shapes, reps)
    if smoke or device.type == "cuda":  # (a CPU never replays a prefill from a graph)
        attention.update(_attention_curve(device, *shapes, reps, graphed=True))
    if smoke:
        moe_read = _moe_read(device, ((64, 32), (128, 64)), MOE_ROWS[:2], reps, mem_gbps)
    elif device.type == "cuda":
        moe_read = _moe_read(device, MOE_SHAPES, MOE_ROWS, reps, mem_gbps)
    else:  # a CPU runs the reference experts, what its decode runs: the smaller shapes, fewer rows
        moe_read = _moe_read(device, MOE_SHAPES[:2], MOE_ROWS[:4], reps, mem_gbps)
    measured = _link(device, 4096, (1 << 20) if smoke else (64 << 20), reps)
    link, how = measured if measured else (None, "")
    collectives = {}
    if measured:
        collectives = _collectives(device, COLLECTIVE_BYTES[:2] if smoke else COLLECTIVE_BYTES, reps)
    sources = ["measured by moe-infer calibrate"]
    if int8 is None:
        sources.append("int8 matmul taken at the bf16 rate (no int8 GEMM measured on this device)")
    if link is None:
        sources.append("links not measured (one rank): NVLink and network taken as 6 us + 360 GB/s and "
                       "12 us + 40 GB/s")
        link = Link(6.0, 360.0)
        network = Link(12.0, 40.0)
    else:
        timed_how = "replayed from CUDA graphs" if device.type == "cuda" else "eager"
        sources.append(f"links from all-reduces over {dist.get_world_size()} ranks (latency: {how}); the "
                       f"network taken as the same (one node); collectives by size over groups of up to "
                       f"{dist.get_world_size()} ranks ({timed_how})")
        network = link
    sources.append("per-block overhead not measured: 15 us; a call's prompts' fixed cost from the embedded model's "
                   "time to its first token")
    sources.append("int8 GEMMs at the int8 rate whatever their rows (the rows curve is bf16's); int8 experts read "
                   "at the measured fraction of bf16 experts of the same bytes")
    hw = Hardware(name=name or kind.lower().replace(" ", "-"), memory_gb=round(memory_gb, 1),
                  mem_gbps=mem_gbps,
                  matmul_tflops={"bfloat16": _figure(bf16), "int8": _figure(int8 if int8 else bf16)},
                  nvlink=link, network=network, gpus_per_node=dist.get_world_size() if dist.is_initialized() else 1,
                  layer_overhead_us=15.0, h2d_gbps=_figure(_h2d_gbps(device, big, reps)),
                  cpu_matmul_gbps=_figure(_cpu_matmul_gbps(*((512, 1024) if smoke else (14336, 4096)), reps)),
                  matmul_curve={"bfloat16": curve}, collectives=collectives, moe_read=moe_read, moe_kernel={},
                  moe_skew={},
                  attention_curve=attention,
                  source="; ".join(sources) + f" ({kind}, {time.strftime('%Y-%m-%d')})")
    hw.prefill_call_us = _prefill_call_us(device, hw, reps)
    if reached is not None:
        reached(hw)
    if models:
        world = dist.get_world_size() if dist.is_initialized() else 1
        ranks = moe_ranks or tuple(2 ** i for i in range(world.bit_length()) if 2 ** i <= world)
        tokens = moe_tokens or (MOE_KERNEL_TOKENS[:2] if smoke else MOE_KERNEL_TOKENS + (
            MOE_KERNEL_PREFILL_TOKENS if device.type == "cuda" else ()))
        skew_tokens = (4, 16) if smoke else (MOE_SKEW_TOKENS if device.type == "cuda" else ())
        skew_tokens = tuple(t for t in skew_tokens if t <= max(tokens))  # none past the calls asked for
        for cfg in models:
            kernel, skew = _moe_kernel(device, [cfg], ranks, tokens, reps, progress, skip=hw.moe_kernel,
                                       skew_tokens=skew_tokens)
            hw.moe_kernel.update(kernel)
            hw.moe_skew.update(skew)
            if reached is not None:
                reached(hw)
    return hw
