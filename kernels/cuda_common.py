"""What the CUDA C++ kernels (``sbi_cuda``, ``moe_cuda``) share: device helpers for
streaming 16-byte weight vectors, bf16 / fp16 / int8 conversions and warp sums; the
split-K reduction kernel; compilation through CuPy (NVRTC); and a launcher that can start
a kernel with programmatic dependent launch (PDL), which CuPy's own launch cannot.

PDL (see ``kernels/pdl.py``): a kernel launched with it may start while the kernel
before it is finishing. Every kernel here calls ``grid_dep_enter()`` (the wait) in every block before
it reads anything an earlier kernel wrote (a no-op without PDL), and may load weights,
which no kernel writes, before that: the first weight loads of a step then overlap the
previous kernel's tail.

Each kernel lets the next launch before its own wait (the early trigger, see
``kernels/pdl.py``; the ``PDL_EARLY`` macro), unless its options pin the late trigger.
Asking L2 for a block's weight lines before its wait was measured slower in the decode
step: the prefetch competes with the kernel still running.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from kernels.pdl import pdl_on

COMMON = r"""
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

// int8 weights on the tensor cores (the MMA kernels): mma m16n8k16, f16 operands, f32
// sums. A warp takes a tile of 16 weight rows by a chunk of 64 along K: lane (g, q) =
// (lane / 4, lane % 4) holds 16 bytes of rows g and g + 8 at k + 16 q, and the activations
// k + 16 q .. + 15 of column g (8 f16 pairs, in order: the A and B fragments then pair the
// same k). One byte permute makes two bytes b the f16s 1152 + b (b ^ 0x80 under an exponent
// byte 0x64: exact), and one more mma per 16 k with every weight -1152 takes the offset
// back off (mma_offset), for every row of every tile at once. Activations enter as f16
// times ACT_F16 (2^-8: finite up to 1.6e7, exact from 2^-6 up, within 8e-6 below), which
// the scales take back (MMA_SCALE).
#define ACT_F16 0.00390625f
#define MMA_SCALE 256.f
#define MMA_CHUNK 64

__device__ __forceinline__ void mma_16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d += (1152 + the int8 tile: rows g = lo, g + 8 = hi) times the chunk's activations b.
__device__ __forceinline__ void mma_chunk(float* d, const u32x4& lo, const u32x4& hi, const u32* b) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 l = lo.v[i] ^ 0x80808080u, h = hi.v[i] ^ 0x80808080u;
    mma_16816(d, __byte_perm(l, 0x64646464u, 0x4140), __byte_perm(h, 0x64646464u, 0x4140),
              __byte_perm(l, 0x64646464u, 0x4342), __byte_perm(h, 0x64646464u, 0x4342), b[2 * i], b[2 * i + 1]);
  }
}

// d += -1152 times the sum of the chunk's activations, in every row: mma_chunk's offset.
__device__ __forceinline__ void mma_offset(float* d, const u32* b) {
  const u32 neg = 0xE480E480u;  // f16x2 (-1152, -1152)
#pragma unroll
  for (int i = 0; i < 4; ++i) mma_16816(d, neg, neg, neg, neg, b[2 * i], b[2 * i + 1]);
}

// acc[0] += s_lo times row g's sum over the chunk (column 0), acc[1] += s_hi times row
// g + 8's; off holds the chunk's mma_offset. Each call is its own chain of mma (no
// dependence between chunks or tiles).
__device__ __forceinline__ void mma_add(float* acc, const float* off, const u32x4& lo, const u32x4& hi,
                                        const u32* b, float s_lo, float s_hi) {
  float d[4] = {off[0], off[1], off[2], off[3]};
  mma_chunk(d, lo, hi, b);
  acc[0] = fmaf(d[0], s_lo, acc[0]);
  acc[1] = fmaf(d[2], s_hi, acc[1]);
}

__device__ __forceinline__ void words8(u32* b, const u32x4& lo, const u32x4& hi) {  // b = lo, hi
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    b[i] = lo.v[i];
    b[4 + i] = hi.v[i];
  }
}

__device__ __forceinline__ u32 f16x2(float lo, float hi) {  // two floats times ACT_F16, as f16x2
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi * ACT_F16), "f"(lo * ACT_F16));
  return r;
}

__device__ __forceinline__ u16 f16_bits(float v) {  // v times ACT_F16, as f16
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v * ACT_F16));
  return h;
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
"""

DTYPES = {torch.bfloat16: 0, torch.float16: 1}


@functools.lru_cache(maxsize=None)
def function(device: int, source: str, name: str, opts: tuple):
    """The handle of kernel ``name`` of ``source`` compiled with ``opts`` (one compile per
    process)."""
    import cupy

    with cupy.cuda.Device(device):  # the CUfunction loaded on this device (RawKernel.kernel)
        kernel = cupy.RawModule(code=source, options=opts).get_function(name).kernel
    return kernel, ctypes.c_void_p(kernel.ptr)  # the Function keeps its module loaded


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_...: the PDL launch attribute
_C_TYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32,
            np.float32: ctypes.c_float}


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    return lib


def launch(device: torch.device, source: str, name: str, opts: tuple, grid: tuple, block: int, args: tuple,
           shared: int = 0):
    """Launches kernel ``name`` on the current stream of ``device``; with PDL where
    ``kernels.pdl`` turns it on. ``args`` are numpy scalars (pointers as np.uint64);
    ``shared``: bytes of dynamic shared memory (at most 48 KiB)."""
    opts = tuple(opts)
    if not any(o.startswith("-DPDL_EARLY=") for o in opts):  # a kernel may pin the late trigger
        opts += ("-DPDL_EARLY=1",)
    _, handle = function(device.index, source, name, opts)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    use_pdl = pdl_on(device)
    config = _Config(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(block, 1, 1), shared_bytes=shared,
                     stream=torch.cuda.current_stream(device).cuda_stream,
                     attrs=ctypes.pointer(attr) if use_pdl else None, num_attrs=int(use_pdl))
    values = [_C_TYPES[type(a)](a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    err = _driver().cuLaunchKernelEx(ctypes.byref(config), handle, params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx({name}) failed with CUDA error {err}")


def ptr(z: torch.Tensor | None) -> np.uint64:
    return np.uint64(z.data_ptr() if z is not None else 0)


def compile_check(source: str, opts: tuple, arch: str = "sm_90", name: str = "kernel.cu") -> None:
    """Compiles ``source`` to a binary for ``arch`` with NVRTC (ptxas included; no GPU
    needed). Raises RuntimeError with the compiler log on a failure."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        nvrtc.compileProgram(prog, [*opts, f"-arch={arch}"])
        nvrtc.getCUBIN(prog)
    except Exception as exc:
        raise RuntimeError(f"{' '.join(opts)}: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
    finally:
        nvrtc.destroyProgram(prog)
