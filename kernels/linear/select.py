"""The dense linear layer, routed per shape to the fastest measured implementation.

At decode sizes (at most ``SMALL_T`` rows) on a GPU, the linear tables (``kernels.tuning``,
written by ``scripts/bench_dense.py --write-table``, nothing is timed while serving) name the
winner per device, weight dtype, weight shape and row bucket:
- ``LinearCublas``: ``torch.nn.functional.linear`` (full-precision weights only);
- ``LinearTriton``: ``kernels.moe.triton.linear_triton``, the grouped GEMM with one group;
- ``LinearSbi``: ``kernels.sbi_linear``, SBI-GeMM in Triton;
- ``LinearCuda``: SBI-GeMM in CUDA C++ (``kernels.linear.sbi_cuda``) with the launch configuration
  that measured fastest. A ``pinned`` one was chosen by timing the decode step itself; the
  table writer leaves it in place.
The lookup is ``tuning.Tables.lookup``'s (a same-chip device's entry where the device has
none of its own). Without any, full-precision weights use cuBLAS and int8 weights SBI-GeMM
(one launch with its epilogue, or two with split-K; it won nearly every int8 entry measured).
A CUDA entry runs only where the kernel states it can take the operands (``cuda_reason``:
``sbi_cuda.supports`` once per layer shape, dtypes, device and T, ``sbi_cuda.layout`` each
call); elsewhere the next backend runs, SBI-GeMM in Triton (for ``norm_linear``'s fused
entry: the norm launch and ``dense_linear``), without an exception.
Larger batches, and every CPU call, take cuBLAS / the reference. The GPU GEMMs (Triton,
CuPy) are imported in the branches that run them, so a CPU-only install needs neither.

``norm_linear`` is the decode step's residual add + RMSNorm + GEMM: one launch where the
table picked the CUDA SBI-GeMM with ``norm`` set (its prologue adds and normalises; set
where the decode step measured it faster: Qwen3-30B-A3B's bf16 and int8 QKV and
DeepSeek-V2-Lite's bf16 merged input projections at batch 1, not OLMoE's), else the norm
launch and ``dense_linear``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import tuning
from kernels.linear.reference import sbi_linear_ref
from kernels.norm.reference import rms_norm_ref
from kernels.tuning import LinearCublas, LinearCuda, LinearEntry, LinearSbi

SMALL_T = 16
BUCKETS = (1, 2, 4, 8, 16)  # the row buckets bench_dense --write-table stores


@functools.lru_cache(maxsize=4096)  # on the decode path: keep it a lookup
def choice(device: torch.device, n: int, k: int, wdtype: torch.dtype, t: int) -> LinearEntry:
    """The implementation for t rows of x @ W.T, W [n, k] of ``wdtype``, on ``device``: the
    linear table's entry (``tuning.Tables.lookup``), else cuBLAS for full-precision weights
    and SBI-GeMM for int8."""
    heuristic = LinearSbi() if wdtype == torch.int8 else LinearCublas()
    return tuning.TABLES.lookup("linear", tuning.device_name(device), tuning.dtype_name(wdtype),
                                tuning.linear_shape(n, k), t, lambda: heuristic)


_MISSING = object()
_CUDA_SUPPORT: dict = {}  # what sbi_cuda.supports reads (see cuda_reason) -> its answer


def _sig(z: torch.Tensor | None) -> tuple | None:
    return None if z is None else (z.dtype, tuple(z.shape))


def cuda_reason(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                norm: tuple | None = None, x_residual: torch.Tensor | None = None) -> str | None:
    """Why SBI-GeMM in CUDA cannot take these operands (None: it can); x2 [T, K], ``norm``
    and ``x_residual`` as ``sbi_cuda.sbi_norm_linear_cuda`` takes them. ``sbi_cuda.supports``
    runs once per key of what it reads (device, dtypes and shapes: one layer at one T), so a
    decode step only looks its answer up; ``sbi_cuda.layout`` (addresses and strides, which
    a view may change) runs every call."""
    from kernels.linear import sbi_cuda

    key = (x2.device, x2.dtype, tuple(x2.shape), weight.device, _sig(weight), _sig(scale), _sig(bias),
           None if norm is None else (norm[0], norm[1].dtype, _sig(norm[2])), _sig(x_residual))
    why = _CUDA_SUPPORT.get(key, _MISSING)
    if why is _MISSING:
        if len(_CUDA_SUPPORT) > 4096:  # bounded: the keys are a model's layer shapes times T <= SMALL_T
            _CUDA_SUPPORT.clear()
        why = _CUDA_SUPPORT[key] = sbi_cuda.supports(x2, weight, scale, bias, None, norm, x_residual)
    return why or sbi_cuda.layout(x2, weight, scale, bias, None, norm, x_residual)


def backend(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
            bias: torch.Tensor | None = None) -> LinearEntry:
    """The implementation that runs x2 [T, K] @ W.T at decode sizes: the table's (``choice``),
    except that a CUDA entry whose kernel cannot take these operands (alignment, dtype,
    ``cuda_reason``) gives way to the next, SBI-GeMM in Triton."""
    pick = choice(x2.device, weight.shape[0], weight.shape[1], weight.dtype, x2.shape[0])
    if isinstance(pick, LinearCuda) and cuda_reason(x2, weight, scale, bias) is not None:
        return LinearSbi()
    return pick


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N]; W [N, K] full precision, or int8 with per-row
    ``scale`` [N]. ``pdl``: our GPU kernels launch with programmatic dependent launch
    where the device has it (``kernels.pdl``)."""
    int8 = weight.dtype == torch.int8
    if int8 and scale is None:
        raise ValueError("weight: int8 needs its per-output-channel scale")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or rows > SMALL_T or rows == 0:
        if not int8:
            return F.linear(x, weight, bias)
        if x.is_cuda:
            from kernels.moe.triton import linear_triton
            y = linear_triton(x, weight, scale, pdl)
        else:
            y = sbi_linear_ref(x, weight, scale)
        return y + bias if bias is not None else y
    x2 = x.reshape(rows, x.shape[-1])  # [T, K]
    pick = backend(x2, weight, scale, bias)
    if isinstance(pick, LinearCuda):
        from kernels.linear import sbi_cuda
        y = sbi_cuda.run(x2, weight, scale, bias, None, None, pick.kernel_args(), pdl)[0]
        return y.view(*x.shape[:-1], weight.shape[0])
    if isinstance(pick, LinearCublas):
        return F.linear(x, weight, bias)
    if isinstance(pick, LinearSbi):
        from kernels.linear.sbi_triton import sbi_linear_triton
        return sbi_linear_triton(x2, weight, scale, bias, pdl=pdl).view(*x.shape[:-1], weight.shape[0])
    from kernels.moe.triton import linear_triton
    y = linear_triton(x, weight, scale, pdl)
    return y + bias if bias is not None else y


def norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual, y = rmsnorm(s) @ W.T (+ bias) -> (y [..., N], s [..., K])."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.is_cuda and 0 < rows <= SMALL_T and x.shape == residual.shape:
        pick = choice(x.device, weight.shape[0], weight.shape[1], weight.dtype, rows)
        if isinstance(pick, LinearCuda) and pick.norm:
            x2, r2, norm = x.reshape(rows, -1), residual.reshape(rows, -1), ("rmsnorm", norm_weight, None, eps)
            # Operands the fused launch cannot take run the two launches below.
            if cuda_reason(x2, weight, scale, bias, norm, r2) is None:
                from kernels.linear import sbi_cuda
                y, s = sbi_cuda.run(x2, weight, scale, bias, None, norm, pick.kernel_args(), pdl, r2)
                return y.view(*x.shape[:-1], weight.shape[0]), s.view(x.shape)
    if x.is_cuda:
        from kernels.norm.triton import rms_norm_triton
        h, s = rms_norm_triton(x, norm_weight, eps, residual, pdl)
    else:
        h, s = rms_norm_ref(x, norm_weight, eps, residual)
    return dense_linear(h, weight, bias, scale, pdl), s
