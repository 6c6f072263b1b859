"""The CUDA C++ source of the top-k routing inside the MoE decode kernels (``kernels.moe_cuda``
with router logits, ROUTE 1 softmax / 2 sigmoid): float32 logits by k rounds of a warp
argmax, bf16 / fp16 logits ranked as int32 keys (one ``redux.sync`` a round), as
``kernels.gating`` ranks them. Part of ``kernels.moe_cuda_source.SOURCE``, after its defines
(E_LANES, LOGITS_F32, RENORM and DT are compile-time parameters)."""
from __future__ import annotations

ROUTE_SOURCE = r"""
#define NEG_INF __int_as_float(0xff800000u)

#if ROUTE
#if LOGITS_F32
// Top-k gating of one token's float32 router logits lg [E] (E <= 32 * E_LANES), as
// kernels.route: softmax (ROUTE 1) or sigmoid (ROUTE 2) scores, k rounds of argmax (ties to
// the lower expert index, torch.topk's order), optional renormalisation. Every warp computes
// the same table (the paper replicates such pre-GEMM work): slot r -> (ids[r], w[r]).
__device__ void route_token(const void* __restrict__ lg, int E, int topk, int* ids, float* w) {
  const int lane = threadIdx.x % 32;
  float s[E_LANES];  // lane holds experts lane, lane + 32, ...
  float mx = NEG_INF;
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) {
    const int e = lane + 32 * i;
    s[i] = e < E ? ((const float*)lg)[e] : NEG_INF;
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
#else
// Top-k gating of one token's bf16 / fp16 router logits lg [E] (E <= 32 * E_LANES), as
// kernels.gating's _topk_keys: softmax and sigmoid keep the logits' order, so each expert
// becomes one int32 key, its logit's 16 bits mapped to an order-preserving integer (-0 as
// +0) in the high half and 0xFFFF - expert in the low half. Keys are distinct and a larger
// key is a larger logit or an equal one of a lower expert (torch.topk's order), so a round
// of the top-k is one warp integer max (redux.sync) and the knock-out of that key. Every
// warp of a block computes the same rounds (no shared memory, no barrier).
#define KEY_NONE ((int)0x80000000)  // below every expert's key

struct Keys {
  int k[E_LANES];  // lane holds experts lane, lane + 32, ...
  float sum;       // softmax without renormalisation: the sum of exp(x - max) over every expert
  float top;       // the first winner's logit (the max)
};

__device__ __forceinline__ int key_of(u32 bits, int e) {
  bits = bits == 0x8000u ? 0u : bits;                              // -0 ties with +0
  const int s = bits >= 0x8000u ? (int)bits - 0x10000 : (int)bits;  // the sign-magnitude pattern
  return ((s ^ ((s >> 15) & 0x7FFF)) << 16) | (0xFFFF - e);        // monotone in the logit
}

__device__ __forceinline__ float key_logit(int key) {
  const int order = key >> 16;
  return lo_f((u32)(order ^ ((order >> 15) & 0x7FFF)) & 0xFFFFu);
}

__device__ __forceinline__ int key_expert(int key) { return 0xFFFF - (key & 0xFFFF); }

__device__ __forceinline__ int next_key(Keys& ks) {  // one round: the best key left, knocked out
  int m = KEY_NONE;
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) m = max(m, ks.k[i]);
  const int best = __reduce_max_sync(0xffffffffu, m);
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) ks.k[i] = ks.k[i] == best ? KEY_NONE : ks.k[i];
  return best;
}

__device__ __forceinline__ float key_score(const Keys& ks, float x) {  // softmax numerator or sigmoid
#if ROUTE == 1
  return __expf(x - ks.top);
#else
  return 1.f / (1.f + __expf(-x));
#endif
}

// The keys of the token's logits, and its first round (the max); the softmax denominator
// where the weights are not renormalised. Returns the first winner's key.
__device__ __forceinline__ int route_begin(const void* __restrict__ lg, int E, Keys& ks) {
  const int lane = threadIdx.x % 32;
  u32 bits[E_LANES];
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) {
    const int e = lane + 32 * i;
    bits[i] = e < E ? (u32)((const u16*)lg)[e] : 0u;
  }
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) ks.k[i] = lane + 32 * i < E ? key_of(bits[i], lane + 32 * i) : KEY_NONE;
  const int first = next_key(ks);
  ks.top = key_logit(first);
  ks.sum = 0.f;
#if ROUTE == 1 && !RENORM
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < E_LANES; ++i) sum += lane + 32 * i < E ? __expf(lo_f(bits[i]) - ks.top) : 0.f;
  ks.sum = warp_sum(sum);
#endif
  return first;
}

// Slot s of the token's top-k: its expert and combine weight. Runs rounds 0 .. s (and on to
// k - 1 where the weights are renormalised over the k winners).
__device__ __forceinline__ void route_slot(const void* __restrict__ lg, int E, int topk, int s, long long* e_out,
                                           float* w_out) {
  Keys ks;
  int key = route_begin(lg, E, ks);
  float mine = key_score(ks, ks.top), total = mine;
  long long e = key_expert(key);
  for (int r = 1; r < (RENORM ? topk : s + 1); ++r) {
    key = next_key(ks);
    const float sc = key_score(ks, key_logit(key));
    total += sc;
    if (r == s) mine = sc, e = key_expert(key);
  }
  *e_out = e;
#if RENORM
  *w_out = mine / total;
#elif ROUTE == 1
  *w_out = mine / ks.sum;
#else
  *w_out = mine;
#endif
}

// The token's k experts (one warp): lane 0 writes expert[r].
__device__ __forceinline__ void route_experts(const void* __restrict__ lg, int E, int topk, long long* expert) {
  Keys ks;
  int key = route_begin(lg, E, ks);
  for (int r = 0; r < topk; ++r) {
    if (r) key = next_key(ks);
    if (threadIdx.x == 0) expert[r] = key_expert(key);
  }
}
#endif
#endif
"""
