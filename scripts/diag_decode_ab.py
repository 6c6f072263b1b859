#!/usr/bin/env python
"""A/B runs of the decode benchmark with parts of the decode path switched off or on
inside this process (the library itself reads no such switch), to show what each part
is worth in the same run and on the same device:

    PYTHONPATH=. python scripts/diag_decode_ab.py --off moe-cuda [bench_decode.py arguments]

--off (repeatable):
  moe-cuda    the tuning table's CUDA MoE entries are dropped: the Triton grouped GEMM,
              the routing launch and the combine run as before those kernels
  cuda-pdl    the CUDA C++ kernels (SBI-GeMM, MoE) launch without PDL
  fused-attention  the QKV epilogue launch and SDPA, not kernels.qkv_attention
  pdl-early   every kernel lets the next launch only after its own wait
  fused-context  the static decode step's positions, mask and rotary rows by torch's ops
              (about twenty launches), not kernels.decode_context_triton (one)
  preload-kv  kernels.qkv_attention loads its keys and values after its PDL wait, not before
  router-preload  the norm + router launch loads its weights after its PDL wait, not before
  norm-in-qkv the attention's residual add and RMSNorm in a launch of their own, not inside
              the QKV GEMM's
--on (repeatable; each measured slower or no faster, so off by default):
  route-in    the gating inside the CUDA MoE kernels, no routing launch
  l2-prefetch the CUDA GEMMs send all their weights to L2 before their wait
  topk-in-router  the top-k table in the norm + router launch's last program, no gating launch
--dense-entry KEY/BUCKET=VALUE (repeatable): one entry of the dense table for this device
  replaced, e.g. 'N2048:K4096:bfloat16/1={"backend": "cuda", "bn": 4, "warps": 8,
  "unroll": 1, "split_k": 1}' or 'N5120:K2048:bfloat16/1="cublas"' (VALUE is JSON); how
  the table's "pinned" entries were chosen, in the step rather than alone
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dense import attention  # noqa: E402
from kernels import cuda_common, linear_select, moe_triton, norm, pdl, qkv_attention  # noqa: E402
from moe_infer import model, moe_layer  # noqa: E402

OFF = ("moe-cuda", "cuda-pdl", "fused-attention", "pdl-early", "fused-context", "preload-kv", "router-preload",
       "norm-in-qkv")
ON = ("route-in", "l2-prefetch", "topk-in-router")


def switch_off(part: str) -> None:
    if part == "moe-cuda":
        table = moe_triton._tuned()
        for entries in table.values():
            for buckets in entries.values():
                for t in [t for t, cfg in buckets.items() if cfg.get("backend") == "cuda"]:
                    del buckets[t]
        moe_triton.launch_config.cache_clear()
    elif part == "cuda-pdl":
        cuda_common.pdl_on = lambda device: False
    elif part == "fused-attention":
        _after_init(attention.Attention, "fused_attention", False)
    elif part == "pdl-early":
        pdl.EARLY_TRIGGER = False
    elif part == "fused-context":
        attention.FUSED_DECODE_CONTEXT = False
    elif part == "preload-kv":
        qkv_attention.PRELOAD_KV = False
    elif part == "router-preload":
        norm.ROUTER_PRELOAD = False
    elif part == "norm-in-qkv":
        _after_init(model.Block, "norm_in_qkv", False)


def switch_on(part: str) -> None:
    if part == "route-in":
        _after_init(moe_layer.MoELayer, "route_in_experts")
    elif part == "topk-in-router":
        _after_init(moe_layer.MoELayer, "topk_in_router")
    elif part == "l2-prefetch":
        cuda_common.L2_PREFETCH = True


def set_dense_entry(spec: str) -> None:
    """'KEY/BUCKET=VALUE': the dense table's entry KEY (e.g. N2048:K4096:bfloat16), row
    bucket BUCKET, set to the JSON VALUE for the device this process runs on."""
    where, sep, value = spec.partition("=")
    key, _, bucket = where.partition("/")
    if not sep or bucket not in {str(b) for b in linear_select.BUCKETS}:
        raise SystemExit(f"--dense-entry {spec!r}: expected KEY/BUCKET=JSON with BUCKET one of {linear_select.BUCKETS}")
    try:
        entry = json.loads(value)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--dense-entry {spec!r}: VALUE is not JSON ({exc})") from None
    device = moe_triton.device_key(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    linear_select._table().setdefault(device, {}).setdefault(key, {})[bucket] = entry
    linear_select._choice.cache_clear()


def _after_init(cls, flag: str, value: bool = True) -> None:
    """Every instance of ``cls`` built from now on has ``flag`` set to ``value``."""
    init = cls.__init__

    def init_then_set(self, *args, **kwargs):
        init(self, *args, **kwargs)
        setattr(self, flag, value)
    cls.__init__ = init_then_set


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--off", action="append", choices=OFF, default=[])
    ap.add_argument("--on", action="append", choices=ON, default=[])
    ap.add_argument("--dense-entry", action="append", default=[], metavar="KEY/BUCKET=JSON")
    args, rest = ap.parse_known_args()
    for spec in args.dense_entry:
        set_dense_entry(spec)
    for part in args.off:
        switch_off(part)
    for part in args.on:
        switch_on(part)
    print(f"switched off: {', '.join(args.off) or 'nothing'}; on: {', '.join(args.on) or 'nothing'}; dense entries: "
          f"{'; '.join(args.dense_entry) or 'as in the table'}", flush=True)
    sys.argv = [str(ROOT / "scripts" / "bench_decode.py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
