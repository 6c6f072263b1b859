#!/usr/bin/env python
"""Dense decode kernels against their torch baselines, measured in one run:

1. small-batch GEMM (T = 1..16 rows) at the linear-layer shapes of the presets: cuBLAS
   (``torch.matmul``, bf16) against ``kernels.moe.triton.linear_triton`` (the grouped GEMM, one group),
   SBI-GeMM in Triton (``kernels.sbi_linear``) and SBI-GeMM in CUDA C++
   (``kernels.linear.sbi_cuda.sbi_linear_cuda``, the fastest of a few launch configurations), each with
   bf16 and int8 weights; time in a CUDA graph (device time, no launch gaps), weight GB/s
   and percent of the copy bandwidth measured at the start. Beside them, a device copy
   that moves the same bytes (half read, half written), timed the same way: the share of
   the copy bandwidth a kernel of this size reaches at all;
2. decode attention (one query token per row over a paged KV cache):
   ``kernels.paged_decode_attention`` reading the pool in place, against SDPA over the
   row's keys gathered into a copy under a mask, and SDPA over exactly the visible prefix
   of a contiguous cache; KV GB/s.

Inputs rotate among several copies so a small case is not served from L2.

    python scripts/bench_dense.py                                  # the GPU sweep
    python scripts/bench_dense.py --models mixtral-8x7b --tokens 1,8
    python scripts/bench_dense.py --models deepseek-v2-lite --layers "q + kv_a" --no-attention --write-table
    python scripts/bench_dense.py --tp 2 --no-attention --write-table   # one rank's shapes of tp 2
    python scripts/bench_dense.py --device cpu --smoke             # tiny, end to end

Writes bench/results/dense-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on a CPU (smoke runs)
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import kernels  # noqa: E402
from kernels import tuning  # noqa: E402
from moe_infer.loader import resolve_config  # noqa: E402

MODELS = "mixtral-8x7b,qwen3-30b-a3b,gpt-j-6b,gpt-neox-20b,gpt-13b"


def linear_shapes(name: str, tp: int = 1) -> list[tuple[str, int, int]]:
    """(layer, K in, N out) of a preset's dense linear layers on one rank of a ``tp``-way
    tensor-parallel group (``dense.attention.Attention``'s split: a KV head per rank where
    there are fewer than ranks, the other ranks' q and k rows too at decode where q and k
    take an all-heads norm; the LM head is not split)."""
    cfg = resolve_config(name)
    m = cfg.model
    if m.num_heads % tp:
        raise SystemExit(f"--tp {tp}: {name} has {m.num_heads} heads, not a multiple")
    heads = m.num_heads // tp
    if m.kv_lora_rank is not None:  # latent attention (dense.mla): its projections, each head's rows on its rank
        q, kv_a = heads * m.head_dim, m.kv_lora_rank + m.rotary_width
        # (the input's two projections as one GEMM: LatentAttention.merge_projections)
        shapes = [("q_a + kv_a", m.hidden_size, m.q_lora_rank + kv_a), ("q_b", m.q_lora_rank, q)] if m.q_lora_rank \
            else [("q + kv_a", m.hidden_size, q + kv_a)]
        shapes += [("o", heads * m.v_head_dim, m.hidden_size)]
    else:
        q, kv = heads * m.head_dim, max(m.num_kv_heads // tp, 1) * m.head_dim
        shapes = [("qkv", m.hidden_size, q + 2 * kv), ("o", q, m.hidden_size)]
        if m.qk_norm == "full" and tp > 1:  # a decode step's rows: every head's q and k, this rank's v
            shapes.append(("qkv decode", m.hidden_size, (m.num_heads + m.num_kv_heads) * m.head_dim + kv))
    gated = m.gated  # up rows and gate rows
    if cfg.moe is None or cfg.moe.first_dense or cfg.moe.every > 1:  # a dense MLP exists
        ffn = m.ffn_hidden // tp
        shapes += [("mlp up", m.hidden_size, (2 if gated else 1) * ffn), ("mlp down", ffn, m.hidden_size)]
    if cfg.moe is not None and cfg.moe.shared_experts:  # one MLP of the shared experts' widths (moe_layer)
        ffn = cfg.moe.shared_experts * cfg.moe.shared_expert_hidden // tp
        shapes += [("shared up", m.hidden_size, (2 if gated else 1) * ffn), ("shared down", ffn, m.hidden_size)]
    if tp == 1:
        shapes.append(("lm head", m.hidden_size, m.vocab_size))
    return shapes


def timer(device, copies):
    """fn(inputs) -> median µs: a CUDA graph over all copies on a GPU, eager on the CPU."""
    def run(fn, inputs):
        if device.type == "cuda":
            return bc.time_graph(lambda: [fn(*a) for a in inputs], reps=20, device=device) / len(inputs)
        return bc.time_fn(lambda a: fn(*a), inputs=inputs, reps=3, device=device)
    return run


def cuda_candidates(t: int, n: int, k: int, sms: int, int8: bool) -> list[dict]:
    """The heuristic launch configuration of the CUDA SBI-GeMM and its neighbours: BN
    outputs per block, 4 or 8 warps, half or twice the K splits, one load or half or twice
    the loads in flight per row (at most 32 16-byte loads a thread). A candidate whose
    last load of a step always lies past its split of K is left out: it only costs
    registers (one load a row covers K = 2048 with 8 warps, and 64 registers drop to 40)."""
    from kernels.linear.sbi_cuda import sbi_cuda_config  # CuPy: imported where a GPU run needs it

    base = sbi_cuda_config(t, n, k, sms, int8)
    bns = (2, 4, 8) if t <= 2 else (1, 2, 4)
    splits = sorted({max(1, base["split_k"] // 2), base["split_k"], base["split_k"] * 2})
    unrolls = sorted({1, max(1, base["unroll"] // 2), base["unroll"], base["unroll"] * 2})
    vec = 16 if int8 else 8
    return [dict(base, bn=bn, warps=warps, split_k=sp, unroll=u) for bn in bns for warps in (4, 8)
            for sp in splits for u in unrolls if bn * u <= 32 and (u - 1) * warps * 32 * vec < -(-k // sp)]


def best_cuda(time, inputs, t, n, k, sms, int8):
    """(µs, configuration) of the fastest CUDA SBI-GeMM candidate; (None, None) on a CPU.
    For int8 the eight fastest are tried again with ``unit`` widening. The six fastest are
    tried again as persistent grids (``persist`` blocks per SM, each walking several column
    tiles), where that leaves fewer blocks than tiles."""
    if inputs[0][0].device.type != "cuda":
        return None, None

    from kernels.linear.sbi_cuda import sbi_linear_cuda

    def timed(cfgs):
        return [(time(lambda x, w, s, c=cfg: sbi_linear_cuda(x, w, s, config=c), inputs), cfg)
                for cfg in cfgs]
    plain = sorted(timed(cuda_candidates(t, n, k, sms, int8)), key=lambda p: p[0])
    if int8:  # the eight fastest also widening int8 with one byte permute a weight
        plain = sorted(plain + timed([dict(cfg, unit=True) for _, cfg in plain[:8]]), key=lambda p: p[0])
    persistent = [dict(cfg, persist=p) for _, cfg in plain[:6] for p in (1, 2, 4, 8) if p * sms < -(-n // cfg["bn"])]
    return min(plain + timed(persistent), key=lambda p: p[0])


def gemm_rows(models, tokens, device, dtype, copies, copy_gbs, tp: int = 1, layers: set | None = None):
    from kernels.moe.triton import linear_triton  # Triton: imported where a run needs it

    rows, time = [], timer(device, copies)
    sms = tuning.sm_count(device)
    copy_same = {}  # bytes moved -> µs of a device copy moving them

    def same_bytes(nbytes):
        if nbytes not in copy_same and copy_gbs:
            half = nbytes // 4  # bf16 elements read, and as many written
            pairs = [(torch.empty(half, device=device, dtype=torch.bfloat16),
                      torch.empty(half, device=device, dtype=torch.bfloat16)) for _ in range(copies)]
            copy_same[nbytes] = time(lambda a, b: b.copy_(a), pairs)
        return copy_same.get(nbytes)

    for model in models:
        for layer, k, n in linear_shapes(model, tp):
            if layers is not None and layer not in layers:
                continue
            same_bytes(n * k * 2)
            same_bytes(n * k + 4 * n)
            ws = [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(copies)]
            qs = [kernels.quantize_int8(w[None]) for w in ws]
            qs = [(q[0], s[0]) for q, s in qs]
            for t in tokens:
                xs = [torch.randn(t, k, device=device, dtype=dtype) for _ in range(copies)]
                cublas = time(lambda x, w: x @ w.t(), list(zip(xs, ws)))
                ours = time(lambda x, w: linear_triton(x, w), list(zip(xs, ws)))
                ours8 = time(lambda x, q, s: linear_triton(x, q, s), [(x, q, s) for x, (q, s) in zip(xs, qs)])
                sbi = time(lambda x, w: kernels.sbi_linear(x, w), list(zip(xs, ws)))
                sbi8 = time(lambda x, q, s: kernels.sbi_linear(x, q, s), [(x, q, s) for x, (q, s) in zip(xs, qs)])
                cuda, cuda_cfg = best_cuda(time, [(x, w, None) for x, w in zip(xs, ws)], t, n, k, sms, False)
                cuda8, cuda8_cfg = best_cuda(time, [(x, q, s) for x, (q, s) in zip(xs, qs)], t, n, k, sms, True)
                wb, qb = n * k * ws[0].element_size(), n * k + 4 * n
                err = ((linear_triton(xs[0], qs[0][0], qs[0][1]).double() - xs[0].double() @ ws[0].double().t())
                       .norm() / (xs[0].double() @ ws[0].double().t()).norm()).item()
                row = {"model": model, "layer": layer, "K": k, "N": n, "T": t, "cublas_us": cublas, "ours_us": ours,
                       "ours_int8_us": ours8, "sbi_us": sbi, "sbi_int8_us": sbi8, "cuda_us": cuda,
                       "cuda_int8_us": cuda8, "cuda_cfg": cuda_cfg, "cuda_int8_cfg": cuda8_cfg,
                       "weight_mb": wb / 1e6, "int8_rel_err": err,
                       "ours_gbs": wb / ours / 1e3, "int8_gbs": qb / ours8 / 1e3}
                if copy_gbs:
                    # the best SBI-GeMM (either version) on the weights' bytes, and a copy of the same bytes
                    best, best8 = min(sbi, cuda or sbi), min(sbi8, cuda8 or sbi8)
                    row.update(ours_pct=100 * row["ours_gbs"] / copy_gbs, int8_pct=100 * row["int8_gbs"] / copy_gbs,
                               cublas_pct=100 * wb / cublas / 1e3 / copy_gbs,
                               sbi_pct=100 * wb / best / 1e3 / copy_gbs, sbi_int8_pct=100 * qb / best8 / 1e3 / copy_gbs,
                               copy_same_pct=100 * wb / copy_same[wb] / 1e3 / copy_gbs,
                               copy_same_int8_pct=100 * qb / copy_same[qb] / 1e3 / copy_gbs)
                rows.append(row)
            del ws, qs
    return rows


def attention_rows(cases, device, dtype, copies, copy_gbs, block: int = 16):
    rows, time = [], timer(device, copies)
    for b, hq, hkv, s, d in cases:
        inputs = []
        for _ in range(copies):
            q = torch.randn(b, hq, d, device=device, dtype=dtype)
            blocks = -(-s // block)
            k_pool = torch.randn(b * blocks * block, hkv, d, device=device, dtype=dtype)
            v_pool = torch.randn_like(k_pool)
            order = torch.randperm(b * blocks, device=device).view(b, blocks)  # each row's block table
            pos = torch.arange(s, device=device)
            slots = (order[:, pos // block] * block + pos % block).contiguous()  # [B, S]
            visible = torch.ones(b, s, dtype=torch.bool, device=device)
            visible[:, s * 3 // 4:] = False  # the decode step's key bucket holds a quarter spare
            inputs.append((q, k_pool, v_pool, slots, visible))
        live = s * 3 // 4
        ours = time(lambda q, k, v, sl, m: kernels.paged_decode_attention(q, k, v, sl, m), inputs)
        gathered = time(lambda q, k, v, sl, m: F.scaled_dot_product_attention(
            q[:, :, None], k[sl].transpose(1, 2), v[sl].transpose(1, 2), attn_mask=m[:, None, None, :],
            enable_gqa=hq != hkv), inputs)
        dense = [(q, k[sl].transpose(1, 2).contiguous(), v[sl].transpose(1, 2).contiguous())
                 for q, k, v, sl, _ in inputs]
        prefix = time(lambda q, k, v: F.scaled_dot_product_attention(
            q[:, :, None], k[:, :, :live], v[:, :, :live], enable_gqa=hq != hkv), dense)
        q, k, v, sl, m = inputs[0]
        kd, vd = dense[0][1].double(), dense[0][2].double()
        ref = F.scaled_dot_product_attention(q[:, :, None].double(), kd, vd, attn_mask=m[:, None, None, :],
                                             enable_gqa=hq != hkv)[:, :, 0]
        err = ((kernels.paged_decode_attention(q, k, v, sl, m).double() - ref).norm() / ref.norm()).item()
        kv_bytes = 2 * b * hkv * live * d * q.element_size()
        row = {"B": b, "Hq": hq, "Hkv": hkv, "S": s, "visible": live, "D": d, "ours_us": ours,
               "sdpa_gathered_us": gathered, "sdpa_prefix_us": prefix, "rel_err": err,
               "ours_gbs": kv_bytes / ours / 1e3}
        if copy_gbs:
            row["ours_pct"] = 100 * row["ours_gbs"] / copy_gbs
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--tp", type=int, default=1, help="the shapes of one rank of this many tensor-parallel ranks "
                                                      "(the LM head, not split, only at 1)")
    ap.add_argument("--copies", type=int, default=4, help="input sets rotated through (defeats L2 reuse)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-attention", action="store_true", help="only the GEMM shapes")
    ap.add_argument("--layers", default=None,
                    help="only these of the models' layers, by the names the table prints (e.g. 'q + kv_a,o')")
    ap.add_argument("--write-table", action="store_true",
                    help="store the fastest GEMM per shape and row bucket in the device's linear tables, "
                         "kernels/linear/tables/<device>-<dtype>.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models, tokens = args.models.split(","), [int(t) for t in args.tokens.split(",")]
    cases = [(b, hq, hkv, s, 128) for b in (1, 8, 32) for hq, hkv in ((32, 8), (32, 4)) for s in (512, 2048, 8192)]
    if args.smoke:
        models, tokens, args.copies = ["tiny-moe"], [1, 3], 2
        cases = [(2, 4, 2, 40, 16)]
    if args.no_attention:
        cases = []
    copy_gbs = bc.measure_copy_bandwidth(device) if device.type == "cuda" else None
    layers = set(args.layers.split(",")) if args.layers else None
    gemm = gemm_rows(models, tokens, device, dtype, args.copies, copy_gbs, args.tp, layers)
    attn = attention_rows(cases, device, dtype, args.copies, copy_gbs)
    run = bc.run_info(device)
    print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | {dtype}"
          + (f" | copy {copy_gbs:.0f} GB/s" if copy_gbs else ""))
    pct = (lambda r, key: f"{r[key]:.0f}") if copy_gbs else (lambda r, key: "-")
    opt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print("bf16 weights: cuBLAS, the grouped GEMM (ours), SBI-GeMM in Triton and in CUDA; int8 weights: the "
          "same three without cuBLAS. %copy SBI: the faster SBI-GeMM; %copy same bytes: a device copy moving the "
          "weights' bytes; SBI/cuBLAS: the faster SBI-GeMM's speedup over cuBLAS")
    print(bc.format_table(
        ["model", "layer", "K", "N", "T", "cuBLAS µs", "ours µs", "sbi µs", "cuda µs", "int8 ours µs", "int8 sbi µs",
         "int8 cuda µs", "weight MB", "%copy cuBLAS", "%copy SBI", "%copy same bytes", "%copy SBI int8",
         "%copy same bytes int8", "SBI/cuBLAS", "int8 err"],
        [[r["model"], r["layer"], r["K"], r["N"], r["T"], f"{r['cublas_us']:.1f}", f"{r['ours_us']:.1f}",
          f"{r['sbi_us']:.1f}", opt(r["cuda_us"]), f"{r['ours_int8_us']:.1f}", f"{r['sbi_int8_us']:.1f}",
          opt(r["cuda_int8_us"]), f"{r['weight_mb']:.1f}", pct(r, "cublas_pct"), pct(r, "sbi_pct"),
          pct(r, "copy_same_pct"), pct(r, "sbi_int8_pct"), pct(r, "copy_same_int8_pct"),
          f"{r['cublas_us'] / min(r['sbi_us'], r['cuda_us'] or r['sbi_us']):.2f}x", f"{r['int8_rel_err']:.1e}"]
         for r in gemm]))
    print()
    print(bc.format_table(
        ["B", "Hq/Hkv", "S (visible)", "D", "ours µs", "SDPA gathered µs", "SDPA prefix µs", "KV GB/s", "%copy",
         "err"],
        [[r["B"], f"{r['Hq']}/{r['Hkv']}", f"{r['S']} ({r['visible']})", r["D"], f"{r['ours_us']:.1f}",
          f"{r['sdpa_gathered_us']:.1f}", f"{r['sdpa_prefix_us']:.1f}", f"{r['ours_gbs']:.0f}",
          pct(r, "ours_pct"), f"{r['rel_err']:.1e}"] for r in attn]))
    if not args.smoke:
        bc.write_results("dense", device, {"run": run, "copy_gbs": copy_gbs, "gemm": gemm, "attention": attn})
    if args.write_table:
        write_table(device, dtype, gemm)


def write_table(device, dtype, gemm, root=tuning.TABLES_DIR):
    """Merges this run's winners into the device's linear tables under ``root``, one per
    weight dtype (``kernels.tuning``). A ``pinned`` entry stays: it was chosen by timing the
    decode step itself, where a kernel shares DRAM with its neighbours."""
    from kernels.linear import select as sel

    dev_name = tuning.device_name(device)
    tables = {}  # weight dtype -> shape -> T bucket -> entry
    for wdtype in (dtype, torch.int8):
        path = tuning.table_path(root, "linear", dev_name, tuning.dtype_name(wdtype))
        old = tuning.load_table(path).entries if path.is_file() else {}
        tables[wdtype] = {shape: dict(buckets) for shape, buckets in old.items()}
    kinds = dict(cublas=tuning.LinearCublas, triton=tuning.LinearTriton, sbi=tuning.LinearSbi)
    for r in gemm:
        bucket = next(b for b in sel.BUCKETS if b >= r["T"])
        full = {"cublas": r["cublas_us"], "triton": r["ours_us"], "sbi": r["sbi_us"], "cuda": r["cuda_us"]}
        int8 = {"triton": r["ours_int8_us"], "sbi": r["sbi_int8_us"], "cuda": r["cuda_int8_us"]}
        for wdtype, times, cfg in ((dtype, full, r["cuda_cfg"]), (torch.int8, int8, r["cuda_int8_cfg"])):
            times = {name: us for name, us in times.items() if us is not None}
            pick = min(times, key=times.get)
            entry = tuning.LinearCuda(**cfg) if pick == "cuda" else kinds[pick]()
            shape = tuning.linear_shape(r["N"], r["K"])
            entries = tables[wdtype].setdefault(shape, {})
            if bucket in entries and entries[bucket].pinned:
                print(f"kept {shape} {tuning.dtype_name(wdtype)} T {bucket} (pinned); this run's pick: {entry}")
                continue
            entries[bucket] = entry
    for wdtype, entries in tables.items():
        if entries:
            table = tuning.Table("linear", dev_name, tuning.dtype_name(wdtype), entries)
            print(f"wrote {tuning.write_table(root, table)}")


if __name__ == "__main__":
    main()
