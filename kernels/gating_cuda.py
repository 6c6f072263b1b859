"""Top-k gating at decode sizes in CUDA C++ (compiled through CuPy): the decode step's
routing launch. Same contract as ``kernels.topk_gating`` (ids [T, k] int32 in descending
score, ties to the lower expert index; weights [T, k] float32) for T <= MAX_T tokens,
E <= MAX_E experts and k <= MAX_K.

The Triton kernel (``kernels.gating``) finds the k winners in k rounds, each a max and an
argmin over the row: two dependent chains of warp shuffles a round, about 50 shuffles in
all at k = 8. In the batch-1 step that launch sits on the critical path between the router
and the experts, and a run with the rounds left out was 1-2% faster (docs/performance.md,
eighteenth session). Here block t has one thread an expert: the softmax's max and sum are
two block reductions, the scores go to shared memory, and each thread counts the experts
that beat its own (higher score, or equal with a lower index), reading the scores four at
a time. That count is the expert's rank; the k threads with rank < k write their slot.
No chain grows with k.

Compile-time parameters: ROUTE (1 softmax, 2 sigmoid), RENORM, LOGITS_F32 (float32 logits,
else DT: 0 bf16, 1 fp16).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_common import COMMON, launch, ptr

MAX_T = 16
MAX_E = 256
MAX_K = 16
LOGITS = (torch.bfloat16, torch.float16, torch.float32)
SCORES = {"softmax": 1, "sigmoid": 2}

SOURCE = COMMON + r"""
#define NEG_INF __int_as_float(0xff800000u)
#define MAX_E 256
#define MAX_K 16

__device__ __forceinline__ float logit_at(const void* lg, long long i) {
#if LOGITS_F32
  return ((const float*)lg)[i];
#else
  return act_f((const u16*)lg + i);  // bf16 or fp16 (DT)
#endif
}

// A block-wide max (MAX 1) or sum of v, every thread gets it; red: one float a warp.
template <int MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? fmaxf(v, u) : v + u;
  }
  const int warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < warps; ++w) v = MAX ? fmaxf(v, red[w]) : v + red[w];
  __syncthreads();  // red is reused by the next reduction
  return v;
}

extern "C" __global__ void __launch_bounds__(MAX_E)
moe_gate(const void* __restrict__ logits,  // [T, E] router logits
         int* __restrict__ ids,            // [T, k] out
         float* __restrict__ weights,      // [T, k] out
         int E, int topk, long long stride_t, long long stride_e) {
  __shared__ float red[MAX_E / 32];
  __shared__ __align__(16) float sc[MAX_E];
  __shared__ int top_id[MAX_K];
  __shared__ float top_w[MAX_K];
  const int t = blockIdx.x, e = threadIdx.x;
  grid_dep_enter();  // the logits are the router's output
  const float x = e < E ? logit_at(logits, t * stride_t + e * stride_e) : NEG_INF;
#if ROUTE == 1
  const float mx = block_reduce<1>(x, red);
  const float p = e < E ? expf(x - mx) : 0.f;
  const float s = e < E ? p / block_reduce<0>(p, red) : NEG_INF;
#else
  const float s = e < E ? 1.f / (1.f + expf(-x)) : NEG_INF;
#endif
  sc[e] = s;
  __syncthreads();
  // Rank: the experts that beat e. Padding (-inf) never beats a real expert.
  int rank = 0;
  for (int j = 0; j < blockDim.x; j += 4) {
    const float4 v = *(const float4*)(sc + j);
    rank += (v.x > s || (v.x == s && j < e)) + (v.y > s || (v.y == s && j + 1 < e))
          + (v.z > s || (v.z == s && j + 2 < e)) + (v.w > s || (v.w == s && j + 3 < e));
  }
  if (e < E && rank < topk) {
    top_id[rank] = e;
    top_w[rank] = s;
  }
  __syncthreads();
  if (e < topk) {
    float w = top_w[e];
#if RENORM
    float total = 0.f;
    for (int r = 0; r < topk; ++r) total += top_w[r];
    w /= total;
#endif
    ids[t * topk + e] = top_id[e];
    weights[t * topk + e] = w;
  }
}
"""


ENABLED = True  # read at each call: an A/B run can switch back to the Triton kernel


def usable(logits: torch.Tensor, k: int, score: str) -> bool:
    """Whether ``topk_gating_cuda`` takes these (already checked) logits and k."""
    t, e = logits.shape
    return (ENABLED and logits.is_cuda and logits.dtype in LOGITS and 1 <= t <= MAX_T and e <= MAX_E
            and k <= MAX_K and score in SCORES)


def options(score: str, renormalize: bool, dtype: torch.dtype) -> tuple:
    return (f"-DROUTE={SCORES[score]}", f"-DRENORM={int(bool(renormalize))}",
            f"-DLOGITS_F32={int(dtype == torch.float32)}", f"-DDT={int(dtype == torch.float16)}", "-DWARPS=1",
            "-DINT8=0", "-std=c++17")


def topk_gating_cuda(logits: torch.Tensor, k: int, score: str, renormalize: bool,
                     ids: torch.Tensor, weights: torch.Tensor) -> None:
    """Fills ids [T, k] int32 and weights [T, k] float32 (contiguous) with the top-k table of
    ``logits`` [T, E]; ``usable`` must hold."""
    t, e = logits.shape
    threads = max(32, -(-e // 32) * 32)
    launch(logits.device, SOURCE, "moe_gate", options(score, renormalize, logits.dtype), (t,), threads,
           (ptr(logits), ptr(ids), ptr(weights), np.int32(e), np.int32(k), np.int64(logits.stride(0)),
            np.int64(logits.stride(1))))
