"""The decode step's attention in one launch, in CUDA C++ compiled through CuPy (NVRTC):
the same contract as ``kernels.qkv_attention.qkv_attention_triton`` (the QKV epilogue,
the KV-cache append and the attention over the cache), for the case the batch-1 decode
step runs: one block of at most 128 keys covers the whole cache, head dim 128, up to 16
query heads per KV head. Everything else stays with the Triton kernel.

Why a second version: the Triton kernel's time after its PDL wait was mostly its own
arithmetic (norms, rotation, two small products, softmax: about 2.2 µs of its 3.4 µs a
layer at batch 1, clock-stamped in the fifteenth session), much of it layout conversions
between the epilogue's and the tensor-core products' layouts. Here each phase is laid
out for the one after it. One block of 8 warps per (row b, KV head h):

- before the wait (nothing a kernel of the step writes): every slot's key goes straight
  into registers in the layout of the first product's B operand (each lane reads 16
  contiguous bytes of a key; the head-dim order inside a 32-wide chunk is permuted, and
  q's A operand takes the same permutation, which leaves the dot products unchanged),
  the values into shared memory (cp.async), the q / k norm weights into registers. All
  slots, not only those before the step's: issuing the loads only after the slot's value
  arrives put an L2 round trip (about 1.1 µs) before the wait in the real step;
- after the wait, every load first (the QKV row's G query heads, k and v, the rotary
  rows, the mask at this lane's keys, and for the all-heads norm the whole q and k), then
  the epilogue: warp w takes the heads w, w + 8, ..., lane l the head-dim elements 2l,
  2l + 1 and their rotate-half partners 64 + 2l, 65 + 2l, so the per-head norm is one
  warp sum and the rotation needs no exchange. Rounding follows the torch modules step by
  step, as the Triton kernel's ``_norm_rotate``. The fresh k and v go to the cache and,
  for the products, k into shared memory (read back by the one lane group whose key is
  the slot) and v into the value block's row;
- q K^T: warp w takes keys 16w .. 16w + 15 (mma m16n8k16, q's G rows padded to 16 with
  zeros); the softmax's row max and sum across warps through shared memory; the weights,
  rounded to the model dtype as flash attention rounds them, into shared memory;
- P V: warp w takes head-dim columns 16w .. 16w + 15 over all keys (ldmatrix, transposed
  for V), so no partial outputs are summed across warps; divided by the row sum, stored.

The mask is read as visible / hidden (0 / -inf), as the Triton kernel reads it; the slot's
own key is always visible.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_common import COMMON, DTYPES, compile_check, launch, ptr
from kernels.qkv_decode import QK_NORMS

ENABLED = True  # read at each call; scripts/diag_decode_ab.py --off cuda-attention
KEYS = 128  # keys one block holds: the cache's slots
HEAD_DIM = 128
MAX_G = 16  # query heads per KV head: the rows of one tensor-core product

SOURCE = r"""
#define WARPS 8
#define INT8 0
""" + COMMON + r"""
#define D 128
#define KEYS 128
#define QS (D + 8)     // shared row pitches (elements): 16 bytes of padding against bank conflicts
#define PS (KEYS + 8)
#define UNITS (G + 1)  // the epilogue's heads: G query heads, then the KV head's k
#define NEG_INF __int_as_float(0xff800000)
#ifndef STAMP
#define STAMP 0
#endif
// STAMP: thread 0 of block (0, 0) writes %globaltimer at each phase (diagnostics only).
#define MARK(i) do { if (STAMP && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) { \
  unsigned long long ns; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns)); stamps[i] = ns; } } while (0)
#if DT == 0
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

__device__ __forceinline__ void mma_act(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* p, bool trans) {
  if (trans)
    asm("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
  else
    asm("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool real) {  // zeros where !real
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(smem_addr(dst)), "l"(src), "r"(real ? 16 : 0));
}

__device__ __forceinline__ float rnd(float x) { return lo_f((u32)to_act(x)); }  // as a torch op rounds
__device__ __forceinline__ u32 pack(float lo, float hi) { return (u32)to_act(lo) | ((u32)to_act(hi) << 16); }
__device__ __forceinline__ float clip_to(float x, float c) { return fminf(fmaxf(x, -c), c); }

#if BIAS_F32
typedef float bias_t;
__device__ __forceinline__ float bias_f(const bias_t* p) { return *p; }
#else
typedef u16 bias_t;
__device__ __forceinline__ float bias_f(const bias_t* p) { return act_f(p); }
#endif

// Sum of squares of n values (a multiple of 8) at row, over the block's threads.
__device__ __forceinline__ float sum_squares(const u16* row, int n) {
  float s = 0.f;
  for (int i = threadIdx.x * 8; i < n; i += WARPS * 256) {
    float a[8];
    u32x4 r = *(const u32x4*)(row + i);
#pragma unroll
    for (int j = 0; j < 4; ++j) { a[2 * j] = lo_f(r.v[j]); a[2 * j + 1] = hi_f(r.v[j]); }
#pragma unroll
    for (int j = 0; j < 8; ++j) s += a[j] * a[j];
  }
  return s;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
qkv_attention_cuda(const u16* qkv, const u16* __restrict__ qn_w, const u16* __restrict__ kn_w,
                   const u16* cos_t, const u16* sin_t, u16* __restrict__ kc,
                   u16* __restrict__ vc, const long long* __restrict__ slot_p, const bias_t* bias,
                   u16* __restrict__ out, float eps, float clip, float scale, long long stride_qkv,
                   long long stride_cos, long long skb, long long skh, long long sks, long long svb, long long svh,
                   long long svs, long long stride_bias, int n_keys,
                   unsigned long long* __restrict__ stamps) {  // STAMP: block (0, 0)'s phase clock, 8 values
  __shared__ __align__(16) u16 vs[KEYS * QS];  // the value block, [key][d]
  __shared__ __align__(16) u16 qs[16 * QS];    // q, G rows and zeros, [row][d]
  __shared__ __align__(16) u16 ps[16 * PS];    // softmax weights, [row][key]
  __shared__ __align__(16) u16 kn[D];          // the fresh key
  __shared__ float red[2][WARPS][16];          // row max / row sum of each warp's keys
  __shared__ float norm_ss[2][WARPS];          // the all-heads norm's sums of squares (q, k)
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const long long b = blockIdx.x, h = blockIdx.y;
  MARK(0);
  const u16* k_rows = kc + b * skb + h * skh;
  const u16* v_rows = vc + b * svb + h * svh;

  // Before the wait: every slot of the cache, as the first product's B operand (lane
  // (g, t) of warp w holds key 16w + 8j + g, head-dim chunk 32c + 8t .. + 7), and the
  // values into shared memory (zeros past the cache). Not only the slots before this
  // step's: waiting for the slot's value first would put an L2 round trip before the
  // loads are issued. The slots from the step's on are hidden below (finite: the cache
  // starts zeroed), and the step's own key and value replaced by the fresh ones.
  u32x4 kr[2][D / 32];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int key = 16 * warp + 8 * j + g;
#pragma unroll
    for (int c = 0; c < D / 32; ++c)
      kr[j][c] = key < n_keys ? *(const u32x4*)(k_rows + key * sks + 32 * c + 8 * t) : zero4();
  }
  for (int i = tid; i < (16 - G) * QS / 2; i += WARPS * 32) ((u32*)(qs + G * QS))[i] = 0u;  // q's padding rows
  // The norm weights of this lane's elements (d = 2 lane, 2 lane + 1 and their partners
  // 64 + 2 lane, 65 + 2 lane) for each of this warp's heads.
  float wq[(UNITS + WARPS - 1) / WARPS][4];
#pragma unroll
  for (int i = 0; i < (UNITS + WARPS - 1) / WARPS; ++i) {
    const int u = warp + WARPS * i;
#pragma unroll
    for (int e = 0; e < 4; ++e) wq[i][e] = 0.f;
#if QK_NORM
    if (u < UNITS) {
      const u16* w = u < G ? qn_w + (QK_NORM == 2 ? (h * G + u) * D : 0) : kn_w + (QK_NORM == 2 ? h * D : 0);
      const u32 lo = *(const u32*)(w + 2 * lane), hi = *(const u32*)(w + D / 2 + 2 * lane);
      wq[i][0] = lo_f(lo); wq[i][1] = hi_f(lo); wq[i][2] = lo_f(hi); wq[i][3] = hi_f(hi);
    }
#endif
  }
  const long long slot = *slot_p;  // written before the step: no wait needed
  MARK(1);
  grid_dep_enter();
  MARK(2);

  // After the wait: every load first.
  const u16* row = qkv + b * stride_qkv;
  u32 x[(UNITS + WARPS - 1) / WARPS][2];
#pragma unroll
  for (int i = 0; i < (UNITS + WARPS - 1) / WARPS; ++i) {
    const int u = warp + WARPS * i;
    const u16* head = row + (u < G ? (h * G + u) * D : (HQ + h) * D);
    x[i][0] = u < UNITS ? *(const u32*)(head + 2 * lane) : 0u;
    x[i][1] = u < UNITS ? *(const u32*)(head + D / 2 + 2 * lane) : 0u;
  }
  const u32 v_raw = tid < D / 2 ? *(const u32*)(row + (HQ + HKV + h) * D + 2 * tid) : 0u;
  u32 cs[2] = {0u, 0u}, sn[2] = {0u, 0u};
#if ROPE
  cs[0] = *(const u32*)(cos_t + b * stride_cos + 2 * lane);
  cs[1] = *(const u32*)(cos_t + b * stride_cos + D / 2 + 2 * lane);
  sn[0] = *(const u32*)(sin_t + b * stride_cos + 2 * lane);
  sn[1] = *(const u32*)(sin_t + b * stride_cos + D / 2 + 2 * lane);
#endif
  bool seen[2][2];  // this lane's keys 16 warp + 8 j + 2 t + e: visible under the mask
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const long long key = 16 * warp + 8 * j + 2 * t + e;
      seen[j][e] = key == slot || (key < slot && bias_f(bias + b * stride_bias + key) > NEG_INF);
    }
  // The values into shared memory, behind the post-wait loads: they are needed last.
  for (int i = tid; i < KEYS * D / 8; i += WARPS * 32) {
    const int key = i / (D / 8), c = i % (D / 8);
    copy_async16(vs + key * QS + 8 * c, v_rows + (key < n_keys ? key * svs : 0) + 8 * c, key < n_keys);
  }
  asm volatile("cp.async.commit_group;");
  float rstd[2] = {1.f, 1.f};  // all-heads 1 / RMS of q and k (QK_NORM 2)
#if QK_NORM == 2
  {
    const float sq = warp_sum(sum_squares(row, HQ * D)), sk = warp_sum(sum_squares(row + HQ * D, HKV * D));
    if (lane == 0) { norm_ss[0][warp] = sq; norm_ss[1][warp] = sk; }
    __syncthreads();
    float tq = 0.f, tk = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) { tq += norm_ss[0][w]; tk += norm_ss[1][w]; }
    rstd[0] = rsqrtf(tq / (HQ * D) + eps);
    rstd[1] = rsqrtf(tk / (HKV * D) + eps);
  }
#endif

  // The epilogue of this warp's heads: norm, clip, rotate; q into shared memory, k to the
  // cache and to shared memory.
#pragma unroll
  for (int i = 0; i < (UNITS + WARPS - 1) / WARPS; ++i) {
    const int u = warp + WARPS * i;
    if (u >= UNITS) break;
    float a[4] = {lo_f(x[i][0]), hi_f(x[i][0]), lo_f(x[i][1]), hi_f(x[i][1])};  // d, d + 1, partners
#if QK_NORM == 2
    const float r = rstd[u < G ? 0 : 1];
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = rnd(rnd(a[e] * r) * wq[i][e]);
#endif
#if CLIP
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = clip_to(a[e], clip);
#endif
#if QK_NORM == 1
    const float r = rsqrtf(warp_sum(a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3]) / D + eps);
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = rnd(rnd(a[e] * r) * wq[i][e]);
#endif
#if ROPE
    const float c[4] = {lo_f(cs[0]), hi_f(cs[0]), lo_f(cs[1]), hi_f(cs[1])};
    const float s[4] = {lo_f(sn[0]), hi_f(sn[0]), lo_f(sn[1]), hi_f(sn[1])};
    float y[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // x * cos + cat(-x2, x1) * sin
      y[e] = rnd(rnd(a[e] * c[e]) + rnd(-a[e + 2] * s[e]));
      y[e + 2] = rnd(rnd(a[e + 2] * c[e + 2]) + rnd(a[e] * s[e + 2]));
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = y[e];
#endif
    const u32 lo = pack(a[0], a[1]), hi = pack(a[2], a[3]);
    u16* dst = u < G ? qs + u * QS : kn;
    *(u32*)(dst + 2 * lane) = lo;
    *(u32*)(dst + D / 2 + 2 * lane) = hi;
    if (u == G) {
      *(u32*)(kc + b * skb + h * skh + slot * sks + 2 * lane) = lo;
      *(u32*)(kc + b * skb + h * skh + slot * sks + D / 2 + 2 * lane) = hi;
    }
  }
  MARK(3);
  u32 v_new = 0u;
  if (tid < D / 2) {  // the fresh value: clipped, rounded; to the cache (the value block's row: below)
    float v0 = lo_f(v_raw), v1 = hi_f(v_raw);
#if CLIP
    v0 = clip_to(v0, clip);
    v1 = clip_to(v1, clip);
#endif
    v_new = pack(v0, v1);
    *(u32*)(vc + b * svb + h * svh + slot * svs + 2 * tid) = v_new;
  }
  __syncthreads();
  MARK(4);

  // Scores: q [16, D] times this warp's 16 keys. The slot's key comes from shared memory.
  float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int j = 0; j < 2; ++j)
    if (16 * warp + 8 * j + g == slot)
#pragma unroll
      for (int c = 0; c < D / 32; ++c) kr[j][c] = *(const u32x4*)(kn + 32 * c + 8 * t);
#pragma unroll
  for (int c = 0; c < D / 32; ++c) {
    const u32x4 qa = *(const u32x4*)(qs + g * QS + 32 * c + 8 * t);
    const u32x4 qb = *(const u32x4*)(qs + (g + 8) * QS + 32 * c + 8 * t);
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        mma_act(sc[j], qa.v[2 * e], qb.v[2 * e], qa.v[2 * e + 1], qb.v[2 * e + 1], kr[j][c].v[2 * e],
                kr[j][c].v[2 * e + 1]);
  }
  // Softmax over all keys: rows g (sc[j][0..1]) and g + 8 (sc[j][2..3]).
  float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sc[j][e] = seen[j][e % 2] ? sc[j][e] * scale : NEG_INF;
      mx[e / 2] = fmaxf(mx[e / 2], sc[j][e]);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    if (t == 0) red[0][warp][g + 8 * r] = mx[r];
  }
  __syncthreads();
  MARK(5);
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, red[0][w][g + 8 * r]);
    mx[r] = m > NEG_INF ? m : 0.f;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = __expf(sc[j][e] - mx[e / 2]);
      sum[e / 2] += p[e];
    }
    *(u32*)(ps + g * PS + 16 * warp + 8 * j + 2 * t) = pack(p[0], p[1]);
    *(u32*)(ps + (g + 8) * PS + 16 * warp + 8 * j + 2 * t) = pack(p[2], p[3]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    if (t == 0) red[1][warp][g + 8 * r] = sum[r];
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();  // every copy has landed: the slot's row takes the fresh value
  if (tid < D / 2) *(u32*)(vs + slot * QS + 2 * tid) = v_new;
  __syncthreads();
  MARK(6);

  // Output: the weights [16, KEYS] times the values' columns 16 warp .. + 15.
  float o[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int ks = 0; ks < KEYS / 16; ++ks) {
    u32 a[4], bv[4];
    ldmatrix_x4(a, ps + (lane % 16) * PS + 16 * ks + (lane / 16) * 8, false);
    ldmatrix_x4(bv, vs + (16 * ks + lane % 8 + ((lane / 8) % 2) * 8) * QS + 16 * warp + (lane / 16) * 8, true);
    mma_act(o[0], a[0], a[1], a[2], a[3], bv[0], bv[1]);
    mma_act(o[1], a[0], a[1], a[2], a[3], bv[2], bv[3]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = g + 8 * r;
    if (m >= G) continue;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) l += red[1][w][m];
    u16* dst = out + (b * HQ + h * G + m) * D + 16 * warp + 2 * t;
#pragma unroll
    for (int j = 0; j < 2; ++j) *(u32*)(dst + 8 * j) = pack(o[j][2 * r] / l, o[j][2 * r + 1] / l);
  }
  MARK(7);
}
"""


STAMPS = None  # a uint64 device tensor of 8: block (0, 0)'s phase clock is written there (diagnostics)


def options(hq: int, hkv: int, qk_norm: int, clip: bool, rope: bool, dt: int, bias_f32: bool,
            stamp: bool = False) -> tuple:
    return ("-std=c++17", f"-DSTAMP={int(stamp)}", f"-DHQ={hq}", f"-DHKV={hkv}", f"-DG={hq // hkv}", f"-DQK_NORM={qk_norm}",
            f"-DCLIP={int(clip)}", f"-DROPE={int(rope)}", f"-DDT={dt}", f"-DBIAS_F32={int(bias_f32)}")


def why_not(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos=None, qk_norm=None,
            q_norm_w=None, k_norm_w=None) -> str | None:
    """Why this kernel cannot take the step (None: it can). The operands' shapes were
    checked by ``kernels.qkv_attention.check``."""
    if not ENABLED:
        return "switched off (attention_cuda.ENABLED)"
    if not qkv.is_cuda:
        return "not on a CUDA device"
    if qkv.dtype not in DTYPES or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        return f"qkv / cache {qkv.dtype} / {k_cache.dtype}: expected bf16 or fp16 throughout"
    if head_dim != HEAD_DIM or num_heads // num_kv_heads > MAX_G:
        return f"head_dim {head_dim}, {num_heads // num_kv_heads} query heads a KV head: expected 128 and at most 16"
    if k_cache.shape[2] > KEYS:
        return f"cache of {k_cache.shape[2]} slots: one block holds at most {KEYS}"
    if slot.dtype != torch.int64 or not slot.is_cuda:
        return f"slot {slot.dtype}: expected an int64 device tensor"
    if bias.dtype not in (qkv.dtype, torch.float32) or bias.reshape(bias.shape[0], -1).stride(-1) != 1:
        return f"bias {bias.dtype}: expected {qkv.dtype} or float32 with unit stride"
    tensors = [("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache)]
    tensors += [(n, z) for n, z in (("cos", cos), ("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)) if z is not None]
    for name, z in tensors:
        if z.stride(-1) != 1 or z.data_ptr() % 16 or any(s * z.element_size() % 16 for s in z.stride()[:-1]):
            return f"{name}: expected unit stride along the last dim and 16-byte aligned rows"
    if qk_norm is not None and not (q_norm_w.dtype == k_norm_w.dtype == qkv.dtype and q_norm_w.is_contiguous()
                                    and k_norm_w.is_contiguous()):
        return f"q / k norm weights: expected contiguous {qkv.dtype}"
    if cos is not None and cos.dtype != qkv.dtype:
        return f"cos / sin {cos.dtype}: expected {qkv.dtype}"
    return None


def qkv_attention_cuda(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos=None, sin=None,
                       qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, scale=None):
    """``qkv_attention_triton``'s contract where ``why_not`` allows (else ValueError naming
    the operand): qkv [B, (Hq + 2 Hkv) * D] -> [B, Hq, D], k / v written at ``slot``."""
    from kernels.qkv_attention import check

    b = check(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias)
    if qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm={qk_norm!r}: expected one of {list(QK_NORMS)}")
    why = why_not(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos, qk_norm, q_norm_w,
                  k_norm_w)
    if why is not None:
        raise ValueError(f"qkv_attention_cuda: {why}")
    s = k_cache.shape[2]
    bias = bias.reshape(b, s)
    if cos is not None:
        cos, sin = cos.reshape(b, head_dim), sin.reshape(b, head_dim)
    out = torch.empty(b, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    opts = options(num_heads, num_kv_heads, QK_NORMS[qk_norm], clip is not None, cos is not None, DTYPES[qkv.dtype],
                   bias.dtype == torch.float32, STAMPS is not None)
    launch(qkv.device, SOURCE, "qkv_attention_cuda", opts, (b, num_kv_heads), 256,
           (ptr(qkv), ptr(q_norm_w), ptr(k_norm_w), ptr(cos), ptr(sin), ptr(k_cache), ptr(v_cache), ptr(slot),
            ptr(bias), ptr(out), np.float32(eps), np.float32(clip or 0.0),
            np.float32(scale if scale is not None else head_dim ** -0.5), np.int64(qkv.stride(0)),
            np.int64(cos.stride(0) if cos is not None else 0), *(np.int64(z.stride(i)) for z in (k_cache, v_cache)
                                                                for i in range(3)), np.int64(bias.stride(0)), np.int32(s), ptr(STAMPS)))
    return out


def compile_all(arch: str = "sm_90") -> int:
    """Compiles the kernel for ``arch`` through NVRTC (no GPU needed) over combinations that
    take every value of every compile-time parameter; returns how many. Raises
    RuntimeError with the compiler log on a failure."""
    cases = [(16, 16, 2, False, True, 0, False), (32, 4, 1, True, True, 1, True), (16, 1, 0, False, False, 0, True),
             (12, 4, 1, False, True, 1, False)]
    for i, case in enumerate(cases):
        compile_check(SOURCE, options(*case, stamp=i == 1) + (f"-DL2PF=0", f"-DPDL_EARLY={i % 2}"), arch,
                      "attention_cuda.cu")
    return len(cases)
