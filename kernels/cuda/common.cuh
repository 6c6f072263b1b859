// Device helpers shared by the CUDA C++ kernels (sbi.cu, moe.cu): the PDL wait and trigger,
// 16-byte loads, bf16 / fp16 / int8 conversions, warp and block sums, and the split-K
// reduction kernel. Compile-time parameters: WARPS, INT8, DT (0 bf16, 1 fp16), UNIT,
// PDL_EARLY. kernels.cuda_common.cuda_source pastes this file in place of its #include line:
// NVRTC compiles one self-contained text (CuPy's cache key covers all of it).

#ifndef PDL_EARLY
#define PDL_EARLY 0
#endif
typedef unsigned short u16;
typedef unsigned int u32;
#define THREADS (WARPS * 32)
#define WVEC (INT8 ? 16 : 8)
#define STEP (THREADS * WVEC)
#define W_BYTES (INT8 ? 1 : 2)

struct __align__(16) u32x4 { u32 v[4]; };

__device__ __forceinline__ void grid_dep_wait() {  // PDL: the previous kernel has finished
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dep_launch() {  // PDL: the next kernel may start
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void grid_dep_enter() {  // both, in the order PDL_EARLY picks
#if PDL_EARLY
  grid_dep_launch();
  grid_dep_wait();
#else
  grid_dep_wait();
  grid_dep_launch();
#endif
}

// Pins v's computation before this point: the asm, as volatile as the PDL wait, claims to
// change it. Called before a wait for what does not depend on the previous kernel.
template <typename T>
__device__ __forceinline__ void pin(T*& v) {
  asm volatile("" : "+l"(v));
}
__device__ __forceinline__ void pin(u32& v) { asm volatile("" : "+r"(v)); }

__device__ __forceinline__ u32x4 load_stream(const void* p) {  // weights: read once
  u32x4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3]) : "l"(p));
  return r;
}

__device__ __forceinline__ u32x4 load_cached(const void* p) {  // activations: read by every block
  u32x4 r;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3]) : "l"(p));
  return r;
}

__device__ __forceinline__ u32x4 zero4() {
  u32x4 r;
#pragma unroll
  for (int i = 0; i < 4; ++i) r.v[i] = 0u;
  return r;
}

__device__ __forceinline__ float lo_f(u32 u) {
#if DT == 0
  return __uint_as_float(u << 16);
#else
  float f; u16 h = (u16)(u & 0xffff); asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#endif
}

__device__ __forceinline__ float hi_f(u32 u) {
#if DT == 0
  return __uint_as_float(u & 0xffff0000u);
#else
  float f; u16 h = (u16)(u >> 16); asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#endif
}

__device__ __forceinline__ u16 to_act(float f) {
  u16 h;
#if DT == 0
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

__device__ __forceinline__ float act_f(const u16* p) { return lo_f((u32)*p); }

__device__ __forceinline__ void unpack8(const u32x4& r, float* f) {  // 8 activations as floats
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = lo_f(r.v[i]);
    f[2 * i + 1] = hi_f(r.v[i]);
  }
}

// 8 consecutive activations (one 16-byte load) as floats.
__device__ __forceinline__ void load_act8(const u16* p, float* f) { unpack8(load_cached(p), f); }

// WVEC consecutive activations (8: one 16-byte load; 16: two) as floats.
__device__ __forceinline__ void load_act(const u16* p, float* f) {
#pragma unroll
  for (int h = 0; h < WVEC / 8; ++h) load_act8(p + 8 * h, f + 8 * h);
}

// One 16-byte weight vector as WVEC floats (int8: byte b -> float(0x4B000000 | (b ^ 0x80)) - 2^23 - 128).
__device__ __forceinline__ void widen_w(const u32x4& r, float* f) {
#if INT8
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 u = r.v[i] ^ 0x80808080u;
#pragma unroll
    for (int b = 0; b < 4; ++b)
      f[4 * i + b] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440 + b)) - 8388736.0f;
  }
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = lo_f(r.v[i]);
    f[2 * i + 1] = hi_f(r.v[i]);
  }
#endif
}

#ifndef UNIT
#define UNIT 0
#endif

#if INT8 && UNIT
// int8 with one byte permute a weight (UNIT): 16 bytes as f = 1 + (b + 128) / 2^15 (b the
// signed byte; exact). A row's sum over 16 activations starts from -UNIT_BIAS * (their
// sum), the same for every row, and is then sum a * b / 2^15: no subtraction per weight.
// The scales carry the 2^15.
#define UNIT_SCALE 32768.f
#define UNIT_BIAS 1.00390625f  // 1 + 128 / 2^15
#else
#define UNIT_SCALE 1.f
#endif

// One 16-byte weight vector as WVEC floats: widen_w's, or with UNIT the f above.
__device__ __forceinline__ void widen_unit(const u32x4& w, float* wf) {
#if INT8 && UNIT
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 u = w.v[i] ^ 0x80808080u;
#pragma unroll
    for (int b = 0; b < 4; ++b) wf[4 * i + b] = __uint_as_float(__byte_perm(u, 0x3F800000u, 0x7604 | (b << 4)));
  }
#else
  widen_w(w, wf);
#endif
}

// dot(a, wf) over WVEC widened weights, added to `start`; with UNIT, `start` must hold
// unit_start(a).
__device__ __forceinline__ float dot_f(const float* a, const float* wf, float start) {
#pragma unroll
  for (int i = 0; i < WVEC; ++i) start = fmaf(a[i], wf[i], start);
  return start;
}

__device__ __forceinline__ float dot_w(const float* a, const u32x4& w, float start) {  // dot_f of widen_unit(w)
  float wf[WVEC];
  widen_unit(w, wf);
  return dot_f(a, wf, start);
}

__device__ __forceinline__ float unit_start(const float* a) {
#if INT8 && UNIT
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < WVEC; ++i) s += a[i];
  return -UNIT_BIAS * s;
#else
  return 0.f;
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The cooperative reduction across a block: each warp sums its NV partials with shuffles,
// then one shared-memory exchange; part[q][j] holds warp q's sum of output j.
template <int NV>
__device__ __forceinline__ void warps_to_shared(const float* acc, float (*part)[NV]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float v = warp_sum(acc[j]);
    if (lane == 0) part[warp][j] = v;
  }
  __syncthreads();
}

// Output j's sum over the warps (after warps_to_shared).
template <int NV>
__device__ __forceinline__ float warps_total(float (*part)[NV], int j) {
  float v = 0.f;
#pragma unroll
  for (int q = 0; q < WARPS; ++q) v += part[q][j];
  return v;
}

// Split-K: out[t, n] = sum of the S float32 partials [S, T, N] (+ bias) (+ residual).
extern "C" __global__ void splitk_reduce(const float* __restrict__ part, const u16* __restrict__ bias,
                                         const u16* __restrict__ res, u16* __restrict__ out, int S, int T, int N,
                                         long long stride_res, long long stride_o) {
  grid_dep_enter();
  const int t = blockIdx.y, n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  float v = 0.f;
  for (int s = 0; s < S; ++s) v += part[((size_t)s * T + t) * N + n];
  if (bias) v += act_f(bias + n);
  if (res) v += act_f(res + t * stride_res + n);
  out[t * stride_o + n] = to_act(v);
}
