"""Dense linear layers: y = x @ W.T (+ bias), W full precision or int8 with per-output-channel
scales; ``norm_linear`` with the residual add and RMSNorm in front; ``sbi_linear`` the
small-batch GEMM with deep fusion (DeepSpeed-Inference III: y = norm(x) @ W.T (+ bias)
(+ residual)).

Shape letters: T rows, K in, N out.

Backends: a CPU tensor runs torch's linear or the plain-torch reference (``reference.py``).
On a GPU, ``dense_linear`` and ``norm_linear`` (``select.py``) take at decode sizes the
implementation the linear tables (``kernels.tuning``) name for the shape: cuBLAS, the
grouped GEMM with one group (``kernels.moe.triton.linear_triton``), SBI-GeMM in Triton
(``sbi_triton.py``) or SBI-GeMM in CUDA C++ (``sbi_cuda.py``, compiled through CuPy);
larger batches take cuBLAS. ``sbi_linear`` runs SBI-GeMM in Triton on a GPU. Each GPU
backend is imported at the first call that runs it.
"""
from __future__ import annotations

from kernels.linear.reference import sbi_linear_ref
from kernels.linear.select import dense_linear, norm_linear


def sbi_linear(x, w, scale=None, bias=None, residual=None, norm=None, *, pdl=True):
    """The small-batch GEMM with deep fusion: y = norm(x) @ W.T (+ bias) (+ residual), x [T, K]
    with T <= 64, W [N, K] (int8 with per-row ``scale``); ``norm`` = (kind, weight, bias, eps)."""
    if x.is_cuda:
        from kernels.linear.sbi_triton import sbi_linear_triton
        return sbi_linear_triton(x, w, scale, bias, residual, norm, pdl=pdl)
    return sbi_linear_ref(x, w, scale, bias, residual, norm)


__all__ = ["dense_linear", "norm_linear", "sbi_linear"]
