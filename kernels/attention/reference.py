"""Plain-torch references for the attention ops of the decode path: decode attention
(over a contiguous or a paged KV cache), and over a paged pool the QKV epilogue and the
QKV epilogue with the attention in one step. The Triton kernels must match these
functions, and they are what the ops in ``kernels.attention`` run on a CPU, so this module
needs torch alone.

Shape letters: B rows, T tokens per row, Hq / Hkv query / KV heads, D head dim, S cache
slots, N pool rows of a paged cache.
"""
from __future__ import annotations

import math

import torch

from kernels.norm.reference import qk_norm_apply_ref, rms_norm_ref

QK_NORMS = {None: 0, "head": 1, "full": 2}


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                         scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row over a KV cache with torch's softmax, in float32 (float64
    inputs stay float64): q [B, Hq, D], k / v [B, Hkv, S, D], visible [B, S] bool
    -> [B, Hq, D]. ``sinks`` [Hq] (GPT-OSS): a logit per head that joins the softmax and
    adds no value."""
    b, hq, d = q.shape
    g = hq // k.shape[1]
    ct = torch.promote_types(q.dtype, torch.float32)
    kk = k.to(ct).repeat_interleave(g, dim=1)  # [B, Hq, S, D]
    vv = v.to(ct).repeat_interleave(g, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.to(ct), kk) * (scale if scale is not None else d ** -0.5)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(ct)[None, :, None].expand(b, -1, 1)], dim=-1)
        return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1)[..., :-1], vv).to(q.dtype)
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), vv).to(q.dtype)


def paged_decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                               visible: torch.Tensor, scale: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_attention_ref`` over a paged cache: k / v pools [N, Hkv, D], slots [B, S] the
    pool row of each row's key s -> [B, Hq, D]. ``visible`` [B, S] bool, or an additive
    mask of 0 / -inf floats (as ``StepContext.paged`` builds it)."""
    if visible.is_floating_point():
        visible = visible > float("-inf")
    hidden = ~visible[:, :, None, None]  # [B, S, 1, 1]: whatever a hidden slot holds is never read
    kk, vv = k[slots].masked_fill(hidden, 0), v[slots].masked_fill(hidden, 0)  # [B, S, Hkv, D]
    return decode_attention_ref(q, kk.transpose(1, 2), vv.transpose(1, 2), visible, scale, sinks)


def paged_latent_decode_ref(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                            latent: int, scale: float | None = None) -> torch.Tensor:
    """Multi-head latent attention's decode over a paged cache: q [B, Hq, C + R], kv pool
    [N, C + R] or [N, 1, C + R] (each token's latent, also its value, then its rotary key;
    ``latent`` = C) -> [B, Hq, C]: ``paged_decode_attention_ref`` with one KV head whose
    values are the keys' first C columns."""
    pool = kv if kv.dim() == 3 else kv[:, None]
    return paged_decode_attention_ref(q, pool, pool[..., :latent], slots, visible, scale)


def partial_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over some of the keys, for a caller that merges it with attention
    over the others: q [B, Hq, T, D], k / v [B, Hkv, S, D] (Hkv dividing Hq; each KV head
    read once for its query heads, not copied per head), ``allowed`` [B, 1, T, S] bool ->
    (out [B, Hq, T, Dv] normalized over the allowed keys, zero where none is; lse
    [B, Hq, T], the log of the softmax's denominator, -inf where none is; float32, or
    float64 for float64 inputs)."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(wide).reshape(b, hkv, (h // hkv) * t, d)  # each KV head's query heads, as rows
    scores = (qg @ k.to(wide).transpose(-1, -2)).view(b, hkv, h // hkv, t, -1) * scale
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))  # [B, Hkv, G, T, S]
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.clamp(min=torch.finfo(wide).min)[..., None])  # 0 where masked
    out = (weights.view(b, hkv, -1, scores.shape[-1]) @ v.to(wide)).view(b, h, t, -1)
    return out.to(q.dtype), lse.view(b, h, t)


def paged_decode_partial_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                             visible: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention_ref`` of one query token per row over a paged pool: q [B, Hq, D],
    k / v pools [N, Hkv, D], slots [B, S], visible [B, S] bool or additive 0 / -inf -> (out
    [B, Hq, D], lse [B, Hq] float32)."""
    if visible.is_floating_point():
        visible = visible > float("-inf")
    hidden = ~visible[:, :, None, None]  # [B, S, 1, 1]: whatever a hidden slot holds is never read
    kk, vv = k[slots].masked_fill(hidden, 0), v[slots].masked_fill(hidden, 0)  # [B, S, Hkv, D]
    out, lse = partial_attention_ref(q[:, :, None], kk.transpose(1, 2), vv.transpose(1, 2), visible[:, None, None],
                                     scale if scale is not None else q.shape[-1] ** -0.5)
    return out[:, :, 0], lse[:, :, 0].float()


def merge_partials_ref(parts: torch.Tensor, sinks: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Partial attentions over P shares of the keys, packed ``parts`` [P, H, B, T, Dv + 1]
    (each share's output normalized over its keys, then the log of its softmax denominator:
    zeros and -inf for a share with none) -> the attention over all of them [B, H, T, Dv]
    in ``dtype``, each share weighted by its part of the whole denominator; ``sinks`` [H]:
    one more logit per head in the denominator (GPT-OSS), adding no value. A row with no key
    anywhere (a padding row) gets zeros, not NaN."""
    outs, lses = parts[..., :-1].transpose(1, 2), parts[..., -1].transpose(1, 2)  # [P, B, H, T, Dv], [P, B, H, T]
    total = torch.logsumexp(lses, dim=0)  # [B, H, T]
    if sinks is not None:
        total = torch.logaddexp(total, sinks.to(total.dtype)[None, :, None])
    share = torch.exp(lses - total.clamp(min=torch.finfo(total.dtype).min)[None])  # [P, B, H, T]
    return (outs.to(share.dtype) * share[..., None]).sum(0).to(dtype)


def qkv_decode_supported(head_dim: int) -> bool:
    """The fused kernel needs a power-of-two head dim (every model in configs/ has one)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def check_qkv(qkv, k_cache, v_cache, num_heads, num_kv_heads, head_dim, qk_norm, slot,
              kv_out=None, other_heads=(0, 0)) -> tuple[int, int]:
    """The QKV epilogue's operand checks (ValueError naming the operand) -> (B, T): a paged
    pool [N, Hkv, D] and one pool row per token; ``other_heads``: q and k heads of other
    ranks after v (``qkv_attention_ref``)."""
    width = (num_heads + 2 * num_kv_heads + sum(other_heads)) * head_dim
    if qkv.dim() not in (2, 3) or qkv.shape[-1] != width:
        more = f" + {sum(other_heads)} other ranks' heads" if any(other_heads) else ""
        raise ValueError(f"qkv {list(qkv.shape)}: expected [B, (Hq + 2 Hkv{more}) * D = {width}] or [B, T, {width}]")
    b, t = qkv.shape[0], qkv.shape[1] if qkv.dim() == 3 else 1
    want = (k_cache.shape[0], num_kv_heads, head_dim)
    if k_cache.dim() != 3 or tuple(k_cache.shape) != want or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache / v_cache {list(k_cache.shape)} / {list(v_cache.shape)}: expected a paged pool "
                         f"[N, Hkv, D] = {list(want)}")
    if not (torch.is_tensor(slot) and slot.dtype == torch.int64 and slot.numel() == b * t):
        got = f"{list(slot.shape)} {slot.dtype}" if torch.is_tensor(slot) else repr(slot)
        raise ValueError(f"slot {got}: a paged pool takes each token's pool row, an int64 tensor of B x T = "
                         f"{b} x {t} elements")
    if kv_out is not None and not (len(kv_out) == 2 and all(
            z.shape == (b, t, num_kv_heads, head_dim) and z.is_contiguous() for z in kv_out)):
        raise ValueError(f"kv_out {[list(z.shape) for z in kv_out]}: expected two contiguous "
                         f"[B, T, Hkv, D] = {[b, t, num_kv_heads, head_dim]} tensors")
    if qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm={qk_norm!r}: expected one of {list(QK_NORMS)}")
    return b, t


def qkv_decode_ref(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos=None, sin=None,
                   qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, kv_out=None):
    """qkv [B, (Hq + 2 Hkv) * D] of one token per row, or [B, T, ...] of T -> q [B, Hq, T, D];
    writes token (b, t)'s k and v at pool row ``slot[b, t]`` (``slot`` int64 [B, T] or
    [B * T]) of the paged pool k_cache / v_cache [N, Hkv, D].
    cos, sin [B, R] or [B, T, R] rotary tables (None: no rotation; R < D: the first R
    dimensions of each head turn, the rest pass as they are, GLM-4.5); ``qk_norm`` None /
    "head" (weights [D]) / "full" (weights [Hq * D], [Hkv * D]); ``clip`` clamps q, k, v.
    ``kv_out``: two [B, T, Hkv, D] tensors that receive k and v as well (a prefill that
    attends over its own keys then reads them there, not from the cache)."""
    b, t = check_qkv(qkv, k_cache, v_cache, num_heads, num_kv_heads, head_dim, qk_norm, slot, kv_out)
    d = head_dim
    norm = lambda x, w: rms_norm_ref(x, w, eps)  # noqa: E731
    q, k, v = qkv.reshape(b, t, -1).split((num_heads * d, num_kv_heads * d, num_kv_heads * d), dim=-1)
    if qk_norm == "full":
        q, k = norm(q, q_norm_w), norm(k, k_norm_w)
    if clip is not None:
        q, k, v = (z.clamp(-clip, clip) for z in (q, k, v))
    q, k, v = q.view(b, t, num_heads, d), k.view(b, t, num_kv_heads, d), v.view(b, t, num_kv_heads, d)
    if qk_norm == "head":
        q, k = norm(q, q_norm_w), norm(k, k_norm_w)
    if cos is not None:
        r = cos.shape[-1]
        if r % 2 or r > d or cos.numel() != b * t * r or sin.shape != cos.shape:
            raise ValueError(f"cos / sin {list(cos.shape)} / {list(sin.shape)}: expected [B, T, R] of B = {b}, T = {t} "
                             f"and an even R <= D = {d}")
        c, s = cos.reshape(b, t, 1, r), sin.reshape(b, t, 1, r)

        def rotate(x):
            x1, x2 = x[..., :r].chunk(2, dim=-1)
            turned = x[..., :r] * c + torch.cat((-x2, x1), dim=-1) * s
            return turned if r == d else torch.cat((turned, x[..., r:]), dim=-1)
        q, k = rotate(q), rotate(k)
    if kv_out is not None:
        kv_out[0].copy_(k), kv_out[1].copy_(v)
    rows = slot.reshape(b * t)  # each token's own pool row
    k_cache.index_copy_(0, rows, k.reshape(b * t, num_kv_heads, d).to(k_cache.dtype))
    v_cache.index_copy_(0, rows, v.reshape(b * t, num_kv_heads, d).to(v_cache.dtype))
    return q.transpose(1, 2).contiguous()


def check_qkv_attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, read_slots,
                        positions, qk_norm=None, other_heads=(0, 0)) -> tuple[int, int]:
    """-> (B, S). Raises ValueError naming the operand where the fused step cannot take it."""
    if len(other_heads) != 2 or min(other_heads) < 0:
        raise ValueError(f"other_heads {tuple(other_heads)}: expected two counts >= 0 (q heads, k heads)")
    if any(other_heads) and qk_norm != "full":
        raise ValueError(f"other_heads {tuple(other_heads)}: other ranks' q and k heads are only read by an all-heads "
                         f"norm (qk_norm 'full'), not qk_norm={qk_norm!r}")
    b, t = check_qkv(qkv, k_cache, v_cache, num_heads, num_kv_heads, head_dim, None, slot, other_heads=other_heads)
    if t != 1:
        raise ValueError(f"qkv {list(qkv.shape)}: one token per row, [B, W]")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads}: expected a multiple of num_kv_heads {num_kv_heads}")
    if not qkv_decode_supported(head_dim):
        raise ValueError(f"head_dim {head_dim}: expected a power of two")
    if not (torch.is_tensor(read_slots) and read_slots.dim() == 2 and read_slots.shape[0] == b
            and read_slots.dtype == torch.int64 and read_slots.stride(1) == 1):
        got = (f"{list(read_slots.shape)} {read_slots.dtype} strides {read_slots.stride()}"
               if torch.is_tensor(read_slots) else repr(read_slots))
        raise ValueError(f"read_slots {got}: expected int64 [B = {b}, S] with contiguous rows, each row's keys' "
                         "pool rows")
    if not (torch.is_tensor(positions) and positions.numel() == b and positions.dtype == torch.int64):
        got = f"{list(positions.shape)} {positions.dtype}" if torch.is_tensor(positions) else repr(positions)
        raise ValueError(f"positions {got}: expected int64 of B = {b} elements, each row's new key's index")
    s = read_slots.shape[1]
    if (bias.shape[0] != b or bias.shape[-1] != s or bias.numel() != b * s
            or not (bias.is_floating_point() or bias.dtype == torch.bool)):
        raise ValueError(f"bias {list(bias.shape)} {bias.dtype}: expected an additive float mask (or a bool one) of "
                         f"B x S = {b} x {s}")
    return b, s


def qkv_attention_ref(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, cos=None, sin=None,
                      qk_norm=None, q_norm_w=None, k_norm_w=None, eps=1e-6, clip=None, scale=None, *,
                      read_slots, positions, sinks=None, other_heads=(0, 0)):
    """qkv [B, (Hq + 2 Hkv) * D] of one token per row -> attention output [B, Hq, D] over the
    paged pool k_cache / v_cache [N, Hkv, D]. Writes the new k and v at pool rows ``slot``
    [B] int64 (as ``qkv_decode_ref``), then gathers each row's keys in order, ``read_slots``
    [B, S] the pool row of its key s (the new key's at index ``positions[b]``, the keys
    after it hidden), and attends over them under the additive mask ``bias`` ([B, S], or any
    shape of B x S values, e.g. [B, 1, 1, S]; or a bool mask, True where visible), softmax
    in float32 or wider. ``sinks`` [Hq] (GPT-OSS): a logit per head in the softmax, no value.
    ``other_heads`` (Hq', Hkv'), with an all-heads norm (``qk_norm`` "full") over heads split
    across tensor-parallel ranks: the row goes on after v with the q of Hq' and the k of Hkv'
    heads of other ranks, whose squares join the norm's mean square (the weights are this
    rank's heads'); nothing else reads them."""
    b, s = check_qkv_attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, bias, read_slots,
                               positions, qk_norm, other_heads)
    if any(other_heads):
        d, (hq_o, hkv_o) = head_dim, other_heads
        mine, qw, kw = (num_heads + 2 * num_kv_heads) * d, num_heads * d, num_kv_heads * d
        wide = qkv.float()  # (as ``rms_norm_ref`` and ``qk_norm_apply_ref`` take the squares)
        others = wide[:, mine:]
        sq = torch.stack((wide[:, :qw].pow(2).sum(-1) + others[:, :hq_o * d].pow(2).sum(-1),
                          wide[:, qw:qw + kw].pow(2).sum(-1) + others[:, hq_o * d:].pow(2).sum(-1)), dim=-1)
        qkv = qk_norm_apply_ref(qkv[:, :mine].clone(), sq, q_norm_w, k_norm_w, (num_heads + hq_o) * d,
                                (num_kv_heads + hkv_o) * d, eps)
        qk_norm = None
    q = qkv_decode_ref(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot, cos, sin, qk_norm,
                       q_norm_w, k_norm_w, eps, clip)[:, :, 0]  # [B, Hq, D]
    k, v = k_cache[read_slots].transpose(1, 2), v_cache[read_slots].transpose(1, 2)  # [B, Hkv, S, D] in token order
    ct = torch.promote_types(q.dtype, torch.float32)
    g = num_heads // num_kv_heads
    if bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=ct, device=bias.device).masked_fill_(~bias, float("-inf"))
    bias = bias.reshape(b, 1, s).to(ct)
    hidden = (bias == float("-inf"))[:, :, :, None]  # whatever a hidden slot holds is never read
    kk = k.to(ct).masked_fill(hidden, 0).repeat_interleave(g, dim=1)  # [B, Hq, S, D]
    vv = v.to(ct).masked_fill(hidden, 0).repeat_interleave(g, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    scores = torch.einsum("bhd,bhsd->bhs", q.to(ct), kk) * scale + bias
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(ct)[None, :, None].expand(b, -1, 1)], dim=-1)
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1)[..., :s], vv).to(q.dtype)


def paged_decode_context_ref(inputs, prev, block_size, num_keys, trash, dtype, tables, sliding_window=None,
                             bias=False) -> dict:
    """``kernels.attention.paged_context.paged_decode_context_triton``'s outputs with torch
    ops (the contract is there): inputs [B, 4 + N] int64 rows (token, position, real, src,
    block table), prev [P] int64."""
    bs = block_size
    tokens, pos, real, src, table = inputs[:, :1], inputs[:, 1:2], inputs[:, 2], inputs[:, 3:4], inputs[:, 4:]
    tokens = torch.where(src >= 0, prev[src.clamp(min=0)], tokens)
    lens = (pos[:, 0] + 1) * (real != 0)  # [B] keys after this step (0: padding)
    write = torch.where((real != 0)[:, None], table.gather(1, pos // bs) * bs + pos % bs, trash)
    k = torch.arange(num_keys, device=inputs.device)
    held = k[None, :] < lens[:, None]  # [B, S]
    read = torch.where(held, table[:, k // bs] * bs + k % bs, trash)
    ok = held & (k[None, :] <= pos)
    if sliding_window is not None:
        ok &= pos - k[None, :] < sliding_window
    ok |= (k == 0)[None, :] & (lens == 0)[:, None]  # a padding row sees key 0: a finite softmax
    mask = ok[:, None, None, :]
    if bias:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    cos = sin = None
    if tables is not None:
        cos, sin = tables[0][pos], tables[1][pos]  # [B, 1, D]
    return {"tokens": tokens, "positions": pos.clone(), "write": write, "lens": lens, "read": read, "mask": mask,
            "cos": cos, "sin": sin}


def check_latent_prologue(q, w_uk, kv) -> tuple[int, int, int, int, int]:
    """-> (B, N, C, R, P) of ``latent_prologue_ref``'s operands; ValueError naming them
    where the shapes disagree."""
    n, p, c = w_uk.shape if w_uk.dim() == 3 else (0, 0, 0)
    r = kv.shape[-1] - c
    b = kv.numel() // kv.shape[-1]
    if (w_uk.dim() != 3 or r <= 0 or r % 2 or q.shape[-1] != n * (p + r) or q.numel() != b * q.shape[-1]
            or kv.numel() != b * kv.shape[-1]):
        raise ValueError(f"q {list(q.shape)}, w_uk {list(w_uk.shape)}, kv {list(kv.shape)}: expected [B, N * (P + R)], "
                         f"[N, P, C] and [B, C + R] with an even R > 0")
    return b, n, c, r, p


def latent_prologue_ref(q, w_uk, kv, norm_w, eps, cos, sin, pool, slot):
    """Multi-head latent attention's decode step between its projections and its attention:
    q [B, N * (P + R)] the query projection's rows (each head's position-free part, then its
    rotary part), w_uk [N, P, C] each head's key up-projection (absorbed into the query),
    kv [B, C + R] the latent projection's rows (the latent, then the shared rotary key),
    the latent's RMSNorm weights [C], rotary tables cos / sin [B, R] (None: no rotation)
    -> the queries [B, N, C + R] the decode attention reads ([q_p W_UK, turned rotary
    part]); stores [norm(latent), turned rotary key] at pool rows ``slot`` [B] of the cache
    [N_POOL, 1, C + R]."""
    b, n, c, r, p = check_latent_prologue(q, w_uk, kv)
    q = q.reshape(b, n, p + r)
    q_c = torch.einsum("bnp,npc->bnc", q[..., :p], w_uk.to(q.dtype))
    q_r = q[..., p:]
    latent, k_r = kv.reshape(b, c + r).split([c, r], dim=-1)
    latent = rms_norm_ref(latent, norm_w, eps)
    if cos is not None:
        cos, sin = cos.reshape(b, 1, r), sin.reshape(b, 1, r)

        def turn(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        q_r, k_r = turn(q_r), turn(k_r[:, None])[:, 0]
    pool.view(pool.shape[0], c + r).index_copy_(0, slot.reshape(b), torch.cat([latent, k_r], dim=-1).to(pool.dtype))
    return torch.cat([q_c, q_r.to(q_c.dtype)], dim=-1)


def check_latent_output(x, w_uv) -> tuple[int, int, int, int]:
    """-> (B, N, C, V) of ``latent_output_ref``'s operands; ValueError naming them where
    the shapes disagree."""
    if x.dim() != 3 or w_uv.dim() != 3 or x.shape[1:] != (w_uv.shape[0], w_uv.shape[2]):
        raise ValueError(f"x {list(x.shape)}, w_uv {list(w_uv.shape)}: expected [B, N, C] and [N, V, C]")
    return x.shape[0], x.shape[1], x.shape[2], w_uv.shape[1]


def latent_output_ref(x, w_uv):
    """Multi-head latent attention's value up-projection after a decode step's attention:
    x [B, N, C] each head's softmax-weighted latent, w_uv [N, V, C] each head's W_UV ->
    [B, N * V], head-major, the rows the output projection reads."""
    b, n, _, v = check_latent_output(x, w_uv)
    return torch.einsum("bnc,nvc->bnv", x, w_uv.to(x.dtype)).reshape(b, n * v)
