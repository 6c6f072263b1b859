"""Causal self-attention (MHA / GQA / MQA) over a paged KV cache, or without a cache.

Shape letters: B batch, T tokens this step, S key slots visible this step, H hidden,
D head dim. Ragged batches are handled by masks, never by per-row loops: ``key_valid``
marks real tokens (left or right padding both work) and positions are per row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

import kernels
from comm import Group, all_gather, all_reduce
from dense.norm import RMSNorm, ShardedRMSNorm
from dense.parallel_linear import Linear, RowParallelLinear
from dense.rotary import Rotary, apply_rotary, pairs_to_halves
from kernels.attention import qkv_attention_fits, qkv_decode_supported
from kernels.options import KernelOptions

# The SDPA kernels a forward may use (``Transformer.forward`` enables these alone). Not
# cuDNN's: it builds an execution plan for every new shape, at a cost far above the
# attention's own, and a server meets a new prompt length or batch with nearly every request.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# A forward replayed from a CUDA graph has fixed shapes: cuDNN's plan is built once, when the
# graph is captured, and its kernels ran every prefill bucket's causal attention faster than
# flash's on the GPUs measured (``KernelOptions.cudnn_prefill_graphs``); in this order.
GRAPH_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *SDPA_BACKENDS]


def _rotary(rotary: Rotary | None, positions: torch.Tensor, dtype: torch.dtype, valid: torch.Tensor):
    """cos, sin [B, T, D] for the query positions (None, None for learned positions); the
    frequencies that follow the forward's positions take the largest of the ``valid`` ones
    (padding's positions do not count)."""
    if rotary is None:
        return None, None
    longest = torch.where(valid, positions, 0).max() + 1 if rotary.per_step and positions.numel() else None
    return rotary(positions, dtype, longest)


@dataclass
class StepContext:
    """What every layer of one forward step shares, computed once per step."""

    positions: torch.Tensor  # [B, T] int64 position of each query token
    attn_mask: torch.Tensor | None  # [B, 1, T, S] bool, True where a query may attend (or
    # additive: 0 / -inf in the model dtype, as ``paged`` builds it); None when ``causal``
    cos: torch.Tensor | None  # [B, T, D] rotary tables, None for learned positions
    sin: torch.Tensor | None
    causal: bool = False  # the queries are every row's first T tokens with no padding and no
    # sliding window: attention is plain causal over these T keys (``is_causal``, no mask)
    # Where only some layers attend within a sliding window (``ModelConfig.sliding_layers``):
    # their mask (``window_mask``), in the form of ``attn_mask``; None: every layer alike.
    window_mask: torch.Tensor | None = None
    # Where some queries are padding (an eager forward over rows of several lengths): the
    # flat indices (row * T + t) of the real ones [N]. The per-token layers (the attention's
    # projections, the feed-forward layers) run on these alone (``per_token``), so padding
    # costs no GEMM or expert work; None: every query is real, or the step's shapes are
    # fixed (a captured step).
    tokens: torch.Tensor | None = None
    # The step is replayed from a CUDA graph (its shapes never change): SDPA may take
    # kernels that plan per shape (``GRAPH_SDPA_BACKENDS``).
    graphed: bool = False

    def per_token(self, fn, x: torch.Tensor) -> torch.Tensor:
        """``fn`` over x [B, T, H]: over its real tokens alone where some are padding, the
        padding's rows zero; else over x as it is."""
        if self.tokens is None:
            return fn(x)
        b, t = x.shape[:2]
        y = fn(x.reshape(b * t, -1).index_select(0, self.tokens))
        return y.new_zeros(b * t, y.shape[-1]).index_copy_(0, self.tokens, y).view(b, t, -1)

    def windowed(self, window: int, key_positions: torch.Tensor, chunk: bool = False) -> "StepContext":
        """This context with ``window_mask`` set: this step's mask (the causal one where
        ``causal``) with the keys ``window`` or more positions before each query masked
        too (``chunk``: the keys outside the query's chunk of ``window`` positions).
        key_positions [S] or [B, S]: the position of each key slot."""
        q = self.positions[:, None, :, None]  # [B, 1, T, 1]
        k = key_positions.reshape(key_positions.shape[0] if key_positions.dim() > 1 else 1, 1, 1, -1)
        far = (q // window != k // window) if chunk else q - k >= window
        mask = self.attn_mask
        if mask is None:  # causal over this step's own keys
            return replace(self, window_mask=(k <= q) & ~far)
        if mask.dtype == torch.bool:
            return replace(self, window_mask=mask & ~far)
        mask = mask.masked_fill(far, float("-inf"))
        # A padding query may lose its one key: it keeps the first, so softmax stays finite.
        first = torch.arange(mask.shape[-1], device=mask.device) == 0
        return replace(self, window_mask=mask.masked_fill(torch.isinf(mask).all(-1, keepdim=True) & first, 0.0))

    def for_window(self) -> "StepContext":
        """The context a sliding-window layer attends with (this one where every layer does)."""
        if self.window_mask is None:
            return self
        return replace(self, attn_mask=self.window_mask, causal=False, window_mask=None)

    @classmethod
    def build(cls, positions: torch.Tensor, key_valid: torch.Tensor, rotary: Rotary | None,
              dtype: torch.dtype, sliding_window: int | None = None,
              no_padding: bool = False) -> "StepContext":
        """A forward without a cache (``Engine.logits``): the queries attend over this step's
        own T keys, key t at position ``positions[:, t]``. positions, key_valid [B, T].
        ``no_padding``: the caller knows every key is valid (all rows full), so the prefill
        may run attention as plain causal."""
        t = positions.shape[1]
        slot = torch.arange(t, device=positions.device)  # [T]
        causal = slot[None, :] <= slot[:, None]  # [T, T]
        mask = key_valid[:, None, :] & causal  # [B, T, T]
        if sliding_window is not None:
            mask &= positions[:, :, None] - positions[:, None, :] < sliding_window
        # A padding query may have no valid key; let it see itself so softmax stays finite.
        mask |= slot[None, :] == slot[:, None]
        cos, sin = _rotary(rotary, positions, dtype, key_valid)
        causal = no_padding and sliding_window is None and t > 1
        return cls(positions, mask.unsqueeze(1), cos, sin, causal)

    @classmethod
    def paged(cls, positions: torch.Tensor, query_valid: torch.Tensor, context_lens: torch.Tensor,
              num_keys: int, rotary: Rotary | None, dtype: torch.dtype,
              sliding_window: int | None = None, *, causal: bool = False) -> "StepContext":
        """For a ``PagedKVCache``: each row's keys are its own tokens in order, so key s has
        position s. positions, query_valid [B, T]; context_lens [B] tokens cached after the
        step; num_keys S, the key slots gathered per row. The mask is additive [B, 1, T, S]
        in ``dtype``, built here once for every layer (SDPA and the paged decode kernels take
        it as it is). ``causal``: the caller knows every row starts at position 0 with its
        padding, if any, after its tokens (fresh prompts, right-padded), so a prefill without
        a sliding window attends causally over its own T keys (``is_causal``: no mask is
        built, nothing gathered from the pool); a padding query's output is garbage that no
        one reads."""
        causal = causal and positions.shape[1] > 1 and sliding_window is None
        cos, sin = _rotary(rotary, positions, dtype, query_valid)
        if causal:  # SDPA takes no mask then
            return cls(positions, None, cos, sin, True)
        k_pos = torch.arange(num_keys, device=positions.device)  # [S]
        mask = (k_pos[None, None, :] < context_lens[:, None, None]) \
            & (k_pos[None, None, :] <= positions[:, :, None])  # [B, T, S]
        if sliding_window is not None:
            mask &= positions[:, :, None] - k_pos[None, None, :] < sliding_window
        mask |= (k_pos == 0)[None, None, :] & ~query_valid[:, :, None]  # padding queries: finite softmax
        b, t = positions.shape
        bias = torch.zeros(b, 1, t, num_keys, dtype=dtype, device=mask.device).masked_fill_(~mask[:, None],
                                                                                           float("-inf"))
        return cls(positions, bias, cos, sin)


# Extra q / k / v coordinates of a sink attention's SDPA (``Attention._sdpa_sinks``), and the
# multiple its key count is rounded up to: a multiple of 8 keeps the fused kernels' alignment.
SINK_PAD = 8


class PagedKVCache:
    """Keys and values in fixed-size blocks shared by every sequence (continuous batching):
    [layers, blocks * block_size + 1, KV heads, D]; the last slot takes padding writes.

    A sequence owns a list of blocks (its block table); its token i lives in slot
    ``table[i // block_size] * block_size + i % block_size``. Before each forward the
    caller sets the step's slots with ``set_step``: ``write_slots`` where the new keys go,
    ``read_slots`` where each row's keys lie in token order (the attention reads them in
    place, or ``gather``s them)."""

    by_tokens = False  # split over the tensor-parallel ranks by tokens (``dense.kv_shard``)

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, v_dim: int | None = None):
        """``v_dim``: the values' width where it is not ``head_dim`` (0: keys alone, as latent
        attention caches them)."""
        shape = (num_layers, num_blocks * block_size + 1, kv_heads, head_dim)
        self.num_layers = num_layers
        self.k, self.v = self._allocate(shape, head_dim if v_dim is None else v_dim, dtype, torch.device(device))
        self.num_blocks, self.block_size = num_blocks, block_size
        self.trash = num_blocks * block_size
        self.write_slots = self.read_slots = None

    def _allocate(self, shape: tuple, v_dim: int, dtype: torch.dtype, device: torch.device):
        """-> the key and value pools of every layer, [layers, slots, KV heads, D / v_dim]."""
        return (torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(*shape[:-1], v_dim, dtype=dtype, device=device))

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s key and value pools [slots, KV heads, D], on the device, for this
        step's attention to read and write in place."""
        return self.k[layer], self.v[layer]

    def finish_step(self) -> None:
        """After a forward (``OffloadedKVCache``: its keys back to host memory)."""

    def slots(self, table: list[int], start: int, stop: int) -> list[int]:
        """Flat slots of a sequence's tokens start .. stop - 1."""
        bs = self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, stop)]

    def set_step(self, write_slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, num_keys: int):
        """write_slots [B, T]: slot of each new token (``trash`` for padding); tables [B, N]
        each row's block table, lens [B] its tokens after the step: the keys each row
        attends to are its first ``num_keys`` slots in token order (``trash`` past its length)."""
        bs = self.block_size
        k = torch.arange(num_keys, device=tables.device)
        read = tables[:, k // bs] * bs + k % bs  # [B, S]
        self.use_slots(write_slots, torch.where(k[None, :] < lens[:, None], read, self.trash))

    def use_slots(self, write_slots: torch.Tensor, read_slots: torch.Tensor):
        """The step's slots as the caller computed them: write_slots [B, T], read_slots [B, S]
        (``trash`` past each row's length), as ``set_step`` derives them."""
        self.write_slots, self.read_slots = write_slots, read_slots

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Stores k, v [B, KV heads, T, D] at the step's write slots."""
        b, h, t, d = k.shape
        slots = self.write_slots.reshape(-1)
        k_pool, v_pool = self.pools(layer)
        k_pool.index_copy_(0, slots, k.transpose(1, 2).reshape(b * t, h, d))
        v_pool.index_copy_(0, slots, v.transpose(1, 2).reshape(b * t, h, v.shape[-1]))

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values [B, KV heads, S, D] in token order, gathered into a copy
        (where no kernel reads the pool in place)."""
        k_pool, v_pool = self.pools(layer)
        return k_pool[self.read_slots].transpose(1, 2), v_pool[self.read_slots].transpose(1, 2)


class Attention(nn.Module):
    """With a tensor-parallel group of P ranks each rank holds num_heads / P query heads
    and their KV heads: num_kv_heads / P of them, or one KV head shared by P / num_kv_heads
    ranks when there are fewer KV heads than ranks. The output projection is row-parallel
    (one all-reduce); the KV cache holds only this rank's KV heads."""

    def __init__(self, cfg, tp: Group | None = None, options: KernelOptions = KernelOptions(), layer: int = 0):
        super().__init__()
        tp = tp or Group.alone()
        self.options = options
        d = cfg.head_dim
        self.head_dim = d
        self.num_heads = cfg.num_heads // tp.size
        if cfg.num_kv_heads % tp.size == 0:
            self.num_kv_heads, kv_first, replicas = cfg.num_kv_heads // tp.size, None, 1
            kv_first = tp.rank * self.num_kv_heads
        else:  # more ranks than KV heads: replicate each KV head over P / num_kv_heads ranks
            replicas = tp.size // cfg.num_kv_heads
            self.num_kv_heads, kv_first = 1, tp.rank // replicas
        q_first = tp.rank * self.num_heads
        q_width, kv_width = self.num_heads * d, self.num_kv_heads * d
        self.split = (q_width, kv_width, kv_width)
        # The fused decode kernels: power-of-two head dims (rotary over all of a head or its
        # first dimensions; NoPE layers' query temperature is not in the kernels).
        self.rope = layer not in getattr(cfg, "nope_layers", ())
        self.fusable = qkv_decode_supported(d) and self.rope
        # An all-heads q / k norm over heads split across ranks (OLMoE) needs every rank's
        # sums of squares. The QKV weight then also holds the other ranks' q and k rows,
        # after this rank's v: a decode step whose attention runs in one launch projects
        # them too and the kernel adds their squares (a few more weight bytes read); prompts
        # and the other steps project this rank's rows alone and all-reduce the sums, which
        # takes a collective and two more launches (``_prenorm``).
        self.sharded_norm = cfg.qk_norm == "full" and tp.size > 1
        self.other_heads = ((cfg.num_heads - self.num_heads, cfg.num_kv_heads - self.num_kv_heads)
                            if self.sharded_norm and self.fusable else (0, 0))
        self.own_rows = q_width + 2 * kv_width  # the rows of this rank's heads
        # One fused projection for q, k and v: one weight read per step.
        self.qkv_proj = Linear(cfg.hidden_size, self.own_rows + sum(self.other_heads) * d, bias=cfg.qkv_bias,
                               options=options)
        q_total, kv_total = cfg.num_heads * d, cfg.num_kv_heads * d

        def pick(full):  # this rank's q rows, then its k rows, then its v rows (then the others' q and k)
            q0, k0, v0 = q_first * d, q_total + kv_first * d, q_total + kv_total + kv_first * d
            spans = [(q0, q0 + q_width), (k0, k0 + kv_width), (v0, v0 + kv_width)]
            if any(self.other_heads):
                spans += [(0, q0), (q0 + q_width, k0), (k0 + kv_width, q_total + kv_total)]
            return torch.cat([full[lo:hi] for lo, hi in spans if hi > lo])  # (a lazy checkpoint reads no empty one)
        self.qkv_proj.shard_fns = {"weight": pick, "bias": pick}
        self.o_proj = RowParallelLinear(q_total, cfg.hidden_size, cfg.out_bias, tp, options)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":  # Qwen3: over each head's D values
            self.q_norm, self.k_norm = RMSNorm(d, cfg.norm_eps, options), RMSNorm(d, cfg.norm_eps, options)
        elif cfg.qk_norm == "full":  # OLMoE: over all heads together, so across ranks
            self.q_norm = ShardedRMSNorm(q_width, q_total, cfg.norm_eps, tp, q_first * d)
            self.k_norm = ShardedRMSNorm(kv_width, kv_total, cfg.norm_eps, tp, kv_first * d, replicas)
        self.clip_qkv = cfg.clip_qkv
        # Whether this layer's keys are limited to a local span: GPT-OSS's sliding window (on
        # every other layer), Llama 4's chunk (on its rotary layers).
        self.sliding = layer in getattr(cfg, "sliding_layers", ()) or layer in getattr(cfg, "chunked_layers", ())
        # Llama 4: rotary positions or none (NoPE, its queries scaled by the position), an
        # L2 q/k norm on the rotary layers, rotary over interleaved pairs.
        self.l2_norm = cfg.qk_norm == "l2" and self.rope
        self.temperature = None if self.rope else getattr(cfg, "nope_temperature", None)
        self.norm_eps = cfg.norm_eps
        self._ones: torch.Tensor | None = None  # the L2 norm's unit weights, for the fused kernels
        if getattr(cfg, "rope_interleaved", False):
            # The checkpoint rotates interleaved pairs: its q and k rows are read as halves.
            q_rows, k_rows = self.split[0], self.split[1]

            def halves(t):  # this rank's [q; k; v] rows (weight or bias)
                q, k, v = t.split([q_rows, k_rows, t.shape[0] - q_rows - k_rows])
                return torch.cat([pairs_to_halves(q, d, 0, d), pairs_to_halves(k, d, 0, d), v])
            self.qkv_proj.load_fns = {"weight": halves, "bias": halves}
        # GPT-OSS: a learned logit per query head joins its softmax as one more key that adds
        # no value (``_sdpa``; a decode step's kernels start their softmax from it).
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if getattr(cfg, "attention_sinks", False) else None
        if self.sinks is not None:
            heads = self.num_heads
            self.shard_fns = {"sinks": lambda full: full[q_first:q_first + heads]}
        self.tp, self.kv_replicas = tp, replicas

    def _epilogue(self, device: torch.device, others: bool = False) -> tuple:
        """The fused kernels' q / k norm, its weights and eps, and the clip (``others``: the
        row holds the other ranks' q and k, so the kernel norms over all heads)."""
        norm = getattr(self, "q_norm", None)
        if self.l2_norm:  # a per-head RMS norm of unit weights (before the rotation, where a
            # rotation keeps each head's norm: the same)
            if self._ones is None or self._ones.device != device:
                self._ones = torch.ones(self.head_dim, device=device)
            return "head", self._ones, self._ones, self.norm_eps, self.clip_qkv
        if norm is None or (self.sharded_norm and not others):  # (sharded: q and k come normed)
            return None, None, None, 1e-6, self.clip_qkv
        return self.qk_norm, norm.weight, self.k_norm.weight, norm.eps, self.clip_qkv

    def _one_launch(self, b: int, t: int, cache: PagedKVCache | None, device: torch.device) -> bool:
        """Whether a step of B rows of T tokens runs its attention in one launch
        (``kernels.qkv_attention``)."""
        return (cache is not None and not cache.by_tokens and t == 1 and self.fusable
                and self.options.fused_decode_attention
                and (device.type != "cuda" or qkv_attention_fits(
                    b, self.num_heads, self.num_kv_heads, self.head_dim, cache.read_slots.shape[1],
                    torch.cuda.get_device_properties(device).multi_processor_count)))

    def _rows(self, x: torch.Tensor, cache: PagedKVCache | None) -> int | None:
        """The QKV rows a step projects: all (None), with the other ranks' q and k, where
        the attention runs in one launch and reads them; else this rank's own."""
        if any(self.other_heads) and self._one_launch(x.shape[0], x.shape[1], cache, x.device):
            return None
        return self.own_rows

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: PagedKVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        rows = self._rows(x, cache)
        return self._attend(ctx.per_token(lambda z: self.qkv_proj(z, rows=rows), x), ctx, cache, layer)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm, ctx: StepContext,
                       cache: PagedKVCache | None = None, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention on norm(x + residual) -> (output, x + residual): the add and the norm go
        into the QKV GEMM's prologue where that is one launch (``kernels.norm_linear``)."""
        qkv, summed = self.qkv_proj.normed(x, residual, norm, rows=self._rows(x, cache))
        return self._attend(qkv, ctx, cache, layer), summed

    def _attend(self, qkv: torch.Tensor, ctx: StepContext, cache: PagedKVCache | None, layer: int) -> torch.Tensor:
        b, t, _ = qkv.shape
        if self.sliding:
            ctx = ctx.for_window()
        if cache is not None:
            out = self._paged(qkv, ctx, cache, layer)
        else:  # a forward without a cache (Engine.logits): the step's own keys, through torch ops
            out = self._sdpa(*self._unfused(qkv, ctx), ctx)
        return ctx.per_token(self.o_proj, out.transpose(1, 2).reshape(b, t, -1))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """SDPA -> [B, Hq, T, D]. A full prefill from position 0 attends causally over its own
        T keys: no mask, so the flash kernels skip the masked half; otherwise the mask over
        every key slot."""
        if self.sinks is not None:
            return self._sdpa_sinks(q, k, v, ctx)
        gqa = self.num_heads != self.num_kv_heads
        if gqa and not ctx.causal and q.is_cuda:
            # The memory-efficient kernel takes a mask but not grouped heads: give it every
            # query head its keys (else only the math kernel would run it).
            k, v = (z.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1) for z in (k, v))
            gqa = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if ctx.causal else ctx.attn_mask,
                                              is_causal=ctx.causal, enable_gqa=gqa)

    def _sdpa_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """SDPA with each head's sink logit -> [B, Hq, T, D]: one more key, of zero value, whose
        score is the head's sink. q, k and v gain SINK_PAD coordinates, zero but for one: q's
        holds its head's sink / scale, the sink key's 1, every real key's 0. So the sink varies
        by head while the mask stays one per row ([B, 1, T, S']), never one per head: a long
        prompt's mask is T x S, not heads x T x S. Keys past S + 1, masked, round S' up to a
        multiple of SINK_PAD so the fused kernels take the mask without padding a copy of it."""
        b, hq, t, d = q.shape
        hkv, s, dv = k.shape[1], k.shape[2], v.shape[-1]
        pad, width = SINK_PAD, max(d, dv) + SINK_PAD
        keys = -(-(s + 1) // pad) * pad  # the real keys, the sink, masked padding
        mask = ctx.attn_mask
        if mask is None:  # causal over this step's own keys
            i = torch.arange(t, device=q.device)
            mask = (i[None, :] <= i[:, None])[None, None]
        if mask.dtype != torch.bool:  # additive: whatever it holds, then 0 (the sink), then -inf
            extra = torch.full((*mask.shape[:-1], keys - s), float("-inf"), dtype=mask.dtype, device=mask.device)
            extra[..., 0] = 0
        else:
            extra = torch.zeros((*mask.shape[:-1], keys - s), dtype=torch.bool, device=mask.device)
            extra[..., 0] = True
        mask = torch.cat([mask, extra], dim=-1)  # [B or 1, 1, T, S']
        wide = torch.promote_types(q.dtype, torch.float32)
        sink_col = (self.sinks.to(wide) * d ** 0.5).to(q.dtype)  # the softmax scale is d ** -0.5
        qs = q.new_zeros(b, hq, t, width)
        qs[..., :d] = q
        qs[..., width - 1] = sink_col[None, :, None]
        ks = k.new_zeros(b, hkv, keys, width)
        ks[:, :, :s, :d] = k
        ks[:, :, s, width - 1] = 1
        vs = v.new_zeros(b, hkv, keys, width)
        vs[:, :, :s, :dv] = v
        if hq != hkv:
            ks, vs = (z.repeat_interleave(hq // hkv, dim=1) for z in (ks, vs))
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=d ** -0.5)
        return out[..., :dv]

    def _paged(self, qkv: torch.Tensor, ctx: StepContext, cache: PagedKVCache, layer: int) -> torch.Tensor:
        """Attention over a ``PagedKVCache`` -> [B, Hq, T, D]. Where the layer is fusable the
        QKV epilogue and the pool write are one launch (``kernels.qkv_decode`` at the step's
        write slots; on a CPU, like every kernel here, its torch reference), and a decode
        step that fits runs its whole attention in one (``kernels.qkv_attention``). A decode
        step is captured in a CUDA graph: nothing here waits for the device or takes a shape
        from its values."""
        if cache.by_tokens:  # a cache split over the ranks by tokens
            return self._paged_by_tokens(qkv, ctx, cache, layer)
        b, t, width = qkv.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_pool, v_pool = cache.pools(layer)
        others = width > self.own_rows  # the other ranks' q and k came too (``_rows``)
        if self.fusable and self.sharded_norm and not others:
            qkv = self._prenorm(qkv)
        if self._one_launch(b, t, cache, qkv.device):
            out = kernels.qkv_attention(qkv.reshape(b, -1), hq, hkv, d, k_pool, v_pool, cache.write_slots,
                                        ctx.attn_mask, ctx.cos, ctx.sin, *self._epilogue(qkv.device, others),
                                        pdl=self.options.pdl, read_slots=cache.read_slots, positions=ctx.positions,
                                        sinks=self.sinks, other_heads=self.other_heads if others else (0, 0))
            return out[:, :, None]  # [B, Hq, 1, D]
        if self.fusable:
            # A fresh prompt attends over its own keys: the epilogue stores them for SDPA too.
            fresh = tuple(qkv.new_empty(b, t, hkv, d) for _ in range(2)) if ctx.causal else None
            q = kernels.qkv_decode(qkv, hq, hkv, d, k_pool, v_pool, cache.write_slots, ctx.cos, ctx.sin,
                                   *self._epilogue(qkv.device), pdl=self.options.pdl, kv_out=fresh)  # [B, Hq, T, D]
            k, v = (fresh[0].transpose(1, 2), fresh[1].transpose(1, 2)) if ctx.causal else (None, None)
        else:
            q, k, v = self._unfused(qkv, ctx)
            cache.write(layer, k, v)
        if ctx.causal:
            return self._sdpa(q, k, v, ctx)
        if t == 1:
            # A decode step: its keys are read where they lie in the pool, not gathered row
            # by row into a copy first (a gather and SDPA measured about twice the time, at
            # 1 and at 8 query heads per KV head); sinks join the splits' combine.
            out = kernels.paged_decode_attention(q[:, :, 0], k_pool, v_pool, cache.read_slots, ctx.attn_mask[:, 0, 0],
                                                 sinks=self.sinks, positions=ctx.positions)  # [B, Hq, D]
            return out[:, :, None]
        return self._sdpa(q, *cache.gather(layer), ctx)

    def _paged_by_tokens(self, qkv: torch.Tensor, ctx: StepContext, cache, layer: int) -> torch.Tensor:
        """``_paged`` over a ``dense.kv_shard.TokenShardedKVCache``: every rank's new keys
        (and queries, where earlier keys are read) gathered and this rank's blocks' stored,
        then attention over this rank's keys -> this rank's heads [B, Hq, T, D]."""
        from dense.kv_shard import combine_heads, gather_heads, split_attention

        scale = self.head_dim ** -0.5
        if qkv.shape[1] == 1 and not ctx.causal and self.fusable and self.kv_replicas == 1:
            # A decode step: every rank's q, k, v rows in one all-gather (an all-heads norm's
            # sums added over the ranks first), then for each rank's part the QKV epilogue
            # and the append of its heads' k and v at this rank's slots in one launch, the
            # keys read where they lie: the torch ops below, in P + 1 launches.
            if self.sharded_norm:
                qkv = self._prenorm(qkv)
            b, hq, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
            parts = all_gather(qkv, self.tp, dim=0)  # [P * B, 1, W], rank by rank
            k_pool, v_pool = cache.pools(layer)
            epilogue = self._epilogue(qkv.device)
            q_all = torch.cat([kernels.qkv_decode(parts[j * b:(j + 1) * b], hq, hkv, d,
                                                  k_pool[:, j * hkv:(j + 1) * hkv], v_pool[:, j * hkv:(j + 1) * hkv],
                                                  cache.write_slots, ctx.cos, ctx.sin, *epilogue, pdl=self.options.pdl)
                               for j in range(self.tp.size)], dim=1)  # [B, P * Hq, 1, D]
            out, lse = kernels.paged_decode_partial(q_all[:, :, 0], k_pool, v_pool, cache.read_slots,
                                                    cache.visible(ctx.attn_mask), scale)
            return combine_heads(out[:, :, None], lse[:, :, None], self.tp, self.sinks)
        q, k, v = self._unfused(qkv, ctx)  # this rank's heads
        if ctx.causal:  # fresh prompts attend over their own keys: this rank's heads, as unsplit
            k_all, v_all = gather_heads(self.tp, k, v)
        else:
            q_all, k_all, v_all = gather_heads(self.tp, q, k, v)
        r = self.kv_replicas  # (each KV head comes from each of its replicas: keep one)
        cache.write(layer, k_all[:, ::r], v_all[:, ::r])
        if ctx.causal:
            return self._sdpa(q, k, v, ctx)
        if qkv.shape[1] == 1:  # a decode step reads this rank's keys where they lie in the pool
            k_pool, v_pool = cache.pools(layer)
            out, lse = kernels.paged_decode_partial(q_all[:, :, 0], k_pool, v_pool, cache.read_slots,
                                                    cache.visible(ctx.attn_mask), scale)
            return combine_heads(out[:, :, None], lse[:, :, None], self.tp, self.sinks)
        return split_attention(q_all, *cache.gather(layer), ctx.attn_mask, cache.own_keys, scale, self.tp, self.sinks)

    def _prenorm(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [B, T, W] with q and k through their all-heads norms, in place: the sums of
        squares of both (one launch) added over the TP ranks in one all-reduce, then both
        scaled (one launch): ``ShardedRMSNorm``'s math, twice."""
        qn, kn = self.q_norm, self.k_norm
        pdl = self.options.pdl
        sq = all_reduce(kernels.qk_sum_squares(qkv, self.split[0], self.split[1], pdl=pdl), qn.group)  # [B, T, 2]
        return kernels.qk_norm_apply(qkv, sq, qn.weight, kn.weight, qn.total, kn.replicas * kn.total, qn.eps,
                                     pdl=pdl)

    def _unfused(self, qkv: torch.Tensor, ctx: StepContext):
        """q [B, Hq, T, D], k, v [B, Hkv, T, D] (this step's own) through torch ops (any device
        and step)."""
        b, t, _ = qkv.shape
        q, k, v = qkv.split(self.split, dim=-1)  # [B, T, heads * D] each
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, D]
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if ctx.cos is not None and self.rope:
            q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        if self.l2_norm:  # (a rotation keeps each head's norm: before or after it, the same)
            q, k = ((z.float() * torch.rsqrt(z.float().pow(2).mean(-1, keepdim=True) + self.norm_eps)).to(z.dtype)
                    for z in (q, k))
        if self.temperature is not None:  # log1p(floor((position + 1) / floor)) * scale + 1
            floor, scale = self.temperature
            t_scale = torch.log1p(torch.floor((ctx.positions.float() + 1.0) / floor)) * scale + 1.0  # [B, T]
            q = (q * t_scale[:, None, :, None]).to(q.dtype)
        return q, k, v
