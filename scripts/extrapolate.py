#!/usr/bin/env python
"""The cost model extrapolated to the DeepSpeed-Inference paper's sparse models (its
Table II: 1.3B to 47B base models with 128 experts, MP / EP / expert-slicing layouts on up
to 256 A100 40 GB GPUs): per-token latency at batch 8 (128-token prompts, 100 new tokens)
against the GPU count, and the share of the GPUs' aggregate peak memory bandwidth each
reaches, beside the paper's published point (the 1.06T-parameter model under 25 ms on
256 GPUs at 33% of peak bandwidth).

    python scripts/extrapolate.py                       # table, docs/extrapolation-deepspeed.png
    python scripts/extrapolate.py --no-plot             # table only (no matplotlib needed)

Assumptions (printed with the table): the ``nvidia-a100-40gb`` profile (published figures,
efficiencies stated in the file); each model at its Table II tensor-parallel degree and
expert-slicing, expert parallelism up to 128 over the GPUs, the dense part data-parallel
over the rest; replicas hold their own sequences (data-parallel attention, the
all-to-all), batch 8 a replica; peak bandwidth 1555 GB/s a GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_SCRIPTS = Path(__file__).resolve().parent
ROOT = _SCRIPTS.parent
sys.path[:0] = [str(ROOT), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
from moe_infer.config import ConfigError, ParallelConfig  # noqa: E402
from moe_infer.costmodel import CostModel, Hardware  # noqa: E402
from moe_infer.loader import resolve_config  # noqa: E402

# Table II: config, MP (tp), expert-slicing, the paper's GPU count
TABLE_II = [("ds-moe-1.3b-e128", 1, 1, 128), ("ds-moe-2.4b-e128", 1, 1, 128), ("ds-moe-8b-e128", 4, 1, 128),
            ("ds-moe-24b-e128", 8, 2, 256), ("ds-moe-47b-e128", 8, 2, 256)]
PEAK_GBPS = 1555.0  # A100 40 GB HBM2, the paper's "peak memory bandwidth"
PUBLISHED = {"ds-moe-24b-e128": (256, 25.0, 0.33)}  # GPUs, "under" ms per token, share of peak bandwidth
BATCH, PROMPT, NEW = 8, 128, 100


def curve(name: str, tp: int, slicing: int, hw: Hardware) -> list[dict]:
    cfg = resolve_config(ROOT / "configs" / f"{name}.yaml")
    model = CostModel(cfg, hw)
    out = []
    for gpus in (8, 16, 32, 64, 128, 256):
        if gpus % (tp * slicing):
            continue
        ep = min(cfg.moe.num_experts, gpus // slicing)
        try:
            p = ParallelConfig(tp=tp, dp=gpus // tp, ep=ep, expert_slicing=slicing, dp_attention=gpus // tp > 1
                               and tp % (ep * slicing) != 0)
            pred = model.predict(p, "decode", BATCH * p.dp if p.dp_attention else BATCH, PROMPT + NEW // 2)
        except ConfigError:
            continue
        if not pred.fits:
            continue
        read = pred.split["memory"] * 1e-3 * hw.mem_gbps * 1e9 * gpus  # bytes every GPU reads a step
        out.append({"model": name, "gpus": gpus, "layout": pred.layout, "ms": pred.ms,
                    "bandwidth_share": read / (pred.ms * 1e-3) / (gpus * PEAK_GBPS * 1e9),
                    "memory_gb": pred.memory_gb})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="nvidia-a100-40gb")
    ap.add_argument("--out", default=str(ROOT / "docs" / "extrapolation-deepspeed.png"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    hw = Hardware.load(args.hardware)
    rows = [r for name, tp, es, _ in TABLE_II for r in curve(name, tp, es, hw)]
    print(f"DeepSpeed-Inference Table II models on {hw.name}: decode ms per token at batch {BATCH} a replica, "
          f"context {PROMPT} + {NEW // 2}")
    print(bc.format_table(["model", "GPUs", "layout", "ms/token", "peak bandwidth share", "GB/GPU"], [
        [r["model"], r["gpus"], r["layout"], f"{r['ms']:.2f}", f"{r['bandwidth_share']:.0%}", f"{r['memory_gb']:.1f}"]
        for r in rows]))
    for name, (gpus, ms, share) in PUBLISHED.items():
        got = next((r for r in rows if r["model"] == name and r["gpus"] == gpus), None)
        if got:
            print(f"{name} on {gpus} GPUs: predicted {got['ms']:.1f} ms and {got['bandwidth_share']:.0%} of peak "
                  f"bandwidth; published under {ms:g} ms and {share:.0%} ({got['ms'] / ms - 1:+.0%}, "
                  f"{got['bandwidth_share'] / share - 1:+.0%})")
    print(f"assumptions: {hw.source}")
    if args.no_plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, *_ in TABLE_II:
        pts = [r for r in rows if r["model"] == name]
        a.plot([r["gpus"] for r in pts], [r["ms"] for r in pts], marker="o", label=name)
        b.plot([r["gpus"] for r in pts], [100 * r["bandwidth_share"] for r in pts], marker="o", label=name)
    for name, (gpus, ms, share) in PUBLISHED.items():
        a.scatter([gpus], [ms], marker="*", s=160, color="black", zorder=5, label=f"published ({name}, < {ms:g} ms)")
        b.scatter([gpus], [100 * share], marker="*", s=160, color="black", zorder=5, label="published")
    for ax, label in ((a, "ms per token (batch 8)"), (b, "% of aggregate peak memory bandwidth")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (A100 40 GB)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.suptitle(f"Cost model extrapolation, {hw.name} profile (assumptions: moe_infer/hardware/{hw.name}.yaml)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
