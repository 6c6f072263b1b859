"""Kernels: each public op sits behind one function; ``*_ref`` is the plain-torch math it
must match. Until a fast backend (Triton, CuPy) exists for an op on a device, the
reference is what runs. This package depends on nothing else of ours.

Only torch is needed to import it and to run every op on a CPU: the references live in
``moe_ref`` and ``dense_ref``, and a GPU backend module (anything importing Triton or CuPy)
is imported where a GPU path first runs it: inside the op's ``is_cuda`` branch, or at the
first access of its ``kernels.<name>_triton`` attribute (``__getattr__`` below). On a GPU
without Triton that import fails as it would at the top of a module, naming ``triton``.
"""
from __future__ import annotations

import importlib
import sys
import types

import torch

from kernels.dense_ref import (argmax_ref, decode_attention_ref, paged_decode_attention_ref, qkv_attention_ref,
                               qkv_decode_ref, qkv_decode_supported, rms_norm_ref, rms_norm_router_ref, sbi_linear_ref)
from kernels.linear_select import dense_linear, norm_linear
from kernels.moe_ref import (ACTIVATIONS, TAG_INTS, dequantize_ref, dispatch_rows_ref, expert_ffn_ref,
                             fused_moe_ref, gather_rows_ref, grouped_ffn_ref, grouped_topk_ref, quantize_int8,
                             row_pair_ref, scatter_rows_ref, token_maps_ref, topk_gating_ref)

# The GPU backends' names, by the module that defines them (kernels.<module>.<name>):
# nothing imports those modules until a name is used.
_BACKENDS = {
    "argmax": ("argmax_triton",),
    "decode_attention": ("decode_attention_triton", "paged_decode_attention_triton"),
    "decode_context": ("decode_context_triton",),
    "gating": ("grouped_topk_triton", "topk_gating_triton"),
    "layout": ("dispatch_rows_triton", "gather_rows_triton", "scatter_rows_triton"),
    "maps": ("token_maps_triton",),
    "moe_triton": ("fused_moe_triton", "linear_triton"),
    "norm": ("ROUTER_MAX_ROWS", "rms_norm_router_triton", "rms_norm_triton"),
    "qkv_attention": ("qkv_attention_triton",),
    "qkv_decode": ("qkv_decode_triton",),
    "route": ("route_triton",),
    "sbi_cuda": ("sbi_linear_cuda",),
    "sbi_gemm": ("sbi_linear_triton",),
}
_BACKEND_OF = {name: module for module, names in _BACKENDS.items() for name in names}


def __getattr__(name: str):
    """``kernels.<name>`` of a GPU backend (PEP 562): its module is imported at the first
    access, and the name is bound here so later accesses are plain lookups."""
    if name not in _BACKEND_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"kernels.{_BACKEND_OF[name]}")
    globals()[name] = value = getattr(module, name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_BACKEND_OF})


class _Package(types.ModuleType):
    """This package's module type. Importing a submodule binds it on its package under its
    own name, and five backend modules are named as the op they implement (kernels/argmax.py
    and ``kernels.argmax``). Imported after the ops are defined, at first use, they would
    replace them: here the op keeps its name (``importlib.import_module("kernels.argmax")``
    still returns the module, as before)."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and isinstance(self.__dict__.get(name), types.FunctionType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def topk_gating(logits, k, score="softmax", renormalize=True, *, pdl=True):
    """-> expert ids [T, k] int32, weights [T, k] float32 (see ``topk_gating_ref``)."""
    if logits.is_cuda:
        from kernels.gating import topk_gating_triton
        return topk_gating_triton(logits, k, score, renormalize, pdl)
    return topk_gating_ref(logits, k, score, renormalize)


def route(logits, k, score="softmax", renormalize=True, *, pdl=True):
    """Gating and dropless maps together (one launch at decode sizes on a GPU):
    -> ids [T, k], weights [T, k], maps = (offsets [E + 1], rows [T, k], row_pair [T * k])."""
    if logits.is_cuda:
        from kernels.route import route_triton
        return route_triton(logits, k, score, renormalize, pdl)
    ids, weights = topk_gating_ref(logits, k, score, renormalize)
    offsets, rows = token_maps_ref(ids, logits.shape[1])
    return ids, weights, (offsets, rows, row_pair_ref(rows))


def grouped_topk(logits, bias, k, n_group, topk_group, score="sigmoid", renormalize=True,
                 routed_scaling_factor=1.0, *, pdl=True):
    """DeepSeek-V3's bias-corrected grouped top-k (see ``grouped_topk_ref``)."""
    if logits.is_cuda:
        from kernels.gating import grouped_topk_triton
        return grouped_topk_triton(logits, bias, k, n_group, topk_group, score, renormalize, routed_scaling_factor,
                                   pdl)
    return grouped_topk_ref(logits, bias, k, n_group, topk_group, score, renormalize, routed_scaling_factor)


def token_maps(expert_ids, num_experts, capacity=None, *, pdl=True):
    """-> offsets [E + 1], rows [T, k] (see ``token_maps_ref``)."""
    if expert_ids.is_cuda:
        from kernels.maps import token_maps_triton
        return token_maps_triton(expert_ids, num_experts, capacity, pdl)[:2]
    return token_maps_ref(expert_ids, num_experts, capacity)


def scatter_rows(x, rows, out=None, *, pdl=True):
    if x.is_cuda:
        from kernels.layout import scatter_rows_triton
        return scatter_rows_triton(x, rows, out, pdl)
    return scatter_rows_ref(x, rows, out)


def gather_rows(ys, rows, weights, limit=None, *, pdl=True):
    if ys.is_cuda:
        from kernels.layout import gather_rows_triton
        return gather_rows_triton(ys, rows, weights, limit, pdl)
    return gather_rows_ref(ys, rows, weights, limit)


def dispatch_rows(x, rows, expert_ids, experts_per_rank, out, *, pdl=True):
    """The expert-parallel send buffer, each row tagged with its local expert (see
    ``dispatch_rows_ref``)."""
    if x.is_cuda:
        from kernels.layout import dispatch_rows_triton
        return dispatch_rows_triton(x, rows, expert_ids, experts_per_rank, out, pdl)
    return dispatch_rows_ref(x, rows, expert_ids, experts_per_rank, out)


def _check_moe_args(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale):
    _check_experts(x, w13, w2, activation, w13_scale, w2_scale)
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} / topk_weights "
                         f"{list(topk_weights.shape)}: expected both [T={x.shape[0]}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected int32 or int64, got {topk_ids.dtype}")


def _check_experts(x, w13, w2, activation, w13_scale, w2_scale):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, H], got shape {list(x.shape)}")
    h = x.shape[1]
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 / w2: expected [E, 2F, H] / [E, H, F], got "
                         f"{list(w13.shape)} / {list(w2.shape)}")
    e, f = w2.shape[0], w2.shape[2]
    rows13 = 2 * f if activation == "silu" else f
    if tuple(w13.shape) != (e, rows13, h) or w2.shape[1] != h:
        raise ValueError(f"w13 {list(w13.shape)} / w2 {list(w2.shape)}: expected "
                         f"[E, {'2F' if activation == 'silu' else 'F'}, H={h}] / [E, H={h}, F]")
    for name, w, s in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if (w.dtype == torch.int8) != (s is not None):
            raise ValueError(f"{name}_scale: expected per-channel scales exactly when {name} is int8")
        if s is not None and tuple(s.shape) != tuple(w.shape[:2]):
            raise ValueError(f"{name}_scale {list(s.shape)}: expected {list(w.shape[:2])}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              capacity: int | None = None, maps: tuple | None = None, *, pdl: bool = True) -> torch.Tensor:
    """MoE expert computation on one device: x [T, H] -> [T, H].

    w13 [E, 2F, H] holds each expert's gate rows then up rows (Hugging Face / vLLM layout;
    [E, F, H] for the plain GeLU experts of GPT-style models), w2 [E, H, F]. int8 weights
    come with per-output-channel scales ``w13_scale [E, 2F]``, ``w2_scale [E, H]``
    (``quantize_int8``). ``capacity`` drops pairs past that many per expert (None: dropless).
    ``maps`` (from ``route``) saves recomputing the maps of ``topk_ids`` on a GPU. ``pdl``: the
    GPU kernels launch with programmatic dependent launch where the device has it
    (``kernels.pdl``; every op here takes it).
    """
    _check_moe_args(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale)
    if x.is_cuda:
        from kernels.moe_triton import fused_moe_triton
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale,
                                capacity, maps=maps, pdl=pdl)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, capacity)


def decode_attention(q, k, v, visible, scale=None):
    """One query token per row over a KV cache: q [B, Hq, D], k / v [B, Hkv, S, D], visible
    [B, S] bool -> [B, Hq, D] (split over the keys on a GPU, GQA-aware)."""
    if q.is_cuda:
        from kernels.decode_attention import decode_attention_triton
        return decode_attention_triton(q, k, v, visible, scale)
    return decode_attention_ref(q, k, v, visible, scale)


def paged_decode_attention(q, k, v, slots, visible, scale=None):
    """``decode_attention`` over a paged cache: k / v pools [N, Hkv, D], slots [B, S] int64
    the pool row of each row's key s, visible [B, S] bool -> [B, Hq, D]. A GPU reads the keys
    in place, without gathering them into a copy."""
    if q.is_cuda:
        from kernels.decode_attention import paged_decode_attention_triton
        return paged_decode_attention_triton(q, k, v, slots, visible, scale)
    return paged_decode_attention_ref(q, k, v, slots, visible, scale)


def argmax(x, *, pdl=True):
    """x [B, V] -> [B] int64: first index of each row's maximum (split over the SMs on a GPU)."""
    if x.is_cuda:
        from kernels.argmax import argmax_triton
        return argmax_triton(x, pdl)
    return argmax_ref(x)


def rms_norm(x, weight, eps, residual=None, *, pdl=True):
    """RMSNorm over the last dimension in one launch on a GPU; with ``residual`` the add
    before it is fused too: -> norm(x + residual), x + residual."""
    if x.is_cuda:
        from kernels.norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual, pdl)
    return rms_norm_ref(x, weight, eps, residual)


def rms_norm_router(x, residual, norm_w, eps, router_w, gating=None, *, pdl=True):
    """The MoE layer's entry in one launch on a GPU (T <= 16 rows): h = RMSNorm(x + residual),
    the new residual stream x + residual, and the router logits h @ router_w.T. ``gating``
    (k, score, renormalize): also the top-k table of those logits (as ``topk_gating``),
    ids [T, k] and weights [T, k], from the same launch."""
    if x.is_cuda:
        from kernels.norm import rms_norm_router_triton
        return rms_norm_router_triton(x, residual, norm_w, eps, router_w, gating, pdl)
    return rms_norm_router_ref(x, residual, norm_w, eps, router_w, gating)


def qkv_decode(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos=None, sin=None,
               qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, *, pdl=True):
    """The QKV epilogue of a decode step (qkv [B, W]) or a prefill (qkv [B, T, W]) in one
    launch on a GPU: q/k norms, clip, rotary, and the KV-cache append at slots ``slot`` ..
    -> q [B, Hq, T, D] (see ``qkv_decode_ref``)."""
    if qkv.is_cuda:
        from kernels.qkv_decode import qkv_decode_triton
        return qkv_decode_triton(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos, sin, qk_norm,
                                 q_norm_w, k_norm_w, eps, clip, pdl)
    return qkv_decode_ref(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos, sin, qk_norm, q_norm_w,
                          k_norm_w, eps, clip)


def qkv_attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos=None, sin=None,
                  qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, *, pdl=True):
    """A static-shape decode step's attention from the QKV GEMM's output qkv [B, W] (one
    token per row, cache slot ``slot`` a 0-d tensor, additive mask ``bias`` of B x S): the
    QKV epilogue, the cache append and the attention in one launch on a GPU -> [B, Hq, D]
    (see ``qkv_attention_ref``)."""
    if qkv.is_cuda:
        from kernels.qkv_attention import qkv_attention_triton
        return qkv_attention_triton(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos, sin,
                                    qk_norm, q_norm_w, k_norm_w, eps, clip, pdl=pdl)
    return qkv_attention_ref(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos, sin, qk_norm,
                             q_norm_w, k_norm_w, eps, clip)


def qkv_attention_fits(b: int, hq: int, hkv: int, d: int, s: int, sms: int) -> bool:
    """Whether ``qkv_attention``'s one launch suits a decode step of B rows, Hq / Hkv heads,
    head dim D and S cache slots on a GPU of ``sms`` SMs (``kernels.qkv_attention.fits``)."""
    from kernels.qkv_attention import fits
    return fits(b, hq, hkv, d, s, sms)


def sbi_linear(x, w, scale=None, bias=None, residual=None, norm=None, *, pdl=True):
    """The small-batch GEMM with deep fusion: y = norm(x) @ W.T (+ bias) (+ residual), x [T, K]
    with T <= 64, W [N, K] (int8 with per-row ``scale``); ``norm`` = (kind, weight, bias, eps)."""
    if x.is_cuda:
        from kernels.sbi_gemm import sbi_linear_triton
        return sbi_linear_triton(x, w, scale, bias, residual, norm, pdl=pdl)
    return sbi_linear_ref(x, w, scale, bias, residual, norm)


__all__ = [
    "decode_attention", "decode_attention_ref", "decode_attention_triton",
    "paged_decode_attention", "paged_decode_attention_ref", "paged_decode_attention_triton",
    "argmax", "argmax_ref", "argmax_triton", "decode_context_triton",
    "rms_norm", "rms_norm_ref", "rms_norm_triton", "ROUTER_MAX_ROWS",
    "rms_norm_router", "rms_norm_router_ref", "rms_norm_router_triton",
    "qkv_decode", "qkv_decode_ref", "qkv_decode_supported", "qkv_decode_triton",
    "qkv_attention", "qkv_attention_fits", "qkv_attention_ref", "qkv_attention_triton",
    "dense_linear", "norm_linear", "linear_triton", "sbi_linear", "sbi_linear_cuda", "sbi_linear_ref", "sbi_linear_triton",
    "fused_moe", "fused_moe_ref", "fused_moe_triton", "quantize_int8", "dequantize_ref",
    "route", "route_triton", "row_pair_ref",
    "topk_gating", "topk_gating_ref", "topk_gating_triton",
    "grouped_topk", "grouped_topk_ref", "grouped_topk_triton",
    "token_maps", "token_maps_ref", "token_maps_triton",
    "scatter_rows", "scatter_rows_ref", "scatter_rows_triton",
    "gather_rows", "gather_rows_ref", "gather_rows_triton",
    "dispatch_rows", "dispatch_rows_ref", "dispatch_rows_triton", "TAG_INTS",
    "grouped_ffn_ref", "expert_ffn_ref",
]
