"""Model assembly: embedding, blocks of attention + (dense MLP | MoE layer), LM head.

Shape letters: B batch, T tokens this step, S key slots, H hidden, V vocab.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention import sdpa_kernel

import kernels
from comm import ParallelGroups
from dense import MLP, Attention, PagedKVCache, Rotary, StepContext, make_norm
from dense.attention import GRAPH_SDPA_BACKENDS, SDPA_BACKENDS
from dense.mla import LatentAttention
from dense.norm import RMSNorm
from dense.parallel_linear import Linear, VocabParallelHead
from kernels.attention.reference import paged_decode_context_ref
from kernels.norm import ROUTER_MAX_ROWS
from kernels.options import KernelOptions
from moe_infer.config import Config
from moe_infer.moe_layer import MoELayer


class OtherStage(nn.Module):
    """The place of a block another pipeline stage holds (no weights here): the blocks keep
    their global indices, as the checkpoint names them."""


def layer_cost(cfg: Config, index: int) -> float:
    """Weights one token reads in block ``index`` (a MoE layer: its routed experts' top-k
    share and the shared experts), for balancing pipeline stages."""
    m, e = cfg.model, cfg.moe
    attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    if e is not None and cfg.is_moe_layer(index):
        gated = 3 if m.gated else 2
        ffn = gated * m.hidden_size * (e.top_k * e.expert_hidden + e.shared_experts * e.shared_expert_hidden)
    else:
        ffn = (3 if m.gated else 2) * m.hidden_size * m.ffn_hidden
    return attn + ffn


def stage_layers(cfg: Config, stages: int) -> list[range]:
    """Contiguous blocks per pipeline stage with the least cost on the costliest stage
    (``layer_cost``; the LM head counts on the last stage), each stage at least one block."""
    n = cfg.model.num_layers
    cost = [layer_cost(cfg, i) for i in range(n)]
    head = cfg.model.vocab_size * cfg.model.hidden_size
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the least costliest stage when the first s stages hold blocks [0, i)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                here = prefix[i] - prefix[j] + (head if s == stages else 0.0)
                value = max(best[s - 1][j], here)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(stages, 0, -1):
        bounds.append(range(cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


class Block(nn.Module):
    def __init__(self, cfg: Config, index: int, groups: ParallelGroups, options: KernelOptions,
                 cache_index: int | None = None):
        super().__init__()
        m = cfg.model
        self.parallel = m.parallel_block
        self.attn_norm = make_norm(m.norm, m.hidden_size, m.norm_eps, options)
        self.attn = LatentAttention(m, groups.tp, options, index) if m.kv_lora_rank is not None \
            else Attention(m, groups.tp, options, index)
        # A parallel block feeds the same normed input to attention and FFN.
        self.ffn_norm = None if self.parallel else make_norm(m.norm, m.hidden_size, m.norm_eps, options)
        if cfg.is_moe_layer(index):
            self.ffn = MoELayer(m, cfg.moe, cfg.parallel, groups, options)
        else:
            self.ffn = MLP(m.hidden_size, m.ffn_hidden, m.activation, bias=m.mlp_bias, tp=groups.tp, options=options)
        # The block's layer of this stage's KV cache (its index where one stage holds all).
        self.index, self.options = index if cache_index is None else cache_index, options
        self.fused_router = isinstance(self.ffn, MoELayer) and isinstance(self.ffn_norm, RMSNorm)
        # The attention norm and its residual add run inside the QKV GEMM's launch (latent
        # attention: its merged input projection's; forward_normed -> kernels.norm_linear)
        # where the dense table's entry for those weights is the CUDA SBI-GeMM with "norm";
        # elsewhere norm_linear makes the two launches. Every GEMM block recomputes the
        # norm, in one round trip after its wait. The tables give "norm" only to the
        # entries where the decode step measured faster with it (see kernels.linear.select).
        # A parallel block also feeds the normed input to its FFN, so it keeps the norm's output.
        self.norm_fusable = (isinstance(self.attn_norm, RMSNorm) and not self.parallel
                             and isinstance(self.attn, (Attention, LatentAttention)))

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: PagedKVCache | None,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual stream, this block's output not yet added to it). ``pending`` is
        the previous block's such output: each residual add happens inside the next norm
        (one launch for add + RMSNorm on a GPU)."""
        if pending is None:
            h = self.attn_norm(x)
            a = self.attn(h, ctx, cache, self.index)
        elif self.norm_fusable and ctx.tokens is None:  # the add and the norm inside the QKV GEMM's launch
            a, x = self.attn.forward_normed(pending, x, self.attn_norm, ctx, cache, self.index)
        else:
            h, x = self.attn_norm.add_and_norm(pending, x)
            a = self.attn(h, ctx, cache, self.index)
        if self.parallel:
            return x, a + ctx.per_token(self.ffn, h)
        if ctx.tokens is None and self.fused_router and a.is_cuda and a.numel() <= ROUTER_MAX_ROWS * a.shape[-1]:
            # Decode: the add, the norm and the router GEMM in one launch.
            shape = a.shape
            h, x, logits, _, _ = kernels.rms_norm_router(a.view(-1, shape[-1]), x.view(-1, shape[-1]),
                                                         self.ffn_norm.weight, self.ffn_norm.eps,
                                                         self.ffn.router.weight, pdl=self.options.pdl)
            return x.view(shape), self.ffn(h.view(shape), router_logits=logits)
        h, x = self.ffn_norm.add_and_norm(a, x)
        return x, ctx.per_token(self.ffn, h)  # (over the real tokens alone where some are padding)


class Transformer(nn.Module):
    """The model as one rank holds it: ``groups`` (built once from ``cfg.parallel``) decide
    which blocks (its pipeline stage's), heads, FFN columns and experts live here; the
    embeddings (first stage), final norm and LM head (last stage) are replicated over the
    stage's ranks. The kernel options of ``cfg.engine`` reach every layer that launches
    kernels."""

    def __init__(self, cfg: Config, groups: ParallelGroups | None = None):
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        groups = groups or ParallelGroups.single()
        self.options = options = cfg.engine.kernel_options()
        # Pipeline parallelism: this stage's blocks; the others' places hold no weights. The
        # first stage holds the embeddings, the last the final norm and the head.
        self.pp = groups.pp
        first, last = self.pp.rank == 0, self.pp.rank == self.pp.size - 1
        self.tied = m.tied_embeddings
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size) if first or (last and self.tied) else None
        self.pos_embed = nn.Embedding(m.max_position, m.hidden_size) if first and m.positions == "learned" else None
        self.rotary = Rotary(m.rotary_width, m.rope_theta, m.rope_scaling, m.max_position) \
            if m.positions == "rope" else None
        self.own = stage_layers(cfg, self.pp.size)[self.pp.rank]
        self.layers = nn.ModuleList(Block(cfg, i, groups, options, i - self.own.start) if i in self.own
                                    else OtherStage() for i in range(m.num_layers))
        self.num_kv_heads = self.layers[self.own.start].attn.num_kv_heads  # on this rank
        self.tp = groups.tp
        self.norm = make_norm(m.norm, m.hidden_size, m.norm_eps, options) if last else None
        self.lm_head = None
        if last and not self.tied:  # split by vocabulary over the TP ranks (a tied head stays whole)
            self.lm_head = VocabParallelHead(m.hidden_size, m.vocab_size, groups.tp, options) if groups.tp.size > 1 \
                else Linear(m.hidden_size, m.vocab_size, bias=False, options=options)
        self.home: torch.device | None = None  # set by the loader for streamed blocks

    @property
    def anchor(self) -> torch.Tensor:
        """A weight every stage holds (its first block's attention norm, in full precision):
        the model's dtype."""
        return self.layers[self.own.start].attn_norm.weight

    @property
    def device(self) -> torch.device:
        """Where the model runs: its first block's device, or, where the blocks live in host
        memory and are copied in to run (``offload: layers``), the device they run on."""
        return self.home if self.home is not None else self.anchor.device

    def dispatchers(self) -> list:
        """Each MoE layer's dispatcher (where its experts live, how tokens reach them)."""
        return [m.dispatcher for m in self.modules() if isinstance(m, MoELayer)]

    def fix_exchanges(self, num_tokens: int) -> None:
        """Steps of at most ``num_tokens`` tokens exchange fixed-capacity buffers in every
        expert all-to-all (no host wait for the counts), so they can be captured in CUDA
        graphs; at least what ``parallel.a2a_fixed_tokens`` asks for."""
        for d in self.dispatchers():
            if hasattr(d, "fixed_tokens"):
                d.fixed_tokens = max(d.fixed_tokens, num_tokens)

    @contextmanager
    def exact_exchanges(self):
        """Inside, every expert all-to-all exchanges its counts first and sends exact sizes:
        for forwards whose token counts differ from rank to rank (fixed buffers are sized
        by the token count, which every rank must share)."""
        saved = [(d, d.fixed_tokens) for d in self.dispatchers() if hasattr(d, "fixed_tokens")]
        for d, _ in saved:
            d.fixed_tokens = 0
        try:
            yield
        finally:
            for d, v in saved:
                d.fixed_tokens = v

    def capturable(self, num_tokens: int) -> bool:
        """Whether a step over ``num_tokens`` tokens runs without waiting for the host, so a
        CUDA graph can hold it (collectives included, offloaded experts too)."""
        layers = [m for m in self.modules() if isinstance(m, MoELayer)]
        return not any(m.dispatcher.waits_for_host(num_tokens) or m.experts.waits_for_host(num_tokens) for m in layers)

    def make_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        m = self.cfg.model
        k, v = m.kv_widths
        if self.cfg.parallel.kv_shard == "tokens":  # every KV head, this rank's blocks (dense.kv_shard)
            from dense.kv_shard import TokenShardedKVCache

            heads = 1 if m.kv_lora_rank is not None else m.num_kv_heads  # (latent attention: one latent "head")
            return TokenShardedKVCache(len(self.own), num_blocks, block_size, heads, k, self.anchor.dtype, self.device,
                                       v, rank=self.tp.rank, ranks=self.tp.size)
        args = (len(self.own), num_blocks, block_size, self.num_kv_heads, k, self.anchor.dtype, self.device, v)
        mode = self.cfg.engine.kv_offload
        if mode is None:
            return PagedKVCache(*args)
        from dense.kv_offload import OffloadedKVCache

        parity = (self.device.index or 0) % 2  # GPUs 2i and 2i + 1 share a PCIe link
        mine = [i for i, layer in enumerate(self.own) if mode == "all" or layer % 2 == parity]
        return OffloadedKVCache(*args, offloaded=mine) if mine else PagedKVCache(*args)

    def rotary_tables(self, slots: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary cos / sin rows of positions 0 .. slots - 1, computed once for a static
        decode step over ``slots`` cache slots (None for learned positions, and for rotary
        frequencies that follow each step's positions: the step computes those)."""
        if self.rotary is None or self.rotary.per_step:
            return None
        return self.rotary.table(slots, self.anchor.dtype, self.device)

    def paged_context(self, positions: torch.Tensor, query_valid: torch.Tensor,
                      context_lens: torch.Tensor, num_keys: int, causal: bool = False,
                      tokens: torch.Tensor | None = None) -> StepContext:
        """``causal``: every row starts at position 0 with no padding (fresh prompts of one
        length; see ``StepContext.paged``). ``tokens``: the real queries' flat indices where
        some are padding (``StepContext.tokens``)."""
        ctx = StepContext.paged(positions, query_valid, context_lens, num_keys, self.rotary,
                                self.anchor.dtype, self._every_layer_window, causal=causal)
        return self._windowed(replace(ctx, tokens=tokens), positions[0] if ctx.causal else num_keys)

    def paged_decode_context(self, inputs: torch.Tensor, prev: torch.Tensor, cache: PagedKVCache, num_keys: int,
                             tables: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, StepContext]:
        """A fixed-shape paged decode step's inputs [B, 4 + N] (``moe_infer.runner.
        PagedDecodeStep``) -> (tokens [B, 1], its StepContext), the cache's write and read
        slots set for the step: one launch on a GPU (``kernels.attention.paged_context``),
        the same values through torch ops elsewhere. ``tables``: ``rotary_tables(num_keys)``."""
        args = (inputs, prev, cache.block_size, num_keys, cache.trash, self.anchor.dtype, tables,
                self._every_layer_window, True)  # the additive mask, as StepContext.paged makes it
        if inputs.is_cuda:
            from kernels.attention.paged_context import paged_decode_context_triton
            c = paged_decode_context_triton(*args, pdl=self.options.pdl)
        else:
            c = paged_decode_context_ref(*args)
        cache.use_slots(c["write"], c["read"])
        cos, sin = c["cos"], c["sin"]
        if self.rotary is not None and self.rotary.per_step:  # from this step's positions, on the device
            cos, sin = self.rotary(c["positions"], self.anchor.dtype)
        ctx = StepContext(c["positions"], c["mask"], cos, sin)
        return c["tokens"], self._windowed(ctx, num_keys)

    def context(self, positions: torch.Tensor, key_valid: torch.Tensor, no_padding: bool = False) -> StepContext:
        """A forward without a cache (``StepContext.build``)."""
        ctx = StepContext.build(positions, key_valid, self.rotary, self.anchor.dtype, self._every_layer_window,
                                no_padding)
        return self._windowed(ctx, positions)

    @property
    def _every_layer_window(self) -> int | None:
        """The sliding window of every layer's mask (None where only some layers have one)."""
        m = self.cfg.model
        return None if m.sliding_layers else m.sliding_window

    def _windowed(self, ctx: StepContext, keys: torch.Tensor | int) -> StepContext:
        """``ctx`` with the local layers' own mask (a sliding window, or chunks) where only
        some layers attend locally; ``keys``: the key slots' positions, or their count where
        key s is at position s (made here only where needed: a decode step launches nothing
        more for other models)."""
        m = self.cfg.model
        if not (m.sliding_layers or m.chunked_layers):
            return ctx
        if isinstance(keys, int):
            keys = torch.arange(keys, device=ctx.positions.device)
        if m.sliding_layers:
            return ctx.windowed(m.sliding_window, keys)
        return ctx.windowed(m.attention_chunk, keys, chunk=True)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext,
                cache: PagedKVCache | None = None, last_only: bool = False,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]; [B, 1, V] with ``last_only`` (each row's last
        slot) or with ``last`` [B] (the slot of each row's last token, for right-padded rows)."""
        pp, p = self.pp, self.anchor
        hidden = None
        if pp.rank > 0:  # the stage before's hidden states
            hidden = self.stage_input(input_ids.shape)
            dist.recv(hidden, src=pp.ranks[pp.rank - 1])
        out = self.stage_forward(input_ids, ctx, cache, last_only, last, hidden)
        if pp.rank < pp.size - 1:
            # On to the next stage; every stage returns the last stage's logits, so each
            # draws the same tokens and the first one feeds them.
            dist.send(out, dst=pp.ranks[pp.rank + 1])
            rows = 1 if last is not None or last_only else input_ids.shape[1]
            out = torch.empty(input_ids.shape[0], rows, self.cfg.model.vocab_size, dtype=p.dtype, device=self.device)
        if pp.size > 1:
            dist.broadcast(out, src=pp.ranks[-1], group=pp.group)
        return out

    def stage_input(self, shape: tuple[int, int]) -> torch.Tensor:
        """An empty [B, T, H] buffer for the hidden states a stage receives."""
        return torch.empty(*shape, self.cfg.model.hidden_size, dtype=self.anchor.dtype, device=self.device)

    def stage_forward(self, input_ids: torch.Tensor, ctx: StepContext, cache: PagedKVCache | None = None,
                      last_only: bool = False, last: torch.Tensor | None = None,
                      hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This pipeline stage's blocks alone, no communication: the first stage embeds
        ``input_ids`` [B, T], a later one starts from ``hidden`` [B, T, H], the previous
        stage's output. -> the hidden states for the next stage [B, T, H], or on the last
        stage the logits (as ``forward``'s)."""
        pp = self.pp
        if pp.rank == 0:
            x = self.embed(input_ids)  # [B, T, H]
            if self.pos_embed is not None:
                x = x + self.pos_embed(ctx.positions)
        else:
            x = hidden
        pending = None
        graph = ctx.graphed and self.options.cudnn_prefill_graphs
        with sdpa_kernel(GRAPH_SDPA_BACKENDS if graph else SDPA_BACKENDS, set_priority=graph):
            for i in self.own:
                x, pending = self.layers[i](x, ctx, cache, pending)
        if pp.rank < pp.size - 1:
            return (x if pending is None else x + pending).contiguous()
        return self._head(x, pending, last, last_only)

    def _head(self, x: torch.Tensor, pending: torch.Tensor | None, last: torch.Tensor | None,
              last_only: bool) -> torch.Tensor:
        """The final norm (with the last block's residual add) and the LM head."""
        if last is not None:  # generation needs one slot a row: skip T - 1 rows of the LM head
            rows = torch.arange(x.shape[0], device=x.device)
            x, pending = x[rows, last][:, None], (pending[rows, last][:, None] if pending is not None else None)
        elif last_only:
            x, pending = x[:, -1:], (pending[:, -1:] if pending is not None else None)
        x = self.norm(x) if pending is None else self.norm.add_and_norm(pending, x)[0]
        if self.tied:  # the embedding table (kept in full precision) is the head
            return x @ self.embed.weight.t()
        return self.lm_head(x)

    @torch.no_grad()
    def init_random(self, seed: int):
        """Seeded random weights for configs without a checkpoint (GPT-2 style scales)."""
        init_random(self, torch.Generator(device=self.device).manual_seed(seed))


@torch.no_grad()
def init_random(module: nn.Module, generator: torch.Generator):
    """GPT-2 style random values for the full-precision parameters of ``module`` (int8
    ones, already quantized, stay): biases 0, norm scales 1, the rest N(0, 0.02). Empty MXFP4
    experts (uint8 codes and scales) get uniform random codes under scales of 2 ** -7, which
    give their weights a standard deviation of about 0.02."""
    for name, p in module.named_parameters():
        if p.dtype == torch.uint8:
            if name.endswith("_scale"):
                p.fill_(127 - 7)
            else:
                p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, device=generator.device,
                                      generator=generator))
            continue
        if not p.is_floating_point():
            continue
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:  # norm scales
            p.fill_(1.0)
        elif p.device == generator.device:
            p.normal_(0.0, 0.02, generator=generator)
        else:  # drawn where the generator is, so the values do not depend on placement
            p.copy_(torch.empty(p.shape, dtype=p.dtype, device=generator.device).normal_(0.0, 0.02,
                                                                                         generator=generator))
