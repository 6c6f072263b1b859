#!/usr/bin/env python
"""Scaling experiments: the decode benchmark (``bench_layouts.py``) over every world size
this machine allows, 1, 2, 4, ... GPUs, and every layout of each, then the cost model's
prediction beside each measurement (``validate_costmodel.compare``): one JSON and a plot
of measured against predicted.

    python scripts/scaling.py --model olmoe-1b-7b                      # every GPU of the machine
    python scripts/scaling.py --smoke                                  # tiny-moe, 1 and 2 CPU ranks (gloo)

Each world size runs as its own job (``scripts/launch.sh -n N``), one after the other, so
the figures share the machine and the day. Writes bench/results/scaling-<model>-<device>-
<date>.json and, unless --no-plot, docs/scaling-<model>.png (with --smoke, both in
--results-dir).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_SCRIPTS = Path(__file__).resolve().parent
ROOT = _SCRIPTS.parent
sys.path[:0] = [str(ROOT), str(_SCRIPTS)]

import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from validate_costmodel import compare  # noqa: E402


def run(cmd: list[str], env: dict) -> None:
    print("$ " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = [line for line in out.stdout.splitlines() if line.strip()][-3:]
    print("\n".join(tail), flush=True)
    if out.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed:\n{out.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-1b-7b")
    ap.add_argument("--max-gpus", type=int, default=None, help="largest world size (default: the GPUs here)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--layouts", help="comma list of bench_layouts layout names per world size (default: every one; "
                                      "--smoke: tp2, ep2, pp2)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hardware", help="the cost model's profile (default: this GPU's shipped one)")
    ap.add_argument("--smoke", action="store_true", help="tiny-moe on 1 and 2 CPU ranks, a profile measured now")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--results-dir", default=str(bc.RESULTS_DIR), help="where the JSON go (default bench/results)")
    args = ap.parse_args()
    bc.RESULTS_DIR = Path(args.results_dir)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    common = ["--model", args.model, "--batches", args.batches, "--reps", str(args.reps),
              "--results-dir", args.results_dir]
    if args.smoke:
        common = ["--smoke", "--results-dir", args.results_dir]
        env["CUDA_VISIBLE_DEVICES"] = ""
        args.model, top = "tiny-moe", 2
        args.layouts = args.layouts or "tp2,ep2,pp2"
        if args.hardware is None:  # this CPU, measured now (no shipped profile describes it)
            from moe_infer.calibrate import measure

            args.hardware = str(Path(tempfile.mkdtemp()) / "cpu.yaml")
            measure(torch.device("cpu"), smoke=True).dump(args.hardware)
    else:
        top = args.max_gpus or torch.cuda.device_count()
        if top < 1:
            raise SystemExit("no GPU here: pass --smoke for the CPU run")
    worlds = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    files = []
    device = "cpu" if args.smoke else torch.device("cuda")
    stem = Path(args.model).stem
    for world in worlds:
        if world == 1:
            run([sys.executable, "scripts/bench_layouts.py", "--baseline", *common], env)
            files.append(bc.results_path(f"layouts-baseline-{stem}", device))
        else:
            chosen = ["--layouts", args.layouts] if args.layouts else []
            run(["bash", "scripts/launch.sh", "-n", str(world), "--", sys.executable, "scripts/bench_layouts.py",
                 *common, *chosen], env)
            files.append(bc.results_path(f"layouts-{stem}-{world}ranks", device))
    rows = compare(files, args.hardware)
    print(bc.format_table(["GPUs", "layout", "batch", "measured ms", "predicted ms", "error"], [
        [1 if r["layout"] == "one GPU" else int(r["file"].split("ranks")[0].rsplit("-", 1)[1]), r["layout"],
         r["batch"], f"{r['ms']:.3f}", f"{r['predicted']:.3f}", f"{r['error']:+.0%}"] for r in rows]))
    path = bc.write_results(f"scaling-{stem}", device, {"run": bc.run_info(device), "model": args.model,
                                                         "worlds": worlds, "rows": rows})
    print(f"wrote {path}")
    if args.no_plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for layout in dict.fromkeys(r["layout"] for r in rows):
        pts = [r for r in rows if r["layout"] == layout]
        ax.scatter([r["predicted"] for r in pts], [r["ms"] for r in pts], label=layout)
    lo = min(min(r["ms"], r["predicted"]) for r in rows)
    hi = max(max(r["ms"], r["predicted"]) for r in rows)
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="predicted ms a decode step", ylabel="measured ms a decode step",
           title=f"{args.model}: measured against the cost model ({rows[0]['profile']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = (Path(args.results_dir) if args.smoke else ROOT / "docs") / f"scaling-{stem}.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
