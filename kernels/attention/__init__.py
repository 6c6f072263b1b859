"""Attention on the decode path: one query token per row over a paged KV cache, and the
QKV epilogue after the QKV GEMM (q / k norms, clip,
rotary, the KV-cache append) and a decode step's epilogue and attention in one launch.

Shape letters: B rows, T tokens per row, Hq / Hkv query / KV heads, D head dim, S key
slots per row, N pool rows of a paged cache, W = (Hq + 2 Hkv) * D the QKV width.

Backends: a CPU tensor runs the plain-torch reference (``reference.py``); a CUDA tensor
runs the Triton kernels, imported at that first call: ``decode.py`` (decode attention,
split over the keys; its latent-attention form), ``qkv_decode_triton.py`` (the epilogue) and
``qkv_attention_triton.py`` (epilogue and attention in one launch, where
``qkv_attention_fits``), ``latent_triton.py`` (latent attention's decode steps
before and after its attention: the absorbed query and epilogue, the value
up-projection). A paged decode step's shared inputs in one launch are
``paged_context.py``'s (``moe_infer.model.Transformer.paged_decode_context``). No module
here is named as an op of this package: importing it would rebind the package's attribute
of that name from the function to the module.
"""
from __future__ import annotations

import torch

from kernels.attention.reference import (latent_output_ref, latent_prologue_ref, merge_partials_ref,
                                         paged_decode_attention_ref, paged_decode_partial_ref, paged_latent_decode_ref,
                                         qkv_attention_ref, qkv_decode_ref, qkv_decode_supported)


def paged_decode_attention(q, k, v, slots, visible, scale=None, sinks=None, *, positions=None):
    """One query token per row over a paged cache: q [B, Hq, D], k / v pools [N, Hkv, D],
    slots [B, S] int64 the pool row of each row's key s, visible [B, S] bool or an additive
    mask of 0 / -inf floats -> [B, Hq, D] (split over the keys on a GPU, GQA-aware). A GPU
    reads the keys in place, without gathering them into a copy. ``sinks`` [Hq]: GPT-OSS's
    logit per head, in the softmax beside the keys, adding no value. ``positions`` [B],
    where given: each row's newest key's index among its S, after which every key is
    hidden (a GPU then splits each row's keys by its own length, not by S)."""
    if q.is_cuda:
        from kernels.attention.decode import paged_decode_attention_triton
        return paged_decode_attention_triton(q, k, v, slots, visible, scale, sinks=sinks, positions=positions)
    return paged_decode_attention_ref(q, k, v, slots, visible, scale, sinks)


def paged_decode_partial(q, k, v, slots, visible, scale=None):
    """``paged_decode_attention`` over the visible keys alone, for a caller that merges it
    with attention over other keys (a KV cache split over ranks by tokens) -> (out
    [B, Hq, D] normalized over these keys, zero where none is; lse [B, Hq] float32, the log
    of the softmax's denominator over them, -inf where none is)."""
    if q.is_cuda:
        from kernels.attention.decode import paged_decode_partial_triton
        return paged_decode_partial_triton(q, k, v, slots, visible, scale)
    return paged_decode_partial_ref(q, k, v, slots, visible, scale)


def merge_partials(parts, sinks=None, dtype=None):
    """Attention over keys split in P shares (a KV cache split over ranks by tokens) from
    each share's partial: ``parts`` [P, H, B, T, Dv + 1] float32, each share's output
    normalized over its keys and then the log of its softmax denominator (zeros and -inf
    for a share with none) -> [B, H, T, Dv] in ``dtype`` (default float32); ``sinks`` [H]:
    GPT-OSS's logit per head in the denominator. One launch on a GPU."""
    dtype = dtype or torch.float32
    if parts.is_cuda:
        from kernels.attention.decode import merge_partials_triton
        return merge_partials_triton(parts.contiguous(), sinks, dtype)
    return merge_partials_ref(parts, sinks, dtype)


def paged_latent_decode(q, kv, slots, visible, latent, scale=None, *, pdl=True, positions=None):
    """Multi-head latent attention's decode step over a paged cache (DeepSeek-V2 / V3, the
    up-projections absorbed): q [B, Hq, C + R], kv pool [N, 1, C + R] (the latent, which is
    also the value, then the rotary key; ``latent`` = C), slots [B, S], visible [B, S] ->
    [B, Hq, C]. A GPU reads each cached row once for all heads, in place. ``positions``
    [B], where given: each row's newest key's index among its S, after which every key is
    hidden (a GPU then splits each row's keys by its own length, not by S)."""
    if q.is_cuda:
        from kernels.attention.decode import paged_latent_decode_triton
        return paged_latent_decode_triton(q, kv, slots, visible, latent, scale, pdl=pdl, positions=positions)
    return paged_latent_decode_ref(q, kv, slots, visible, latent, scale)


def latent_prologue(q, w_uk, kv, norm_w, eps, cos, sin, pool, slot, *, pdl=True):
    """Multi-head latent attention's decode step between its projections and its attention,
    in one launch on a GPU: each head's absorbed query (q_p W_UK), the latent's norm, the
    rotary turn of the queries' rotary parts and of the shared rotary key, the cache append
    at pool rows ``slot`` -> the queries [B, N, C + R] that ``paged_latent_decode`` reads
    (see ``latent_prologue_ref``). The kernel takes a power-of-two rotary width
    (DeepSeek's 64); others run the reference."""
    r = kv.shape[-1] - w_uk.shape[-1]
    if q.is_cuda and r > 0 and r & (r - 1) == 0:
        from kernels.attention.latent_triton import latent_prologue_triton
        return latent_prologue_triton(q, w_uk, kv, norm_w, eps, cos, sin, pool, slot, pdl=pdl)
    return latent_prologue_ref(q, w_uk, kv, norm_w, eps, cos, sin, pool, slot)


def latent_output(x, w_uv, *, pdl=True):
    """Multi-head latent attention's value up-projection after a decode step's attention,
    in one launch on a GPU: x [B, N, C] (``paged_latent_decode``'s output) times each head's
    W_UV [N, V, C] -> [B, N * V], the output projection's input (see ``latent_output_ref``)."""
    if x.is_cuda:
        from kernels.attention.latent_triton import latent_output_triton
        return latent_output_triton(x, w_uv, pdl=pdl)
    return latent_output_ref(x, w_uv)


def qkv_decode(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos=None, sin=None,
               qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, *, pdl=True, kv_out=None):
    """The QKV epilogue of a decode step (qkv [B, W]) or a prefill (qkv [B, T, W]) in one
    launch on a GPU: q/k norms, clip, rotary, and the KV-cache append at pool rows ``slot``
    (int64 [B, T]) of a paged pool [N, Hkv, D]; ``kv_out`` (two [B, T, Hkv, D]) receive k
    and v too -> q [B, Hq, T, D] (see ``qkv_decode_ref``)."""
    if qkv.is_cuda:
        from kernels.attention.qkv_decode_triton import qkv_decode_triton
        return qkv_decode_triton(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos, sin, qk_norm,
                                 q_norm_w, k_norm_w, eps, clip, pdl, kv_out)
    return qkv_decode_ref(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos, sin, qk_norm, q_norm_w,
                          k_norm_w, eps, clip, kv_out)


def qkv_attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos=None, sin=None,
                  qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, *, read_slots, positions,
                  pdl=True, sinks=None, other_heads=(0, 0)):
    """A decode step's attention from the QKV GEMM's output qkv [B, W] (one token per row)
    over a paged pool k_cache / v_cache [N, Hkv, D]: ``slot`` [B] the new k, v's pool rows,
    ``read_slots`` [B, S] each row's keys' pool rows (the new one's at index ``positions``
    [B]), additive mask ``bias`` of B x S (or a bool one); ``sinks`` [Hq]: GPT-OSS's logit per
    head in the softmax, adding no value; ``other_heads``: q and k heads of other ranks after
    v, read by an all-heads norm alone. The QKV epilogue, the pool write and the attention
    in one launch on a GPU -> [B, Hq, D] (see ``qkv_attention_ref``)."""
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks {list(sinks.shape)}: expected one logit per query head, [{num_heads}]")
    if qkv.is_cuda:
        from kernels.attention.qkv_attention_triton import qkv_attention_triton
        return qkv_attention_triton(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos, sin,
                                    qk_norm, q_norm_w, k_norm_w, eps, clip, pdl=pdl, read_slots=read_slots,
                                    positions=positions, sinks=sinks, other_heads=other_heads)
    return qkv_attention_ref(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos, sin, qk_norm,
                             q_norm_w, k_norm_w, eps, clip, read_slots=read_slots, positions=positions, sinks=sinks,
                             other_heads=other_heads)


def qkv_attention_fits(b: int, hq: int, hkv: int, d: int, s: int, sms: int) -> bool:
    """Whether ``qkv_attention``'s one launch suits a decode step of B rows, Hq / Hkv heads,
    head dim D and S key slots per row on a GPU of ``sms`` SMs
    (``kernels.attention.qkv_attention_triton.fits``)."""
    from kernels.attention.qkv_attention_triton import fits
    return fits(b, hq, hkv, d, s, sms)


__all__ = ["latent_output", "latent_prologue", "merge_partials", "paged_decode_attention", "qkv_decode",
           "qkv_attention", "qkv_attention_fits", "qkv_decode_supported"]
