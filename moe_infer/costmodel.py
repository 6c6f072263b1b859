"""A cost model of every layout moe-infer runs: the time of a decode step or a prefill, the
memory each GPU needs, from a hardware profile (``Hardware``: measured by ``moe-infer
calibrate``, or shipped from published figures under ``moe_infer/hardware/``).

Each block on a rank costs the larger of its bytes over the memory bandwidth and its FLOPs
over the matmul rate its GEMMs reach at their rows (a roofline; an expert's rows are its
share of the routed pairs; a prompt's attention at the measured rate of the attention
kernel for its keys), plus its element-wise passes over the activations (norms, the
attention epilogue, the experts' dispatch) at the memory bandwidth, its collectives
(alpha-beta: a latency per message and bytes over the link's bandwidth, for the link the
group spans) and a fixed per-block overhead (the kernels' own latency); a call's prompts
add the host's fixed cost of a call (``Hardware.prefill_call_us``). What a rank reads
and computes follows the layout: attention and dense FFNs split over tp; experts over ep
(whole) and expert_slicing (their width); pipeline stages split the blocks
(``model.stage_layers``) and their micro-batches hide each other (``pipeline``'s
schedule); replicas split the batch where ``Engine.split_prompts`` says they do. The
routed experts a step reads are the expected number of distinct experts its tokens hit
(``distinct_experts``: uniform routing, or a measured histogram). A model offloaded to
host memory (``engine.gpu_memory_gb``) keeps the experts its budget holds after every
other weight on the device, the same number a layer as the planner does; the share of
those a step hits (the hit rate: the routing's, or a measured one) is read there, the rest
("cold") comes over the host link (read in place or copied: ``h2d_gbps``) or is computed
by the CPU (``engine.offload: cpu``: its weight-read rate ``cpu_matmul_gbps``), after the
device's part of the layer.

Shape letters: B rows, S tokens of context, H hidden, D head dim, E experts, k slots, F
expert width, V vocab, L blocks.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from moe_infer.closed_forms import CLOSED_FORMS, busiest_rank_experts, distinct_experts, pipeline_slots
from moe_infer.config import Config, ConfigError, ParallelConfig
from moe_infer.hardware_profile import GB, Hardware, local_profile, moe_kernel_key


# ----------------------------------------------------------------------------- the model
@dataclass
class Prediction:
    """One (layout, phase, batch): ``ms`` a decode step (every row one token) or the whole
    prefill; ``tokens_per_s``; per GPU ``memory_gb``; the split (ms) of the step or the
    prefill's forwards (a pipeline's: of one slot) into memory reads, compute, collectives
    and fixed overhead on the critical rank."""

    layout: str
    phase: str
    batch: int
    ms: float
    tokens_per_s: float
    memory_gb: float
    fits: bool
    split: dict = field(default_factory=dict)
    parallel: ParallelConfig | None = None


def layout_name(p: ParallelConfig) -> str:
    parts = [f"{k}{v}" for k, v in (("tp", p.tp), ("ep", p.ep), ("pp", p.pp), ("dp", p.dp)) if v > 1]
    if p.expert_slicing > 1:
        parts.append(f"slicing{p.expert_slicing}")
    if p.dp_attention:
        parts.append("dp-attention")
    if p.kv_shard == "tokens":
        parts.append("kv-tokens")
    return "-".join(parts) or "one GPU"


def with_layout(cfg: Config, parallel: ParallelConfig) -> Config:
    """``cfg`` under ``parallel``, refused with one line where the model cannot take it."""
    return dataclasses.replace(cfg, parallel=parallel)


class AttentionCost(NamedTuple):
    """One block's attention on a rank (``CostModel._attention``)."""

    weights: float  # bytes of its projections' weights
    kv: float  # bytes of the KV cache it reads
    flops: float  # of the projections (at the rows of the new tokens)
    score_flops: float  # of the score and output products over the keys
    score_rows: float  # query rows that share each key read: those products' GEMM rows
    kv_token: float  # bytes a cached token takes
    score_rate: float | None = None  # FLOP/s of those products where measured (a prompt's attention kernel)


class CostModel:
    """Predictions for one model on one hardware profile (``predict``, ``rank``)."""

    USABLE = 0.9  # of a GPU's memory, for weights and KV (the rest: activations, workspaces)

    def __init__(self, cfg: Config, hw: Hardware, weight_bytes: float = 2.0, act_bytes: float = 2.0,
                 histogram: list[float] | dict[int, list[float]] | None = None, expert_bytes: float | None = None,
                 hit_rate: float | None = None):
        """``histogram``: a measured routing, each expert's picks (counts, as
        ``moe_infer.routing.load`` gives them) or share of the picks, for every MoE layer or
        by layer (a layer it lacks routes uniformly; ``distinct_experts`` reads either).
        ``expert_bytes``: of a routed expert's weight, where it differs (MXFP4 experts).
        ``hit_rate``: offloaded models, the share of routed pairs whose expert is on the
        device, where measured (default: the routing's share of the experts kept there)."""
        self.cfg, self.hw = cfg, hw
        self.wb, self.ab = weight_bytes, act_bytes
        self.eb = weight_bytes if expert_bytes is None else expert_bytes
        self.histogram, self.hit_rate = histogram, hit_rate
        m = cfg.model
        self.head_dim = m.head_dim or m.hidden_size // m.num_heads
        self.kv_heads = m.num_kv_heads or m.num_heads

    # -- per block, on one rank
    def _attention(self, p: ParallelConfig, rows: float, tokens: float, context: float,
                   index: int = 0) -> "AttentionCost":
        """Block ``index``'s attention on a rank: ``rows`` sequences of ``tokens`` new tokens
        over ``context`` keys (a prompt's: the mean a query attends). At decode its score and
        output products read each key once for every query row that shares it (a KV head's
        group of query heads, every head for a latent), so they run at the matmul rate of
        that many rows, not of the projections' ``tokens``; a prompt's run in one attention
        kernel, at the profile's ``attention_rate`` where it has one (``_prompt_attention``)."""
        m, d = self.cfg.model, self.head_dim
        hq = m.num_heads / p.tp
        if m.kv_lora_rank is not None:  # latent attention: the latent and its projection whole on each rank
            c, r, v, ql, h = m.kv_lora_rank, m.rotary_width, m.v_head_dim, m.q_lora_rank, m.hidden_size
            q = h * ql + ql * hq * d if ql else h * hq * d
            weights = (q + h * (c + r) + c * hq * (d - r + v) + hq * v * h) * self.wb
            # split by tokens: every head's queries over 1 / tp of the tokens (one latent "head")
            share = 1 / p.tp if p.kv_shard == "tokens" else 1
            kv_token = (c + r) * self.ab * share
            flops = 2 * rows * tokens * weights / self.wb
            if tokens > 1 and p.kv_shard != "tokens":  # prompt tokens (dense.mla._decompressed): every key's
                # latent up-projected to each head's key and value (``context`` the mean keys a query
                # attends, half the prompt's), then attention at the head width, a key per head
                flops += 2 * rows * 2 * context * c * hq * (d - r + v)
                score, rate = self._prompt_attention(index, rows, hq, tokens, context, d, v)
                return AttentionCost(weights, rows * context * kv_token, flops, score, tokens, kv_token, rate)
            # absorbed: scores and outputs in the latent's space, which every head reads
            score, score_rows = 2 * rows * tokens * context * hq * (2 * c + r), tokens * hq
            return AttentionCost(weights, rows * context * kv_token, flops, score, score_rows, kv_token)
        hkv = max(1.0, self.kv_heads / p.tp)  # fewer KV heads than ranks: each holds one
        weights = m.hidden_size * d * (hq + 2 * hkv + hq) * self.wb
        if self._whole_qk(p, tokens):  # the other ranks' q and k rows too
            weights += m.hidden_size * d * (m.num_heads - hq + self.kv_heads - hkv) * self.wb
        kv_token = 2 * (self.kv_heads / p.tp if p.kv_shard == "tokens" else hkv) * d * self.ab
        score, rate = 4 * rows * tokens * context * hq * d, None
        if tokens > 1 and p.kv_shard != "tokens":
            width = d
            if m.attention_sinks:  # the sink's coordinates (dense.attention._sdpa_sinks)
                from dense.attention import SINK_PAD

                width += SINK_PAD
            score, rate = self._prompt_attention(index, rows, hq, tokens, context, width, width)
        return AttentionCost(weights, rows * context * kv_token, 2 * rows * tokens * weights / self.wb,
                             score, tokens * max(1.0, hq / hkv), kv_token, rate)

    def _prompt_attention(self, index: int, rows: float, heads: float, tokens: float, context: float,
                          qk_width: float, v_width: float) -> tuple[float, float | None]:
        """(FLOPs, FLOP/s or None: the matmul rate) of block ``index``'s attention over a
        forward's ``rows`` prompts, ``heads`` query heads each on the rank, ``tokens``
        queries over ``context`` keys each on average. A fresh prompt attends causally over
        its own keys (``StepContext.paged``: no mask, the flash kernels skip the masked
        half); sinks, sliding windows and chunks take a mask, and the kernel that takes one
        computes every query against every key slot (a prompt in pieces: the slots up to its
        piece, the mean of which is ``context`` + half a piece). A forward replayed from a
        CUDA graph (``engine.prefill_graph_tokens``; padding to its bucket aside) runs on the
        kernels ``engine.cudnn_prefill_graphs`` picks, at their curve."""
        m, e = self.cfg.model, self.cfg.engine
        masked = (m.attention_sinks or m.sliding_window is not None
                  or (m.attention_chunk is not None and (not m.chunked_layers or index in m.chunked_layers)))
        keys = context + tokens / 2
        pairs = tokens * (keys if masked else context)
        graphed = e.cuda_graphs and e.cudnn_prefill_graphs and rows * tokens <= e.prefill_graph_tokens
        rate = self.hw.attention_rate("masked" if masked else "causal", qk_width, v_width, keys, graphed)
        return 2 * rows * heads * pairs * (qk_width + v_width), rate

    def _whole_qk(self, p: ParallelConfig, new_tokens: float) -> bool:
        """Whether a step of ``new_tokens`` tokens a row projects every head's q and k on
        each rank (``dense.attention``: an all-heads q / k norm over split heads, at decode)
        in place of an all-reduce of their sums of squares. (At batches too large for the
        one-launch attention the ranks all-reduce the sums: either is a small share of
        such a step.)"""
        return self.cfg.model.qk_norm == "full" and p.tp > 1 and new_tokens == 1

    def _ffn(self, p: ParallelConfig, index: int, tokens: float, group_tokens: float, phase: str = "decode",
             offloaded: tuple[float, float] | None = None) -> tuple[float, float, float, float]:
        """(bytes read, the experts' scaled by the rate the MoE kernel reads them at; seconds
        of its GEMMs at the matmul rate of their rows, the experts' only past the rows
        ``moe_read`` timed the kernel at; seconds of the MoE kernel where the profile timed
        this rank's share of the experts (``moe_kernel``: then the experts count in neither
        of the first two); seconds of the cold experts of an offloaded model over the host
        link or on the CPU) of block ``index``'s FFN on a rank; ``tokens`` the replica's
        tokens, ``group_tokens`` those the rank's experts see; ``offloaded``: what
        ``_offloaded`` gives the layout."""
        m, e = self.cfg.model, self.cfg.moe
        gated = 3 if m.gated else 2
        if e is None or not self.cfg.is_moe_layer(index):
            w = gated * m.hidden_size * m.ffn_hidden / p.tp
            return w * self.wb, 2 * tokens * w / self._rate(tokens), 0.0, 0.0
        histogram = self._histogram(index)
        expert = gated * m.hidden_size * e.expert_hidden / p.expert_slicing  # one expert's slice here
        local = e.num_experts // p.ep
        shared = (gated * m.hidden_size * e.shared_experts * e.shared_expert_hidden / p.tp) if e.shared_experts else 0
        shared_s = 2 * tokens * shared / self._rate(tokens) if shared else 0.0
        shared_reads = shared * self.wb  # a dense MLP's weights, read at the copy rate
        folded = self.cfg.folded_experts(p)
        if folded:
            # Experts of the routed call (MoELayer.fold_shared) that every token takes: read at
            # the MoE kernel's rate for experts of this size with all the tokens as rows, their
            # GEMMs in that rate where the profile timed the kernel at that many rows.
            shared_reads = shared * self.eb / self.hw.expert_read(expert * self.eb, tokens)
            shared_s = 0.0 if tokens <= self.hw.moe_rows_measured() else shared_s
        # Where calibrate timed the kernel on this very share (bf16 experts on the device),
        # its time: the generic terms below price experts by size and rows alone, and miss
        # what the kernel's launch configuration for the share does. (It was timed on calls
        # holding every token with the other ranks' pairs masked; a rank whose pairs come
        # through an all-to-all runs on those alone, priced the same.) With the shared
        # experts folded, the time of the folded call holds them too, where calibrate has it.
        width = e.expert_hidden // p.expert_slicing
        calls = [(local + n, e.num_experts + n, e.top_k + n) for n in ((folded, 0) if folded else (0,))]
        for held, experts, k in (calls if offloaded is None and self.eb == 2.0 else ()):
            key = moe_kernel_key(held, experts, m.hidden_size, width, k, m.activation)
            timed = self.hw.moe_kernel_s(key, group_tokens)
            if timed is not None:
                if histogram is not None:  # as calibrate timed it under such a routing, else estimated
                    hit = distinct_experts(e.num_experts, e.top_k, group_tokens, local, histogram)
                    skewed = self.hw.moe_skewed_s(key, group_tokens, hit)
                    timed = skewed if skewed is not None else self._rerouted(
                        timed, group_tokens, local, held - local, expert, histogram)
                return (0.0, 0.0, timed, 0.0) if held > local else (shared_reads, shared_s, timed, 0.0)
        if histogram is None and p.ep > 1 and group_tokens == int(group_tokens):
            hit = busiest_rank_experts(e.num_experts, e.top_k, int(group_tokens), p.ep)
        else:
            hit = distinct_experts(e.num_experts, e.top_k, group_tokens, local, histogram)
        pairs = group_tokens * e.top_k / p.ep
        # each expert hit runs its GEMMs over its share of the pairs
        rows = pairs / max(hit, 1e-9)
        host = 0.0
        if offloaded is not None:  # the cold ones over the host link or on the CPU
            kept, share = offloaded
            picks = e.top_k * local / e.num_experts  # a token's, on this rank

            def met(n, frac):  # distinct experts of n that take frac of the picks, evenly (as distinct_experts)
                return n * (1 - (1 - min(1.0, picks * frac / n)) ** group_tokens) if n > 0 else 0.0
            hit, cold = met(kept, share), met(local - kept, 1 - share)
            host = self._cold_s(cold * expert * self.eb, phase)
        # (bytes at the rate the MoE kernel reads experts of this size, with this many rows each)
        reads = hit * expert * self.eb / self.hw.expert_read(expert * self.eb, rows)
        # Where the profile timed the kernel at this many rows, that time holds its compute
        # too; a dense GEMM's rate at these rows would count its own weight reads again.
        measured = rows <= self.hw.moe_rows_measured()
        seconds = 0.0 if measured else 2 * pairs * expert / self._rate(rows)
        return reads + shared_reads, seconds + shared_s, 0.0, host

    def _histogram(self, index: int | None = None) -> list[float] | None:
        """The measured routing of MoE layer ``index`` (None: uniform); without an index, the
        layers' shares averaged."""
        h = self.histogram
        if not isinstance(h, dict):
            return h
        if index is not None:
            return h.get(index)
        if not h:
            return None
        shares = [[x / sum(v) for x in v] for v in h.values()]
        return [sum(col) / len(shares) for col in zip(*shares)]

    def _rerouted(self, timed: float, tokens: float, local: int, folded: int, expert: float,
                  histogram: list[float]) -> float:
        """The MoE kernel's ``timed`` seconds (calibrate routes uniformly) under a measured
        routing: less the reads (at the kernel's rate for experts of their size) of the
        experts uniform routing hits and this one does not (the ``folded`` shared experts,
        hit by every token, either way); the rest of the time, its launches and math, stays,
        and it is at least the pairs' FLOPs at the rate of the rows each expert then gets.
        Routing concentrated on a few experts takes longer than this: the kernel's tiles
        follow the call's tokens, not the rows each expert then gets (``moe_skew``, where
        calibrate timed the share so, prices that instead)."""
        e = self.cfg.moe
        uniform = distinct_experts(e.num_experts, e.top_k, tokens, local) + folded
        measured = distinct_experts(e.num_experts, e.top_k, tokens, local, histogram) + folded
        pairs = tokens * (e.top_k * local / e.num_experts + folded)
        read_s = expert * self.eb / (self.hw.mem_gbps * GB * self.hw.expert_read(expert * self.eb, pairs / uniform))
        math_s = 2 * pairs * expert / self._rate(pairs / max(measured, 1e-9))
        return max(timed - (uniform - measured) * read_s, math_s)

    def _offloaded(self, p: ParallelConfig) -> tuple[float, float] | None:
        """Offloaded models (``engine.gpu_memory_gb``): (the experts a layer keeps on a
        rank's device: the budget's room after every other weight, spread evenly over the
        MoE layers, as ``offload.plan`` does; the share of the rank's routed pairs they take:
        ``hit_rate`` where given, else the routing's: the histogram's picks of the most
        picked, or their share of the experts); None where nothing is offloaded."""
        budget, e, m = self.cfg.engine.gpu_memory_gb, self.cfg.moe, self.cfg.model
        if budget is None or e is None:
            return None
        layers = [i for i in range(m.num_layers) if self.cfg.is_moe_layer(i)]
        local = e.num_experts // p.ep
        expert = (3 if m.gated else 2) * m.hidden_size * e.expert_hidden / p.expert_slicing * self.eb
        fixed = (sum(self._attention(p, 1, 1, 0).weights + self._ffn_weights(p, i) for i in range(m.num_layers))
                 + 2 * m.vocab_size * m.hidden_size * self.wb / p.tp - len(layers) * local * expert)
        kept = min(local, max(0.0, budget * GB - fixed) // expert / max(1, len(layers)))
        if self.hit_rate is not None:
            return kept, self.hit_rate
        histogram = self._histogram()
        if histogram is None:
            return kept, kept / local
        shares = sorted(histogram[:local], reverse=True)
        return kept, sum(shares[:int(kept)]) / sum(shares)

    def _cold_s(self, nbytes: float, phase: str) -> float:
        """Seconds of an offloaded layer's cold experts (``nbytes`` of weights) by
        ``engine.offload``: over the host link (read in place at decode, copied in for
        larger calls), on the CPU, or with "auto" at prefill whichever is faster."""
        link = nbytes / (self.hw.h2d_gbps * GB) if self.hw.h2d_gbps else math.inf
        cpu = nbytes / (self.hw.cpu_matmul_gbps * GB) if self.hw.cpu_matmul_gbps else math.inf
        mode = self.cfg.engine.offload
        if mode == "cpu" or (mode == "auto" and phase == "prefill" and cpu < link):
            return cpu
        return link

    def _collective(self, kind: str, nbytes: float, ranks: int, span: int | None = None) -> float:
        """Seconds of one collective over ``ranks`` that lie within ``span`` consecutive
        ranks (default: the group's own): measured where the profile has that group size
        and the group stays inside a node, else its closed form over the link it spans."""
        if ranks <= 1:
            return 0.0
        span = span or ranks
        measured = None
        if span <= self.hw.gpus_per_node:
            measured = self.hw.collective_s(kind, nbytes, ranks)
            if measured is None and kind == "all_reduce_nccl":  # NCCL's not measured: the layers' sum's
                measured = self.hw.collective_s("all_reduce", nbytes, ranks)
        return measured if measured is not None else CLOSED_FORMS[kind](nbytes, ranks, self.hw.link(span))

    def _rate(self, rows: float) -> float:
        """FLOP/s of a GEMM of ``rows`` rows in the weights' dtype."""
        return self.hw.matmul_rate("int8" if self.wb == 1 else "bfloat16", rows)

    def _replica_rows(self, p: ParallelConfig, batch: int) -> float:
        """Rows one replica runs: replicas that hold every expert they route to, or with
        data-parallel attention, split the batch; others all run it."""
        independent = p.tp % (p.ep * p.expert_slicing) == 0
        return math.ceil(batch / p.dp) if p.dp > 1 and (independent or p.dp_attention) else batch

    def predict(self, parallel: ParallelConfig, phase: str, batch: int, context: int,
                prompt: int | None = None) -> Prediction:
        """A decode step of ``batch`` rows with ``context`` cached tokens each, or
        (``phase`` "prefill") the prefill of ``batch`` prompts of ``prompt`` tokens."""
        cfg = with_layout(self.cfg, parallel)
        p, m, hw = cfg.parallel, cfg.model, self.hw
        prefill = phase == "prefill"
        new = (prompt or context) if prefill else 1
        keys = (new / 2 if prefill else context)  # mean keys a query attends (causal prompt: half)
        rows = self._replica_rows(p, batch)
        # A prefill runs as generate() runs it (``engine.prefill_plan``): forwards of at most
        # ``engine.prefill_tokens`` tokens, whole prompts together while they fit, a longer
        # prompt alone in pieces; every forward reads the weights again.
        pieces = math.ceil(new / cfg.engine.prefill_tokens) if prefill else 1
        new_f = new / pieces
        tokens = rows * new_f
        # The tokens one rank's experts see: its replica's, or under dp-attention those of
        # every replica that shares the experts (the all-to-all gathers them).
        sharing = max(1, p.ep * p.expert_slicing // p.tp) if p.dp_attention else 1
        group_tokens = tokens * sharing
        from moe_infer.model import stage_layers

        stages = stage_layers(cfg, p.pp)
        bw = hw.mem_gbps * GB
        mb = (p.prompt_micro_batches if prefill else p.micro_batches) if p.pp > 1 else 1
        if prefill:  # groups of rows a forward takes
            mb = max(mb, math.ceil(rows / max(1, cfg.engine.prefill_tokens // math.ceil(new_f))))
        mb = max(1, min(mb, math.ceil(rows)))
        per_stage, splits, mem_bytes = [], [], []
        offloaded = self._offloaded(p)
        for own in stages:  # each stage's blocks on one micro-batch
            split = dict.fromkeys(("memory", "compute", "collectives", "overhead", "host"), 0.0)
            weights, kv_token, busy = 0.0, 0.0, 0.0
            for i in own:
                a = self._attention(p, rows / mb, new_f, keys, i)
                f_reads, f_cmp, f_kernel, f_host = self._ffn(p, i, tokens / mb, group_tokens / mb, phase, offloaded)
                t_mem = (a.weights + a.kv + f_reads) / bw
                t_cmp = a.flops / self._rate(tokens / mb) + a.score_flops / (a.score_rate or self._rate(a.score_rows)) \
                    + f_cmp
                t_act = self._activation_bytes(p, i, tokens / mb) / bw
                # a block's roofline, its passes over the activations, its timed experts, its cold ones
                busy += max(t_mem, t_cmp) + t_act + f_kernel + f_host
                split["host"] += f_host
                split["memory"] += t_mem + t_act + f_kernel  # (a decode step's MoE kernel is bound by its reads)
                split["compute"] += t_cmp
                split["collectives"] += self._block_collectives(p, i, tokens / mb, group_tokens / mb, new_f)
                split["overhead"] += hw.layer_overhead_us * 1e-6
                weights += self._attention(p, 1, 1, 0).weights + self._ffn_weights(p, i)  # held (decode's rows too)
                kv_token += a.kv_token
            t_stage = busy + split["collectives"] + split["overhead"]
            if own.stop == m.num_layers:  # the final norm and the LM head, on each row's last token
                head = m.vocab_size * m.hidden_size * self.wb / p.tp
                t_stage += max(head / bw, 2 * rows / mb * head / self.wb / self._rate(rows / mb))
                gather = self._collective("all_gather", rows / mb * m.vocab_size / p.tp * self.ab, p.tp)
                t_stage += gather  # every TP rank's share of the logits
                split["collectives"] += gather
                weights += head
            if own.start == 0:  # the embeddings
                weights += m.vocab_size * m.hidden_size * self.wb / p.tp
            per_stage.append(t_stage)
            splits.append(split)
            if cfg.engine.gpu_memory_gb is not None:  # offloaded: the budget's weights at most
                weights = min(weights, cfg.engine.gpu_memory_gb * GB)
            mem_bytes.append(weights + rows * (context + new) * kv_token)  # every micro-batch's cache
        slot = max(per_stage)
        split = splits[per_stage.index(slot)]  # the costliest stage's
        if p.pp > 1:
            hop = hw.link(p.pp * p.tp * p.dp).seconds(tokens / mb * m.hidden_size * self.ab)
            slot += hop
            split["collectives"] += hop
            # Prefill: every micro-batch once through the stages; decode: every micro-batch
            # one token, one a slot (max(M, P) slots: fewer groups than stages leave gaps).
            seconds = (pipeline_slots(p.pp, mb * pieces, 1) if prefill else max(mb, p.pp)) * slot
        else:
            seconds = mb * pieces * slot
            split = {k: v * mb * pieces for k, v in split.items()}  # every forward's
        if prefill:  # the call's own: its set-up on the host before the forwards, the sync after them
            seconds += hw.prefill_call_us * 1e-6
            split["overhead"] += hw.prefill_call_us * 1e-6
        out_tokens = batch * (new if prefill else 1)
        memory = max(mem_bytes) / GB
        return Prediction(layout_name(p), phase, batch, seconds * 1e3, out_tokens / seconds, memory,
                          memory <= hw.memory_gb * self.USABLE, {k: v * 1e3 for k, v in split.items()}, p)

    def _ffn_weights(self, p: ParallelConfig, index: int) -> float:
        """Bytes of block ``index``'s FFN weights a rank holds."""
        m, e = self.cfg.model, self.cfg.moe
        gated = 3 if m.gated else 2
        if e is None or not self.cfg.is_moe_layer(index):
            return gated * m.hidden_size * m.ffn_hidden / p.tp * self.wb
        w = e.num_experts // p.ep * gated * m.hidden_size * e.expert_hidden / p.expert_slicing * self.eb
        if e.shared_experts:
            w += gated * m.hidden_size * e.shared_experts * e.shared_expert_hidden / p.tp * self.wb
        return w

    def _activation_bytes(self, p: ParallelConfig, index: int, tokens: float) -> float:
        """Bytes block ``index``'s element-wise kernels move on a rank for ``tokens`` tokens,
        beside its GEMMs and attention: two residual adds with their norms (each reads the
        hidden state and the residual and writes both), the attention epilogue (reads the
        projections' output, writes the queries and the cached keys and values: rotary, q /
        k norms), and at a MoE layer the dispatch (reads each token, writes a copy for each
        of its picks that this rank's experts take). A prompt's forward spends a tenth of
        its time in them; a decode step's rows make them small."""
        m, e = self.cfg.model, self.cfg.moe
        h, hq = m.hidden_size, m.num_heads / p.tp
        if m.kv_lora_rank is not None:  # the queries and the latent with its rotary key
            heads = hq * self.head_dim + m.kv_lora_rank + m.rotary_width
        else:
            heads = (hq + 2 * max(1.0, self.kv_heads / p.tp)) * self.head_dim
        passes = 8 * h + 2 * heads
        if e is not None and self.cfg.is_moe_layer(index):
            passes += h * (1 + e.top_k / p.ep)
        return tokens * passes * self.ab

    def _block_collectives(self, p: ParallelConfig, index: int, tokens: float, group_tokens: float,
                           new_tokens: float) -> float:
        """Seconds of one block's collectives on a rank (``new_tokens`` a row)."""
        m, e = self.cfg.model, self.cfg.moe
        act = tokens * m.hidden_size * self.ab
        ar = "all_reduce_nccl" if p.all_reduce == "nccl" else "all_reduce"  # (parallel.all_reduce)
        seconds = self._collective(ar, act, p.tp)  # after attention
        if p.kv_shard == "tokens":  # the queries (and new keys) gathered, then the partial outputs
            heads = m.num_heads * self.head_dim * self.ab
            q_and_kv = tokens * (heads + (0 if m.kv_lora_rank is not None else 2 * self.kv_heads * self.head_dim * self.ab))
            outs = tokens * m.num_heads * ((m.kv_lora_rank or self.head_dim) + 1) * 4 * p.tp  # float32, with the lse
            seconds += self._collective("all_to_all", q_and_kv, p.tp) + self._collective("all_to_all", outs, p.tp)
        if m.qk_norm == "full" and not self._whole_qk(p, new_tokens):  # its sums of squares (float32)
            seconds += self._collective(ar, tokens * 2 * 4, p.tp)
        moe = e is not None and self.cfg.is_moe_layer(index)
        expert_ranks = p.ep * p.expert_slicing
        if not moe or expert_ranks == 1:
            return seconds + self._collective(ar, act, p.tp)  # after the FFN
        same_tokens = not p.dp_attention or expert_ranks <= p.tp
        if e.shared_experts and not (same_tokens and expert_ranks == p.tp):  # (else one sum with the experts')
            seconds += self._collective(ar, act, p.tp)
        if same_tokens:  # every expert rank holds the tokens: one all-reduce sums their parts
            return seconds + self._collective(ar, act, expert_ranks)
        # dp-attention: the pairs out and back (PCC: within the ranks of one TP index)
        peers = expert_ranks // p.tp if p.pcc else expert_ranks
        pairs = tokens * e.top_k * p.expert_slicing / (p.tp if p.pcc else 1)
        a2a = self._collective("all_to_all", pairs * m.hidden_size * self.ab, peers, expert_ranks)
        return seconds + 2 * a2a + (self._collective(ar, act, p.tp) if p.pcc else 0.0)

    # -- choosing
    def layouts(self, gpus: int) -> list[ParallelConfig]:
        """Every layout of ``gpus`` ranks the model takes: tp x pp x dp, each with the expert
        placements (ep, expert slicing), data-parallel attention and the KV cache split by
        tokens where they apply."""
        out, seen = [], set()
        divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
        for tp, pp in itertools.product(divisors, divisors):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for ep, es in itertools.product(divisors, divisors):
                if (tp * dp) % (ep * es):
                    continue
                # the KV cache split by tokens where split by heads would copy it (fewer KV
                # heads than ranks, or one latent "head")
                copied = self.cfg.model.kv_lora_rank is not None or self.kv_heads < tp
                shards = ("heads", "tokens") if tp > 1 and copied else ("heads",)
                for dp_attention, kv_shard in itertools.product((False, True), shards):
                    try:
                        p = ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, expert_slicing=es, dp_attention=dp_attention,
                                           kv_shard=kv_shard)
                        with_layout(self.cfg, p)
                    except ConfigError:
                        continue
                    key = layout_name(p)
                    if key not in seen:
                        seen.add(key)
                        out.append(p)
        return out

    LIMIT = 1 << 24  # the most rows or tokens ``largest`` looks for

    def largest(self, parallel: ParallelConfig, phase: str, batch: int, context: int,
                prompt: int | None = None, vary: str = "batch") -> int:
        """The most rows (``vary`` "batch") or tokens a row ("context": cached tokens at
        decode, a prefill's prompt tokens) whose weights and KV cache fit the memory, the
        others as given; 0 where not even one does, ``LIMIT`` where that many do. The
        memory grows linearly with either: the line through 1 and 2 gives the answer,
        checked against ``predict`` (a bisection where the check fails)."""
        def predict(n: int) -> Prediction:
            if vary == "batch":
                return self.predict(parallel, phase, n, context, prompt)
            if phase == "prefill":
                return self.predict(parallel, phase, batch, context, n)
            return self.predict(parallel, phase, batch, n, prompt)

        def fits(n: int) -> bool:
            return predict(n).fits

        one = predict(1)
        if not one.fits:
            return 0
        slope = predict(2).memory_gb - one.memory_gb
        if slope > 0:
            room = self.hw.memory_gb * self.USABLE - one.memory_gb
            guess = max(1, min(self.LIMIT, 1 + int(room / slope)))
            if fits(guess) and (guess == self.LIMIT or not fits(guess + 1)):
                return guess
        good = 1  # doubling, then halving the gap: fits(good), not fits(bad)
        while good < self.LIMIT and fits(min(2 * good, self.LIMIT)):
            good = min(2 * good, self.LIMIT)
        bad = 2 * good
        while bad - good > 1 and good < self.LIMIT:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
        return good

    def rank(self, gpus: int, phase: str, batch: int, context: int, goal: str = "latency",
             prompt: int | None = None) -> list[Prediction]:
        """Every layout of ``gpus`` ranks that fits, best first: the shortest step
        (``goal`` "latency") or the most tokens/s (``goal`` "throughput")."""
        preds = [self.predict(p, phase, batch, context, prompt) for p in self.layouts(gpus)]
        preds = [q for q in preds if q.fits]
        return sorted(preds, key=(lambda q: q.ms) if goal == "latency" else (lambda q: -q.tokens_per_s))


def weight_sizes(quantize: str | None) -> dict:
    """The cost model's bytes a weight (``weight_bytes``) and a routed expert's weight
    (``expert_bytes``) under ``engine.quantize``: MXFP4 keeps 4 bits and a scale byte per 32."""
    return {None: dict(weight_bytes=2.0), "int8": dict(weight_bytes=1.0),
            "mxfp4": dict(weight_bytes=2.0, expert_bytes=4.25 / 8)}[quantize]


def choose_layout(cfg: Config, ranks: int, hardware: str | Path | None = None, batch: int | None = None,
                  goal: str = "latency", weight_bytes: float = 2.0,
                  dp_attention: bool = True, expert_bytes: float | None = None) -> tuple[ParallelConfig, str]:
    """``parallel: auto``: the layout of ``ranks`` ranks the cost model ranks first for a
    decode step of ``batch`` rows (default the engine's max_batch_size) at half the
    context (``dp_attention`` False: none of its layouts, as the server runs none) ->
    (the layout, one line saying what was chosen on which profile)."""
    profile = hardware or local_profile()
    if profile is None:
        raise ConfigError("parallel: auto needs a hardware profile for this machine (no shipped one matches its "
                          "GPU, or it has none): pass --hardware PROFILE|YAML (moe-infer calibrate writes one)")
    hw = Hardware.load(profile)
    e = cfg.engine
    rows = batch or e.max_batch_size
    context = (e.max_seq_len or cfg.model.max_position) // 2
    ranked = [q for q in CostModel(cfg, hw, weight_bytes, expert_bytes=expert_bytes).rank(ranks, "decode", rows,
                                                                                         context, goal)
              if dp_attention or not q.parallel.dp_attention]
    if not ranked:
        raise ConfigError(f"parallel: auto: no layout of {ranks} ranks fits {cfg.name} in {hw.memory_gb:g} GB a "
                          f"GPU ({hw.name}); launch more ranks or quantize to int8")
    best = ranked[0]
    return best.parallel, (f"parallel: auto chose {best.layout} for {ranks} ranks on {hw.name} "
                           f"(predicted {best.ms:.2f} ms a decode step at batch {rows})")
