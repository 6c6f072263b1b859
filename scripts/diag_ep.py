#!/usr/bin/env python
"""Where the expert-parallel dispatch and combine spend their time: each step on its own,
with a device sync after it, next to the floor of one NCCL call and of one torch launch.

    scripts/launch.sh -n 4 -- python scripts/diag_ep.py [--tokens 64,4096]

Rank 0 prints the median wall time of each step (µs) per layout and tokens per rank.
The experts are left out: the combine sends back the rows the dispatch received.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
from bench_ep import timed  # noqa: E402
import kernels  # noqa: E402
from comm import ParallelGroups, all_reduce, all_to_all, bootstrap, exchange_counts, shutdown  # noqa: E402
from moe_infer.config import ModelConfig, MoEConfig, ParallelConfig  # noqa: E402
from moe_infer.moe_layer import MoELayer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64,4096")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=4096, help="Mixtral's; smaller for a CPU smoke run")
    ap.add_argument("--label", default="", help="printed with the table (e.g. the mpirun binding)")
    args = ap.parse_args()
    info = bootstrap(backend="nccl" if torch.cuda.is_available() else "gloo", timeout_s=300)
    device, world, reps = info.device, info.world_size, args.reps
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    one = torch.ones(1, device=device)
    world_group = ParallelGroups.build(ParallelConfig(dp=world), info.rank, world).dp
    rows = [["-", "-", "one torch launch (add_)", timed(lambda: one.add_(1), device, reps)[0]],
            ["-", "-", "NCCL all_reduce, 1 float, world", timed(lambda: all_reduce(one, world_group), device, reps)[0]]]
    h, f, e, k = args.hidden, 64, 8, 2  # Mixtral's H, E and k; the experts are not run
    for name, layout in [("naive", dict(tp=2, dp=world // 2, ep=world, pcc=False)),
                         ("pcc", dict(tp=2, dp=world // 2, ep=world, pcc=True))]:
        parallel = ParallelConfig(**layout)
        groups = ParallelGroups.build(parallel, info.rank, world)
        m = ModelConfig(vocab_size=16, hidden_size=h, num_layers=1, num_heads=8, ffn_hidden=16)
        layer = MoELayer(m, MoEConfig(num_experts=e, top_k=k, expert_hidden=f), parallel, groups)
        layer = layer.to(device=device, dtype=dtype)
        d = layer.dispatcher
        gen = torch.Generator(device=device).manual_seed(1000 + groups.dp.rank)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02, generator=gen)
            for t in [int(s) for s in args.tokens.split(",")]:
                x = torch.randn(t, h, device=device, dtype=dtype, generator=gen)
                routing = layer.router(x)
                dest = d.table(device).index_select(0, routing.expert_ids.reshape(-1)).reshape(t, -1)
                offsets, unit_rows = kernels.token_maps(dest, d.group.size + 1)
                counts = offsets[1:-1] - offsets[:-2]
                send, recv = exchange_counts(counts, d.group)
                payload = torch.empty(dest.numel(), h + 16, dtype=x.dtype, device=device)
                sent = d.dispatch(x, routing)
                y = sent.x.contiguous()
                back = torch.randn(sent.sent_rows, h, device=device, dtype=dtype)
                steps = {
                    "token_maps": lambda: kernels.token_maps(dest, d.group.size + 1),
                    "exchange_counts (a2a + host wait)": lambda: exchange_counts(counts, d.group),
                    "dispatch_rows (send buffer)": lambda: kernels.dispatch_rows(x, unit_rows, routing.expert_ids,
                                                                                 d.e_local, payload),
                    "payload a2a": lambda: all_to_all(payload[:sum(send)], send, d.group, recv_counts=recv),
                    "whole dispatch": lambda: d.dispatch(x, routing),
                    "a2a back": lambda: all_to_all(y, sent.recv_counts, sent.group, recv_counts=sent.send_counts),
                    "gather": lambda: kernels.gather_rows(back, sent.rows, sent.weight, limit=sent.sent_rows),
                    "whole combine": lambda: d.combine(y, sent),
                }
                if d.pcc:
                    out = torch.randn(t, h, device=device, dtype=dtype)
                    steps["TP all_reduce of the output"] = lambda: all_reduce(out, groups.tp)
                for step, fn in steps.items():
                    rows.append([name, t, step, timed(fn, device, reps)[0]])
        del layer
    shutdown()
    if info.rank == 0:
        run = bc.run_info(device)
        print(f"device {run['device']} x {world} | date {run['date']} | commit {run['commit']} | {args.label}")
        print(bc.format_table(["layout", "T/rank", "step", "median µs"],
                              [[a, b, c, f"{v:.1f}"] for a, b, c, v in rows]))


if __name__ == "__main__":
    main()
