"""The generation engine: prompts in, completions out, through the model runner
(``moe_infer.runner``) that the server's scheduler drives too.

Shape letters: B batch, V vocab.
A batch of prompts gets blocks of the runner's paged KV cache (each row its prompt and
``max_new_tokens``), prefills in forwards of at most ``engine.prefill_tokens`` tokens, then
decodes one token per row a step: on one GPU a captured CUDA graph per (rows, keys)
bucket, the greedy argmax inside it, one host sync per step.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm import ParallelGroups, all_gather_json
from moe_infer.config import Config
from moe_infer.graphs import GRAPH_PRIMERS
from moe_infer.model import Transformer
from moe_infer.offload import OffloadedExperts, rebalance
from moe_infer.pipeline import PipelineSchedule
from moe_infer.runner import PagedRunner, Row
from moe_infer.sampling import SamplingParams, knobs, sample_rows
from moe_infer.tokenizer import Tokenizer


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens, without the prompt and without the EOS token
    text: str | None  # decoded when the engine has a tokenizer
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens)
    # Host clock: from the generate() call to this row's first token on the host (the
    # prefill, and any batches of the same call before this row's), and the mean time
    # between its later tokens (None with fewer than two).
    time_to_first_token_s: float | None = None
    inter_token_s: float | None = None


@dataclass
class GenerationStats:
    """Host-clock totals of one ``generate()`` call (every replica's, with data parallelism)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    # One process: from each batch's start to its first tokens on the host, then to its
    # last. Pipeline stages: the time a prompt was in the pipeline, then the time it held
    # decode steps alone (moe_infer.pipeline.Timeline).
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decoded_tokens: int = 0  # tokens made in decode_s (after each row's first)
    time_to_first_token_s: float | None = None  # from the call to the first batch's first tokens

    def merge(self, other: "GenerationStats") -> "GenerationStats":
        """Replicas that ran side by side: tokens add up, times are the slowest replica's."""
        ttft = [t for t in (self.time_to_first_token_s, other.time_to_first_token_s) if t is not None]
        return GenerationStats(self.prompt_tokens + other.prompt_tokens,
                               self.generated_tokens + other.generated_tokens,
                               max(self.prefill_s, other.prefill_s), max(self.decode_s, other.decode_s),
                               self.decoded_tokens + other.decoded_tokens, min(ttft) if ttft else None)

    def summary(self) -> str:
        """One line: prompt tokens/s, time to first token, decode tokens/s."""
        def rate(n, s):
            return f"{n / s:,.1f} tokens/s" if s > 0 else "n/a"

        ttft = "n/a" if self.time_to_first_token_s is None else f"{self.time_to_first_token_s * 1e3:,.1f} ms"
        return (f"prompt {self.prompt_tokens} tokens at {rate(self.prompt_tokens, self.prefill_s)}, "
                f"time to first token {ttft}, decode {self.decoded_tokens} tokens at "
                f"{rate(self.decoded_tokens, self.decode_s)}")


class _HostIds:
    """Token ids [B] on their way to the host: ``send`` queues the copy (into pinned memory
    on a GPU) and returns; ``receive`` waits for that copy alone, not for what the stream
    has queued after it."""

    def __init__(self, n: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buf = torch.empty(n, dtype=torch.long, pin_memory=self.cuda)
        self.done = torch.cuda.Event() if self.cuda else None

    def send(self, ids: torch.Tensor) -> None:
        self.buf.copy_(ids, non_blocking=True)
        if self.cuda:
            self.done.record()

    def receive(self) -> list[int]:
        if self.cuda:
            self.done.synchronize()
        return self.buf.tolist()


class Engine:
    BLOCK_SIZE = 16  # tokens per block of generate()'s paged KV cache
    REBALANCE_STEPS = 64  # offloaded experts: runner steps between placements by routing counts

    def __init__(self, model: Transformer, config: Config, tokenizer: Tokenizer | None = None,
                 groups: ParallelGroups | None = None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.groups = groups or ParallelGroups.single()
        p_ = config.parallel
        # Data-parallel replicas that hold every expert they route to (the experts spread
        # over ranks of one replica at most) generate independently: generate() splits the
        # prompts over them. Where the experts spread over several replicas, every replica
        # runs every prompt, as their expert all-to-alls must meet; with dp_attention they
        # split the prompts too and step together (``lockstep``): each forward of one meets
        # the others' in the all-to-alls, a replica out of prompts runs a stand-in.
        independent = p_.tp % (p_.ep * p_.expert_slicing) == 0
        self.split_prompts = self.groups.dp.size > 1 and (independent or p_.dp_attention)
        # Streamed layers (offload: layers) are fetched by the replicas together, a part
        # each, in every block's forward: they step together too.
        self.lockstep = self.split_prompts and (not independent or config.engine.offload == "layers")
        self.last_stats: GenerationStats | None = None  # the latest generate() call's
        self.device, self.dtype = model.device, model.anchor.dtype
        self.eos = set(config.model.eos_token_ids)
        # "graph": decode steps replay CUDA graphs (GPUs; on several ranks with the NCCL
        # collectives inside); "static": the same fixed-shape step run eagerly; "eager":
        # shapes grow with the cache (any device, any layout).
        nccl = not (dist.is_initialized() and dist.get_world_size() > 1) or dist.get_backend() == "nccl"
        # Offloaded experts may wait for the host in a decode step (which pairs are cold:
        # ``OffloadedExperts.waits_for_host``); streamed layers run on weights that move, an
        # offloaded KV cache on pools that move.
        self.offloaded = config.engine.gpu_memory_gb is not None
        rows = 1 << (config.engine.max_batch_size - 1).bit_length()  # a decode step's largest bucket
        waits = any(m.waits_for_host(rows) for m in model.modules() if isinstance(m, OffloadedExperts))
        moving = waits or config.engine.offload == "layers" or config.engine.kv_offload is not None
        graphs = self.device.type == "cuda" and nccl and config.engine.cuda_graphs and not moving
        self.decode_mode = "graph" if graphs else "eager"
        self.graph_primers = GRAPH_PRIMERS  # graphs made before the first decode step's (0: none)
        self._primed = False
        self.runner: PagedRunner | None = None  # generate()'s, made at the first call
        self.last_timeline = None  # pipeline stages: the last generate() batch's (moe_infer.pipeline.Timeline)
        self.auto_layout: str | None = None  # parallel: auto: the cost model's choice, in one line
        self._calls = 0  # generate() calls: unseeded sampling draws anew in each

    def release_graphs(self) -> None:
        """Drops generate()'s captured steps (``PagedRunner.release_graphs``): before the
        process group of a multi-rank job is destroyed."""
        if self.runner is not None:
            self.runner.release_graphs()

    def runner_for(self, blocks: int) -> PagedRunner:
        """generate()'s runner with a cache of at least ``blocks`` blocks. The cache grows in
        powers of two; a new one drops the old one first, and with it the captured steps
        (they hold the old cache's addresses)."""
        r, batch = self.runner, self.config.engine.max_batch_size
        graph = self.decode_mode == "graph"
        if r is None or r.cache.num_blocks < blocks or r.max_batch < batch or r.graph != graph:
            self.runner = None
            r = self.runner = PagedRunner(self, 1 << (blocks - 1).bit_length(), self.BLOCK_SIZE, batch)
        # (an offloaded KV cache's steps end on the host: no fixed-shape step runs them)
        r.static = self.decode_mode != "eager" and self.config.engine.kv_offload is None
        return r

    # ----------------------------------------------------------------- inputs

    def encode(self, prompts) -> list[list[int]]:
        """Strings or token-id lists (one, or a list of them) -> validated id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts: expected a string, a list of strings or a list of "
                             f"token-id lists, got {type(prompts).__name__} {prompts!r:.60}")
        vocab = self.config.model.vocab_size
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"prompts[{i}]: empty prompt; give at least one token")
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}]: this model has no tokenizer; pass token ids")
                ids = self.tokenizer.encode(p)
            elif isinstance(p, (list, tuple)) and set(map(type, p)) <= {int}:  # bools and int subclasses fail
                ids = list(p)
                if ids and not (0 <= min(ids) and max(ids) < vocab):  # builtins: prompts run to thousands of ids
                    bad = next(t for t in ids if not 0 <= t < vocab)
                    raise ValueError(f"prompts[{i}]: token id {bad} outside the vocabulary [0, {vocab})")
            else:
                raise ValueError(f"prompts[{i}]: expected a string or a list of int token ids, got {p!r:.60}")
            if not ids:
                raise ValueError(f"prompts[{i}]: empty prompt; give at least one token")
            out.append(ids)
        return out

    # ----------------------------------------------------------------- one full forward

    @torch.no_grad()
    def logits(self, input_ids, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One forward without a cache -> float32 logits [B, L, V].

        ``input_ids`` is a [B, L] tensor (with an optional [B, L] mask of real tokens, left
        or right padding) or a list of id lists of any lengths, right-padded here.
        Padding positions of the result are 0.
        """
        if not torch.is_tensor(input_ids):
            rows = self.encode(input_ids)
            width = max(map(len, rows))
            input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
            attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, L], got shape {list(input_ids.shape)}")
        no_padding = attention_mask is None  # then attention runs plain causal
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {list(attention_mask.shape)}: expected the shape "
                             f"of input_ids {list(input_ids.shape)}")
        ids = input_ids.to(self.device)
        valid = attention_mask.to(self.device).bool()
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]
        ctx = self.model.context(positions, valid, no_padding=no_padding)
        out = self.model(ids, ctx).float()
        return out.masked_fill(~valid.unsqueeze(-1), 0.0)

    # ----------------------------------------------------------------- generation

    def check_request(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        """Validates a ``generate`` call without running it -> (id lists, SamplingParams).
        Raises ValueError naming the argument; it needs no other rank."""
        params = SamplingParams(temperature, top_k, top_p, seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
        rows = self.encode(prompts)
        limit = self.config.max_seq_len
        for i, r in enumerate(rows):
            if len(r) + max_new_tokens > limit:
                raise ValueError(f"prompts[{i}]: {len(r)} prompt tokens + max_new_tokens="
                                 f"{max_new_tokens} exceed max_seq_len={limit}")
        return rows, params

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> list[Completion]:
        """Completions of ``prompts`` (strings or token-id lists), in order. With data-parallel
        replicas that generate independently (``split_prompts``), each takes a contiguous
        share of the prompts and every rank returns all the completions."""
        start = time.perf_counter()  # the completions' time to first token counts from here
        rows, params = self.check_request(prompts, max_new_tokens, temperature, top_k, top_p, seed)
        shares = [(0, len(rows))]
        if self.split_prompts:
            dp = self.groups.dp
            shares = [(r * len(rows) // dp.size, (r + 1) * len(rows) // dp.size) for r in range(dp.size)]
        lo, hi = shares[self.groups.dp.rank if self.split_prompts else 0]
        # Prompt i samples with seed + i, so its tokens do not depend on the other prompts.
        # Without a seed, one from the engine's seed and a count of the calls: the same on
        # every rank (tensor-parallel ranks must draw the same tokens), new for each call.
        self._calls += 1
        base = seed if seed is not None else hash((self.config.engine.seed, self._calls))
        out, stats = [], GenerationStats()
        step = self.config.engine.max_batch_size  # larger requests run in several batches
        # Replicas in lockstep run as many batches as the largest share needs, each beside
        # the batches the others run at the same time (``peers``: their prompts).
        span = max(b - a for a, b in shares) if self.lockstep else hi - lo
        if self.model.pp.size > 1 and not self.lockstep:  # every prompt in one schedule, joining as rows end
            out += self._generate_pipelined(rows[lo:hi], max_new_tokens, params, [base + i for i in range(lo, hi)],
                                            start, stats)
            span = 0
        for at in range(0, span, step):
            b0, b1 = lo + at, min(hi, lo + at + step)
            peers = [rows[a + at:min(b, a + at + step)] for a, b in shares] if self.lockstep else None
            seeds = [base + i for i in range(b0, b1)]
            out += self._generate_batch(rows[b0:b1], max_new_tokens, params, seeds, start, stats, peers)
        if self.split_prompts:
            device = self.device if dist.get_backend() == "nccl" else "cpu"
            shares = all_gather_json([[dataclasses.asdict(c) for c in out], dataclasses.asdict(stats)],
                                     self.groups.dp, device)
            out = [Completion(**c) for share, _ in shares for c in share]
            stats = GenerationStats()
            for _, s in shares:
                stats = stats.merge(GenerationStats(**s))
        self.last_stats = stats
        return out

    def _generate_batch(self, rows, max_new, params, seeds: list[int], start: float,
                        stats: GenerationStats, peers: list[list[list[int]]] | None = None) -> list[Completion]:
        """``peers``: replicas in lockstep (``self.lockstep``), every replica's prompts of this
        batch. Each replica then runs as many prefill forwards as the one that needs the
        most (the others' extra ones write a spare block) and every decode step, padded to
        the largest batch; one without prompts runs a one-token stand-in, and returns none."""
        began = time.perf_counter()
        stand_in = peers is not None and not rows
        if stand_in:
            rows, seeds = [[0]], [0]
        else:
            stats.prompt_tokens += sum(map(len, rows))
        b, bs = len(rows), self.BLOCK_SIZE

        def blocks(prompts):
            return [-(-(len(r) + max_new) // bs) for r in prompts]
        need = blocks(rows)
        lockstep, prefill_lockstep, longest = None, None, 0  # alone
        total = sum(need)
        if peers is not None:
            # Every replica captures the same steps at the same time (a capture runs the
            # step's collectives): the same cache size, the largest batch and the longest
            # row's keys; and as many prefill forwards as the replica that needs most.
            peers = [p or [[0]] for p in peers]
            total = max(sum(blocks(p)) for p in peers) + 1  # + a spare block
            longest = max(len(r) for p in peers for r in p)
            budget = self.config.engine.prefill_tokens
            prefill_lockstep = max(len(prefill_plan([len(r) for r in p], budget)) for p in peers), total - 1
        runner = self.runner_for(total)
        tables, at = [], 0
        for n in need:
            tables.append(list(range(at, at + n)))
            at += n

        logits = self._prefill(runner, rows, tables, prefill_lockstep)
        if self.offloaded:  # the experts the prompts routed to most onto the device
            rebalance(self.model)

        generated = [[] for _ in range(b)]
        finish = [None] * b
        arrived = []  # host clock as each step's ids reach the host
        host = _HostIds(b, self.device)
        nxt = sample_rows(logits, [knobs(params, s, 0) for s in seeds], pdl=self.model.options.pdl)
        for t in range(max_new):
            host.send(nxt)
            if t < max_new - 1:
                # Step t + 1 is queued before token t reaches the host, so the GPU never
                # waits for this loop. After the last EOS it is one wasted step. Each row
                # feeds the token just picked from the device (``Row.src``) and samples
                # inside the step.
                runner.prev[:b].copy_(nxt)
                if peers is not None:  # (rows, keys) of every replica's step
                    lockstep = (max(map(len, peers)), longest + t + 1)
                upcoming = runner.decode([Row([0], len(r) + t, tab, i, knobs(params, s, t + 1))
                                          for i, (r, tab, s) in enumerate(zip(rows, tables, seeds))], lockstep)[1]
            ids = host.receive()  # the one host sync per token
            arrived.append(time.perf_counter())
            for i, tok in enumerate(ids):
                if finish[i] is None:
                    if tok in self.eos:
                        finish[i] = "stop"
                    else:
                        generated[i].append(tok)
            # In lockstep every replica runs every step: the others' rows may not be done.
            if (all(f is not None for f in finish) and peers is None) or t == max_new - 1:
                break
            nxt = upcoming

        def gap(n):  # mean seconds between a row's n tokens after its first
            return (arrived[n - 1] - arrived[0]) / (n - 1) if n > 1 else None

        if stand_in:
            return []
        stats.prefill_s += arrived[0] - began
        stats.decode_s += arrived[-1] - arrived[0]
        stats.generated_tokens += sum(map(len, generated))
        stats.decoded_tokens += sum(max(0, len(g) - 1) for g in generated)
        if stats.time_to_first_token_s is None:
            stats.time_to_first_token_s = arrived[0] - start

        return [Completion(g, self.tokenizer.decode(g) if self.tokenizer else None, f or "length",
                           arrived[0] - start, gap(len(g)))
                for g, f in zip(generated, finish)]

    def _generate_pipelined(self, rows, max_new: int, params, seeds: list[int], start: float,
                            stats: GenerationStats) -> list[Completion]:
        """generate() over pipeline stages: the inference schedule of ``moe_infer.pipeline``
        (micro-batches through the stages without draining), at most ``max_batch_size`` rows
        holding the cache at a time, a waiting prompt joining as a row ends."""
        if not rows:  # a replica's empty share
            return []
        stats.prompt_tokens += sum(map(len, rows))
        p, bs = self.config.parallel, self.BLOCK_SIZE
        need = [-(-(len(r) + max_new) // bs) for r in rows]
        slots, width = min(len(rows), self.config.engine.max_batch_size), max(need)
        runner = self.runner_for(slots * width)
        schedule = PipelineSchedule(self, runner, p.micro_batches, p.prompt_micro_batches)
        generated, finish, first_at, last_at = schedule.run(
            rows, max_new, lambda i, t: knobs(params, seeds[i], t), slots,
            lambda i, slot: list(range(slot * width, slot * width + need[i])))
        tl = self.last_timeline = schedule.timeline
        stats.prefill_s += tl.prefill_s
        stats.decode_s += tl.decode_s
        stats.generated_tokens += sum(map(len, generated))
        stats.decoded_tokens += tl.decoded
        if stats.time_to_first_token_s is None:
            stats.time_to_first_token_s = min(first_at) - start
        return [Completion(g, self.tokenizer.decode(g) if self.tokenizer else None, f or "length", a - start,
                           (b - a) / (len(g) - 1) if len(g) > 1 else None)
                for g, f, a, b in zip(generated, finish, first_at, last_at)]

    def _prefill(self, runner: PagedRunner, rows: list[list[int]], tables: list[list[int]],
                 lockstep: tuple[int, int] | None = None) -> torch.Tensor:
        """Caches the prompts ``rows`` in their blocks -> float32 logits of each one's last
        token [B, V], in the forwards of ``prefill_plan``. ``lockstep``: (the most forwards
        a replica in lockstep runs, a spare block): this replica runs that many, the extra
        ones one token into the spare block."""
        plan = prefill_plan([len(r) for r in rows], self.config.engine.prefill_tokens)
        out = [None] * len(rows)
        for pieces in plan:
            logits = runner.forward([Row(rows[i][a:e], a, tables[i]) for i, a, e in pieces], lockstep is not None)
            for j, (i, _, e) in enumerate(pieces):
                if e == len(rows[i]):  # a captured step's output is rewritten by its next replay
                    out[i] = logits[j].clone()
        if lockstep:
            forwards, spare = lockstep
            for _ in range(forwards - len(plan)):
                runner.forward([Row([0], 0, [spare])], True)
        return torch.stack(out)


def prefill_plan(lengths: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """The forwards that prefill prompts of ``lengths`` tokens, each at most ``budget``
    tokens (its rows x its widest row): consecutive prompts together while they fit, a
    longer one alone in pieces (a piece attends over what its earlier pieces cached).
    -> per forward, its pieces (prompt index, first token, end)."""
    plan, group, widest = [], [], 0
    for i, n in enumerate(lengths):
        if n > budget:
            plan += [[(i, a, min(n, a + budget))] for a in range(0, n, budget)]
            continue
        if group and (len(group) + 1) * max(widest, n) > budget:
            plan.append(group)
            group, widest = [], 0
        group.append((i, 0, n))
        widest = max(widest, n)
    if group:
        plan.append(group)
    return plan
