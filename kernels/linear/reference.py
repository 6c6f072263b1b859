"""Plain-torch reference for the small-batch GEMM with deep fusion (SBI-GeMM): what
``kernels.sbi_linear`` runs on a CPU, and what ``kernels.linear.sbi_triton`` and
``kernels.linear.sbi_cuda`` must match.

Shape letters: T rows, K in, N out.
"""
from __future__ import annotations

import torch


def sbi_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                   norm: tuple | None = None) -> torch.Tensor:
    """y [T, N] = norm(x [T, K]) @ dequant(w [N, K]).T (+ bias [N]) (+ residual [T, N]),
    computed in float32 (float64 inputs stay float64) with torch ops."""
    ct = torch.promote_types(x.dtype, torch.float32)
    a = x.to(ct)
    if norm is not None:
        kind, g, gb, eps = norm
        if kind == "layernorm":
            a = torch.nn.functional.layer_norm(a, (a.shape[-1],), g.to(ct), None if gb is None else gb.to(ct), eps)
        else:
            a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * g.to(ct)
    wf = w.to(ct) if scale is None else w.to(ct) * scale.to(ct)[:, None]
    y = a @ wf.t()
    if bias is not None:
        y = y + bias.to(ct)
    if residual is not None:
        y = y + residual.to(ct)
    return y.to(x.dtype)
