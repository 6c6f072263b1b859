#!/usr/bin/env python
"""How fast can one kernel read a small weight matrix at all? For the linear-layer shapes
SBI-GeMM serves at T = 1, the time of:

- a device copy moving the weights' bytes (half read, half written);
- the fastest pure read of the same bytes we have: a CUDA kernel that streams them with
  the loads SBI-GeMM uses (16 bytes per thread, no L1 allocation, 256-byte L2 prefetch,
  four loads in flight per thread) and keeps one XOR, over a sweep of grid sizes;
- the same pure read launched as the decode kernels are (``kernels.cuda_common.launch``:
  programmatic dependent launch with the early trigger, so consecutive calls overlap),
  with 0 or 4 loads a thread issued before its wait (weights: no kernel writes them, so
  SBI-GeMM issues its first loads before the wait too);
- SBI-GeMM in CUDA (best of its launch candidates) and cuBLAS, T = 1. ``--sweep N`` also
  prints every grid of the PDL read and the N fastest SBI-GeMM configurations, each
  candidate also as a persistent grid.

Each is a CUDA-graph replay over rotating copies (no L2 reuse), as in bench_dense.py, with
the large-copy bandwidth measured at the start as the 100% mark. The pure read is the
ceiling for a kernel of that size on this GPU: launch, ramp-up and tail included; the
launched-alike read ("read PDL") is that ceiling under bench_dense.py's own conditions.

``--moe`` does the same for the MoE experts at T = 1 (issue 3's int8 target), in bf16 and
int8: two pure reads under PDL, one after the other, of the bytes the up and the down
kernel read (the k active experts' rows, int8 with their scales), each on its own fastest
grid and with its loads before the wait where that is faster (the real up kernel cannot
issue any: its experts are an earlier kernel's output); one pure read of both at once; and
``kernels.fused_moe`` on the tuned table, over 8 rotating input sets (as tune_moe.py).

    PYTHONPATH=. python scripts/diag_read.py [--models qwen3-30b-a3b,mixtral-8x7b,...]
    PYTHONPATH=. python scripts/diag_read.py --moe [--shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import bench_dense  # noqa: E402
import kernels  # noqa: E402

READ = r"""
extern "C" __global__ void read_all(const char* __restrict__ p, long long n16, unsigned* __restrict__ out) {
  unsigned acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    unsigned r[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
          : "=r"(r[u][0]), "=r"(r[u][1]), "=r"(r[u][2]), "=r"(r[u][3]) : "l"(p + 16 * (i + u * stride)));
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= r[u][0] ^ r[u][1] ^ r[u][2] ^ r[u][3];
  }
  for (; i < n16; i += stride) {
    unsigned r0, r1, r2, r3;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "l"(p + 16 * i));
    acc ^= r0 ^ r1 ^ r2 ^ r3;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;  // keeps the loads; almost never stores
}
"""


READ_PDL = kernels.cuda_common.COMMON + r"""
extern "C" __global__ void read_pdl(const char* __restrict__ p, long long n16, unsigned* __restrict__ out) {
  unsigned acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
#if PRE
  u32x4 r0[PRE];  // issued before the wait, as SBI-GeMM's first weight loads are
#pragma unroll
  for (int u = 0; u < PRE; ++u) r0[u] = i + u * stride < n16 ? load_stream(p + 16 * (i + u * stride)) : zero4();
  grid_dep_enter();
#pragma unroll
  for (int u = 0; u < PRE; ++u) acc ^= r0[u].v[0] ^ r0[u].v[1] ^ r0[u].v[2] ^ r0[u].v[3];
  i += PRE * stride;
#else
  grid_dep_enter();
#endif
  for (; i + 3 * stride < n16; i += 4 * stride) {
    u32x4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = load_stream(p + 16 * (i + u * stride));
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= r[u].v[0] ^ r[u].v[1] ^ r[u].v[2] ^ r[u].v[3];
  }
  for (; i < n16; i += stride) {
    const u32x4 r = load_stream(p + 16 * i);
    acc ^= r.v[0] ^ r.v[1] ^ r.v[2] ^ r.v[3];
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;  // keeps the loads; almost never stores
}
"""


def read_pdl_times(time, bufs, sms: int) -> list[tuple[float, int, int, int]]:
    """(µs, blocks, threads, loads before the wait) of the pure read launched as the decode
    kernels are (PDL, early trigger where on), for each grid of the sweep; fastest first."""
    out = torch.empty(64 * sms, dtype=torch.int32, device=bufs[0].device)
    n16 = bufs[0].numel() // 16
    times = []
    for pre in (0, 4):
        opts = ("-std=c++17", "-DWARPS=8", "-DINT8=0", "-DDT=0", f"-DPRE={pre}")
        for blocks in (sms, 2 * sms, 4 * sms, 8 * sms):
            for threads in (256, 512, 1024):
                us = time(lambda b, g=blocks, t=threads, o=opts: kernels.cuda_common.launch(
                    b.device, READ_PDL, "read_pdl", o, (g,), t,
                    (np.uint64(b.data_ptr()), np.int64(n16), np.uint64(out.data_ptr()))), [(b,) for b in bufs])
                times.append((us, blocks, threads, pre))
    return sorted(times)


def sbi_times(time, inputs, n: int, k: int, sms: int) -> list[tuple[float, dict]]:
    """(µs, configuration) of every CUDA SBI-GeMM candidate of bench_dense.py at T = 1, each
    also as a persistent grid of 1, 2, 4 and 8 blocks per SM; fastest first."""
    cfgs = []
    for cfg in bench_dense.cuda_candidates(1, n, k, sms, False):
        cfgs += [cfg] + [dict(cfg, persist=p) for p in (1, 2, 4, 8) if p * sms < -(-n // cfg["bn"])]
    return sorted(((time(lambda x, w, c=c: kernels.sbi_linear_cuda(x, w, config=c), inputs), c) for c in cfgs),
                  key=lambda p: p[0])


def _read_pdl(buf, grid: tuple[int, int, int], out) -> None:
    blocks, threads, pre = grid
    opts = ("-std=c++17", "-DWARPS=8", "-DINT8=0", "-DDT=0", f"-DPRE={pre}")
    kernels.cuda_common.launch(buf.device, READ_PDL, "read_pdl", opts, (blocks,), threads,
                               (np.uint64(buf.data_ptr()), np.int64(buf.numel() // 16), np.uint64(out.data_ptr())))


def moe_rows(time, device, sms: int, copies: int, shapes: list[str], pct_of) -> list[dict]:
    """Per shape and weight dtype: the experts at T = 1 against the pure reads of their bytes."""
    from bench_moe import SHAPES, make_inputs, make_weights

    out = torch.empty(64 * sms, dtype=torch.int32, device=device)
    rows = []
    for name in shapes:
        shape = SHAPES[name]
        gen = torch.Generator(device=device).manual_seed(0)
        w13, w2 = make_weights(shape, device, gen)
        inputs = make_inputs(shape, 1, copies, device, gen)
        for wdtype in ("bf16", "int8"):
            scales, a, b = {}, w13, w2
            if wdtype == "int8":
                a, s13 = kernels.quantize_int8(w13)
                b, s2 = kernels.quantize_int8(w2)
                scales = dict(w13_scale=s13, w2_scale=s2)
            wb, extra = (1, 4) if wdtype == "int8" else (2, 0)  # int8: a float32 scale a row
            k, h, f, r = shape.topk, shape.hidden, shape.ffn, shape.rows13
            up_bytes, down_bytes = k * r * (h * wb + extra), k * h * (f * wb + extra)
            bufs = [(torch.empty(-(-up_bytes // 16) * 16, dtype=torch.uint8, device=device).random_(),
                     torch.empty(-(-down_bytes // 16) * 16, dtype=torch.uint8, device=device).random_())
                    for _ in range(copies)]
            up_grid = read_pdl_times(time, [u for u, _ in bufs], sms)[0][1:]
            down_grid = read_pdl_times(time, [d for _, d in bufs], sms)[0][1:]
            chain = time(lambda u, d: (_read_pdl(u, up_grid, out), _read_pdl(d, down_grid, out)), bufs)
            both = [torch.cat([u, d]) for u, d in bufs]
            one = read_pdl_times(time, both, sms)[0][0]
            ours = time(lambda i: kernels.fused_moe(i.x, a, b, i.weights, i.ids, shape.activation, **scales),
                        [(i,) for i in inputs])
            nbytes = up_bytes + down_bytes
            rows.append(dict(shape=name, wdtype=wdtype, mb=nbytes / 1e6, up_grid=list(up_grid),
                             down_grid=list(down_grid), read_chain_us=chain, read_one_us=one, ours_us=ours,
                             read_chain_pct=pct_of(nbytes, chain), read_one_pct=pct_of(nbytes, one),
                             ours_pct=pct_of(nbytes, ours)))
            del bufs, both
        del w13, w2
    return rows


def print_moe(rows: list[dict]) -> None:
    by = {(r["shape"], r["wdtype"]): r for r in rows}
    print(bc.format_table(
        ["shape", "weights", "MB", "two reads µs", "one read µs", "ours µs", "%copy: two reads", "one read", "ours",
         "ours / two reads", "int8 speedup: ours", "two reads", "at most: bf16 ours / int8 two reads"],
        [[r["shape"], r["wdtype"], f"{r['mb']:.1f}", f"{r['read_chain_us']:.1f}", f"{r['read_one_us']:.1f}",
          f"{r['ours_us']:.1f}", f"{r['read_chain_pct']:.0f}", f"{r['read_one_pct']:.0f}", f"{r['ours_pct']:.0f}",
          f"{r['ours_us'] / r['read_chain_us']:.2f}"]
         + ([f"{by[r['shape'], 'bf16']['ours_us'] / r['ours_us']:.2f}",
             f"{by[r['shape'], 'bf16']['read_chain_us'] / r['read_chain_us']:.2f}",
             f"{by[r['shape'], 'bf16']['ours_us'] / r['read_chain_us']:.2f}"]
            if r["wdtype"] == "int8" else ["", "", ""]) for r in rows]))


def read_time(time, bufs, sms: int) -> tuple[float, int, int]:
    """(µs, blocks, threads) of the fastest pure read of each buffer over a grid sweep."""
    import cupy

    fn = cupy.RawKernel(READ, "read_all")
    out = torch.empty(64 * sms, dtype=torch.int32, device=bufs[0].device)
    n16 = bufs[0].numel() // 16

    def launch(buf, blocks, threads):
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            fn((blocks,), (threads,), (np.uint64(buf.data_ptr()), np.int64(n16), np.uint64(out.data_ptr())))

    best = None
    for blocks in (sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms):
        for threads in (256, 512, 1024):
            us = time(lambda b, g=blocks, t=threads: launch(b, g, t), [(b,) for b in bufs])
            best = min(best or (us, blocks, threads), (us, blocks, threads))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b,gpt-j-6b,olmoe-1b-7b")
    ap.add_argument("--copies", type=int, help="rotating weight copies (default 4; 8 with --moe, tune_moe.py's sets)")
    ap.add_argument("--sweep", type=int, default=0, metavar="N",
                    help="also print every PDL read's time and the N fastest SBI-GeMM configurations")
    ap.add_argument("--moe", action="store_true", help="the MoE experts at T = 1 against pure reads instead")
    ap.add_argument("--shapes", default="qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128", help="with --moe")
    args = ap.parse_args()
    args.copies = args.copies or (8 if args.moe else 4)
    device = torch.device("cuda")
    copy_gbs = bc.measure_copy_bandwidth(device)
    time = bench_dense.timer(device, args.copies)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if args.moe:
        rows = moe_rows(time, device, sms, args.copies, args.shapes.split(","),
                        lambda nbytes, us: 100 * nbytes / us / 1e3 / copy_gbs)
        run = bc.run_info(device)
        print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | T = 1 "
              f"| copy {copy_gbs:.0f} GB/s")
        print_moe(rows)
        bc.write_results("read-ceiling-moe", device, {"run": run, "copy_gbs": copy_gbs, "rows": rows})
        return
    rows, seen = [], set()
    for model in args.models.split(","):
        for layer, k, n in bench_dense.linear_shapes(model):
            if (k, n) in seen:
                continue
            seen.add((k, n))
            nbytes = n * k * 2
            ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(args.copies)]
            xs = [torch.randn(1, k, device=device, dtype=torch.bfloat16) for _ in range(args.copies)]
            halves = [(torch.empty(nbytes // 4, device=device, dtype=torch.bfloat16),
                       torch.empty(nbytes // 4, device=device, dtype=torch.bfloat16)) for _ in range(args.copies)]
            copy = time(lambda a, b: b.copy_(a), halves)
            flat = [w.view(torch.uint8).view(-1) for w in ws]
            read, blocks, threads = read_time(time, flat, sms)
            pdl_times = read_pdl_times(time, flat, sms)
            read_pdl, pdl_blocks, pdl_threads, pre = pdl_times[0]
            pct = lambda us: 100 * nbytes / us / 1e3 / copy_gbs  # noqa: E731
            if args.sweep:
                print(f"{model} {layer} (K {k}, N {n}): the pure read under PDL, fastest first")
                for us, g, th, before in pdl_times:
                    print(f"  {us:6.2f} µs {pct(us):4.0f}%  {g} x {th}, {before} loads before the wait")
                print(f"{model} {layer}: SBI-GeMM (CUDA) candidates, fastest {args.sweep}")
                for us, cfg in sbi_times(time, list(zip(xs, ws)), n, k, sms)[:args.sweep]:
                    print(f"  {us:6.2f} µs {pct(us):4.0f}%  {cfg}")
            cuda, cfg = bench_dense.best_cuda(time, [(x, w, None) for x, w in zip(xs, ws)], 1, n, k, sms, False)
            cublas = time(lambda x, w: x @ w.t(), list(zip(xs, ws)))
            rows.append(dict(model=model, layer=layer, K=k, N=n, mb=nbytes / 1e6, copy_us=copy, read_us=read,
                             read_grid=[blocks, threads], read_pdl_us=read_pdl,
                             read_pdl_grid=[pdl_blocks, pdl_threads, pre], sbi_cuda_us=cuda, sbi_cuda_cfg=cfg,
                             cublas_us=cublas, copy_pct=pct(copy), read_pct=pct(read), read_pdl_pct=pct(read_pdl),
                             sbi_pct=pct(cuda), cublas_pct=pct(cublas)))
            del ws, xs, halves
    run = bc.run_info(device)
    print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | bf16 | copy {copy_gbs:.0f} GB/s")
    print(bc.format_table(
        ["model", "layer", "K", "N", "MB", "copy µs", "read µs", "read PDL µs", "SBI cuda µs", "cuBLAS µs",
         "%copy: copy", "read", "read PDL", "SBI", "cuBLAS", "SBI / read PDL", "read PDL grid"],
        [[r["model"], r["layer"], r["K"], r["N"], f"{r['mb']:.1f}", f"{r['copy_us']:.1f}", f"{r['read_us']:.1f}",
          f"{r['read_pdl_us']:.1f}", f"{r['sbi_cuda_us']:.1f}", f"{r['cublas_us']:.1f}", f"{r['copy_pct']:.0f}",
          f"{r['read_pct']:.0f}", f"{r['read_pdl_pct']:.0f}", f"{r['sbi_pct']:.0f}", f"{r['cublas_pct']:.0f}",
          f"{r['sbi_cuda_us'] / r['read_pdl_us']:.2f}",
          "{} x {}, {} before the wait".format(*r["read_pdl_grid"])] for r in rows]))
    bc.write_results("read-ceiling", device, {"run": run, "copy_gbs": copy_gbs, "rows": rows})


if __name__ == "__main__":
    main()
