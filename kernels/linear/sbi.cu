// SBI-GeMM, the small-batch GEMM y = norm(x) @ W.T (+ bias) (+ residual) for T <= 16 rows:
// kernel sbi_gemm of kernels/linear/sbi_cuda.py, whose docstring describes it and its compile-time
// parameters (TP, BN, WARPS, U, INT8, DT, NORM, PARTIAL, NORM_RES, PERSIST, UNIT, RESIDENT,
// PIPE); split-K partials are summed by common.cuh's splitk_reduce.
#include "common.cuh"

#ifndef PIPE
#define PIPE 0
#endif
#ifndef RESIDENT
#define RESIDENT 0
#endif
#if RESIDENT && !NORM
#error "RESIDENT keeps normed activations: NORM only"
#endif

#if NORM_RES
// a[0..8) += the 8 residual values packed in r, each sum rounded to the activations' dtype
// (the unfused add stores it so); the 8 sums also go to out where it is given.
__device__ __forceinline__ void add_rounded(float* a, const u32x4& r, u16* out) {
  u32x4 packed;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u16 lo = to_act(a[2 * i] + lo_f(r.v[i])), hi = to_act(a[2 * i + 1] + hi_f(r.v[i]));
    packed.v[i] = (u32)lo | ((u32)hi << 16);
    a[2 * i] = lo_f(packed.v[i]);
    a[2 * i + 1] = hi_f(packed.v[i]);
  }
  if (out) *(u32x4*)out = packed;
}
#endif

// The epilogue's per-column constants of thread tid's first output (o = tid, column
// n0 + tid % BN): (int8 scale, bias). No kernel writes them, so they load beside the first
// weights instead of after the reduction.
__device__ __forceinline__ float2 column_consts(const float* __restrict__ scale, const u16* __restrict__ bias,
                                                int n0, int N) {
  float2 c = make_float2(1.f, 0.f);
  const int n = n0 + threadIdx.x % BN;
  if (threadIdx.x < TP * BN && n < N) {
#if INT8
    c.x = scale[n];
#endif
#if !PARTIAL
    if (bias) c.y = act_f(bias + n);
#endif
  }
  return c;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sbi_gemm(const u16* __restrict__ x, const void* __restrict__ w, const float* __restrict__ scale,
         const u16* __restrict__ norm_w, const u16* __restrict__ norm_b, const u16* __restrict__ bias,
         const u16* __restrict__ res, void* __restrict__ out, int T, int N, int K, float eps,
         long long stride_x, long long stride_w, long long stride_res, long long stride_o, int k_span,
         const u16* __restrict__ x_res,  // NORM_RES: [T, K] residual stream added to x before the norm
         u16* __restrict__ x_sum) {      // NORM_RES: [T, K] out, x + x_res (written by block (0, 0))
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // PERSIST: the grid holds fewer blocks than column tiles, and each block walks tiles
  // blockIdx.x, + gridDim.x, ... with the next tile's first weights in flight during this
  // one's reduction and store (no wave of blocks ends with idle SMs). Else one tile a block.
  const int n_tiles = (N + BN - 1) / BN;
  int tile = blockIdx.x;
  int n0 = tile * BN;
  const int k_lo = blockIdx.y * k_span, k_hi = min(K, k_lo + k_span);
  const char* w_rows = (const char*)w + (size_t)n0 * stride_w * W_BYTES;

  u32x4 wv[U][BN];  // every weight load of a step in flight before the first is used
  auto load_into = [&](u32x4 (&buf)[U][BN], int kb) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < BN; ++j) {
        const int k = kb + u * STEP;
        buf[u][j] = k < k_hi && n0 + j < N ? load_stream(w_rows + ((size_t)j * stride_w + k) * W_BYTES) : zero4();
      }
  };
  int kb = k_lo + tid * WVEC;
  load_into(wv, kb);  // weights are no kernel's output: in flight before the wait
  float2 consts = column_consts(scale, bias, n0, N);
#if NORM
  // The norm's weights are no kernel's output either. RESIDENT (one K split, K <= U * STEP:
  // the block's whole reduction is one step) loads this thread's slots of them here; its
  // activations are then loaded once, normed in registers and kept for every tile.
#if RESIDENT
  float gw[U][WVEC], gbw[U][WVEC];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = tid * WVEC + u * STEP;
#pragma unroll
    for (int i = 0; i < WVEC; ++i) gw[u][i] = gbw[u][i] = 0.f;
    if (k < K) {
      load_act(norm_w + k, gw[u]);
#if NORM == 2
      load_act(norm_b + k, gbw[u]);
#endif
    }
  }
#endif
#endif
  grid_dep_enter();

#if NORM
  // Each row's mean and 1 / std over all of K, from every thread of the block: a thread
  // sums its own slices, then one shared-memory exchange.
  __shared__ float red[2][WARPS][TP];
  float s1[TP], s2[TP], mu[TP], rs[TP];
#if NORM_RES
  const bool writes_sum = blockIdx.x == 0 && blockIdx.y == 0;
#endif
#pragma unroll
  for (int t = 0; t < TP; ++t) s1[t] = s2[t] = 0.f;
#if RESIDENT
  float xa[TP][U][WVEC];  // this thread's activations, normed below
  {
    u32x4 raw[TP][U][WVEC / 8];  // every load issued before any is used: one round trip
#if NORM_RES
    u32x4 rraw[TP][U][WVEC / 8];
#endif
#pragma unroll
    for (int t = 0; t < TP; ++t)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < WVEC / 8; ++h) {
          const int k = tid * WVEC + u * STEP + 8 * h;
          const bool in = t < T && tid * WVEC + u * STEP < K;
          raw[t][u][h] = in ? load_cached(x + t * stride_x + k) : zero4();
#if NORM_RES
          rraw[t][u][h] = in ? load_cached(x_res + t * K + k) : zero4();
#endif
        }
#pragma unroll
    for (int t = 0; t < TP; ++t)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < WVEC / 8; ++h) {
          float* v = xa[t][u] + 8 * h;
          unpack8(raw[t][u][h], v);
#if NORM_RES
          const int k = tid * WVEC + u * STEP + 8 * h;
          add_rounded(v, rraw[t][u][h],
                      writes_sum && t < T && tid * WVEC + u * STEP < K ? x_sum + t * K + k : nullptr);
#endif
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            s1[t] += v[i];
            s2[t] += v[i] * v[i];
          }
        }
  }
#else
  for (int k = tid * WVEC; k < K; k += STEP)
#pragma unroll
    for (int t = 0; t < TP; ++t) {
      if (t >= T) continue;
#pragma unroll
      for (int h = 0; h < WVEC / 8; ++h) {
        float v[8];
        load_act8(x + t * stride_x + k + 8 * h, v);
#if NORM_RES
        add_rounded(v, load_cached(x_res + t * K + k + 8 * h), writes_sum ? x_sum + t * K + k + 8 * h : nullptr);
#endif
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          s1[t] += v[i];
          s2[t] += v[i] * v[i];
        }
      }
    }
#endif
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    s1[t] = warp_sum(s1[t]);
    s2[t] = warp_sum(s2[t]);
    if (lane == 0) {
      red[0][warp][t] = s1[t];
      red[1][warp][t] = s2[t];
    }
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < TP; ++t) {
    float a1 = 0.f, a2 = 0.f;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) {
      a1 += red[0][q][t];
      a2 += red[1][q][t];
    }
    mu[t] = NORM == 2 ? a1 / K : 0.f;
    rs[t] = rsqrtf(a2 / K - mu[t] * mu[t] + eps);
  }
#if RESIDENT
#pragma unroll
  for (int t = 0; t < TP; ++t)
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < WVEC; ++i) xa[t][u][i] = (xa[t][u][i] - mu[t]) * rs[t] * gw[u][i] + gbw[u][i];
#endif
#endif

  __shared__ float part[WARPS][TP * BN];
  for (;;) {
  float acc[TP * BN];  // acc[t * BN + j]
#pragma unroll
  for (int o = 0; o < TP * BN; ++o) acc[o] = 0.f;

  // acc += step kb's products, from the weights in buf.
  auto add_step = [&](const u32x4 (&buf)[U][BN], int kb) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * STEP;
      if (k >= k_hi) break;
#if NORM && !RESIDENT
      float g[WVEC], gb[WVEC];
      load_act(norm_w + k, g);
#if NORM == 2
      load_act(norm_b + k, gb);
#endif
#endif
      float wf[BN][WVEC];
#pragma unroll
      for (int j = 0; j < BN; ++j) widen_unit(buf[u][j], wf[j]);
#pragma unroll
      for (int t = 0; t < TP; ++t) {
        if (t < T) {
#if RESIDENT
          const float* a = xa[t][u];
#else
          float a[WVEC];
          load_act(x + t * stride_x + k, a);
#if NORM_RES
#pragma unroll
          for (int h = 0; h < WVEC / 8; ++h) add_rounded(a + 8 * h, load_cached(x_res + t * K + k + 8 * h), nullptr);
#endif
#if NORM
#pragma unroll
          for (int i = 0; i < WVEC; ++i) {
            a[i] = (a[i] - mu[t]) * rs[t] * g[i];
#if NORM == 2
            a[i] += gb[i];
#endif
          }
#endif
#endif
          const float start = unit_start(a);
#pragma unroll
          for (int j = 0; j < BN; ++j)
            acc[t * BN + j] = UNIT ? acc[t * BN + j] + dot_f(a, wf[j], start) : dot_f(a, wf[j], acc[t * BN + j]);
        }
      }
    }
  };
#if PIPE
  // Two buffers by name: each step's loads are in flight during the arithmetic of the step
  // before it (the tile's second step's from here on: after the wait).
  u32x4 nx[U][BN];
  if (kb + U * STEP < k_hi) load_into(nx, kb + U * STEP);
  for (; kb < k_hi; kb += 2 * U * STEP) {
    add_step(wv, kb);
    if (kb + U * STEP >= k_hi) break;
    if (kb + 2 * U * STEP < k_hi) load_into(wv, kb + 2 * U * STEP);
    add_step(nx, kb + U * STEP);
    if (kb + 3 * U * STEP < k_hi) load_into(nx, kb + 3 * U * STEP);
  }
#else
  for (; kb < k_hi; kb += U * STEP) {
    add_step(wv, kb);
    if (kb + U * STEP < k_hi) load_into(wv, kb + U * STEP);
  }
#endif

  const int this_n0 = n0;
  const float2 this_consts = consts;
#if PERSIST
  tile += gridDim.x;
  if (tile < n_tiles) {  // the next tile's first weights, in flight during this reduction
    n0 = tile * BN;
    w_rows = (const char*)w + (size_t)n0 * stride_w * W_BYTES;
    kb = k_lo + tid * WVEC;
    load_into(wv, kb);
    consts = column_consts(scale, bias, n0, N);
  }
#endif
  warps_to_shared<TP * BN>(acc, part);
  for (int o = tid; o < TP * BN; o += THREADS) {
    const int t = o / BN, n = this_n0 + o % BN;
    if (t >= T || n >= N) continue;
    float v = warps_total<TP * BN>(part, o);
#if INT8
    v *= (o == tid ? this_consts.x : scale[n]) * UNIT_SCALE;
#endif
#if PARTIAL
    ((float*)out)[((size_t)blockIdx.y * T + t) * N + n] = v;
#else
    if (bias) v += o == tid ? this_consts.y : act_f(bias + n);
    if (res) v += act_f(res + t * stride_res + n);
    ((u16*)out)[t * stride_o + n] = to_act(v);
#endif
  }
#if PERSIST
  if (tile >= n_tiles) break;
  __syncthreads();  // every thread has read part before the next tile writes it
#else
  break;
#endif
  }
}
