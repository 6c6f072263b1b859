"""The MoE layer's entry at decode sizes in one CUDA C++ launch (compiled through CuPy): the
residual add, RMSNorm, router GEMM and top-k gating of ``kernels.rms_norm_router`` with its
``gating`` table, for T <= MAX_T rows on Hopper.

Shape letters: T rows, H hidden, E experts, k slots.

One thread block cluster (Hopper, ``__cluster_dims__``) of CL blocks. Block c owns experts
c * EPC .. c * EPC + EPC - 1 and holds their router rows in registers, loaded before the PDL
wait (weights are no kernel's output), so their DRAM round trip overlaps the kernel before.
After the wait every block loads the rows of x and the residual once (one round trip),
computes the sum, its RMSNorm and its logits; block 0 stores h and the sum. The logits go to
shared memory, and after one cluster barrier block 0 reads every row's E logits from the
blocks' shared memory (``ld.shared::cluster``), one expert a thread, and ranks them: each
thread counts the experts that beat its own (``topk_rows``), so the table takes one pass
over the scores instead of k rounds of argmax. A second barrier keeps each block's shared
memory alive until block 0 has read it.

What this replaces: the Triton norm + router launch, then the gating launch (a kernel
boundary: the top-k needs every program's logits). In the Triton kernel the last program to
take an atomic ticket computed the table instead; that measured slower than two launches
(docs/performance.md). A cluster barrier costs far less than either.

Numerics follow ``kernels.norm.rms_norm_router_triton``: the sum rounded to the activations'
dtype, h = (norm rounded) * weight rounded, logits summed in float32 and rounded, and the
top-k on the rounded logits as ``kernels.topk_gating`` computes it.

Compile-time parameters: WARPS, CL (blocks in the cluster), EPC (experts a block), TP (rows,
padded to 1, 2, 4), HV (16-byte vectors of a row a thread: ceil(H / (8 * THREADS))), DT (0
bf16, 1 fp16), ROUTE (1 softmax, 2 sigmoid), RENORM.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_common import COMMON, DTYPES, compile_check, launch, ptr

MAX_T = 4  # rows: a thread keeps TP x HV x 8 values of h in registers
MAX_K = 16
MAX_VECS = 16  # router vectors (8 weights each) a thread holds in registers: HV x EPC
CL = 8  # blocks in the cluster: the portable maximum
WARPS = 8
MAX_E = WARPS * 32  # the top-k scores one expert a thread
SCORES = {"softmax": 1, "sigmoid": 2}
ENABLED = True  # read at each call of kernels.rms_norm_router (an A/B run can switch it)

SOURCE = COMMON + r"""
#define NEG_INF __int_as_float(0xff800000u)
#define MAX_K 16

// Thread block clusters: the block's shared-memory address p in block `rank` of the cluster.
__device__ __forceinline__ float load_cluster(const float* p, int rank) {
  u32 local, remote;
  float v;
  asm("{ .reg .u64 g; cvta.to.shared.u64 g, %1; cvt.u32.u64 %0, g; }" : "=r"(local) : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

__device__ __forceinline__ void cluster_sync() {  // every thread of every block of the cluster
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Block 0's top-k tables, every row of T at once, from the cluster's logits (block r holds
// experts r * EPC .. in lg_r[t * EPC + e % EPC]): thread e scores expert e as route_scores
// does in kernels.moe_cuda (softmax over the row, or sigmoid), then counts the experts that beat it (a higher
// score, or an equal one at a lower index: torch.topk's order). Rank r < k takes slot r;
// the renormalising total sums the k winners' scores in slot order, as route_scores does.
__device__ void topk_rows(const float* lg, int T, int E, int topk, int* __restrict__ ids,
                          float* __restrict__ weights) {
  __shared__ float sc[TP][THREADS], red[2][WARPS][TP], top[TP][MAX_K];
  const int e = threadIdx.x, warp = e / 32, lane = e % 32;
  float v[TP];
#pragma unroll
  for (int t = 0; t < TP; ++t) v[t] = e < E && t < T ? load_cluster(lg + t * EPC + e % EPC, e / EPC) : NEG_INF;
#if ROUTE == 1
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    float m = v[t];
#pragma unroll
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[0][warp][t] = m;
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    float m = NEG_INF;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) m = fmaxf(m, red[0][q][t]);
    v[t] = e < E ? __expf(v[t] - m) : 0.f;
    const float s = warp_sum(v[t]);
    if (lane == 0) red[1][warp][t] = s;
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) s += red[1][q][t];
    sc[t][e] = v[t] = e < E ? v[t] / s : NEG_INF;
  }
#else
#pragma unroll
  for (int t = 0; t < TP; ++t) sc[t][e] = v[t] = e < E ? 1.f / (1.f + __expf(-v[t])) : NEG_INF;
#endif
  __syncthreads();
  int rank[TP];
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    rank[t] = 0;
    for (int j = 0; j < E; ++j) {
      const float u = sc[t][j];
      rank[t] += u > v[t] || (u == v[t] && j < e);
    }
    if (e < E && t < T && rank[t] < topk) top[t][rank[t]] = v[t];
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    if (e >= E || t >= T || rank[t] >= topk) continue;
    float w = v[t];
#if RENORM
    float total = 0.f;
    for (int r = 0; r < topk; ++r) total += top[t][r];
    w /= total;
#endif
    ids[t * topk + rank[t]] = e;
    weights[t * topk + rank[t]] = w;
  }
}

extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(THREADS)
norm_router_topk(const u16* __restrict__ x,         // [T, H] the layer's input (row stride stride_x)
                 const u16* __restrict__ res,       // [T, H] the residual stream (row stride stride_res)
                 const u16* __restrict__ norm_w,    // [H]
                 const u16* __restrict__ router_w,  // [E, H]
                 u16* __restrict__ h_out,           // [T, H] out: RMSNorm(x + res) * norm_w
                 u16* __restrict__ sum_out,         // [T, H] out: x + res
                 u16* __restrict__ logits,          // [T, E] out
                 int* __restrict__ ids,             // [T, k] out
                 float* __restrict__ weights,       // [T, k] out
                 int T, int H, int E, int topk, float eps, long long stride_x, long long stride_res) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int cta = blockIdx.x;  // the grid is one cluster: the block's rank in it
  u32x4 wr[EPC][HV], gv[HV];
#pragma unroll
  for (int j = 0; j < HV; ++j) {
    const int v = (tid + j * THREADS) * 8;
    gv[j] = v < H ? load_cached(norm_w + v) : zero4();
#pragma unroll
    for (int e = 0; e < EPC; ++e) {
      const int expert = cta * EPC + e;
      wr[e][j] = v < H && expert < E ? load_stream(router_w + (size_t)expert * H + v) : zero4();
    }
  }
  grid_dep_enter();

  u32x4 rx[TP][HV], rr[TP][HV];  // every load issued before any is used: one round trip
#pragma unroll
  for (int t = 0; t < TP; ++t)
#pragma unroll
    for (int j = 0; j < HV; ++j) {
      const int v = (tid + j * THREADS) * 8;
      const bool in = t < T && v < H;
      rx[t][j] = in ? load_cached(x + t * stride_x + v) : zero4();
      rr[t][j] = in ? load_cached(res + t * stride_res + v) : zero4();
    }
  float hv[TP][HV][8], ss[TP];
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    ss[t] = 0.f;
#pragma unroll
    for (int j = 0; j < HV; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // the sum, rounded as the unfused add stores it (kept in rx)
        const u16 lo = to_act(lo_f(rx[t][j].v[i]) + lo_f(rr[t][j].v[i]));
        const u16 hi = to_act(hi_f(rx[t][j].v[i]) + hi_f(rr[t][j].v[i]));
        rx[t][j].v[i] = (u32)lo | ((u32)hi << 16);
        hv[t][j][2 * i] = lo_f(rx[t][j].v[i]);
        hv[t][j][2 * i + 1] = hi_f(rx[t][j].v[i]);
        ss[t] += hv[t][j][2 * i] * hv[t][j][2 * i] + hv[t][j][2 * i + 1] * hv[t][j][2 * i + 1];
      }
  }

  __shared__ float red[WARPS][TP];
  __shared__ float part[WARPS][TP * EPC];
  __shared__ float lg[TP * EPC];  // this block's rounded logits, read by block 0 across the cluster
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    const float s = warp_sum(ss[t]);
    if (lane == 0) red[warp][t] = s;
  }
  __syncthreads();
  float acc[TP * EPC];
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    float total = 0.f;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) total += red[q][t];
    const float rstd = 1.f / sqrtf(total / H + eps);
#pragma unroll
    for (int j = 0; j < HV; ++j) {
      float g[8];
      unpack8(gv[j], g);
#pragma unroll
      for (int i = 0; i < 8; ++i) hv[t][j][i] = lo_f(to_act(lo_f(to_act(hv[t][j][i] * rstd)) * g[i]));
    }
#pragma unroll
    for (int e = 0; e < EPC; ++e) {
      float a = 0.f;
#pragma unroll
      for (int j = 0; j < HV; ++j) {
        float w[8];
        unpack8(wr[e][j], w);
#pragma unroll
        for (int i = 0; i < 8; ++i) a = fmaf(hv[t][j][i], w[i], a);
      }
      acc[t * EPC + e] = a;
    }
  }
  warps_to_shared<TP * EPC>(acc, part);
  for (int o = tid; o < TP * EPC; o += THREADS) lg[o] = lo_f(to_act(warps_total<TP * EPC>(part, o)));
  // Every block's logits are in its shared memory. The global stores come after: the
  // barrier's release would otherwise wait for them.
  cluster_sync();
  for (int o = tid; o < TP * EPC; o += THREADS) {
    const int t = o / EPC, expert = cta * EPC + o % EPC;
    if (t < T && expert < E) logits[t * E + expert] = to_act(lg[o]);
  }
  if (cta == 0)
#pragma unroll
    for (int t = 0; t < TP; ++t)
#pragma unroll
      for (int j = 0; j < HV; ++j) {
        const int v = (tid + j * THREADS) * 8;
        if (t >= T || v >= H) continue;
        u32x4 packed;
#pragma unroll
        for (int i = 0; i < 4; ++i) packed.v[i] = (u32)to_act(hv[t][j][2 * i]) | ((u32)to_act(hv[t][j][2 * i + 1]) << 16);
        *(u32x4*)(h_out + t * H + v) = packed;
        *(u32x4*)(sum_out + t * H + v) = rx[t][j];
      }

  if (cta == 0) topk_rows(lg, T, E, topk, ids, weights);
  // No block leaves (freeing its shared memory) before block 0 has read it; nothing to release.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
"""


def _tp(t: int) -> int:
    return 1 << max(0, t - 1).bit_length()


def options(tp: int, hv: int, epc: int, dt: int, route: int, renorm: bool) -> tuple:
    return ("-std=c++17", "-DINT8=0", f"-DWARPS={WARPS}", f"-DCL={CL}", f"-DEPC={epc}", f"-DTP={tp}", f"-DHV={hv}",
            f"-DDT={dt}", f"-DROUTE={route}", f"-DRENORM={int(renorm)}")


def _layout(t: int, h: int, e: int) -> tuple[int, int, int]:
    """(TP, HV, EPC) for T rows, H, E."""
    return _tp(t), -(-h // (8 * WARPS * 32)), -(-e // CL)


def check(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, router_w: torch.Tensor, k: int,
          score: str) -> str | None:
    """Why the cluster kernel cannot take these operands (None: it can)."""
    t, h = x.shape
    e = router_w.shape[0]
    if residual.shape != x.shape or tuple(norm_w.shape) != (h,) or tuple(router_w.shape) != (e, h):
        return f"x {list(x.shape)}, residual {list(residual.shape)}, norm weight {list(norm_w.shape)}, " \
               f"router weight {list(router_w.shape)}: expected [T, H], [T, H], [H], [E, H]"
    if x.dtype not in DTYPES or any(z.dtype != x.dtype for z in (residual, norm_w, router_w)):
        return f"x {x.dtype}: expected bf16 or fp16, the residual, norm and router weights alike"
    if not 1 <= t <= MAX_T:
        return f"x {list(x.shape)}: 1 to {MAX_T} rows"
    _, hv, epc = _layout(t, h, e)
    if h % 8 or e > MAX_E or not 1 <= k <= min(MAX_K, e) or score not in SCORES:
        return f"H = {h}, E = {e}, k = {k}, score {score!r}: expected H % 8 == 0, E <= {MAX_E}, k <= {MAX_K}"
    if hv * epc > MAX_VECS:
        return f"H = {h}, E = {e}: a thread would hold {hv * epc} router vectors, at most {MAX_VECS}"
    for name, z in (("x", x), ("residual", residual), ("norm weight", norm_w), ("router weight", router_w)):
        if z.stride(-1) != 1 or z.data_ptr() % 16 or (z.dim() == 2 and z.stride(0) * z.element_size() % 16):
            return f"{name}: expected unit stride along H and rows on 16-byte boundaries"
    if not router_w.is_contiguous():
        return "router weight: expected contiguous [E, H]"
    if not x.is_cuda or any(z.device != x.device for z in (residual, norm_w, router_w)) \
            or torch.cuda.get_device_capability(x.device)[0] < 9:
        return f"x on {x.device}: thread block clusters need every operand on one Hopper or later GPU"
    return None


def norm_router_topk_cuda(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                          router_w: torch.Tensor, k: int, score: str = "softmax", renormalize: bool = True
                          ) -> tuple[torch.Tensor, ...]:
    """``kernels.rms_norm_router`` with its top-k table, in one launch: -> (h [T, H],
    x + residual [T, H], logits [T, E], ids [T, k] int32, weights [T, k] float32). Raises
    ValueError naming the operand where the kernel cannot take it (``check``)."""
    why = check(x, residual, norm_w, router_w, k, score)
    if why is not None:
        raise ValueError(f"norm_router_topk_cuda: {why}")
    t, h = x.shape
    e = router_w.shape[0]
    out_h, summed = torch.empty(2, t, h, dtype=x.dtype, device=x.device).unbind(0)
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
    ids, weights = torch.empty(2, t, k, dtype=torch.int32, device=x.device).unbind(0)
    weights = weights.view(torch.float32)
    tp, hv, epc = _layout(t, h, e)
    opts = options(tp, hv, epc, DTYPES[x.dtype], SCORES[score], renormalize)
    launch(x.device, SOURCE, "norm_router_topk", opts, (CL,), WARPS * 32,
           (ptr(x), ptr(residual), ptr(norm_w), ptr(router_w), ptr(out_h), ptr(summed), ptr(logits), ptr(ids),
            ptr(weights), np.int32(t), np.int32(h), np.int32(e), np.int32(k), np.float32(eps),
            np.int64(x.stride(0)), np.int64(residual.stride(0))))
    return out_h, summed, logits, ids, weights


def compile_all(arch: str = "sm_90") -> int:
    """Compiles the kernel for ``arch`` through NVRTC (no GPU needed) over combinations that
    take every value of every compile-time parameter; returns how many."""
    count = 0
    for tp, hv, epc, dt, route, renorm in ((1, 1, 8, 0, 1, False), (2, 2, 1, 1, 2, True), (4, 1, 16, 0, 1, True),
                                           (1, 4, 4, 1, 2, False)):
        compile_check(SOURCE, options(tp, hv, epc, dt, route, renorm) + ("-DPDL_EARLY=1",), arch,
                      "router_cuda.cu")
        count += 1
    return count
