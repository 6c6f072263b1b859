"""Multi-head latent attention (DeepSeek-V2 / V3) over a compressed KV cache.

Shape letters: B batch, T tokens this step, S key slots, H hidden, N heads on this rank,
C the KV latent (``kv_lora_rank``), R the rotary part of a query / key head
(``qk_rope_head_dim``), P its position-free part (``qk_nope_head_dim``), V the value width.

Keys and values come from one latent c [C] a token (after its norm) and one rotary key
k_r [R] shared by every head; the cache holds [c, k_r] alone, one "KV head" of C + R.
At decode the up-projections are absorbed, as the DeepSeek-V2 paper describes, so the
cache is read once and never expanded: head n's score is (q_p W_UK[n]) . c + q_r . k_r, its
output (softmax . c) W_UV[n], where kv_b_proj = [W_UK; W_UV] per head. A decode step reads
the cache in place, each cached row once for every head (``kernels.paged_latent_decode``).
Prompt tokens, many queries a key, go the other way: the keys' latents are up-projected to
every head's key and value and attention runs at the head width (``_decompressed``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from comm import Group
from dense.attention import PagedKVCache, StepContext
from dense.norm import RMSNorm
from dense.parallel_linear import Linear, RowParallelLinear
from dense.rotary import apply_rotary, pairs_to_halves
from kernels.options import KernelOptions


def softmax_scale(cfg) -> float:
    """head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the
    scaling sets mscale_all_dim (DeepSeek's long-context checkpoints)."""
    scale = cfg.head_dim ** -0.5
    r = cfg.rope_scaling
    if r is not None and r.mscale_all_dim and (r.factor or 1.0) > 1.0:
        m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
        scale *= m * m
    return scale


class LatentAttention(nn.Module):
    """With a tensor-parallel group each rank holds num_heads / P heads: their rows of the
    query projection and of kv_b_proj, their columns of the row-parallel output projection
    (one all-reduce); the latent projection and the cache (shared by every head) are whole
    on every rank."""

    def __init__(self, cfg, tp: Group | None = None, options: KernelOptions = KernelOptions(), layer: int = 0):
        super().__init__()
        tp = tp or Group.alone()
        self.options = options
        h = cfg.hidden_size
        self.rope_dim = r = cfg.rotary_width
        self.nope_dim = p = cfg.head_dim - r
        self.latent = c = cfg.kv_lora_rank
        self.v_dim = v = cfg.v_head_dim
        self.num_heads = n = cfg.num_heads // tp.size
        self.num_kv_heads = 1  # the cache's one latent "head"
        self.scale = softmax_scale(cfg)
        first = tp.rank * n

        def heads(width):  # this rank's heads' rows of a [num_heads * width, K] weight
            return lambda full: full[first * width:(first + n) * width]
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias, options=options)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, options)
            self.q_b_proj = Linear(cfg.q_lora_rank, n * (p + r), bias=False, options=options)
            self.q_b_proj.shard_fns = {"weight": heads(p + r)}
        else:
            self.q_proj = Linear(h, n * (p + r), bias=False, options=options)
            self.q_proj.shard_fns = {"weight": heads(p + r)}
        self.kv_a_proj = Linear(h, c + r, bias=cfg.qkv_bias, options=options)
        self.kv_a_norm = RMSNorm(c, cfg.norm_eps, options)
        self.kv_b_proj = Linear(c, n * (p + v), bias=False, options=options)
        self.kv_b_proj.shard_fns = {"weight": heads(p + v)}
        self.o_proj = RowParallelLinear(cfg.num_heads * v, h, cfg.out_bias, tp, options)
        self.tp = tp
        self.lora = bool(cfg.q_lora_rank)
        self.in_proj, self.in_split = None, None  # both input projections as one (merge_projections)
        self.kv_b = None  # kv_b_proj's weight with the rotary gap (gap_up_projection)
        if cfg.rope_interleaved:  # the checkpoint rotates interleaved pairs: its rotary rows read as halves
            q = self.q_b_proj if cfg.q_lora_rank else self.q_proj
            q.load_fns = {"weight": lambda t: pairs_to_halves(t, p + r, p, r)}
            kv = lambda t: pairs_to_halves(t, c + r, c, r)  # noqa: E731  (one "head": the latent, then the rotary key)
            self.kv_a_proj.load_fns = {"weight": kv, "bias": kv}

    def merge_projections(self) -> bool:
        """The two projections of the layer's input (the query's, or its q-LoRA down
        projection, and the latent's) as one GEMM of their rows stacked: one launch a step
        instead of two. -> whether it did: not once either is quantized or a different
        dtype (called after loading, before quantizing)."""
        if self.in_proj is not None:
            return False
        first, second = self.q_a_proj if self.lora else self.q_proj, self.kv_a_proj
        if type(first) is not Linear or type(second) is not Linear or first.weight.dtype != second.weight.dtype \
                or not first.weight.is_floating_point():
            return False
        n1, n2 = first.weight.shape[0], second.weight.shape[0]
        has_bias = first.bias is not None or second.bias is not None
        with torch.device("meta"):
            merged = Linear(first.weight.shape[1], n1 + n2, has_bias, options=self.options)
        merged = merged.to_empty(device=first.weight.device).to(first.weight.dtype)
        with torch.no_grad():
            merged.weight.copy_(torch.cat([first.weight, second.weight]))
            if has_bias:
                merged.bias.copy_(torch.cat([first.bias if first.bias is not None else first.weight.new_zeros(n1),
                                             second.bias if second.bias is not None else second.weight.new_zeros(n2)]))
        merged.requires_grad_(False)
        self.in_proj, self.in_split = merged, (n1, n2)
        del self.kv_a_proj
        if self.lora:
            del self.q_a_proj
        else:
            del self.q_proj
        return True

    def gap_up_projection(self) -> bool:
        """kv_b_proj's weight kept as each head's [W_UK rows, R rows, W_UV rows] (``kv_b``
        [N, P + R + V, C]; the R rows' products are the rotary key's gap, which it
        overwrites), the form a prompt's one up-projection GEMM takes (``_decompressed``),
        instead of a copy of the weight made at each prompt; decode reads W_UK and W_UV as
        views of it. -> whether it did: not once (called after loading)."""
        if self.kv_b is not None:
            return False
        self.kv_b = nn.Parameter(self._gapped(), requires_grad=False)
        del self.kv_b_proj
        return True

    def _gapped(self) -> torch.Tensor:
        """-> [N, P + R + V, C]: ``kv_b``, or kv_b_proj's weight with a zero gap (made here)."""
        if self.kv_b is not None:
            return self.kv_b
        w_uk, w_uv = self._up_weights()
        return torch.cat([w_uk, w_uk.new_zeros(self.num_heads, self.rope_dim, self.latent), w_uv], dim=1)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (W_UK [N, P, C], W_UV [N, V, C]): views of kv_b_proj's weight or of ``kv_b``."""
        p, c = self.nope_dim, self.latent
        if self.kv_b is not None:
            return self.kv_b[:, :p], self.kv_b[:, p + self.rope_dim:]
        w = self.kv_b_proj.weight.view(self.num_heads, p + self.v_dim, c)
        return w[:, :p], w[:, p:]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> the queries [B, T, N * (P + R)] and the latent projection's rows
        [B, T, C + R] (the latent, then the rotary key)."""
        if self.in_proj is not None:
            return self._queries(*self.in_proj(x).split(self.in_split, dim=-1))
        return self._queries(self.q_a_proj(x) if self.lora else self.q_proj(x), self.kv_a_proj(x))

    def _queries(self, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input projections' outputs -> (queries, latent rows): q-LoRA's up projection."""
        return (self.q_b_proj(self.q_a_norm(q)) if self.lora else q), kv

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: PagedKVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        return self._attend(*self._project(x), ctx, cache, layer)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm, ctx: StepContext,
                       cache: PagedKVCache | None = None, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention on norm(x + residual) -> (output, x + residual): with the input
        projections merged (``merge_projections``), the add and the norm go into their
        GEMM's prologue where that is one launch (``kernels.norm_linear``)."""
        if self.in_proj is None:
            h, summed = norm.add_and_norm(x, residual)
            return self.forward(h, ctx, cache, layer), summed
        y, summed = self.in_proj.normed(x, residual, norm)
        return self._attend(*self._queries(*y.split(self.in_split, dim=-1)), ctx, cache, layer), summed

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, ctx: StepContext, cache: PagedKVCache | None,
                layer: int) -> torch.Tensor:
        """The queries [B, T, N * (P + R)] and latent rows [B, T, C + R] -> the output [B, T, H]."""
        b, t, _ = kv.shape
        n, p, r, c = self.num_heads, self.nope_dim, self.rope_dim, self.latent
        w_uk, w_uv = self._up_weights()  # [N, P, C], [N, V, C]
        if cache is not None and t == 1 and not ctx.causal and not cache.by_tokens:
            # A decode step: the absorbed query (q_p W_UK per head, in the latent's space),
            # the latent's norm, the rotations and the cache append in one launch; the
            # attention reads the pool in place, each cached row once for every head; then
            # each head's W_UV in one more launch, in the layout o_proj reads.
            pool = cache.pools(layer)[0]
            query = kernels.latent_prologue(q.view(b, -1), w_uk, kv, self.kv_a_norm.weight, self.kv_a_norm.eps,
                                            ctx.cos, ctx.sin, pool, cache.write_slots,
                                            pdl=self.options.pdl)  # [B, N, C + R]
            out = kernels.paged_latent_decode(query, pool, cache.read_slots, ctx.attn_mask[:, 0, 0], c, self.scale,
                                              pdl=self.options.pdl, positions=ctx.positions)
            out = kernels.latent_output(out, w_uv, pdl=self.options.pdl)  # [B, N * V]
            return self.o_proj(out.view(b, 1, n * self.v_dim))
        q = q.view(b, t, n, p + r).transpose(1, 2)  # [B, N, T, P + R]
        q_p, q_r = q.split([p, r], dim=-1)
        latent, k_r = kv.split([c, r], dim=-1)  # [B, T, C], [B, T, R]
        latent = self.kv_a_norm(latent)
        k_r = k_r[:, None]  # [B, 1, T, R]: one rotary key for every head
        by_tokens = cache is not None and not ctx.causal and cache.by_tokens
        prompt = t > 1 and not by_tokens
        if ctx.cos is not None:
            q_r, k_r = apply_rotary(q_r, ctx.cos, ctx.sin), apply_rotary(k_r, ctx.cos, ctx.sin)
            if prompt:  # turned in place: the projection's rows are then the whole query, no copy of it
                q[..., p:] = q_r
        key = torch.cat([latent[:, None], k_r], dim=-1)  # [B, 1, T, C + R]
        if cache is not None:
            cache.write(layer, key, key[..., :0])
        if cache is not None and not ctx.causal:  # earlier keys too: the row's slots, in token order
            key = cache.gather(layer)[0]  # [B, 1, S, C + R]
        mask = None if ctx.causal else ctx.attn_mask
        if prompt:
            return self._decompressed(q, key, mask, ctx.causal)
        q_c = torch.einsum("bntp,npc->bntc", q_p, w_uk.to(q_p.dtype))
        query = torch.cat([q_c, q_r], dim=-1)  # [B, N, T, C + R]: absorbed, in the latent's space
        if by_tokens:  # the latent split over the ranks by tokens (every rank computed the same new latent)
            from dense.kv_shard import gather_heads, split_attention

            out = split_attention(gather_heads(self.tp, query)[0], key, key[..., :c], ctx.attn_mask, cache.own_keys,
                                  self.scale, self.tp)
        else:
            out = F.scaled_dot_product_attention(query, key.expand(-1, n, -1, -1), key[..., :c].expand(-1, n, -1, -1),
                                                 attn_mask=mask, is_causal=ctx.causal, scale=self.scale)  # [B, N, T, C]
        return self._output(out, w_uv)

    def _decompressed(self, query: torch.Tensor, key: torch.Tensor, mask, causal: bool) -> torch.Tensor:
        """Prompt tokens: the latent keys [B, 1, S, C + R] up-projected to every head's key
        (W_UK latent, then the rotary key) and value (W_UV latent), then attention at the
        head width D = P + R (the queries [B, N, T, D], any strides but unit along D): for T
        queries over S keys this is P + R + V multiply-adds a query-key pair and head where
        the absorbed form takes 2 C + R (320 against 1088 for DeepSeek-V2 / V3), and the
        width takes the fused attention kernels. One GEMM writes each key's heads as
        [W_UK latent, a gap, W_UV latent] (a zero block of W_UK's rows leaves the gap) and
        the rotary key fills the gap: the keys are a view of the first D columns and, where
        V < D, the values a view of the last D (the rotary key, then the value: outputs past
        the first D - V columns are the values'), so nothing is concatenated or padded. The
        gapped weight is kept from load (``gap_up_projection``), else made for the call."""
        b, n, t, d = query.shape
        p, r, v, c = self.nope_dim, self.rope_dim, self.v_dim, self.latent
        latent, k_r = key[:, 0].split([c, r], dim=-1)  # [B, S, C], [B, S, R]
        s = latent.shape[1]
        kv = torch.matmul(latent, self._gapped().reshape(n * (d + v), c).t().to(latent.dtype)).view(b, s, n, d + v)
        kv[..., p:d] = k_r[:, :, None]  # every head's rotary key in its gap
        keys = kv[..., :d].transpose(1, 2)  # [B, N, S, D]
        values = (kv[..., v:] if d > v else kv[..., d:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal,
                                             scale=self.scale)[..., max(0, d - v):]  # [B, N, T, V]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, n * v))

    def _output(self, out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """The softmax-weighted latents [B, N, T, C] -> (out W_UV per head) o_proj [B, T, H]."""
        b, n, t, _ = out.shape
        out = torch.einsum("bntc,nvc->btnv", out, w_uv.to(out.dtype))
        return self.o_proj(out.reshape(b, t, n * self.v_dim))
