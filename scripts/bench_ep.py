#!/usr/bin/env python
"""Multi-rank MoE benchmark: the MoE layer under expert parallelism, its time split into
dispatch / experts / combine, the naive all-to-all against PCC, the bytes each rank sends
and the peers it talks to; then the TP scaling of a dense decode layer.

    scripts/launch.sh -n 4 -- python scripts/bench_ep.py                    # GPUs (NCCL)
    scripts/launch.sh -n 4 -- python scripts/bench_ep.py --device cpu --smoke   # CPU (gloo)

On GPUs, up to ``--graph-tokens`` tokens per rank, the exchange is also timed as captured
decode runs it: fixed-capacity buffers (no count exchange, no host wait), each part
replayed from a CUDA graph.

Every rank of a TP group holds the same tokens (as after a TP layer); data-parallel
replicas hold different ones. Times are medians over back-to-back repeats after one
barrier and a warm-up call, measured on rank 0 (the slowest rank decides a collective, so
rank 0 sees it).
Rank 0 prints the table and writes bench/results/ep-x<ranks>-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
from comm import ParallelGroups, bootstrap, shutdown  # noqa: E402
from dense import MLP, Attention, PagedKVCache, Rotary, StepContext  # noqa: E402
from moe_infer.config import ModelConfig, MoEConfig, ParallelConfig  # noqa: E402
from moe_infer.dispatch import ExpertParallelDispatcher  # noqa: E402
from moe_infer.graphs import capture  # noqa: E402
from moe_infer.moe_layer import MoELayer  # noqa: E402

SHAPES = {  # name: H, F, E, k
    "mixtral": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "smoke": (64, 48, 8, 2),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int):
    """Median wall time of fn() in microseconds over back-to-back repeats, plus its last result.

    One barrier and a warm-up call come first; after them the ranks run in step, held
    together by the collectives inside fn (a barrier per repeat would add its own skew
    between ranks, hundreds of µs on a slow host, to every sample)."""
    dist.barrier()
    out = fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times), out


def layouts(world: int) -> list[tuple[str, dict]]:
    out = [(f"ep{world}", dict(dp=world, ep=world))]
    if world >= 2 and world % 2 == 0:
        out += [(f"tp2-ep{world // 2 * 2}-naive", dict(tp=2, dp=world // 2, ep=world, pcc=False)),
                (f"tp2-ep{world // 2 * 2}-pcc", dict(tp=2, dp=world // 2, ep=world, pcc=True))]
    return out


def moe_case(shape: str, layout: dict, t: int, device, dtype, reps: int, profile: bool = False,
             graph_tokens: int = 0) -> dict:
    h, f, e, k = SHAPES[shape]
    parallel = ParallelConfig(**layout)
    groups = ParallelGroups.build(parallel, dist.get_rank(), dist.get_world_size())
    m = ModelConfig(vocab_size=16, hidden_size=h, num_layers=1, num_heads=8, ffn_hidden=16)
    layer = MoELayer(m, MoEConfig(num_experts=e, top_k=k, expert_hidden=f), parallel, groups)
    # The exchange itself, as replicas with tokens of their own run it (data-parallel
    # attention): ranks that hold the same tokens would all-reduce instead (MoELayer's
    # SameTokensDispatcher), which this benchmark does not time.
    layer.dispatcher = ExpertParallelDispatcher(e, k, parallel.ep, parallel.expert_slicing, groups, parallel.pcc)
    layer = layer.to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(1000 + groups.dp.rank)  # same within a TP group
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02, generator=gen)
        x = torch.randn(t, h, device=device, dtype=dtype, generator=gen)
        routing = layer.router(x)
        d: ExpertParallelDispatcher = layer.dispatcher
        t_dispatch, sent = timed(lambda: d.dispatch(x, routing), device, reps)
        t_experts, y = timed(lambda: d.compute(sent, layer.experts), device, reps)
        t_combine, _ = timed(lambda: d.combine(y, sent), device, reps)
        graphed = graph_case(d, x, routing, layer.experts, device, reps) if t <= graph_tokens else {}
        if profile:  # every rank runs the collectives; rank 0 records them
            import contextlib

            from torch.profiler import ProfilerActivity, profile as torch_profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            rec = torch_profile(activities=activities) if dist.get_rank() == 0 else contextlib.nullcontext()
            with rec:
                again = d.dispatch(x, routing)
                d.combine(d.compute(again, layer.experts), again)
                sync(device)
            if dist.get_rank() == 0:
                print(f"--- profile: {shape} {layout} T={t} (dispatch, experts, combine) ---")
                print(rec.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    row_bytes = sent.x.stride(0) * x.element_size()  # a hidden row, padded, its expert id inside
    counts = list(sent.send_counts)
    counts[sent.group.rank] = 0  # rows for this rank's own experts never leave it
    peers = sum(c > 0 for c in counts)
    if graphed:  # every peer gets the fixed capacity, whatever the routing
        graphed["graph_bytes_sent"] = graphed.pop("cap") * (sent.group.size - 1) * row_bytes
    del layer
    return {"shape": shape, "T_per_rank": t, "dispatch_us": t_dispatch, "experts_us": t_experts,
            "combine_us": t_combine, "pairs_sent": d.sent_pairs,
            "bytes_sent": sum(counts) * row_bytes, "a2a_group": sent.group.size,
            "peers": peers, **graphed}


def graph_case(d: ExpertParallelDispatcher, x, routing, experts, device, reps: int) -> dict:
    """The exchange as captured decode runs it: fixed-capacity buffers (no count exchange,
    no host wait), dispatch, experts and combine each captured in a CUDA graph of its own
    and replayed. Each graph is replayed once before the next is captured, so the next
    one's warm-up reads real rows and expert ids."""
    if device.type != "cuda":
        return {}
    d.fixed_tokens = x.shape[0]
    try:
        g_dispatch, sent = capture(lambda: d.dispatch(x, routing), device)
        g_dispatch.replay()
        g_experts, y = capture(lambda: d.compute(sent, experts), device)
        g_experts.replay()
        g_combine, _ = capture(lambda: d.combine(y, sent), device)
        out = {"graph_dispatch_us": timed(g_dispatch.replay, device, reps)[0],
               "graph_experts_us": timed(g_experts.replay, device, reps)[0],
               "graph_combine_us": timed(g_combine.replay, device, reps)[0],
               "cap": sent.send_counts[0]}
    finally:
        d.fixed_tokens = 0
    return out


def dense_case(tp_size: int, device, dtype, reps: int, hidden: int, heads: int, kv: int, ffn: int,
               context: int) -> dict | None:
    """One dense decode step (attention over ``context`` cached tokens in a paged KV cache,
    then the MLP) at batch 1, on the first ``tp_size`` ranks; the others wait at the
    barriers."""
    world = dist.get_world_size()
    if world % tp_size:
        return None
    groups = ParallelGroups.build(ParallelConfig(tp=tp_size, dp=world // tp_size), dist.get_rank(), world)
    m = ModelConfig(vocab_size=16, hidden_size=hidden, num_layers=1, num_heads=heads, num_kv_heads=kv,
                    ffn_hidden=ffn, max_position=context + 1)
    attn = Attention(m, groups.tp).to(device=device, dtype=dtype)
    mlp = MLP(hidden, ffn, "swiglu", tp=groups.tp).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in list(attn.parameters()) + list(mlp.parameters()):
            p.normal_(0, 0.02)
    # One row holding ``context`` tokens adds one: its step slots set as the runner sets them
    # (moe_infer.runner.PagedRunner._run), so the layer takes the product's decode path.
    block = 16
    table = list(range(-(-(context + 1) // block)))
    cache = PagedKVCache(1, len(table), block, attn.num_kv_heads, m.head_dim, dtype, device)
    keys = torch.tensor([context + 1], device=device)  # [B] tokens cached after the step
    cache.set_step(torch.tensor([cache.slots(table, context, context + 1)], device=device),
                   torch.tensor([table], device=device), keys, context + 1)
    ctx = StepContext.paged(torch.tensor([[context]], device=device), torch.ones(1, 1, dtype=torch.bool, device=device),
                            keys, context + 1, Rotary(m.head_dim, m.rope_theta), dtype)
    x = torch.randn(1, 1, hidden, device=device, dtype=dtype)

    def step():
        return mlp(x + attn(x, ctx, cache))

    with torch.no_grad():
        eager_us, _ = timed(step, device, reps)
        row = {"tp": tp_size, "eager_us": eager_us}
        if device.type == "cuda":  # the layer as decode replays it: one CUDA graph, NCCL inside
            graph, _ = capture(step, device)
            row["graph_us"], _ = timed(graph.replay, device, reps)
    weights = sum(p.numel() * p.element_size() for p in list(attn.parameters()) + list(mlp.parameters()))
    row["weight_bytes_per_rank"] = weights
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few tokens and repeats")
    ap.add_argument("--shapes", default="mixtral,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,64,512,4096", help="tokens per rank")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--graph-tokens", type=int, default=512,
                    help="up to this many tokens per rank, also time the captured fixed-buffer exchange")
    ap.add_argument("--profile", action="store_true", help="rank 0 prints a torch.profiler table per case")
    ap.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    args = ap.parse_args()
    info = bootstrap(backend="nccl" if args.device == "cuda" else "gloo", timeout_s=600)
    device = info.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    tokens = [1, 8] if args.smoke else [int(t) for t in args.tokens.split(",")]
    reps = 3 if args.smoke else args.reps
    rows = []
    for shape in shapes:
        for name, layout in layouts(info.world_size):
            for t in tokens:
                row = moe_case(shape, layout, t, device, dtype, reps, args.profile, args.graph_tokens)
                row["layout"] = name
                rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    h, heads, kv, ffn = (64, 8, 2, 96) if args.smoke else (4096, 32, 8, 14336)
    dense = [r for tp in (1, 2, 4) if (r := dense_case(tp, device, dtype, reps, h, heads, kv, ffn, 512))]
    shutdown()
    if info.rank != 0:
        return
    run = bc.run_info(device)
    print(f"device {run['device']} x {info.world_size} | date {run['date']} | commit {run['commit']} | {dtype}")
    cols = ["shape", "layout", "T/rank", "dispatch µs", "experts µs", "combine µs", "pairs sent", "MB to peers",
            "a2a group", "peers", "graph disp / exp / comb µs", "graph MB to peers"]

    def graph_cells(r):
        if "graph_dispatch_us" not in r:
            return ["-", "-"]
        return [f"{r['graph_dispatch_us']:.1f} / {r['graph_experts_us']:.1f} / {r['graph_combine_us']:.1f}",
                f"{r['graph_bytes_sent'] / 1e6:.3f}"]

    print(bc.format_table(cols, [[r["shape"], r["layout"], r["T_per_rank"], f"{r['dispatch_us']:.1f}",
                                  f"{r['experts_us']:.1f}", f"{r['combine_us']:.1f}", r["pairs_sent"],
                                  f"{r['bytes_sent'] / 1e6:.3f}", r["a2a_group"], r["peers"], *graph_cells(r)]
                                 for r in rows]))
    ratios = []
    for r in rows:
        if r["layout"].endswith("-pcc"):
            naive = next(n for n in rows if n["layout"] == r["layout"][:-4] + "-naive"
                         and n["shape"] == r["shape"] and n["T_per_rank"] == r["T_per_rank"])
            r["pcc_over_naive"] = (r["dispatch_us"] + r["combine_us"]) / (naive["dispatch_us"] + naive["combine_us"])
            graph = "-"
            if "graph_dispatch_us" in r and "graph_dispatch_us" in naive:
                r["graph_pcc_over_naive"] = ((r["graph_dispatch_us"] + r["graph_combine_us"])
                                             / (naive["graph_dispatch_us"] + naive["graph_combine_us"]))
                graph = f"{r['graph_pcc_over_naive']:.2f}"
            ratios.append([r["shape"], r["layout"], r["T_per_rank"], f"{r['pcc_over_naive']:.2f}", graph])
    if ratios:
        print("\nPCC dispatch + combine time over the naive all-to-all's (target <= 0.7 at T >= 64), eager exact "
              "sizes and captured fixed buffers:")
        print(bc.format_table(["shape", "layout", "T/rank", "eager PCC / naive", "graph PCC / naive"], ratios))
    print(f"\ndense decode layer (H={h}, {heads} heads / {kv} KV, F={ffn}, 512 cached tokens, batch 1):")
    print(bc.format_table(["tp", "eager µs", "graph µs", "MB weights/rank"],
                          [[r["tp"], f"{r['eager_us']:.1f}", f"{r['graph_us']:.1f}" if "graph_us" in r else "-",
                            f"{r['weight_bytes_per_rank'] / 1e6:.1f}"] for r in dense]))
    if not args.no_json:
        bc.write_results(f"ep-x{info.world_size}", device, {"run": run, "world_size": info.world_size,
                                                            "dtype": str(dtype), "moe": rows, "dense_decode": dense})


if __name__ == "__main__":
    main()
