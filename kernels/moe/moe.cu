// The MoE decode kernels of kernels/moe/cuda.py, whose docstring describes them and their
// compile-time parameters: moe_up (h = act(x @ w13[e].T) times the pair's combine weight)
// and moe_down (out = the sum over a token's slots of w2[e] @ h, the combine inside the
// reduction); split-K partials are summed by common.cuh's splitk_reduce.
#include "common.cuh"

#define ROWS_PER_F (GATED ? 2 : 1)  // rows of w13 per column of h
#define ROWS (ROWS_PER_F * BN)
#define MAX_K 16
#ifndef MINB
#define MINB 1  // blocks an SM the registers must allow (ptxas caps them to fit)
#endif

#ifndef MASKED
#define MASKED 0  // a pair whose expert is not among w13 / w2's (on another rank) adds nothing
#endif
#ifndef FIRST
#define FIRST 0  // MASKED: the ids count from this one (a model's global ids)
#endif
#ifndef E_HERE
#define E_HERE 0  // MASKED: the experts here, ids FIRST .. FIRST + E_HERE - 1 (0: every id from FIRST on)
#endif

#ifndef SLOTS
#define SLOTS 0  // the ids name the far place's experts; slots[e] >= 0: expert e is also near, at that slot
#endif

// SLOTS: where expert e (an id, -1: elsewhere) is read: its near slot (>= 0), or -2 - e
// for the far place (-1 stays). Otherwise e itself.
__device__ __forceinline__ long long placed(const long long* __restrict__ slots, long long e) {
#if SLOTS
  if (e >= 0) {
    const long long s = slots[e];
    return s >= 0 ? s : -2 - e;
  }
#endif
  return e;
}

// The place of a ``placed`` expert e (near or far tensor), e made an index there.
template <class T>
__device__ __forceinline__ const T* tier(const T* near, const T* far, long long& e) {
#if SLOTS
  if (e <= -2) {
    e = -2 - e;
    return far;
  }
#endif
  return near;
}

#ifndef OAI
#define OAI 0  // GATED: GPT-OSS's SwiGLU (gate clamped above at 7, up to [-7, 7], gate sigmoid(1.702 gate) (up + 1))
#endif
#ifndef B13
#define B13 0  // per-expert biases of w13's rows, added before the activation
#endif
#ifndef B2
#define B2 0  // per-expert biases of w2's rows, added before the combine weight
#endif
#ifndef WIN
#define WIN 0  // the pair's weight scales the expert's input (Llama 4), not its output
#endif

#ifndef PIPE
#define PIPE 0  // moe_down: two weight buffers, the next step in flight during this one's arithmetic
#endif
#ifndef RG
#define RG 1  // moe_up / moe_down: row groups, each of WARPS / RG warps taking ROWS / RG rows over all of K
#endif
#define WPG (WARPS / RG)         // warps a row group
#define GSTEP (WPG * 32 * WVEC)  // a row group's step along K
static_assert(WARPS % RG == 0, "whole warps a row group");

// A thread's row group and its place in it.
__device__ __forceinline__ int row_group() { return RG == 1 ? 0 : (int)threadIdx.x / (WPG * 32); }
__device__ __forceinline__ int group_tid() { return RG == 1 ? (int)threadIdx.x : (int)threadIdx.x % (WPG * 32); }

// Row j's sum over the warps of its row group, each warp's rows at part[warp][0 .. NV)
// (after warps_to_shared; with RG 1, every warp's).
template <int NV>
__device__ __forceinline__ float group_total(float (*part)[NV], int j) {
  const int g = j / NV, i = j % NV;
  float v = 0.f;
#pragma unroll
  for (int q = 0; q < WPG; ++q) v += part[g * WPG + q][i];
  return v;
}

// Pair p's expert among w13 / w2's; MASKED: -1 for one that is not there.
__device__ __forceinline__ long long id_at(const void* ids, int p) {
#if IDS64
  long long e = ((const long long*)ids)[p];
#else
  long long e = ((const int*)ids)[p];
#endif
#if MASKED
  e -= FIRST;
  if (e < 0 || (E_HERE > 0 && e >= E_HERE)) e = -1;
#endif
  return e;
}

// An up kernel's block: pair p and first column n0 from the grid (up_tile, before the wait),
// then, after the PDL wait (the ids and weights are an earlier kernel's output), the pair's
// expert e and combine weight (up_expert).
struct UpBlock {
  int p, n0;
  long long e;
  float weight;
};

__device__ __forceinline__ UpBlock up_tile() {
  UpBlock b;
#if PAIR_MAJOR
  b.p = blockIdx.x, b.n0 = blockIdx.y * BN;
#else
  b.p = blockIdx.y, b.n0 = blockIdx.x * BN;
#endif
  return b;
}

__device__ __forceinline__ void up_expert(UpBlock& b, const void* __restrict__ ids, const float* __restrict__ pair_w) {
  grid_dep_enter();
  b.e = id_at(ids, b.p);
  b.weight = pair_w[b.p];
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

// The biases of output column n0 + tid (B13; the thread that finishes that column), gate
// (or GeLU) row then up row: constants, loaded beside the first weights as the scales are.
__device__ __forceinline__ float2 up_bias(const u16* __restrict__ b13, long long e, int n0, int F) {
  float2 b = make_float2(0.f, 0.f);
#if B13
  const int n = n0 + threadIdx.x;
  if (threadIdx.x < BN && n < F) {
    b.x = act_f(b13 + e * ROWS_PER_F * F + n);
    if (GATED) b.y = act_f(b13 + e * 2 * F + F + n);
  }
#endif
  return b;
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

// Token t's k experts into expert (the down kernels), in shared memory, ``placed``.
__device__ __forceinline__ void token_experts(const void* __restrict__ ids, const long long* __restrict__ slots, int t,
                                              int topk, long long* expert) {
  for (int i = threadIdx.x; i < topk; i += THREADS) expert[i] = placed(slots, id_at(ids, t * topk + i));
  __syncthreads();
}

// A down block's outputs, rows n0 .. n0 + BN of token t: each the sum of its row group's
// warps' partials (part, filled and synchronised), as float32 split-K partials (PARTIAL) or
// in x's dtype.
// ``extra``: what thread o < BN adds to row n0 + o (the weighted biases, ``token_bias``).
template <int NV>
__device__ __forceinline__ void store_down(float (*part)[NV], void* __restrict__ out, int t, int n0, int H,
                                           int tokens, long long stride_o, float extra) {
  static_assert(BN <= THREADS, "one thread a row");
  for (int o = threadIdx.x; o < BN; o += THREADS) {
    const int n = n0 + o;
    if (n >= H) continue;
    const float v = group_total<NV>(part, o) + extra;
#if PARTIAL
    ((float*)out)[((size_t)blockIdx.y * tokens + t) * H + n] = v;
#else
    ((u16*)out)[t * stride_o + n] = to_act(v);
#endif
  }
}

// The int8 scales of rows n0 .. n0 + BN of each of the token's experts (times mul) into
// sc[slot], in shared memory. Called once the block's first weights are on their way: the
// two loads then wait together.
__device__ __forceinline__ void token_scales(const float* __restrict__ scale, const float* __restrict__ scale_far,
                                             const long long* expert, int topk, float (*sc)[BN], int n0, int H,
                                             float mul) {
  for (int i = threadIdx.x; i < topk * BN; i += THREADS) {
    const int n = n0 + i % BN;
    long long e = expert[i / BN];
    const float* s = tier(scale, scale_far, e);
    sc[i / BN][i % BN] = n < H && (!MASKED || e >= 0) ? s[e * H + n] * mul : 0.f;
  }
  __syncthreads();
}

// B2: the sum over token t's slots of each pair's weight (1 under WIN) times its expert's
// bias of row n0 + tid, for thread tid < BN, in the first split only (the others' partials
// are summed with it). Loaded beside the first weights.
__device__ __forceinline__ float token_bias(const u16* __restrict__ b2, const u16* __restrict__ b2_far,
                                            const float* __restrict__ pair_w, const long long* expert, int t,
                                            int topk, int n0, int H) {
  float v = 0.f;
#if B2
  const int n = n0 + threadIdx.x;
  if (threadIdx.x < BN && n < H && blockIdx.y == 0)
    for (int i = 0; i < topk; ++i) {
      long long e = expert[i];
      const u16* b = tier(b2, b2_far, e);
      if (!MASKED || e >= 0) v += (WIN ? 1.f : pair_w[t * topk + i]) * act_f(b + e * H + n);
    }
#endif
  return v;
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_up(const u16* __restrict__ x,        // [T, H] tokens, row stride stride_x
       const void* __restrict__ w13,     // [E, 2F, H] gate rows then up rows ([E, F, H] for GeLU)
       const float* __restrict__ scale,  // [E, 2F] int8 per-row scales
       const u16* __restrict__ b13,      // [E, 2F] biases (B13)
       const void* __restrict__ ids,     // [P] expert of each pair (int32, IDS64: int64)
       const float* __restrict__ pair_w, // [P] combine weight of each pair
       u16* __restrict__ h,              // [P, F] out
       int H, int F, int topk, long long stride_x,
       const long long* __restrict__ slots,  // SLOTS: [E] each expert's near slot, -1: read from far
       const void* __restrict__ w13_far,     // SLOTS: every expert's w13, scales and biases
       const float* __restrict__ scale_far,
       const u16* __restrict__ b13_far) {
  const int tid = threadIdx.x;
  UpBlock blk = up_tile();
  const int p = blk.p, n0 = blk.n0;
  // Row j < BN: gate (or GeLU) column n0 + j; j >= BN: up column n0 + j - BN. A thread's
  // rows are its row group's, j = grp RR + i.
  constexpr int RR = ROWS / RG;
  static_assert(ROWS % RG == 0, "whole rows a row group");
  const int grp = row_group(), k0 = group_tid() * WVEC;
  // What does not depend on the expert is computed before the wait and pinned there, so
  // that once the expert's id arrives only its own offset stands before the weight loads.
  const u16* xr = x + (size_t)(p / topk) * stride_x;
  u32 row_off[RR];  // row j's bytes from the expert's first, at k0 (an expert is < 4 GiB: check())
#pragma unroll
  for (int i = 0; i < RR; ++i) {
    const int j = grp * RR + i;
    row_off[i] = (u32)((((size_t)(j < BN ? 0 : F) + n0 + j % BN) * H + k0) * W_BYTES);
    pin(row_off[i]);
  }
  pin(xr);
  up_expert(blk, ids, pair_w);  // waits: x and the ids are earlier kernels' outputs
  long long e = blk.e;
  const float weight = blk.weight;
#if MASKED
  if (e < 0) {  // the expert is elsewhere: zeros, which the down kernel skips anyway
    for (int o = tid; o < BN; o += THREADS)
      if (n0 + o < F) h[(size_t)p * F + n0 + o] = to_act(0.f);
    return;
  }
#endif
  e = placed(slots, e);
  const bool far = SLOTS && e < 0;  // (its weights, scales and biases in the far place)
  e = far ? -2 - e : e;
  const char* w_e = (const char*)(far ? w13_far : w13) + (size_t)e * ROWS_PER_F * F * H * W_BYTES;
  const float2 sc = up_scales(far ? scale_far : scale, e, n0, F);  // in flight beside the weights, not after
  const float2 bias = up_bias(far ? b13_far : b13, e, n0, F);

  float acc[RR];
#pragma unroll
  for (int i = 0; i < RR; ++i) acc[i] = 0.f;
  for (int kb = k0; kb < H; kb += U * GSTEP) {
    u32x4 wv[U][RR];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < RR; ++i) {
        const int j = grp * RR + i, k = kb + u * GSTEP, n = n0 + j % BN;
        wv[u][i] = k < H && n < F ? load_stream(w_e + row_off[i] + (size_t)(kb - k0 + u * GSTEP) * W_BYTES) : zero4();
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * GSTEP;
      if (k >= H) break;
      float a[WVEC];
      load_act(xr + k, a);
      const float start = unit_start(a);
#pragma unroll
      for (int i = 0; i < RR; ++i) acc[i] = UNIT ? acc[i] + dot_w(a, wv[u][i], start) : dot_w(a, wv[u][i], acc[i]);
    }
  }

  __shared__ float part[WARPS][RR];
  warps_to_shared<RR>(acc, part);
  for (int o = tid; o < BN; o += THREADS) {
    const int n = n0 + o;
    if (n >= F) continue;
    float g = group_total<RR>(part, o);
#if INT8
    g *= sc.x * UNIT_SCALE;
#endif
    g = (WIN ? g * weight : g) + bias.x;  // (bias 0 without B13)
#if GATED
    float up = group_total<RR>(part, BN + o);
#if INT8
    up *= sc.y * UNIT_SCALE;
#endif
    up = (WIN ? up * weight : up) + bias.y;
#if OAI
    g = fminf(g, 7.f);
    const float v = g / (1.f + __expf(-1.702f * g)) * (fminf(fmaxf(up, -7.f), 7.f) + 1.f);
#else
    const float v = g / (1.f + __expf(-g)) * up;
#endif
#else
    const float v = 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
#endif
    h[(size_t)p * F + n] = to_act(WIN ? v : v * weight);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_down(const u16* __restrict__ h,        // [P, F] weighted up outputs (moe_up)
         const void* __restrict__ w2,      // [E, H, F]
         const float* __restrict__ scale,  // [E, H] int8 per-row scales
         const u16* __restrict__ b2,       // [E, H] biases (B2)
         const void* __restrict__ ids,     // [P] expert of each pair (int32, IDS64: int64)
         const float* __restrict__ pair_w, // [P] combine weight of each pair (B2: the biases')
         void* __restrict__ out,           // [T, H] (PARTIAL: float32 [S, T, H])
         int H, int F, int topk, int k_span, long long stride_o,
         const long long* __restrict__ slots,  // SLOTS: [E] each expert's near slot, -1: read from far
         const void* __restrict__ w2_far,      // SLOTS: every expert's w2, scales and biases
         const float* __restrict__ scale_far,
         const u16* __restrict__ b2_far) {
  const DownBlock blk = down_block(F, topk, k_span);
  const int t = blk.t, n0 = blk.n0, tokens = blk.tokens, k_lo = blk.k_lo, k_hi = blk.k_hi;
  const int len = topk * F;  // this token's reduction: its k pairs' F columns back to back
  __shared__ long long expert[MAX_K];
  token_experts(ids, slots, t, topk, expert);

  // A thread's rows are its row group's: n0 + r0 + i, i < RR.
  constexpr int RR = BN / RG;
  static_assert(BN % RG == 0, "whole rows a row group");
  const int r0 = row_group() * RR;
  u32x4 wv[U][RR];
  int slot[U];  // the pair (slot) of each step's vectors: F is a multiple of WVEC
  const float inv_f = 1.f / (float)F;
  const size_t row_bytes = (size_t)F * W_BYTES;
  // Where step kb's vectors are (at[u]: the thread's first row) and their slots: k / F from
  // a float reciprocal (k < 2^24), corrected by one either way, not an integer division.
  auto plan_step = [&](const char* (&at)[U], int (&sl)[U], int kb) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * GSTEP;
      int s = (int)((float)k * inv_f);
      s -= s * F > k;
      s += (s + 1) * F <= k;
      sl[u] = k < k_hi ? s : 0;
      long long e = expert[sl[u]];
      const char* w = tier((const char*)w2, (const char*)w2_far, e);
      at[u] = w + ((size_t)e * H + n0 + r0) * row_bytes + (size_t)(k - sl[u] * F) * W_BYTES;
      if (MASKED && e < 0) at[u] = nullptr;  // an expert elsewhere: no weights read
    }
  };
  auto issue_step = [&](u32x4 (&w)[U][RR], const char* const (&at)[U], int kb) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < RR; ++i)
        w[u][i] = kb + u * GSTEP < k_hi && n0 + r0 + i < H && (!MASKED || at[u] != nullptr)
                      ? load_stream(at[u] + i * row_bytes) : zero4();
  };
  auto load_step = [&](u32x4 (&w)[U][RR], int (&sl)[U], int kb) {
    const char* at[U];
    plan_step(at, sl, kb);
    issue_step(w, at, kb);
  };
  int kb = k_lo + group_tid() * WVEC;
  load_step(wv, slot, kb);
#if INT8
  __shared__ float sc[MAX_K][BN];  // the scales of this block's rows, per slot
  token_scales(scale, scale_far, expert, topk, sc, n0, H, UNIT_SCALE);
#endif
  const float bias = token_bias(b2, b2_far, pair_w, expert, t, topk, n0, H);  // (0 without B2)
#if PIPE
  const char* nx_at[U];  // the second step's rows, planned before the wait and issued after it
  int nx_slot[U];
  plan_step(nx_at, nx_slot, kb + U * GSTEP);
#pragma unroll
  for (int u = 0; u < U; ++u) pin(nx_at[u]);
#endif
  grid_dep_enter();  // h is the up kernel's output

  float acc[RR];
#pragma unroll
  for (int i = 0; i < RR; ++i) acc[i] = 0.f;
  const u16* ht = h + (size_t)t * len;
  auto add_step = [&](const u32x4 (&w)[U][RR], const int (&sl)[U], int kb) {  // acc += step kb's products
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * GSTEP;
      if (k >= k_hi) break;
      float a[WVEC];
      load_act(ht + k, a);
      const float start = unit_start(a);
#pragma unroll
      for (int i = 0; i < RR; ++i) {
        const float d = dot_w(a, w[u][i], start);
#if INT8
        acc[i] = fmaf(d, sc[sl[u]][r0 + i], acc[i]);
#else
        acc[i] += d;
#endif
      }
    }
  };
#if PIPE
  // Two buffers by name: the step after next is issued as soon as a buffer is free, so a
  // step's loads are in flight during the arithmetic of the step before it (the second
  // step's from the wait on; never before it, where they would compete with the up kernel's).
  u32x4 nx[U][RR];
  issue_step(nx, nx_at, kb + U * GSTEP);
  for (; kb < k_hi; kb += 2 * U * GSTEP) {
    add_step(wv, slot, kb);
    if (kb + U * GSTEP >= k_hi) break;
    load_step(wv, slot, kb + 2 * U * GSTEP);
    add_step(nx, nx_slot, kb + U * GSTEP);
    load_step(nx, nx_slot, kb + 3 * U * GSTEP);
  }
#else
  for (; kb < k_hi; kb += U * GSTEP) {
    add_step(wv, slot, kb);
    load_step(wv, slot, kb + U * GSTEP);
  }
#endif

  __shared__ float part[WARPS][RR];
  warps_to_shared<RR>(acc, part);
  store_down(part, out, t, n0, H, tokens, stride_o, bias);
}
