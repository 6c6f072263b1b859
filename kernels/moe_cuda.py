"""The MoE experts at decode sizes in CUDA C++ (compiled through CuPy): two kernels, no
maps, no combine launch. Same contract as ``kernels.fused_moe`` for T <= MAX_T tokens.

Shape letters: T tokens, H hidden, E experts, k slots, F expert width, P = T * k pairs
(pair p is slot p % k of token p // k).

- ``moe_up``: block (column tile, pair p) computes BN columns of
  h[p] = act(x[p // k] @ w1[e_p].T) (* x @ w3[e_p].T) times the pair's combine weight. The
  weight moves here from the down GEMM because the sum over slots is linear; h is [P, F].
- ``moe_down``: block (column tile, K split, token t) computes
  out[t] = sum over the token's k slots of w2[e_p] @ h[p]: one reduction over the k slots'
  F columns back to back (k * F long), so the combine is the GEMM's own sum. int8 scales
  differ per expert, so each 16-byte vector's dot product is scaled before it is added.

Both stream weights as SBI-GeMM does (``kernels.sbi_cuda``: 16-byte loads along the
reduction, U loads per row in flight, warp-shuffle then one shared-memory reduction).
Weights are read once per pair, not once per expert: at T = 1 the k experts are
distinct, so that is each active byte once. Past T = 1 pairs share experts; the
pair-major grid (``pair_major``: the blocks of all pairs for one column tile launch next
to each other) has the pairs that share an expert read the same rows at about the same
time, so the second read tends to come from L2. The Triton grouped GEMM, which groups
pairs by expert, is used unless the tuning table chose this for that T.

With router logits instead of ids (``fused_moe_logits_cuda``) both kernels compute the
top-k gating themselves, each block for its token (k rounds of a warp argmax over at most
256 experts): the routing kernel before them is gone too.

The down kernel loads the ids (or computes them) and its first weights before waiting
for the up kernel (PDL): the ids or logits come from a kernel before the up GEMM, which
has completed once every up block has passed its own wait, the condition for the down
grid to start (the up kernel never takes ``pdl.EARLY_TRIGGER``'s early trigger). With
``cuda_common.L2_PREFETCH`` the down blocks then also send the rest of their weights to
L2 before the wait.

Compile-time parameters: BN, WARPS, U, INT8, DT (0 bf16, 1 fp16), GATED (SiLU gate * up,
else GeLU), IDS64 (int64 ids, else int32), PARTIAL (down: float32 split-K partials),
ROUTE (0 ids given, 1 softmax, 2 sigmoid of the logits), RENORM, E_LANES (ceil(E / 32)),
LOGITS_F32 (float32 logits, else the activations' dtype), PAIR_MAJOR (grid: pairs / tokens
fastest, else column tiles fastest), MINB (the registers are capped so that MINB blocks
fit on an SM), UNIT (int8 widened by one byte permute a weight, its offset cancelled once
per 16 activations: about a third fewer instructions, relative error about 1e-4 against
1e-7; the tuner picks it for the small experts at T = 1),
MMA (int8 only: ``moe_up_mma`` / ``moe_down_mma`` on the tensor cores, cuda_common's mma
helpers; H and F multiples of 64), H16 (the up kernel writes h as f16 times ACT_F16, the
operand of an MMA down kernel). The MMA kernels halve the instructions a weight again, but
on the H100 they measured slower than ``unit`` at T = 1 for the small shapes; the H200
table uses the MMA up kernel for Mixtral (docs/performance.md, twelfth session).

At decode sizes a block is one short chain of dependent memory round trips (expert id,
weights, reduction) in a grid of one or two waves, so the kernels are latency-bound
(Nsight Compute: the wait on global loads is the top stall). Anything a block loads that
no kernel writes (the int8 scales) is therefore loaded beside its first weights, never
after them (docs/performance.md, thirteenth session).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from kernels.cuda_common import COMMON, DTYPES, compile_check, launch, ptr

MAX_T = 16
MAX_K = 16
MAX_E = 256  # routing in the kernels: E / 32 scores a lane
ROUTE_SCORES = {"softmax": 1, "sigmoid": 2}

SOURCE = COMMON + r"""
#define ROWS_PER_F (GATED ? 2 : 1)  // rows of w13 per column of h
#define ROWS (ROWS_PER_F * BN)
#define MAX_K 16
#ifndef MINB
#define MINB 1  // blocks an SM the registers must allow (ptxas caps them to fit)
#endif

#define NEG_INF __int_as_float(0xff800000u)
#define LOGIT_BYTES (LOGITS_F32 ? 4 : 2)
#ifndef H16
#define H16 0
#endif
#ifndef MMA
#define MMA 0
#endif

// An up kernel's output: in the activations' dtype, or (H16: for an MMA down kernel) as f16
// times ACT_F16, the operand that kernel's tensor cores take.
__device__ __forceinline__ u16 out_h(float v) {
#if H16
  return f16_bits(v);
#else
  return to_act(v);
#endif
}

__device__ __forceinline__ long long id_at(const void* ids, int p) {
#if IDS64
  return ((const long long*)ids)[p];
#else
  return ((const int*)ids)[p];
#endif
}

#if ROUTE
// Top-k gating of one token's router logits lg [E] (E <= 32 * E_LANES; float32, or the
// activations' dtype), as kernels.route:
// softmax (ROUTE 1) or sigmoid (ROUTE 2) scores, k rounds of argmax (ties to the lower
// expert index, torch.topk's order), optional renormalisation. Every warp computes the
// same table (the paper replicates such pre-GEMM work): slot r -> (ids[r], w[r]).
__device__ void route_token(const void* __restrict__ lg, int E, int topk, int* ids, float* w) {
  const int lane = threadIdx.x % 32;
  float s[E_LANES];  // lane holds experts lane, lane + 32, ...
  float mx = NEG_INF;
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) {
    const int e = lane + 32 * i;
#if LOGITS_F32
    s[i] = e < E ? ((const float*)lg)[e] : NEG_INF;
#else
    s[i] = e < E ? act_f((const u16*)lg + e) : NEG_INF;
#endif
    mx = fmaxf(mx, s[i]);
  }
#if ROUTE == 1
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) {
    s[i] = lane + 32 * i < E ? __expf(s[i] - mx) : 0.f;
    sum += s[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) s[i] = lane + 32 * i < E ? s[i] / sum : NEG_INF;
#else
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) s[i] = lane + 32 * i < E ? 1.f / (1.f + __expf(-s[i])) : NEG_INF;
#endif
  float total = 0.f;
  for (int r = 0; r < topk; ++r) {
    float best = NEG_INF;
    int arg = 1 << 30;
#pragma unroll
    for (int i = 0; i < E_LANES; ++i)
      if (s[i] > best) { best = s[i]; arg = lane + 32 * i; }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
      if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
    }
#pragma unroll
    for (int i = 0; i < E_LANES; ++i)
      if (lane + 32 * i == arg) s[i] = NEG_INF;  // knocked out for the next round
    ids[r] = arg;
    w[r] = best;
    total += best;
  }
#if RENORM
  for (int r = 0; r < topk; ++r) w[r] /= total;
#endif
}
#endif

// An up kernel's block: pair p and first column n0 from the grid, then, after the PDL wait
// (the ids or logits are an earlier kernel's output), the pair's expert e and combine
// weight: given, or routed from its token's logits.
struct UpBlock {
  int p, n0;
  long long e;
  float weight;
};

__device__ __forceinline__ UpBlock up_block(const void* __restrict__ ids, const float* __restrict__ pair_w, int topk,
                                            int E) {
  UpBlock b;
#if PAIR_MAJOR
  b.p = blockIdx.x, b.n0 = blockIdx.y * BN;
#else
  b.p = blockIdx.y, b.n0 = blockIdx.x * BN;
#endif
  grid_dep_enter();
#if ROUTE
  int top[MAX_K];
  float top_w[MAX_K];
  route_token((const char*)ids + (size_t)(b.p / topk) * E * LOGIT_BYTES, E, topk, top, top_w);
  b.e = top[b.p % topk];
  b.weight = top_w[b.p % topk];
#else
  b.e = id_at(ids, b.p);
  b.weight = pair_w[b.p];
#endif
  return b;
}

// An int8 up kernel's scales for output column n0 + tid (thread tid < BN <= THREADS: the one
// that finishes that column): gate (or GeLU) row, then up row. Loaded as soon as the expert
// is known, so that their latency overlaps the weights' instead of following the reduction.
__device__ __forceinline__ float2 up_scales(const float* __restrict__ scale, long long e, int n0, int F) {
  float2 sc = make_float2(0.f, 0.f);
#if INT8
  static_assert(BN <= THREADS, "one thread a column");
  const int n = n0 + threadIdx.x;
  if (threadIdx.x < BN && n < F) {
    sc.x = scale[e * ROWS_PER_F * F + n];
    if (GATED) sc.y = scale[e * 2 * F + F + n];
  }
#endif
  return sc;
}

// A down kernel's block, from the grid: token t, first row n0, the number of tokens, and its
// split [k_lo, k_hi) of the token's reduction (its k pairs' F columns back to back).
struct DownBlock {
  int t, n0, tokens, k_lo, k_hi;
};

__device__ __forceinline__ DownBlock down_block(int F, int topk, int k_span) {
  DownBlock b;
#if PAIR_MAJOR
  b.t = blockIdx.x, b.n0 = blockIdx.z * BN, b.tokens = gridDim.x;
#else
  b.t = blockIdx.z, b.n0 = blockIdx.x * BN, b.tokens = gridDim.z;
#endif
  b.k_lo = blockIdx.y * k_span;
  b.k_hi = min(topk * F, b.k_lo + k_span);
  return b;
}

// Token t's k experts into expert (the down kernels), in shared memory.
__device__ __forceinline__ void token_experts(const void* __restrict__ ids, int t, int topk, int E, long long* expert) {
#if ROUTE
  int top[MAX_K];
  float top_w[MAX_K];
  route_token((const char*)ids + (size_t)t * E * LOGIT_BYTES, E, topk, top, top_w);
  if (threadIdx.x == 0)
    for (int i = 0; i < topk; ++i) expert[i] = top[i];
#else
  for (int i = threadIdx.x; i < topk; i += THREADS) expert[i] = id_at(ids, t * topk + i);
#endif
  __syncthreads();
}

// The int8 scales of rows n0 .. n0 + BN of each of the token's experts (times mul) into
// sc[slot], in shared memory. Called once the block's first weights are on their way: the
// two loads then wait together.
__device__ __forceinline__ void token_scales(const float* __restrict__ scale, const long long* expert, int topk,
                                             float (*sc)[BN], int n0, int H, float mul) {
  for (int i = threadIdx.x; i < topk * BN; i += THREADS) {
    const int n = n0 + i % BN;
    sc[i / BN][i % BN] = n < H ? scale[expert[i / BN] * H + n] * mul : 0.f;
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_up(const u16* __restrict__ x,        // [T, H] tokens, row stride stride_x
       const void* __restrict__ w13,     // [E, 2F, H] gate rows then up rows ([E, F, H] for GeLU)
       const float* __restrict__ scale,  // [E, 2F] int8 per-row scales
       const void* __restrict__ ids,     // [P] expert of each pair (ROUTE: [T, E] router logits)
       const float* __restrict__ pair_w, // [P] combine weight of each pair (ROUTE: unused)
       u16* __restrict__ h,              // [P, F] out
       int H, int F, int topk, long long stride_x, int E) {
  const int tid = threadIdx.x;
  const UpBlock blk = up_block(ids, pair_w, topk, E);  // waits: x and the ids are earlier kernels' outputs
  const int p = blk.p, n0 = blk.n0;
  const long long e = blk.e;
  const float weight = blk.weight;
  const char* w_e = (const char*)w13 + (size_t)e * ROWS_PER_F * F * H * W_BYTES;
  const u16* xr = x + (size_t)(p / topk) * stride_x;
  const float2 sc = up_scales(scale, e, n0, F);  // in flight beside the weights, not after them

  float acc[ROWS];  // j < BN: gate (or GeLU) column n0 + j; j >= BN: up column n0 + j - BN
#pragma unroll
  for (int j = 0; j < ROWS; ++j) acc[j] = 0.f;
  for (int kb = tid * WVEC; kb < H; kb += U * STEP) {
    u32x4 wv[U][ROWS];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        const int k = kb + u * STEP, n = n0 + j % BN, row = (j < BN ? 0 : F) + n;
        wv[u][j] = k < H && n < F ? load_stream(w_e + ((size_t)row * H + k) * W_BYTES) : zero4();
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * STEP;
      if (k >= H) break;
      float a[WVEC];
      load_act(xr + k, a);
      const float start = unit_start(a);
#pragma unroll
      for (int j = 0; j < ROWS; ++j) acc[j] = UNIT ? acc[j] + dot_w(a, wv[u][j], start) : dot_w(a, wv[u][j], acc[j]);
    }
  }

  __shared__ float part[WARPS][ROWS];
  warps_to_shared<ROWS>(acc, part);
  for (int o = tid; o < BN; o += THREADS) {
    const int n = n0 + o;
    if (n >= F) continue;
    float g = warps_total<ROWS>(part, o);
#if INT8
    g *= sc.x * UNIT_SCALE;
#endif
#if GATED
    float up = warps_total<ROWS>(part, BN + o);
#if INT8
    up *= sc.y * UNIT_SCALE;
#endif
    const float v = g / (1.f + __expf(-g)) * up;
#else
    const float v = 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
#endif
    h[(size_t)p * F + n] = out_h(v * weight);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_down(const u16* __restrict__ h,        // [P, F] weighted up outputs (moe_up)
         const void* __restrict__ w2,      // [E, H, F]
         const float* __restrict__ scale,  // [E, H] int8 per-row scales
         const void* __restrict__ ids,     // [P] expert of each pair (ROUTE: [T, E] router logits)
         void* __restrict__ out,           // [T, H] (PARTIAL: float32 [S, T, H])
         int H, int F, int topk, int k_span, long long stride_o, int E) {
  const int tid = threadIdx.x;
  const DownBlock blk = down_block(F, topk, k_span);
  const int t = blk.t, n0 = blk.n0, tokens = blk.tokens, k_lo = blk.k_lo, k_hi = blk.k_hi;
  const int len = topk * F;  // this token's reduction: its k pairs' F columns back to back
  __shared__ long long expert[MAX_K];
  token_experts(ids, t, topk, E, expert);

  u32x4 wv[U][BN];
  int slot[U];  // the pair (slot) of each step's vectors: F is a multiple of WVEC
  auto load_step = [&](int kb) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * STEP;
      slot[u] = k < k_hi ? k / F : 0;
      const char* row = (const char*)w2 + ((size_t)expert[slot[u]] * H + n0) * F * W_BYTES;
#pragma unroll
      for (int j = 0; j < BN; ++j)
        wv[u][j] = k < k_hi && n0 + j < H ? load_stream(row + ((size_t)j * F + k - slot[u] * F) * W_BYTES)
                                          : zero4();
    }
  };
  int kb = k_lo + tid * WVEC;
  load_step(kb);
  for (int s = k_lo / F; s * F < k_hi; ++s) {  // the rest of the block's weights on the way to L2
    const int lo = max(k_lo, s * F) - s * F, hi = min(k_hi, (s + 1) * F) - s * F;
    prefetch_rows((const char*)w2 + (((size_t)expert[s] * H + n0) * F + lo) * W_BYTES, min(BN, H - n0),
                  (size_t)F * W_BYTES, (size_t)(hi - lo) * W_BYTES);
  }
#if INT8
  __shared__ float sc[MAX_K][BN];  // the scales of this block's rows, per slot
  token_scales(scale, expert, topk, sc, n0, H, UNIT_SCALE);
#endif
  grid_dep_enter();  // h is the up kernel's output

  float acc[BN];
#pragma unroll
  for (int j = 0; j < BN; ++j) acc[j] = 0.f;
  const u16* ht = h + (size_t)t * len;
  for (; kb < k_hi; kb += U * STEP) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * STEP;
      if (k >= k_hi) break;
      float a[WVEC];
      load_act(ht + k, a);
      const float start = unit_start(a);
#pragma unroll
      for (int j = 0; j < BN; ++j) {
        const float d = dot_w(a, wv[u][j], start);
#if INT8
        acc[j] = fmaf(d, sc[slot[u]][j], acc[j]);
#else
        acc[j] += d;
#endif
      }
    }
    load_step(kb + U * STEP);
  }

  __shared__ float part[WARPS][BN];
  warps_to_shared<BN>(acc, part);
  for (int o = tid; o < BN; o += THREADS) {
    const int n = n0 + o;
    if (n >= H) continue;
    const float v = warps_total<BN>(part, o);
#if PARTIAL
    ((float*)out)[((size_t)blockIdx.y * tokens + t) * H + n] = v;
#else
    ((u16*)out)[t * stride_o + n] = to_act(v);
#endif
  }
}

#if INT8 && MMA
// The int8 kernels on the tensor cores (cuda_common's mma helpers; H and F multiples of 64).
// A block's warps split the reduction into 64-long chunks (warp w takes chunks w, w + WARPS,
// ...; U of them loaded before the first is used); each warp multiplies its chunks by
// every 16-row tile of the block. Only column 0 of the mma is a real operand (the pair's
// token or h row): lanes g > 0 give zeros. The products of the offset (mma_offset) are
// exact, so the offset cancels to float32 rounding.
#define MMA_STEP (WARPS * MMA_CHUNK)
#define UP_TILES (ROWS / 16)  // moe_up_mma: gated, BN a multiple of 8; GeLU, of 16

#if ROWS % 16 == 0
// moe_up's contract. BN columns as UP_TILES tiles: gated, tile m has gate rows n0 + 8 m + g and
// up rows F + n0 + 8 m + g (the same column in rows g and g + 8); GeLU, rows n0 + 16 m + ...
// The pair's token row moves to shared memory once, as f16, for every warp's B operands.
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_up_mma(const u16* __restrict__ x, const void* __restrict__ w13, const float* __restrict__ scale,
           const void* __restrict__ ids, const float* __restrict__ pair_w, u16* __restrict__ h,
           int H, int F, int topk, long long stride_x, int E) {
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  const UpBlock blk = up_block(ids, pair_w, topk, E);  // waits: x and the ids are earlier kernels' outputs
  const int p = blk.p, n0 = blk.n0;
  const long long e = blk.e;
  const float weight = blk.weight;
  const char* w_e = (const char*)w13 + (size_t)e * ROWS_PER_F * F * H;
  const float2 sc = up_scales(scale, e, n0, F);
  const char* rows[UP_TILES][2];  // this lane's rows g and g + 8 of each tile (null: past F)
#pragma unroll
  for (int m = 0; m < UP_TILES; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int n = GATED ? n0 + 8 * m + g : n0 + 16 * m + 8 * r + g;
      rows[m][r] = n < F ? w_e + ((size_t)(GATED && r ? F + n : n) * H + 16 * q) : nullptr;
    }
  u32x4 wv[U][UP_TILES][2];
  auto load_step = [&](int kb) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int m = 0; m < UP_TILES; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int k = kb + u * MMA_STEP;
          wv[u][m][r] = k < H && rows[m][r] ? load_stream(rows[m][r] + k) : zero4();
        }
  };
  int kb = warp * MMA_CHUNK;
  load_step(kb);

  extern __shared__ __align__(16) u32 xs[];  // [H / 2] the token's row, f16 pairs times ACT_F16
  const u16* xr = x + (size_t)(p / topk) * stride_x;
  for (int i = tid * 8; i < H; i += THREADS * 8) {
    float a[8];
    load_act8(xr + i, a);
    u32x4 v;
#pragma unroll
    for (int j = 0; j < 4; ++j) v.v[j] = f16x2(a[2 * j], a[2 * j + 1]);
    *(u32x4*)(xs + i / 2) = v;
  }
  __syncthreads();

  float acc[UP_TILES][2];  // rows g and g + 8 of each tile, column 0
#pragma unroll
  for (int m = 0; m < UP_TILES; ++m) acc[m][0] = acc[m][1] = 0.f;
  for (; kb < H; kb += U * MMA_STEP) {
    u32 b[U][8];  // every chunk's activations first: no chunk waits on another's
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * MMA_STEP + 16 * q;
      if (g == 0 && k < H)
        words8(b[u], *(const u32x4*)(xs + k / 2), *(const u32x4*)(xs + k / 2 + 4));
      else
        words8(b[u], zero4(), zero4());  // past H the weights are zeros too
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float off[4] = {0.f, 0.f, 0.f, 0.f};
      mma_offset(off, b[u]);
#pragma unroll
      for (int m = 0; m < UP_TILES; ++m) mma_add(acc[m], off, wv[u][m][0], wv[u][m][1], b[u], 1.f, 1.f);
    }
    if (kb + U * MMA_STEP < H) load_step(kb + U * MMA_STEP);
  }

  __shared__ float part[WARPS][ROWS];  // [warp][16 m + row of the tile]
  if (q == 0)
#pragma unroll
    for (int m = 0; m < UP_TILES; ++m) {
      part[warp][16 * m + g] = acc[m][0];
      part[warp][16 * m + 8 + g] = acc[m][1];
    }
  __syncthreads();
  for (int o = tid; o < BN; o += THREADS) {
    const int n = n0 + o;
    if (n >= F) continue;
#if GATED
    const int row = 16 * (o / 8) + o % 8;
    const float gate = warps_total<ROWS>(part, row) * sc.x * MMA_SCALE;
    const float up = warps_total<ROWS>(part, row + 8) * sc.y * MMA_SCALE;
    const float v = gate / (1.f + __expf(-gate)) * up;
#else
    const float z = warps_total<ROWS>(part, o) * sc.x * MMA_SCALE;
    const float v = 0.5f * z * (1.f + erff(z * 0.70710678118654752f));
#endif
    h[(size_t)p * F + n] = out_h(v * weight);
  }
}

#endif

#if BN % 16 == 0
// moe_down's contract, with h from an up kernel compiled H16 (f16 times ACT_F16). Tile m
// has rows n0 + 16 m + g and + 8; each chunk lies in one slot (F a multiple of 64), whose
// expert's scales weigh the chunk's sums before they join the float32 accumulators.
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_down_mma(const u16* __restrict__ h, const void* __restrict__ w2, const float* __restrict__ scale,
             const void* __restrict__ ids, void* __restrict__ out, int H, int F, int topk, int k_span,
             long long stride_o, int E) {
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  const DownBlock blk = down_block(F, topk, k_span);
  const int t = blk.t, n0 = blk.n0, tokens = blk.tokens, k_lo = blk.k_lo, k_hi = blk.k_hi;
  const int len = topk * F;  // this token's reduction: its k pairs' F columns back to back
  __shared__ long long expert[MAX_K];
  token_experts(ids, t, topk, E, expert);

  u32x4 wv[U][BN / 16][2];
  int slot[U];
  auto load_step = [&](int kb) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * MMA_STEP;
      slot[u] = k < k_hi ? k / F : 0;
      const char* base = (const char*)w2 + (size_t)expert[slot[u]] * H * F + (k - slot[u] * F) + 16 * q;
#pragma unroll
      for (int m = 0; m < BN / 16; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = n0 + 16 * m + 8 * r + g;
          wv[u][m][r] = k < k_hi && n < H ? load_stream(base + (size_t)n * F) : zero4();
        }
    }
  };
  int kb = k_lo + warp * MMA_CHUNK;
  load_step(kb);
  for (int s = k_lo / F; s * F < k_hi; ++s) {  // the rest of the block's weights on the way to L2
    const int lo = max(k_lo, s * F) - s * F, hi = min(k_hi, (s + 1) * F) - s * F;
    prefetch_rows((const char*)w2 + (((size_t)expert[s] * H + n0) * F + lo), min(BN, H - n0), (size_t)F,
                  (size_t)(hi - lo));
  }
  __shared__ float sc[MAX_K][BN];  // the scales of this block's rows, per slot
  token_scales(scale, expert, topk, sc, n0, H, MMA_SCALE);
  grid_dep_enter();  // h is the up kernel's output

  u32 bv[U][8];  // the chunks' activations, loaded with the weights of the same step
  const u16* ht = h + (size_t)t * len + 16 * q;
  auto load_b = [&](int kb) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * MMA_STEP;
      if (g == 0 && k < k_hi)
        words8(bv[u], load_cached(ht + k), load_cached(ht + k + 8));
      else
        words8(bv[u], zero4(), zero4());  // past k_hi the weights are zeros too
    }
  };
  load_b(kb);
  float acc[BN / 16][2];
#pragma unroll
  for (int m = 0; m < BN / 16; ++m) acc[m][0] = acc[m][1] = 0.f;
  for (; kb < k_hi; kb += U * MMA_STEP) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float off[4] = {0.f, 0.f, 0.f, 0.f};
      mma_offset(off, bv[u]);
#pragma unroll
      for (int m = 0; m < BN / 16; ++m)
        mma_add(acc[m], off, wv[u][m][0], wv[u][m][1], bv[u], sc[slot[u]][16 * m + g], sc[slot[u]][16 * m + 8 + g]);
    }
    load_step(kb + U * MMA_STEP);
    load_b(kb + U * MMA_STEP);
  }

  __shared__ float part[WARPS][BN];
  if (q == 0)
#pragma unroll
    for (int m = 0; m < BN / 16; ++m) {
      part[warp][16 * m + g] = acc[m][0];
      part[warp][16 * m + 8 + g] = acc[m][1];
    }
  __syncthreads();
  for (int o = tid; o < BN; o += THREADS) {
    const int n = n0 + o;
    if (n >= H) continue;
    const float v = warps_total<BN>(part, o);
#if PARTIAL
    ((float*)out)[((size_t)blockIdx.y * tokens + t) * H + n] = v;
#else
    ((u16*)out)[t * stride_o + n] = to_act(v);
#endif
  }
}
#endif
#endif
"""

# Launch configurations tried by the tuning script (the table stores the winner per shape
# and T): bn outputs per block, warps, unroll (loads per row in flight), split_k (down),
# pair_major (the grid order; absent: column tiles fastest). The pair-major ones are tried
# only past T = 1 (``candidates``), where pairs can share an expert.
UP_CANDIDATES = [dict(backend="cuda", bn=bn, warps=w, unroll=u)
                 for bn, w, u in ((2, 4, 2), (4, 4, 1), (4, 4, 2), (8, 4, 1), (2, 8, 2), (4, 8, 1))]
DOWN_CANDIDATES = [dict(backend="cuda", bn=bn, warps=w, unroll=u, split_k=s)
                   for (bn, w, u), s in itertools.product(((2, 4, 4), (4, 4, 2), (4, 4, 4), (8, 4, 2), (4, 8, 2)),
                                                          (1, 2))]


# The int8 kernels on the tensor cores (``mma``): bn a multiple of 8 (gated up) or 16.
MMA_UP_CANDIDATES = [dict(backend="cuda", mma=True, bn=bn, warps=w, unroll=u)
                     for bn, w, u in ((8, 4, 2), (8, 4, 4), (8, 4, 8), (16, 4, 1), (16, 4, 2), (16, 4, 4), (8, 8, 2),
                                      (32, 4, 1), (8, 2, 4), (16, 2, 2))]
MMA_DOWN_CANDIDATES = [dict(backend="cuda", mma=True, bn=bn, warps=w, unroll=u, split_k=s)
                       for (bn, w, u), s in itertools.product(((16, 4, 2), (16, 4, 4), (16, 4, 8), (32, 4, 2),
                                                               (32, 4, 4), (16, 8, 2), (32, 4, 1), (16, 2, 4)),
                                                              (1, 2))]

MIN_BLOCKS = (4, 5, 6, 8)  # register caps tried (``min_blocks``): more blocks, more loads in flight an SM


def candidates(phase: str, t: int, int8: bool = False, h: int | None = None, f: int | None = None,
               gated: bool = True) -> list[dict]:
    """The CUDA launch configurations the tuning script times for ``phase`` at T = t: the
    base ones, each also with its registers capped for ``min_blocks`` blocks an SM (the
    int8 kernels use 100-180 registers uncapped, so two or three blocks an SM hold all
    the loads in flight), for int8 each also widening with one byte permute a weight
    (``unit``), then the tensor-core kernels (``mma``, where H = h and F = f allow them;
    they need no cap), and past T = 1 each in the pair-major grid."""
    base = UP_CANDIDATES if phase == "up" else DOWN_CANDIDATES
    base = base + ([dict(c, unit=True) for c in base] if int8 else [])
    base = base + [dict(c, min_blocks=m) for c in base for m in MIN_BLOCKS]
    if int8 and h is not None:  # 50-110 registers: uncapped
        mma = MMA_UP_CANDIDATES if phase == "up" else MMA_DOWN_CANDIDATES
        base = base + [c for c in mma if mma_check(phase, c, h, f, gated) is None]
    return base + ([dict(c, pair_major=True) for c in base] if t > 1 else [])


def default_configs(t: int, h: int, sms: int) -> tuple[dict, dict]:
    """(up, down) launch configurations when the table has none for this shape."""
    up = dict(backend="cuda", bn=4, warps=4, unroll=2)
    down = dict(backend="cuda", bn=4, warps=4, unroll=4, split_k=1)
    if -(-h // down["bn"]) * t < 2 * sms:  # too few blocks: split the k * F reduction
        down["split_k"] = 2
    return up, down


def check(x, w13, w2, topk, w13_scale=None, w2_scale=None) -> str | None:
    """Why these kernels cannot take the operands (None: they can). The shapes themselves
    were checked by ``kernels.fused_moe``."""
    t, h = x.shape
    f = w2.shape[2]
    if not (x.is_cuda and w13.device == x.device and w2.device == x.device):
        return f"x / w13 / w2 on {x.device} / {w13.device} / {w2.device}: expected one CUDA device"
    if x.dtype not in DTYPES:
        return f"x: bf16 or fp16, got {x.dtype}"
    if not 1 <= t <= MAX_T or topk > MAX_K:
        return f"x {list(x.shape)}, k = {topk}: 1 to {MAX_T} tokens and k <= {MAX_K}"
    int8 = w13.dtype == torch.int8
    if w13.dtype != w2.dtype or w13.dtype not in (x.dtype, torch.int8):
        return f"w13 / w2 {w13.dtype} / {w2.dtype}: expected both {x.dtype}, or both int8"
    vec = 16 if int8 else 8
    if h % vec or f % vec:
        return f"H = {h}, F = {f}: expected multiples of {vec}"
    if not (w13.is_contiguous() and w2.is_contiguous()) or w13.data_ptr() % 16 or w2.data_ptr() % 16:
        return "w13 / w2: expected contiguous weights on 16-byte boundaries"
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16:
        return "x: expected unit stride along H and rows on 16-byte boundaries"
    if int8 and not (w13_scale.dtype == w2_scale.dtype == torch.float32
                     and w13_scale.is_contiguous() and w2_scale.is_contiguous()):
        return "w13_scale / w2_scale: expected contiguous float32"
    return None


def check_logits(logits: torch.Tensor, x: torch.Tensor, e: int, score: str) -> str | None:
    """Why the kernels cannot route from these router logits (None: they can)."""
    if score not in ROUTE_SCORES:
        return f"score={score!r}: expected one of {tuple(ROUTE_SCORES)}"
    t = x.shape[0]
    if logits.dtype not in (torch.float32, x.dtype) or not logits.is_contiguous() or tuple(logits.shape) != (t, e):
        return f"logits {list(logits.shape)} {logits.dtype}: expected contiguous float32 or {x.dtype} [{t}, {e}]"
    if e > MAX_E:
        return f"E = {e}: at most {MAX_E} experts"
    return None


def options(bn: int, warps: int, unroll: int, int8: bool, dt: int, gated: bool, partial: bool,
            ids64: bool = False, route: int = 0, renorm: bool = False, e_lanes: int = 1,
            logits_f32: bool = False, pair_major: bool = False, min_blocks: int = 1, unit: bool = False,
            mma: bool = False, h16: bool = False) -> tuple:
    return ("-std=c++17", f"-DBN={bn}", f"-DWARPS={warps}", f"-DU={unroll}", f"-DINT8={int(int8)}",
            f"-DUNIT={int(unit)}", f"-DDT={dt}", f"-DGATED={int(gated)}", f"-DIDS64={int(ids64)}",
            f"-DPARTIAL={int(partial)}", f"-DROUTE={route}", f"-DRENORM={int(renorm)}", f"-DE_LANES={e_lanes}",
            f"-DLOGITS_F32={int(logits_f32)}", f"-DPAIR_MAJOR={int(pair_major)}", f"-DMINB={max(1, min_blocks)}",
            f"-DMMA={int(mma)}", f"-DH16={int(h16)}")


def mma_check(phase: str, cfg: dict, h: int, f: int, gated: bool = True) -> str | None:
    """Why the tensor-core kernels (``mma``) cannot run configuration ``cfg`` of ``phase`` on
    H, F (None: they can); int8 weights only (``check``)."""
    tile = 8 if phase == "up" and gated else 16
    if h % 64 or f % 64 or h > 24576:
        return f"H = {h}, F = {f}: the mma kernels need multiples of 64 and H <= 24576"
    if cfg["bn"] % tile:
        return f"{phase} bn = {cfg['bn']}: the mma kernels need a multiple of {tile}"
    return None


def fused_moe_cuda(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, activation: str = "silu", w13_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None,
                   configs: tuple[dict | None, dict | None] | None = None) -> torch.Tensor:
    """``kernels.fused_moe`` for T <= MAX_T tokens (dropless); ``configs`` are the (up, down)
    launch configurations (None: ``default_configs``). Raises ValueError naming the
    operand where the kernels cannot take it (``check``)."""
    why = check(x, w13, w2, topk_ids.shape[1], w13_scale, w2_scale)
    if why is not None:
        raise ValueError(f"fused_moe_cuda: {why}")
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    pair_w = topk_weights.reshape(-1).float().contiguous()  # [P]
    route = dict(ids64=ids.dtype == torch.int64)
    return _experts(x, w13, w2, ids, pair_w, topk_ids.shape[1], route, activation, w13_scale, w2_scale, configs)


def fused_moe_logits_cuda(x: torch.Tensor, logits: torch.Tensor, topk: int, w13: torch.Tensor, w2: torch.Tensor,
                          activation: str = "silu", score: str = "softmax", renormalize: bool = True,
                          w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                          configs: tuple[dict | None, dict | None] | None = None) -> torch.Tensor:
    """Top-k gating of ``logits`` [T, E] (as ``kernels.route``) and the experts, in the same
    two launches. Raises ValueError naming the operand where the kernels cannot take it."""
    e = w2.shape[0]
    why = check(x, w13, w2, topk, w13_scale, w2_scale) or check_logits(logits, x, e, score)
    if why is not None:
        raise ValueError(f"fused_moe_logits_cuda: {why}")
    route = dict(route=ROUTE_SCORES[score], renorm=renormalize, e_lanes=-(-e // 32),
                 logits_f32=logits.dtype == torch.float32)
    return _experts(x, w13, w2, logits, None, topk, route, activation, w13_scale, w2_scale, configs)


def _experts(x, w13, w2, ids, pair_w, topk, route: dict, activation, w13_scale, w2_scale, configs) -> torch.Tensor:
    """The two launches (and the split-K sum); ``ids`` are the pairs' experts, or the
    router logits where ``route`` says so."""
    t, h = x.shape
    e, f = w2.shape[0], w2.shape[2]
    up, down = configs if configs is not None else (None, None)
    if up is None or down is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        default_up, default_down = default_configs(t, h, sms)
        up, down = up or default_up, down or default_down
    int8, gated, dt = w13.dtype == torch.int8, activation == "silu", DTYPES[x.dtype]
    up_mma, down_mma = up.get("mma", False), down.get("mma", False)
    for phase, cfg in (("up", up), ("down", down)):
        why = cfg.get("mma") and (mma_check(phase, cfg, h, f, gated) if int8 else f"{phase} mma: int8 weights only")
        if why:
            raise ValueError(f"fused_moe_cuda: {why}")
    hidden = torch.empty(t * topk, f, dtype=x.dtype, device=x.device)  # [P, F] (f16 bits for an mma down)
    # The up kernel lets the down kernel launch only after its own wait (never early): the
    # down kernel reads the ids before its wait, and they are from the kernel before this one.
    up_major = up.get("pair_major", False)
    up_opts = options(up["bn"], up["warps"], up["unroll"], int8, dt, gated, False, pair_major=up_major,
                      min_blocks=up.get("min_blocks", 1), unit=up.get("unit", False), mma=up_mma, h16=down_mma,
                      **route) + ("-DPDL_EARLY=0",)
    up_grid = (-(-f // up["bn"]), t * topk)
    launch(x.device, SOURCE, "moe_up_mma" if up_mma else "moe_up", up_opts, up_grid[::-1] if up_major else up_grid,
           up["warps"] * 32, (ptr(x), ptr(w13), ptr(w13_scale), ptr(ids), ptr(pair_w), ptr(hidden), np.int32(h),
                              np.int32(f), np.int32(topk), np.int64(x.stride(0)), np.int32(e)),
           shared=2 * h if up_mma else 0)
    step = down["warps"] * (64 if down_mma else 32 * (16 if int8 else 8))
    length = topk * f
    k_span = -(-length // (down["split_k"] * step)) * step
    split = -(-length // k_span)  # no empty splits
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    target = out if split == 1 else torch.empty(split, t, h, dtype=torch.float32, device=x.device)
    down_major = down.get("pair_major", False)
    opts = options(down["bn"], down["warps"], down["unroll"], int8, dt, gated, split > 1, pair_major=down_major,
                   min_blocks=down.get("min_blocks", 1), unit=down.get("unit", False), mma=down_mma, **route)
    down_grid = (-(-h // down["bn"]), split, t)
    launch(x.device, SOURCE, "moe_down_mma" if down_mma else "moe_down", opts,
           down_grid[::-1] if down_major else down_grid, down["warps"] * 32,
           (ptr(hidden), ptr(w2), ptr(w2_scale), ptr(ids), ptr(target), np.int32(h), np.int32(f), np.int32(topk),
            np.int32(k_span), np.int64(out.stride(0)), np.int32(e)))
    if split > 1:
        launch(x.device, SOURCE, "splitk_reduce", opts, (-(-h // 256), t), 256,
               (ptr(target), ptr(None), ptr(None), ptr(out), np.int32(split), np.int32(t), np.int32(h),
                np.int64(0), np.int64(out.stride(0))))
    return out


def compile_all(arch: str = "sm_90") -> int:
    """Compiles the kernels for ``arch`` through NVRTC (no GPU needed) over combinations
    that take every value of every compile-time parameter; returns how many."""
    count = 0
    for i, (int8, dt, gated) in enumerate(itertools.product((False, True), DTYPES.values(), (False, True))):
        up, down = UP_CANDIDATES[i % len(UP_CANDIDATES)], DOWN_CANDIDATES[i % len(DOWN_CANDIDATES)]
        route = dict(route=i % 3, renorm=i % 2 == 0, e_lanes=1 + i % 8, logits_f32=i % 4 < 2)
        launch_flags = (f"-DL2PF={i % 2}", f"-DPDL_EARLY={i // 2 % 2}")  # what ``launch`` adds
        min_blocks = MIN_BLOCKS[i % len(MIN_BLOCKS)] if i % 2 else 1
        compile_check(SOURCE, options(up["bn"], up["warps"], up["unroll"], int8, dt, gated, False, ids64=i % 2 == 0,
                                      pair_major=i % 2 == 1, min_blocks=min_blocks, unit=i % 4 == 1, **route)
                      + launch_flags, arch, "moe_cuda.cu")
        compile_check(SOURCE, options(down["bn"], down["warps"], down["unroll"], int8, dt, gated, i % 4 < 2,
                                      ids64=i % 2 == 1, pair_major=i % 4 >= 2, min_blocks=min_blocks,
                                      unit=i % 4 == 3, **route)
                      + launch_flags, arch, "moe_cuda.cu")
        count += 2
        if int8:  # the tensor-core kernels, the up one writing f16 for them or not
            up, down = MMA_UP_CANDIDATES[i % len(MMA_UP_CANDIDATES)], MMA_DOWN_CANDIDATES[i % len(MMA_DOWN_CANDIDATES)]
            compile_check(SOURCE, options(16 if not gated else up["bn"], up["warps"], up["unroll"], int8, dt, gated,
                                          False, ids64=i % 2 == 0, pair_major=i % 2 == 1, min_blocks=min_blocks,
                                          mma=True, h16=i % 4 < 2, **route) + launch_flags, arch, "moe_cuda.cu")
            compile_check(SOURCE, options(down["bn"], down["warps"], down["unroll"], int8, dt, gated, i % 4 < 2,
                                          ids64=i % 2 == 1, pair_major=i % 4 >= 2, min_blocks=min_blocks, mma=True,
                                          **route) + launch_flags, arch, "moe_cuda.cu")
            count += 2
    return count
