"""The dense linear layer, routed per shape to the fastest measured implementation.

At decode sizes (at most ``SMALL_T`` rows) on a GPU, ``kernels/configs/dense.json`` (written
by ``scripts/bench_dense.py --write-table``, nothing is timed while serving) names the
winner per device, weight shape, weight dtype and row bucket:
- "cublas": ``torch.nn.functional.linear`` (full-precision weights only);
- "triton": ``kernels.linear_triton``, the grouped GEMM with one group;
- "sbi": ``kernels.sbi_linear``, SBI-GeMM in Triton;
- {"backend": "cuda", bn, warps, unroll, split_k}: SBI-GeMM in CUDA C++
  (``kernels.sbi_cuda``) with the launch configuration that measured fastest. One with a
  "pinned" reason was chosen by timing the decode step itself; the table writer leaves it
  in place.
A device with no entry of its own for a shape and bucket takes one of the same chip's
(``moe_triton.SAME_CHIP``). Without any, full-precision weights use cuBLAS and int8 weights
SBI-GeMM (one launch with its epilogue, or two with split-K; it won nearly every int8
entry measured).
Larger batches, and every CPU call, take cuBLAS / the reference. The GPU GEMMs (Triton,
CuPy) are imported in the branches that run them, so a CPU-only install needs neither.

``norm_linear`` is the decode step's residual add + RMSNorm + GEMM: one launch where the
table picked the CUDA SBI-GeMM with ``"norm": true`` (its prologue adds and normalises; set
where the decode step measured it faster: Qwen3-30B-A3B's bf16 and int8 QKV at batch 1, not
OLMoE's), else the norm launch and ``dense_linear``.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.dense_ref import rms_norm_ref, sbi_linear_ref

TABLE_FILE = Path(__file__).with_name("configs") / "dense.json"
SMALL_T = 16
BUCKETS = (1, 2, 4, 8, 16)
CHOICES = ("cublas", "triton", "sbi")


def table_key(n: int, k: int, wdtype: torch.dtype) -> str:
    return f"N{n}:K{k}:{str(wdtype).removeprefix('torch.')}"


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    return json.loads(TABLE_FILE.read_text()) if TABLE_FILE.is_file() else {}


@functools.lru_cache(maxsize=4096)
def _choice(device: torch.device, n: int, k: int, wdtype: torch.dtype, t: int) -> str | tuple:
    from kernels.moe_triton import table_entries

    bucket = next(b for b in BUCKETS if b >= t)
    picked = next((e[str(bucket)] for e in table_entries(_table(), device, table_key(n, k, wdtype))
                   if str(bucket) in e), None)
    if isinstance(picked, dict) and picked.get("backend") == "cuda":
        return tuple(sorted(picked.items()))  # hashable for the cache
    if picked in CHOICES and not (picked == "cublas" and wdtype == torch.int8):
        return picked
    return "sbi" if wdtype == torch.int8 else "cublas"


def choice(device: torch.device, n: int, k: int, wdtype: torch.dtype, t: int) -> str | dict:
    """The implementation for t rows of x @ W.T, W [n, k] of ``wdtype``, on ``device``: a
    name from CHOICES, or the CUDA SBI-GeMM's launch configuration (a dict)."""
    picked = _choice(device, n, k, wdtype, t)
    return dict(picked) if isinstance(picked, tuple) else picked


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N]; W [N, K] full precision, or int8 with per-row
    ``scale`` [N]."""
    int8 = weight.dtype == torch.int8
    if int8 and scale is None:
        raise ValueError("weight: int8 needs its per-output-channel scale")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or rows > SMALL_T or rows == 0:
        if not int8:
            return F.linear(x, weight, bias)
        if x.is_cuda:
            from kernels.moe_triton import linear_triton
            y = linear_triton(x, weight, scale)
        else:
            y = sbi_linear_ref(x, weight, scale)
        return y + bias if bias is not None else y
    pick = choice(x.device, weight.shape[0], weight.shape[1], weight.dtype, rows)
    if isinstance(pick, dict):
        from kernels import sbi_cuda
        try:
            y = sbi_cuda.sbi_linear_cuda(x.reshape(rows, x.shape[-1]), weight, scale, bias, config=pick)
            return y.view(*x.shape[:-1], weight.shape[0])
        except ValueError:  # operands the CUDA kernel cannot take (alignment, dtype): the Triton version
            pick = "sbi"
    if pick == "cublas":
        return F.linear(x, weight, bias)
    if pick == "sbi":
        from kernels.sbi_gemm import sbi_linear_triton
        x2 = x.reshape(rows, x.shape[-1])
        return sbi_linear_triton(x2, weight, scale, bias).view(*x.shape[:-1], weight.shape[0])
    from kernels.moe_triton import linear_triton
    y = linear_triton(x, weight, scale)
    return y + bias if bias is not None else y


def norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual, y = rmsnorm(s) @ W.T (+ bias) -> (y [..., N], s [..., K])."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.is_cuda and 0 < rows <= SMALL_T and x.shape == residual.shape:
        pick = choice(x.device, weight.shape[0], weight.shape[1], weight.dtype, rows)
        if isinstance(pick, dict) and pick.get("norm"):
            from kernels import sbi_cuda
            try:
                y, s = sbi_cuda.sbi_norm_linear_cuda(x.reshape(rows, -1), residual.reshape(rows, -1),
                                                     ("rmsnorm", norm_weight, None, eps), weight, scale, bias, pick)
                return y.view(*x.shape[:-1], weight.shape[0]), s.view(x.shape)
            except ValueError:  # operands the fused launch cannot take: the two launches
                pass
    if x.is_cuda:
        from kernels.norm import rms_norm_triton
        h, s = rms_norm_triton(x, norm_weight, eps, residual)
    else:
        h, s = rms_norm_ref(x, norm_weight, eps, residual)
    return dense_linear(h, weight, bias, scale), s
