#!/usr/bin/env python
"""The cost model's predictions against measured decode steps: every row of the layout
benchmarks' JSON (``scripts/bench_layouts.py``: one GPU alone and each layout;
``scripts/bench_pipeline.py``: pp with and without draining, its peers;
``scripts/bench_decode.py``'s prompt x batch matrix: one GPU, bf16) beside
``moe_infer.costmodel``'s prediction for the same model, layout, batch and context on the
device's hardware profile, with the error of each. A row measured again later counts by its
latest run (``--superseded``: every run).

    python scripts/validate_costmodel.py        # every layouts-, pipeline- and decode-matrix-*.json in bench/results
    python scripts/validate_costmodel.py --files a.json b.json --hardware my-h200.yaml
    python scripts/validate_costmodel.py --offload bench/results/offload-M-D-DATE.json   # offloaded decode too

The context of a step is the prompt plus half the new tokens (the mean over the timed
steps). Then, per (model, device, batch) with several layouts of one world size measured,
whether the layout the model ranks first among them is the measured-fastest one or within
5% of it (``choices``). Prefill, in a table of its own: the time to the first token of
``scripts/bench_decode.py``'s prompt x batch matrix (one GPU, bf16: its decode-matrix-*.json)
and the pipelined prompt processing of ``scripts/bench_pipeline.py`` (pp with each
micro-batch count), each against the model's prefill of those prompts (by the routing a
matrix cell recorded of its prompts, ``bench_decode.py --routing``, where it did). ``--offload``: the
decode rows of ``scripts/bench_offload.py`` results too (an offloaded model in a budget),
each predicted with the hit rate the run measured, summed up apart. No GPU needed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
from moe_infer import ParallelConfig  # noqa: E402
from moe_infer.costmodel import CostModel  # noqa: E402
from moe_infer.hardware_profile import DEVICE_PROFILES, Hardware  # noqa: E402
from moe_infer.loader import resolve_config  # noqa: E402



def rows_of(path: Path) -> list[dict]:
    """(model, device, layout, parallel, batch, measured ms, context) of one results file
    (bench_layouts' or bench_pipeline's)."""
    d = json.loads(path.read_text())
    args, device = d.get("args") or {}, d["run"]["device"]
    context = args.get("prompt_len", 128) + args.get("new_tokens", 32) / 2
    # when it ran: the later of two runs of the same row replaces the earlier (``latest``)
    when = (d["run"].get("time") or d["run"].get("date", ""), path.name)
    # the SDPA kernels its graphed prefills took (a file from before the option: flash's)
    cudnn = bool((d.get("kernel_options") or {}).get("cudnn_prefill_graphs", False))
    if "rows" in d:
        return [dict(model=d["model"], device=device, layout=r["layout"], parallel=r["parallel"], batch=r["batch"],
                     ms=r["ms_per_token"], context=context, file=path.name, when=when) for r in d["rows"]]
    if "decode" in d:  # scripts/bench_pipeline.py: ms a decode step of the whole batch; its prompts' prefill
        world = max((ParallelConfig(**r["parallel"]).world_size for r in d["decode"]), default=1)
        return [dict(model=d["model"], device=device, layout=r["layout"], parallel=r["parallel"], batch=r["batch"],
                     ms=r["ms_per_step"], context=context, file=path.name, when=when) for r in d["decode"]] + [
            dict(model=d["model"], device=device, layout=f"pp{world}, {r['micro_batches']} micro-batches",
                 parallel={"pp": world, "prompt_micro_batches": r["micro_batches"]}, batch=args["prompts"],
                 ms=r["seconds"] * 1e3, context=args["prompt_tokens"], phase="prefill", file=path.name, when=when,
                 cudnn_prefill_graphs=cudnn) for r in d.get("prompts", [])]
    if "cells" in d:  # scripts/bench_decode.py's matrix, bf16 on one GPU: the time to the first token, decode
        if args.get("quantize") is not None:
            return []
        cell = dict(model=d["model"], device=device, layout="one GPU", parallel={}, layers=args.get("layers"),
                    file=path.name, when=when)
        return [dict(cell, batch=c["batch"], ms=c["prefill_s"] * 1e3, context=c["prompt_len"], phase="prefill",
                     cudnn_prefill_graphs=cudnn, **({"routing": c["routing"]} if "routing" in c else {}))
                for c in d["cells"]] + [
            dict(cell, batch=c["batch"], ms=c["decode_ms_per_token"], context=c["prompt_len"] + args["new_tokens"] / 2)
            for c in d["cells"]]
    if "ms_per_token" in d:  # a --baseline run: one GPU alone
        return [dict(model=d["model"], device=device, layout="one GPU", parallel={}, batch=int(b), ms=ms,
                     context=context, file=path.name, when=when) for b, ms in d["ms_per_token"].items()]
    return []


def latest(rows: list[dict]) -> list[dict]:
    """Each (model, device, layout, batch, context) once: its latest run's row (a row
    re-measured after the code changed measures the code as it is), in their order."""
    def key(r):
        return (r["model"], r.get("layers"), r["device"], r.get("phase", "decode"), r["layout"],
                json.dumps(r["parallel"], sort_keys=True), r["batch"], r["context"])

    keep: dict = {}
    for r in rows:
        if key(r) not in keep or r["when"] >= keep[key(r)]["when"]:
            keep[key(r)] = r
    return [r for r in rows if keep[key(r)] is r]


def offload_rows_of(path: Path) -> list[dict]:
    """The rows of one ``bench_offload`` results file that ran in a budget, as ``rows_of``'s
    (one GPU) with the budget, the mode and the measured hit rate."""
    d = json.loads(path.read_text())
    args = d.get("args") or {}
    context = args.get("prompt_len", 128) + args.get("new_tokens", 8) / 2
    return [dict(model=d["model"], device=d["run"]["device"], layout=f"offload {r['mode']}, {r['budget_gb']:g} GB",
                 parallel={}, batch=r["batch"], ms=r["ms_per_token"], context=context, file=path.name,
                 offload=(r["budget_gb"], r["mode"], r["hit_rate"]))
            for r in d.get("rows", []) if r.get("budget_gb") is not None and r.get("hit_rate") is not None]


def compare(files: list[Path], hardware: str | None = None, offload_files: list[Path] = (),
            superseded: bool = False) -> list[dict]:
    """The rows of ``files`` (each row's latest run, or every run with ``superseded``; and
    the rows of ``offload_files``: ``offload_rows_of``) with the cost model's prediction:
    ``predicted`` ms and ``error`` (predicted / measured - 1); ``hardware``: the profile for
    all (default: by each file's device)."""
    rows = [r for f in files for r in rows_of(f)]
    rows = (rows if superseded else latest(rows)) + [r for f in offload_files for r in offload_rows_of(f)]
    out = []
    for r in rows:
        profile = hardware or DEVICE_PROFILES.get(r["device"])
        if profile is None:
            raise SystemExit(f"{r['file']}: no profile for {r['device']!r}; pass --hardware")
        cfg, hit_rate = resolve_config(r["model"]), None
        if r.get("layers") is not None:  # a run on the model's first layers (``bench_decode.py --layers``)
            cfg = bc.first_layers(cfg, r["layers"])
        if "offload" in r:
            budget, mode, hit_rate = r["offload"]
            cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, gpu_memory_gb=budget, offload=mode))
        if "cudnn_prefill_graphs" in r:  # a prefill priced on the attention kernels it ran
            cfg = dataclasses.replace(cfg, engine=dataclasses.replace(
                cfg.engine, cudnn_prefill_graphs=r["cudnn_prefill_graphs"]))
        # a prefill whose prompts' routing the run recorded (bench_decode.py --routing): priced by it
        histogram = {int(k): [float(n) for n in v] for k, v in r["routing"].items()} if "routing" in r else None
        model = CostModel(cfg, Hardware.load(profile), hit_rate=hit_rate, histogram=histogram)
        phase = r.get("phase", "decode")  # (a prefill's context: its prompt)
        pred = model.predict(ParallelConfig(**r["parallel"]), phase, r["batch"], round(r["context"]),
                             prompt=r["context"] if phase == "prefill" else None)
        out.append({**r, "profile": profile, "predicted": pred.ms, "error": pred.ms / r["ms"] - 1})
    return out


def gpus_of(row: dict) -> int:
    return 1 if row["layout"] == "one GPU" else ParallelConfig(**row["parallel"]).world_size


def choices(rows: list[dict]) -> list[dict]:
    """Per (model, device, number of GPUs, batch) with two or more multi-rank layouts
    measured: the layout the model predicts fastest among them, the measured-fastest, and
    whether the first ran within 5% of the second."""
    cases: dict = {}
    for r in rows:
        if r["layout"] != "one GPU" and "offload" not in r and r.get("phase", "decode") == "decode":
            cases.setdefault((r["model"], r["device"], gpus_of(r), r["batch"]), []).append(r)
    out = []
    for (model, device, gpus, batch), rs in sorted(cases.items()):
        if len(rs) < 2:
            continue
        picked, best = min(rs, key=lambda r: r["predicted"]), min(rs, key=lambda r: r["ms"])
        out.append(dict(model=model, device=device, gpus=gpus, batch=batch, picked=picked["layout"],
                        best=best["layout"], ratio=picked["ms"] / best["ms"], hit=picked["ms"] <= 1.05 * best["ms"]))
    return out


def by_gpus(items: list[dict], gpus, ok) -> str:
    """How many of ``items`` are ``ok``, per number of GPUs ("1 GPU: 20 of 23, 2 GPUs: ..."):
    the targets are stated per machine size."""
    counts: dict = {}
    for it in items:
        n = counts.setdefault(gpus(it), [0, 0])
        n[0] += bool(ok(it))
        n[1] += 1
    return ", ".join(f"{g} GPU{'s' if g > 1 else ''}: {a} of {b}" for g, (a, b) in sorted(counts.items()))


def within(rows: list[dict]) -> str:
    """How many of ``rows`` the model predicts within 15%, per number of GPUs, and the median error."""
    errors = sorted(abs(r["error"]) for r in rows)
    return (f"{sum(e <= 0.15 for e in errors)} of {len(errors)} within 15% "
            f"({by_gpus(rows, gpus_of, lambda r: abs(r['error']) <= 0.15)}); median |error| "
            f"{errors[len(errors) // 2]:.0%}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="*",
                    help="results JSON files (default: bench/results/layouts-*.json, pipeline-*.json and "
                         "decode-matrix-*.json)")
    ap.add_argument("--hardware", help="a profile for every file (default: by each file's device)")
    ap.add_argument("--offload", nargs="*", default=[], metavar="JSON",
                    help="bench_offload results whose rows in a budget to predict too (their measured hit rates)")
    ap.add_argument("--superseded", action="store_true",
                    help="also the rows a later run of the same model, layout, batch and context measured again")
    args = ap.parse_args()
    files = [Path(f) for f in args.files] if args.files else sorted(
        [*bc.RESULTS_DIR.glob("layouts-*.json"), *bc.RESULTS_DIR.glob("pipeline-*.json"),
         *bc.RESULTS_DIR.glob("decode-matrix-*.json")])
    everything = compare(files, args.hardware, [Path(f) for f in args.offload], args.superseded)
    rows = [r for r in everything if "offload" not in r and r.get("phase", "decode") == "decode"]
    print(bc.format_table(["model", "layout", "batch", "measured ms", "predicted ms", "error", "profile", "file"], [
        [r["model"], r["layout"], r["batch"], f"{r['ms']:.3f}", f"{r['predicted']:.3f}", f"{r['error']:+.0%}",
         r["profile"], r["file"]] for r in rows]))
    if rows:
        print(within(rows))
    prefills = [r for r in everything if r.get("phase") == "prefill"]
    if prefills:
        print()
        print(bc.format_table(["model", "layout", "prompt x batch", "measured ms", "predicted ms", "error", "profile",
                               "file"],
                              [[r["model"] + (f" ({r['layers']} layers)" if r.get("layers") else ""), r["layout"],
                                f"{r['context']} x {r['batch']}", f"{r['ms']:.1f}", f"{r['predicted']:.1f}",
                                f"{r['error']:+.0%}", r["profile"], r["file"]] for r in prefills]))
        print("prefill: " + within(prefills))
    offloaded = [r for r in everything if "offload" in r]
    if offloaded:
        print()
        print(bc.format_table(["model", "offload", "batch", "hit rate", "measured ms", "predicted ms", "error",
                               "profile", "file"],
                              [[r["model"], r["layout"], r["batch"], f"{r['offload'][2]:.2f}", f"{r['ms']:.3f}",
                                f"{r['predicted']:.3f}", f"{r['error']:+.0%}", r["profile"], r["file"]]
                               for r in offloaded]))
        print(f"offloaded: {sum(abs(r['error']) <= 0.15 for r in offloaded)} of {len(offloaded)} within 15%")
    picks = choices(rows)
    if picks:
        print()
        print(bc.format_table(["model", "GPUs", "batch", "model's first choice", "measured fastest",
                               "its time / fastest"],
                              [[p["model"], p["gpus"], p["batch"], p["picked"], p["best"], f"{p['ratio']:.2f}"]
                               for p in picks]))
        print(f"first choice fastest or within 5%: {sum(p['hit'] for p in picks)} of {len(picks)} cases "
              f"({by_gpus(picks, lambda p: p['gpus'], lambda p: p['hit'])})")


if __name__ == "__main__":
    main()
