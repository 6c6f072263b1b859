"""Kernels: each public operator sits behind one function; its package's ``reference.py``
holds the plain-torch math (``*_ref``) the fast backends must match. This package depends
on nothing else of ours.

One package per operator family, each an ``__init__`` with the ops, a ``reference.py`` and
its GPU backends (Triton; CUDA C++ compiled through CuPy):

  routing    topk_gating, grouped_topk, route, cold_pairs
  layout     token_maps, scatter_rows, gather_rows, dispatch_rows
  moe        fused_moe, gated_mlp, quantize_int8, quantize_mxfp4
  linear     dense_linear, norm_linear, sbi_linear
  norm       rms_norm, rms_norm_router, qk_sum_squares, qk_norm_apply
  attention  paged_decode_attention, paged_decode_partial, merge_partials, paged_latent_decode, latent_prologue,
             latent_output, qkv_decode, qkv_attention
  argmax     argmax

Shared by them: ``options`` (what a user may set), ``pdl`` (programmatic dependent launch),
``tuning`` (the typed tables in each operator's ``tables/``), ``launcher`` (cached Triton launches),
``cuda_common`` (the CUDA C++ sources in ``cuda/``, compilation and launch).

Only torch is needed to import this package and to run every op on a CPU: an op runs its
reference for a CPU tensor and imports its GPU backend module (anything importing Triton
or CuPy) inside its ``is_cuda`` branch, the first time a CUDA tensor reaches it. On a GPU
without Triton that import fails as it would at the top of a module, naming ``triton``.
Callers that need a backend itself import it from its module (e.g.
``from kernels.moe.triton import linear_triton``).
"""
from __future__ import annotations

from kernels.argmax import argmax
from kernels.attention import (latent_output, latent_prologue, merge_partials, paged_decode_attention,
                               paged_decode_partial, paged_latent_decode, qkv_attention, qkv_decode)
from kernels.layout import dispatch_rows, gather_rows, scatter_rows, token_maps
from kernels.linear import dense_linear, norm_linear, sbi_linear
from kernels.moe import fused_moe, gated_mlp, quantize_int8, quantize_mxfp4
from kernels.norm import qk_norm_apply, qk_sum_squares, rms_norm, rms_norm_router
from kernels.routing import cold_pairs, grouped_topk, route, topk_gating

__all__ = [
    "topk_gating", "grouped_topk", "route", "cold_pairs",
    "token_maps", "scatter_rows", "gather_rows", "dispatch_rows",
    "fused_moe", "gated_mlp", "quantize_int8", "quantize_mxfp4",
    "dense_linear", "norm_linear", "sbi_linear",
    "rms_norm", "rms_norm_router", "qk_sum_squares", "qk_norm_apply",
    "paged_decode_attention", "paged_decode_partial", "merge_partials", "paged_latent_decode", "latent_prologue",
    "latent_output", "qkv_decode", "qkv_attention",
    "argmax",
]
