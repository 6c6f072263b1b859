"""SBI-GeMM in CUDA C++ (``kernels/linear/sbi.cu``), compiled at run time through CuPy
(NVRTC): the small-batch GEMM of DeepSpeed-Inference III-C, y = norm(x) @ W.T (+ bias)
(+ residual), x [T, K] with T <= 16, W [N, K] bf16 / fp16 or int8 with per-output-channel
scales. Same contract as ``kernels.linear.sbi_triton.sbi_linear_triton``.

The paper's three parts, as built here:
- Tiling (III-C1). A block of WARPS warps owns BN output channels; grid.y splits K when
  N alone gives too few blocks, and a second kernel then sums the float32 partials.
- Cooperative reduction (III-C2). Every thread accumulates its own slice of K for all
  T x BN outputs; each warp reduces its partials in registers with shuffles, and one
  shared-memory exchange sums the warps: no shared-memory tree.
- Full cache lines (III-C3). The paper transposes column-major weights at load so a
  thread reads several input-dimension elements. Our weights are [N, K] with K
  contiguous, which is that layout already: each thread reads 16 bytes along K (8 bf16
  or 16 int8), a warp 512 contiguous bytes of one row, with no L1 allocation and a
  256-byte L2 prefetch. U such loads per row are issued before any is used.

The norm (RMSNorm / LayerNorm) is recomputed by every block for the rows it needs, as the
paper replicates pre-GEMM work: every thread sums its slices of the rows, then one
shared-memory exchange (one round trip after the wait where one step covers K). Rows of x
are read through the L1 cache (every block reads them). bf16 / fp16 conversions use PTX cvt (no CUDA headers under NVRTC); int8
widens through the 2^23 float trick with byte permutes.

The first step's weight loads are issued before the wait for the previous kernel (PDL,
``kernels.cuda_common``), so they overlap that kernel's tail.

Compile-time parameters (macros): TP (rows, padded to 1, 2, 4, 8, 16), BN, WARPS, U,
INT8, DT (0 bf16, 1 fp16), NORM (0 none, 1 RMSNorm, 2 LayerNorm), PARTIAL (write float32
split-K partials), NORM_RES (``sbi_norm_linear_cuda``: a residual stream is added to x
before the norm, rounded as the unfused add stores it, and block (0, 0) writes the sum),
PERSIST, UNIT (int8 widened by one byte permute a weight, as ``kernels.moe.cuda``'s: a
third fewer instructions, relative error about 1e-4), RESIDENT (with a norm, where the
block's whole K is one step: its normed activations stay in registers for every column
tile; ``resident``), PIPE (a table entry's ``pipe``: two weight buffers, each step's loads
issued before the arithmetic of the step before it, a tile's second step right after the
wait). Each combination compiles once per process (CuPy caches the binary).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from kernels.cuda_common import DTYPES, compile_check, cuda_source, launch, ptr
from kernels.linear.sbi_triton import NORMS

SOURCE = cuda_source("linear/sbi.cu")  # kernel sbi_gemm, and common.cuh's splitk_reduce

MAX_T = 16


def _tp(t: int) -> int:
    return 1 << max(0, t - 1).bit_length()


def options(tp: int, bn: int, warps: int, unroll: int, int8: bool, dt: int, norm: int, partial: bool,
            norm_res: bool = False, persist: bool = False, unit: bool = False, resident: bool = False,
            pipe: bool = False) -> tuple:
    return ("-std=c++17", f"-DTP={tp}", f"-DBN={bn}", f"-DWARPS={warps}", f"-DU={unroll}", f"-DINT8={int(int8)}",
            f"-DDT={dt}", f"-DNORM={norm}", f"-DPARTIAL={int(partial)}", f"-DNORM_RES={int(norm_res)}",
            f"-DPERSIST={int(persist)}", f"-DUNIT={int(unit)}", f"-DRESIDENT={int(resident)}", f"-DPIPE={int(pipe)}")


RESIDENT_FLOATS = 32  # the most normed activations a thread keeps in registers (RESIDENT)


def resident(norm: bool, tp: int, k: int, warps: int, unroll: int, int8: bool, split: int) -> bool:
    """Whether a normed launch keeps its activations in registers (RESIDENT): one K split
    whose whole reduction is one step of the main loop, and few enough values a thread."""
    wvec = 16 if int8 else 8
    return norm and split == 1 and k <= unroll * warps * 32 * wvec and tp * unroll * wvec <= RESIDENT_FLOATS


def sbi_cuda_config(t: int, n: int, k: int, sms: int, int8: bool) -> dict:
    """Launch configuration: BN outputs per block of ``warps`` warps, U loads in flight per
    output row, K split until there are about four blocks per SM, each split keeping at
    least two block steps of K."""
    tp = _tp(t)
    bn = 4 if tp <= 4 else 2
    warps = 4
    unroll = 4 if tp <= 2 else (2 if tp <= 8 else 1)
    step = warps * 32 * (16 if int8 else 8)
    split = 1
    while -(-n // bn) * split < 4 * sms and k // (2 * split) >= 2 * step and split < 16:
        split *= 2
    return dict(bn=bn, warps=warps, unroll=unroll, split_k=split)


def supports(x: torch.Tensor, w: torch.Tensor, scale=None, bias=None, residual=None, norm=None,
             x_residual=None) -> str | None:
    """Why the CUDA version cannot take operands of these shapes, dtypes and devices (None:
    it can); ``x_residual``: the residual stream of ``sbi_norm_linear_cuda``. It reads
    nothing else, so a caller may keep its answer per (device, dtypes, shapes)
    (``kernels.linear.select``); ``layout`` checks the addresses and strides."""
    t, k = x.shape if x.dim() == 2 else (None, None)
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != k:
        return f"x {list(x.shape)} / w {list(w.shape)}: expected [T, K] and [N, K]"
    if x.dtype not in DTYPES:
        return f"x: bf16 or fp16, got {x.dtype}"
    if t > MAX_T or t == 0:
        return f"x {list(x.shape)}: 1 to {MAX_T} rows"
    if w.dtype not in (x.dtype, torch.int8) or (w.dtype == torch.int8) != (scale is not None):
        return f"w {w.dtype}: expected {x.dtype}, or int8 with its per-row scale"
    vec = 16 if w.dtype == torch.int8 else 8  # elements of one 16-byte weight load
    if k % vec:
        return f"K = {k}: expected a multiple of {vec}"
    n = w.shape[0]
    if scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (n,)):
        return f"scale {list(scale.shape)} {scale.dtype}: expected float32 [{n}]"
    for name, z, shape in (("bias", bias, (n,)), ("residual", residual, (t, n))):
        if z is not None and (z.dtype != x.dtype or tuple(z.shape) != shape):
            return f"{name} {list(z.shape)} {z.dtype}: expected {x.dtype} {list(shape)}"
    if norm is not None:
        kind, g, gb, _ = norm
        if kind not in ("rmsnorm", "layernorm") or g.dtype != x.dtype:
            return f"norm {kind!r}: expected rmsnorm / layernorm with a {x.dtype} weight"
        if kind == "layernorm" and (gb is None or gb.dtype != x.dtype):
            return "norm: layernorm needs a bias in the activations' dtype"
    if x_residual is not None:
        if norm is None or norm[0] != "rmsnorm":
            return f"norm {None if norm is None else norm[0]!r}: the residual add is fused before an RMSNorm only"
        if x_residual.dtype != x.dtype or tuple(x_residual.shape) != tuple(x.shape):
            return f"x_residual {list(x_residual.shape)} {x_residual.dtype}: expected {x.dtype} {list(x.shape)}"
    if not (x.is_cuda and w.device == x.device):
        return f"x / w on {x.device} / {w.device}: expected one CUDA device"
    return None


def layout(x: torch.Tensor, w: torch.Tensor, scale=None, bias=None, residual=None, norm=None,
           x_residual=None) -> str | None:
    """Why the kernel cannot read these operands where they lie (None: it can): unit stride
    along K, 16-byte aligned rows and vectors. A view can change these from call to call,
    so they are checked at each call (a few integer tests); ``supports`` must have passed."""
    if x.stride(1) != 1 or w.stride(1) != 1:
        return f"x / w strides {x.stride()} / {w.stride()}: expected unit stride along K"
    for name, z, row in (("x", x, x.stride(0)), ("w", w, w.stride(0))):
        if z.data_ptr() % 16 or row * z.element_size() % 16:
            return f"{name}: rows must start on 16-byte boundaries"
    if scale is not None and not scale.is_contiguous():
        return "scale: expected contiguous"
    for name, z in (("bias", bias), ("residual", residual)):
        if z is not None and z.stride(-1) != 1:
            return f"{name}: expected unit stride"
    if norm is not None:
        kind, g, gb, _ = norm
        if not g.is_contiguous() or g.data_ptr() % 16 or (kind == "layernorm" and gb.data_ptr() % 16):
            return f"norm {kind!r}: expected a contiguous weight (and layernorm bias) on 16-byte boundaries"
    if x_residual is not None and (not x_residual.is_contiguous() or x_residual.data_ptr() % 16):
        return "x_residual: expected contiguous, on a 16-byte boundary"
    return None


def check(x: torch.Tensor, w: torch.Tensor, scale=None, bias=None, residual=None, norm=None,
          x_residual=None) -> str | None:
    """Why the CUDA version cannot take these operands (None: it can): ``supports``, then
    ``layout``."""
    return (supports(x, w, scale, bias, residual, norm, x_residual)
            or layout(x, w, scale, bias, residual, norm, x_residual))


def sbi_linear_cuda(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                    norm: tuple | None = None, config: dict | None = None, pdl: bool = True) -> torch.Tensor:
    """y [T, N] = norm(x [T, K]) @ dequant(w [N, K]).T (+ bias [N]) (+ residual [T, N]), in x's
    dtype; ``norm`` is (kind, weight [K], bias [K] or None, eps). Raises ValueError naming
    the operand where the kernel cannot take it (``check``)."""
    why = check(x, w, scale, bias, residual, norm)
    if why is not None:
        raise ValueError(f"sbi_linear_cuda: {why}")
    return run(x, w, scale, bias, residual, norm, config, pdl)[0]


def sbi_norm_linear_cuda(x: torch.Tensor, x_residual: torch.Tensor, norm: tuple, w: torch.Tensor,
                         scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         config: dict | None = None, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step's add, RMSNorm and GEMM in one launch: s = x + x_residual (rounded
    to x's dtype, as the unfused add stores it), y = rmsnorm(s) @ dequant(w).T (+ bias)
    -> (y [T, N], s [T, K]). ``norm`` is ("rmsnorm", weight [K], None, eps). Raises
    ValueError naming the operand where the kernel cannot take it."""
    why = check(x, w, scale, bias, None, norm, x_residual)
    if why is not None:
        raise ValueError(f"sbi_norm_linear_cuda: {why}")
    return run(x, w, scale, bias, None, norm, config, pdl, x_residual)


def run(x, w, scale, bias, residual, norm, config, pdl: bool,
        x_residual=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The launch(es) of sbi_linear_cuda / sbi_norm_linear_cuda without their operand
    checks, for callers that made them (``check``, or ``supports`` once per key and then
    ``layout``: ``kernels.linear.select``): -> (y, x + x_residual or None)."""
    t, k = x.shape
    n = w.shape[0]
    int8 = w.dtype == torch.int8
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    cfg = config or sbi_cuda_config(t, n, k, sms, int8)
    bn, warps, unroll, split = cfg["bn"], cfg["warps"], cfg["unroll"], cfg["split_k"]
    step = warps * 32 * (16 if int8 else 8)
    k_span = -(-k // (split * step)) * step
    split = -(-k // k_span)  # no empty splits
    kind, g, gb, eps = norm if norm is not None else (None, None, None, 0.0)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    target = out if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    tiles = -(-n // bn)
    blocks = min(tiles, cfg["persist"] * sms) if cfg.get("persist") else tiles  # persist: blocks per SM
    opts = options(_tp(t), bn, warps, unroll, int8, DTYPES[x.dtype], NORMS[kind], split > 1, x_residual is not None,
                   blocks < tiles, int8 and cfg.get("unit", False),
                   resident(kind is not None, _tp(t), k, warps, unroll, int8, split), cfg.get("pipe", False))
    stride_res = residual.stride(0) if residual is not None else 0
    x_sum = torch.empty_like(x_residual) if x_residual is not None else None
    launch(x.device, SOURCE, "sbi_gemm", opts, (blocks, split), warps * 32,
           (ptr(x), ptr(w), ptr(scale), ptr(g), ptr(gb), ptr(bias if split == 1 else None),
            ptr(residual if split == 1 else None), ptr(target), np.int32(t), np.int32(n), np.int32(k),
            np.float32(eps), np.int64(x.stride(0)), np.int64(w.stride(0)), np.int64(stride_res),
            np.int64(out.stride(0)), np.int32(k_span), ptr(x_residual), ptr(x_sum)), pdl=pdl)
    if split > 1:
        launch(x.device, SOURCE, "splitk_reduce", opts, (-(-n // 256), t), 256,
               (ptr(target), ptr(bias), ptr(residual), ptr(out), np.int32(split), np.int32(t), np.int32(n),
                np.int64(stride_res), np.int64(out.stride(0))), pdl=pdl)
    return out, x_sum


def compile_all(arch: str = "sm_90") -> int:
    """Compiles the kernels for ``arch`` through NVRTC (no GPU needed) over a set of
    combinations that takes every value of every compile-time parameter; returns how
    many. Raises RuntimeError with the compiler log on a failure."""
    tiles = ((1, 4, 4), (2, 4, 2), (4, 8, 4), (8, 4, 1))  # (bn, warps, unroll)
    count = 0
    for i, (tp, int8, dt) in enumerate(itertools.product((1, 2, 4, 8, 16), (False, True), DTYPES.values())):
        bn, warps, unroll = tiles[i % len(tiles)]
        norm = i % len(NORMS)
        launch_flags = (f"-DPDL_EARLY={i // 4 % 2}",)  # what ``launch`` adds, or a kernel pins
        compile_check(SOURCE, options(tp, bn, warps, unroll, int8, dt, norm, i % 2 == 1, norm == 1 and i % 4 < 2,
                                      i % 3 == 0, int8 and i % 8 < 4, pipe=i % 5 < 2) + launch_flags, arch,
                      "sbi_cuda.cu")
        count += 1
    # RESIDENT (normed activations kept in registers): (tp, int8, dt, norm, norm_res, persist, unroll, warps)
    for tp, int8, dt, norm, norm_res, persist, unroll, warps in (
            (1, False, 0, 1, True, True, 1, 8), (1, True, 1, 2, False, False, 2, 4), (2, False, 1, 1, True, False, 2, 4),
            (4, False, 0, 2, False, True, 1, 8)):
        compile_check(SOURCE, options(tp, 4, warps, unroll, int8, dt, norm, False, norm_res, persist, int8, True)
                      + (f"-DPDL_EARLY={int(persist)}",), arch, "sbi_cuda.cu")
        count += 1
    return count
