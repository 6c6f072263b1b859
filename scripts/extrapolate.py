#!/usr/bin/env python
"""The cost model extrapolated to the DeepSpeed-Inference paper's sparse models (its
Table II: 1.3B to 47B base models with 128 experts, MP / EP / expert-slicing layouts on up
to 256 A100 40 GB GPUs): per-token latency at batch 8 (128-token prompts, 100 new tokens)
against the GPU count, and the share of the GPUs' aggregate peak memory bandwidth each
reaches, beside the paper's published point (the 1.06T-parameter model under 25 ms on
256 GPUs at 33% of peak bandwidth).

    python scripts/extrapolate.py                       # table, docs/extrapolation-deepspeed.png
    python scripts/extrapolate.py --no-plot             # table only (no matplotlib needed)
    python scripts/extrapolate.py --paper palm          # PaLM 540B on TPU v4, docs/extrapolation-palm.png

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
from moe_infer.costmodel import CostModel  # noqa: E402
from moe_infer.hardware_profile import Hardware  # noqa: E402
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


# PaLM 540B on 64 TPU v4 (the inference paper's Table 2): (what, layout, batch, new tokens a row,
# context, weight bytes, published seconds for the whole phase, published MFU)
PALM_TABLE_2 = [("decode, 64 tokens, batch 64, int8", "2d-weight-stationary", 64, 64, 2048, 1, 1.82, 0.14),
                ("decode, 64 tokens, batch 512, bf16", "2d-weight-stationary", 512, 64, 2048, 2, 6.0, 0.33),
                ("prefill 2048, batch 1, int8", "2d-weight-stationary", 1, 2048, 0, 1, 0.29, 0.43),
                ("prefill 2048, batch 512, bf16", "weight-gathered", 512, 2048, 0, 2, 85.2, 0.76)]
TPU_V4_PEAK = 275.0  # TFLOP/s bf16: the paper's MFU denominator


def palm(args) -> None:
    from moe_infer.palm import PALM, palm_predict

    hw = Hardware.load("tpu-v4" if args.hardware == "nvidia-a100-40gb" else args.hardware)
    shape = PALM["palm-540b"]
    rows = []
    for what, layout, batch, new, context, wb, pub_s, pub_mfu in PALM_TABLE_2:
        if what.startswith("decode"):  # every step over the prompt and half the new tokens on average
            r = palm_predict(shape, hw, 64, layout, batch, 1, context + new // 2, wb, peak_tflops=TPU_V4_PEAK)
            seconds, mfu = r["seconds"] * new, r["mfu"]
        else:
            r = palm_predict(shape, hw, 64, layout, batch, new, new // 2, wb, peak_tflops=TPU_V4_PEAK)
            seconds, mfu = r["seconds"], r["mfu"]
        rows.append([what, layout, f"{seconds:.2f}", f"{pub_s:g}", f"{seconds / pub_s - 1:+.0%}", f"{mfu:.0%}",
                     f"{pub_mfu:.0%}"])
    print(f"PaLM 540B ({shape.params / 1e9:.0f}B with its heads padded to 64) on 64 x {hw.name}")
    print(bc.format_table(["phase", "FFN layout", "predicted s", "published s", "error", "MFU", "published MFU"],
                          rows))
    # Figure 6's trend: decode latency a token against chips, 1D against 2D weight-stationary
    chips = [8, 16, 32, 64, 128, 256]
    curves = {lay: [palm_predict(shape, hw, n, lay, 64, 1, 2048, 1)["seconds"] * 1e3 for n in chips]
              for lay in ("1d-weight-stationary", "2d-weight-stationary")}
    print("decode ms a token, batch 64, int8: " + "; ".join(
        f"{lay}: " + ", ".join(f"{n} chips {ms:.1f}" for n, ms in zip(chips, v)) for lay, v in curves.items()))
    print(f"assumptions: {hw.source}")
    if args.no_plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for lay, v in curves.items():
        a.plot(chips, v, marker="o", label=lay)
    a.scatter([64], [1.82 / 64 * 1e3], marker="*", s=160, color="black", zorder=5, label="published (Table 2)")
    a.set(xscale="log", xlabel="TPU v4 chips", ylabel="ms per token (PaLM 540B, batch 64, int8)")
    tokens = [2 ** k for k in range(11, 21)]
    for lay in ("2d-weight-stationary", "weight-gathered"):
        b.plot(tokens, [100 * palm_predict(shape, hw, 64, lay, t // 2048, 2048, 1024, 2, peak_tflops=TPU_V4_PEAK)["mfu"]
                        for t in tokens], marker="o", label=lay)
    b.scatter([512 * 2048, 2048], [76, 43], marker="*", s=160, color="black", zorder=5, label="published (Table 2)")
    b.set(xscale="log", xlabel="tokens a prefill (batch x 2048)", ylabel="MFU % (64 chips)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Cost model, PaLM 540B on TPU v4 (assumptions: moe_infer/hardware/tpu-v4.yaml)", fontsize=9)
    fig.tight_layout()
    out = str(ROOT / "docs" / "extrapolation-palm.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="nvidia-a100-40gb")
    ap.add_argument("--out", default=str(ROOT / "docs" / "extrapolation-deepspeed.png"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--paper", choices=["deepspeed", "palm"], default="deepspeed")
    args = ap.parse_args()
    if args.paper == "palm":
        return palm(args)
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
