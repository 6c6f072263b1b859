#!/usr/bin/env python
"""Multi-rank decode: generate() under each parallel layout, as a user runs it, beside one
GPU of the same machine.

    python scripts/bench_layouts.py --model olmoe-1b-7b --baseline          # one GPU alone
    scripts/launch.sh -n 2 -- python scripts/bench_layouts.py --model olmoe-1b-7b
    scripts/launch.sh -n 2 -- python scripts/bench_layouts.py --smoke       # tiny-moe, CPU ranks (gloo)

The ``--baseline`` run (one process, so its decode runs the captured step, as a one-GPU
user's does) writes its ms/token per batch to bench/results/layouts-baseline-<model>-
<device>-<date>.json; a multi-rank run of the same model, device and day reads it and
prints each layout's ratio to it.

ms/token is ``bench_decode.decode_step_ms``: generate()'s own clock from a batch's first
tokens to its last over its N - 1 decode steps, median of ``--reps`` (with data-parallel
replicas that split the prompts, the slowest replica's). Run the baseline and
the layouts in one device session, so both come from the same machine. Random
weights are drawn per rank's shard, so layouts run models of the same shapes, not the same
values: this times, parity is the mpi tests' (tests/test_model_mpi.py). A second
pass, under the profiler, splits a token's time into communication and the rest, and gives
the time the experts' GEMMs add to the GPU's timeline (rank 0's; the baseline's too: kernels
that start early and wait for the one before count once); the profiler slows that
pass, so its total is printed beside the first. Writes bench/results/layouts-<model>-<N>ranks-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import moe_infer  # noqa: E402
from bench_decode import decode_step_ms  # noqa: E402
from comm import Group, all_gather_json  # noqa: E402
from moe_infer import ParallelConfig  # noqa: E402
from moe_infer.config import ConfigError  # noqa: E402

def layouts(world: int) -> list[tuple[str, dict]]:
    """(name, parallel settings) of every layout for ``world`` ranks; data parallelism of
    the dense part fills the ranks a layout leaves."""
    out = [(f"tp{world}", dict(tp=world)), (f"tp{world}-nccl", dict(tp=world, all_reduce="nccl")),
           (f"ep{world}", dict(dp=world, ep=world)),
           # tensor-parallel attention, each rank E / ep whole experts (vLLM's TP with expert parallelism)
           (f"tp{world}-ep{world}", dict(tp=world, ep=world)),
           (f"ep{world}-dp-attention", dict(dp=world, ep=world, dp_attention=True)),
           (f"slicing{world}", dict(dp=world, expert_slicing=world)), (f"pp{world}", dict(pp=world)),
           (f"tp{world}-kv-tokens", dict(tp=world, kv_shard="tokens"))]
    if world >= 4 and world % 2 == 0:
        out += [(f"tp2-ep{world}-pcc", dict(tp=2, dp=world // 2, ep=world, pcc=True)),
                (f"tp2-ep{world}-naive", dict(tp=2, dp=world // 2, ep=world, pcc=False)),
                (f"tp2-ep{world}-pcc-dp-attention", dict(tp=2, dp=world // 2, ep=world, pcc=True, dp_attention=True))]
    return out


def is_collective(event) -> bool:
    """A profiler record of communication: an NCCL or symmetric-memory all-reduce kernel on
    the GPU (inside a replayed graph too), or a gloo collective's call on CPU ranks (it
    blocks for its whole exchange)."""
    if event.device_type == DeviceType.CUDA:
        return event.name.lower().startswith("nccl") or "one_shot_all_reduce" in event.name
    return event.name.startswith("gloo:")


EXPERT_KERNELS = ("moe_up", "moe_down", "grouped_gemm", "grouped_mm")  # kernels.fused_moe's GEMMs, torch's


def is_expert_kernel(event) -> bool:
    """A GPU kernel of the routed experts' GEMMs: ``kernels.fused_moe``'s CUDA decode
    kernels or Triton grouped GEMM, or ``torch._grouped_mm``."""
    return event.device_type == DeviceType.CUDA and any(k in event.name.lower() for k in EXPERT_KERNELS)


def device_shares(events) -> dict[int, float]:
    """id(event) -> the µs each GPU kernel of ``events`` adds to the device's timeline
    (``bench_common.timeline_shares``)."""
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    shares = bc.timeline_shares([(e.time_range.start, e.time_range.end) for e in kernels])
    return {id(e): share for e, share in zip(kernels, shares)}


def expert_s(events, shares: dict[int, float] | None = None) -> float:
    """Seconds the profiled ``events``' experts' GEMMs (``is_expert_kernel``) add to the
    device's timeline (``shares``: ``device_shares(events)``, made here where not given)."""
    shares = device_shares(events) if shares is None else shares
    return sum(shares[id(e)] for e in events if is_expert_kernel(e)) / 1e6


def profiled(engine, prompts, new: int):
    """-> (wall seconds, the profiler's events) of generate() with ``new`` new tokens."""
    bc.synchronize(engine.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]
                 if engine.device.type == "cuda" else [ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        engine.generate(prompts, max_new_tokens=new)
        bc.synchronize(engine.device)
        wall = time.perf_counter() - t
    return wall, prof.events()


def expert_ms(engine, prompts, n: int) -> float:
    """ms per token this process's GPU spends in the experts' GEMMs (``is_expert_kernel``):
    generate() with n + 1 new tokens against 2, once each; 0 on a CPU."""
    two, more = (expert_s(profiled(engine, prompts, new)[1]) for new in (2, n + 1))
    return 1e3 * (more - two) / (n - 1)


def split_ms(engine, prompts, n: int) -> tuple[float, float, int, float]:
    """-> (ms per token under the profiler, of it in collectives, collectives per token, of
    it in this rank's expert GEMMs): generate() with n + 1 new tokens against 2, once each.
    A GPU collective counts what it adds to the device's timeline (``device_shares``), a
    gloo call its duration. Either also lasts while it waits for the last rank to arrive,
    and which rank waits varies from call to call; the rank that arrives last waits for
    none, so each collective counts the least of its ranks' times (where every rank
    recorded the same sequence of collectives; else this rank's own)."""
    out = []
    for new in (2, n + 1):
        dist.barrier()  # outside the profile: its wait for the slower rank is no step's
        wall, events = profiled(engine, prompts, new)
        comm = sorted((e for e in events if is_collective(e)), key=lambda e: e.time_range.start)
        shares = device_shares(events)
        mine = [shares.get(id(e), e.time_range.elapsed_us()) for e in comm]
        world = Group(None, dist.get_rank(), dist.get_world_size(), tuple(range(dist.get_world_size())))
        every = all_gather_json(mine, world, engine.device if engine.device.type == "cuda" else "cpu")
        if all(len(d) == len(mine) for d in every):
            mine = [min(d) for d in zip(*every)]
        out.append((wall, sum(mine) / 1e6, len(comm), expert_s(events, shares)))
    (t2, c2, k2, x2), (tn, cn, kn, xn) = out
    per = 1e3 / (n - 1)
    return per * (tn - t2), per * (cn - c2), round((kn - k2) / (n - 1)), per * (xn - x2)


def baseline_name(model: str) -> str:
    return f"layouts-baseline-{Path(model).stem}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-1b-7b", help="a preset name or config YAML (random weights)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layouts", default="", help="comma list of layout names (default: every one)")
    ap.add_argument("--baseline", action="store_true", help="one process: the one-GPU figures the layouts compare to")
    ap.add_argument("--smoke", action="store_true", help="tiny-moe on CPU ranks, few tokens")
    ap.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    ap.add_argument("--results-dir", default=str(bc.RESULTS_DIR), help="where the JSON go (default bench/results)")
    args = ap.parse_args()
    bc.RESULTS_DIR = Path(args.results_dir)
    if args.smoke:
        args.model, args.batches, args.prompt_len, args.new_tokens, args.reps = "tiny-moe", "1,4", 8, 4, 1
    batches = [int(b) for b in args.batches.split(",")]

    def prompts(engine, b):  # the same prompts for every layout and the baseline
        gen = torch.Generator().manual_seed(b)
        vocab = engine.config.model.vocab_size
        return [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(b)]

    def load(parallel=None):
        engine = moe_infer.load(args.model, parallel=parallel, progress=False, device="cpu" if args.smoke else None)
        engine.eos = set()  # every row runs all its tokens (decode_step_ms needs it)
        engine.config.engine.max_batch_size = max(batches)
        return engine

    if args.baseline:
        engine = load()
        rows = {b: decode_step_ms(engine, prompts(engine, b), args.new_tokens, args.reps) for b in batches}
        experts = {b: expert_ms(engine, prompts(engine, b), args.new_tokens) for b in batches}
        print(f"one process, {engine.device}, decode mode {engine.decode_mode}: "
              + ", ".join(f"batch {b} {ms:.3f} ms/token (experts' GEMMs {experts[b]:.3f})" for b, ms in rows.items()))
        if not args.no_json:
            bc.write_results(baseline_name(args.model), engine.device, {
                "run": bc.run_info(engine.device), "model": args.model, "decode_mode": engine.decode_mode,
                "ms_per_token": rows, "expert_ms_per_token": experts})
        return

    from comm import bootstrap, shutdown
    info = bootstrap(backend="gloo" if args.smoke else None)
    world, rank = info.world_size, dist.get_rank()
    chosen = [(n, kw) for n, kw in layouts(world) if not args.layouts or n in args.layouts.split(",")]
    if info.device.type == "cuda":  # the profiler's start-up on a GPU (seconds) in no timed split_ms run
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            torch.ones(1, device=info.device).add_(1)
            torch.cuda.synchronize(info.device)
    results = []
    for name, kw in chosen:
        try:  # every rank validates alike, so every rank skips alike
            engine = load(ParallelConfig(**kw))
        except ConfigError as e:
            if rank == 0:
                print(f"{name} skipped: {e}", flush=True)
            continue
        for b in batches:
            ps = prompts(engine, b)
            ms = decode_step_ms(engine, ps, args.new_tokens, args.reps)
            under, comm_ms, calls, experts = split_ms(engine, ps, args.new_tokens)
            results.append({"layout": name, "parallel": kw, "batch": b, "decode_mode": engine.decode_mode,
                            "ms_per_token": ms, "profiled_ms": under, "comm_ms": comm_ms,
                            "collectives_per_token": calls, "expert_ms": experts})
            if rank == 0:  # as it comes: a run cut short keeps what it measured
                print(f"{name} batch {b}: {ms:.3f} ms/token ({engine.decode_mode})", flush=True)
        del engine
        bc.empty_cache(info.device)
    base, base_experts = {}, {}
    device = info.device
    path = bc.results_path(baseline_name(args.model), device)
    if path.exists():
        saved = json.loads(path.read_text())
        base = {int(b): ms for b, ms in saved["ms_per_token"].items()}
        base_experts = {int(b): ms for b, ms in saved.get("expert_ms_per_token", {}).items()}
    if rank == 0:
        run = bc.run_info(device)
        print(f"device {run['device']} x {world} ranks | date {run['date']} | commit {run['commit']} | "
              f"model {args.model}, random weights, prompts of {args.prompt_len} tokens, {args.new_tokens} new")
        print("one GPU alone (--baseline, same day and device): "
              + (", ".join(f"batch {b} {ms:.3f} ms" + (f" (experts' GEMMs {base_experts[b]:.3f})" if b in base_experts
                                                       else "") for b, ms in sorted(base.items())) if base else "not run"))
        cols = ["layout", "decode", "batch", "ms/token", "x one GPU", "profiled ms", "comm ms", "comm share",
                "collectives/token", "experts' GEMMs ms"]
        print(bc.format_table(cols, [[r["layout"], r["decode_mode"], r["batch"], f"{r['ms_per_token']:.3f}",
                                      f"{r['ms_per_token'] / base[r['batch']]:.2f}" if r["batch"] in base else "-",
                                      f"{r['profiled_ms']:.3f}", f"{r['comm_ms']:.3f}",
                                      f"{r['comm_ms'] / r['profiled_ms']:.0%}" if r['profiled_ms'] > 0 else "-",
                                      r["collectives_per_token"], f"{r['expert_ms']:.3f}"] for r in results]))
        if not args.no_json:
            bc.write_results(f"layouts-{Path(args.model).stem}-{world}ranks", device,
                             {"run": run, "model": args.model, "args": vars(args),
                              "baseline_ms_per_token": base, "rows": results})
    shutdown()


if __name__ == "__main__":
    main()
