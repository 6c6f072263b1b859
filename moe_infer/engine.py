"""The generation engine: prefill, then decode into a preallocated KV cache.

Shape letters: B batch, L prompt slots (longest prompt), S cache slots, V vocab.
A batch of prompts is left-padded so every row writes the same cache slot each step;
``key_valid`` masks the padding and positions are counted per row.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import kernels
from comm import ParallelGroups, all_gather_json
from moe_infer.config import Config
from moe_infer.model import Transformer
from moe_infer.sampling import SamplingParams, sample
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


# The first two CUDA graphs a process instantiates measured slower in replay than the later
# ones: the same decode step (the same kernels in the same order on the same addresses)
# replayed faster as the process's third graph or later. Two one-kernel graphs made and
# dropped before it gave the fast time, and a third added nothing. The graphs and their
# memory were the same, so the cause lies below torch.
GRAPH_PRIMERS = 2


def prime_cuda_graphs(device: torch.device, count: int = GRAPH_PRIMERS) -> None:
    """Captures, replays and drops ``count`` one-kernel CUDA graphs on ``device``, so the
    graphs captured after them are the process's third and later."""
    x = torch.zeros(32, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        x.add_(1)  # the kernel loaded outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    for _ in range(count):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
        graph.replay()
    torch.cuda.synchronize(device)


@dataclass
class GenerationStats:
    """Host-clock totals of one ``generate()`` call (every replica's, with data parallelism)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # from each batch's start to its first tokens on the host
    decode_s: float = 0.0  # from each batch's first tokens to its last
    decoded_tokens: int = 0  # tokens after each row's first, made in decode_s
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


def capture(step, device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Runs ``step()`` twice on a side stream (every kernel compiled and loaded outside the
    capture), then captures it in a CUDA graph -> (graph, the outputs its replays rewrite)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


class StaticDecoder:
    """The decode step with fixed shapes for one (batch, cache slots) bucket: its own KV
    cache and input buffers, the slot as a device tensor. ``graph=True`` captures the step
    (every layer, and the greedy argmax) once in a CUDA graph and replays it; otherwise it
    runs the same step eagerly (how CPU tests check the math)."""

    def __init__(self, model: Transformer, batch: int, slots: int, graph: bool):
        dev = model.embed.weight.device
        self.model, self.batch, self.slots = model, batch, slots
        self.cache = model.make_cache(batch, slots)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.slot = torch.zeros((), dtype=torch.long, device=dev)
        self.key_valid = torch.zeros(batch, slots, dtype=torch.bool, device=dev)
        self.positions = torch.zeros(batch, slots, dtype=torch.long, device=dev)
        self.tables = model.rotary_tables(slots)  # rotary rows looked up by position each step
        self.graph = None
        if graph:
            self.graph, self.out = capture(self._step, dev)

    def _step(self):
        ctx = self.model.static_decode_context(self.slot, self.key_valid, self.positions, self.tables)
        logits = self.model(self.tokens, ctx, self.cache, last_only=True)[:, -1]
        return logits, kernels.argmax(logits, pdl=self.model.options.pdl)

    def run(self, tokens: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [batch] written at ``slot`` -> (logits [batch, V], greedy ids [batch])."""
        self.tokens[:, 0].copy_(tokens)
        self.slot.fill_(slot)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.out


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
    SLOT_BUCKET = 64  # cache lengths of static decode steps are rounded up to a multiple of this
    MAX_DECODERS = 4  # captured (batch, slots) buckets kept; the oldest goes first

    def __init__(self, model: Transformer, config: Config, tokenizer: Tokenizer | None = None,
                 groups: ParallelGroups | None = None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.groups = groups or ParallelGroups.single()
        p_ = config.parallel
        # Data-parallel replicas that hold every expert they route to (the experts spread
        # over ranks of one replica at most) generate independently: generate() splits the
        # prompts over them. Where the experts spread over several replicas, every replica
        # runs every prompt, as their expert all-to-alls must meet.
        self.split_prompts = self.groups.dp.size > 1 and p_.tp % (p_.ep * p_.expert_slicing) == 0
        self.last_stats: GenerationStats | None = None  # the latest generate() call's
        p = model.embed.weight
        self.device, self.dtype = p.device, p.dtype
        self.eos = set(config.model.eos_token_ids)
        # "graph": decode steps replay CUDA graphs (one GPU); "static": the same fixed-shape
        # step run eagerly; "eager": shapes grow with the cache (any device, any layout).
        single = not (dist.is_initialized() and dist.get_world_size() > 1)
        self.decode_mode = "graph" if p.is_cuda and single and config.engine.cuda_graphs else "eager"
        self._decoders: dict[tuple[int, int], StaticDecoder] = {}
        self.graph_primers = GRAPH_PRIMERS  # graphs made before the first decode step's (0: none)
        self._primed = False

    def decoder(self, batch: int, slots: int) -> StaticDecoder:
        key = (batch, slots)
        if key not in self._decoders:
            if len(self._decoders) >= self.MAX_DECODERS:
                del self._decoders[next(iter(self._decoders))]
            if self.decode_mode == "graph" and not self._primed:
                prime_cuda_graphs(self.device, self.graph_primers)
                self._primed = True
            self._decoders[key] = StaticDecoder(self.model, batch, slots, self.decode_mode == "graph")
        return self._decoders[key]

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
        ctx = self.model.context(positions, valid, positions, start=0, no_padding=no_padding)
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
        lo, hi = 0, len(rows)
        if self.split_prompts:
            dp = self.groups.dp
            lo, hi = dp.rank * len(rows) // dp.size, (dp.rank + 1) * len(rows) // dp.size
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        out, stats = [], GenerationStats()
        step = self.config.engine.max_batch_size  # larger requests run in several batches
        for b in range(lo, hi, step):
            out += self._generate_batch(rows[b:min(hi, b + step)], max_new_tokens, params, generator, start, stats)
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

    def _generate_batch(self, rows, max_new, params, generator, start: float,
                        stats: GenerationStats) -> list[Completion]:
        began = time.perf_counter()
        stats.prompt_tokens += sum(map(len, rows))
        b, width = len(rows), max(map(len, rows))
        slots = width + max_new
        decoder = None
        if self.decode_mode != "eager" and max_new > 1:
            # Fixed shapes: the batch padded to a power of two (copies of row 0, dropped
            # below), the cache to a multiple of SLOT_BUCKET; one decoder per bucket.
            bucket = 1 << (b - 1).bit_length()
            rows = rows + [rows[0]] * (bucket - b)
            slots = min(-(-slots // self.SLOT_BUCKET) * self.SLOT_BUCKET, max(slots, self.config.max_seq_len))
            decoder = self.decoder(bucket, slots)
        pad = torch.tensor([width - len(r) for r in rows], device=self.device)  # [B]
        left = np.zeros((len(rows), width), np.int64)  # left-padded ids; numpy fills it faster than torch.tensor
        for i, r in enumerate(rows):
            left[i, width - len(r):] = r
        tokens = torch.from_numpy(left).to(self.device)
        slot = torch.arange(slots, device=self.device)
        key_valid = slot[None, :] >= pad[:, None]  # [B, S]: padding slots never attend
        positions = (slot[None, :] - pad[:, None]).clamp(min=0)  # [B, S]
        if decoder is not None:
            decoder.key_valid.copy_(key_valid)
            decoder.positions.copy_(positions)
            cache = decoder.cache
        else:
            cache = self.model.make_cache(len(rows), slots)

        logits = self._prefill(tokens, key_valid[:, :width], positions[:, :width], cache,
                               [len(r) == width for r in rows])

        def pick(logits, greedy):  # -> the next ids [len(rows)], on the device
            if greedy is not None and params.greedy:
                return greedy  # the argmax the graph computed
            nxt = sample(logits[:b], params, generator, pdl=self.model.options.pdl)  # [b]: padding rows draw nothing
            return torch.cat([nxt, nxt[:1].expand(len(rows) - b)]) if len(rows) > b else nxt

        generated = [[] for _ in range(b)]
        finish = [None] * b
        arrived = []  # host clock as each step's ids reach the host
        host = _HostIds(len(rows), self.device)
        nxt = pick(logits, None)
        for t in range(max_new):
            host.send(nxt)
            if t < max_new - 1:
                # Step t + 1 is queued before token t reaches the host, so the GPU never
                # waits for this loop. After the last EOS it is one wasted step.
                s = width + t
                if decoder is not None:
                    upcoming = pick(*decoder.run(nxt, s))
                else:
                    upcoming = pick(self._decode(nxt, s, key_valid[:, :s + 1], positions[:, :s + 1], cache), None)
            ids = host.receive()  # the one host sync per token
            arrived.append(time.perf_counter())
            for i, tok in enumerate(ids[:b]):
                if finish[i] is None:
                    if tok in self.eos:
                        finish[i] = "stop"
                    else:
                        generated[i].append(tok)
            if all(f is not None for f in finish) or t == max_new - 1:
                break
            nxt = upcoming

        def gap(n):  # mean seconds between a row's n tokens after its first
            return (arrived[n - 1] - arrived[0]) / (n - 1) if n > 1 else None

        stats.prefill_s += arrived[0] - began
        stats.decode_s += arrived[-1] - arrived[0]
        stats.generated_tokens += sum(map(len, generated))
        stats.decoded_tokens += sum(max(0, len(g) - 1) for g in generated)
        if stats.time_to_first_token_s is None:
            stats.time_to_first_token_s = arrived[0] - start

        return [Completion(g, self.tokenizer.decode(g) if self.tokenizer else None, f or "length",
                           arrived[0] - start, gap(len(g)))
                for g, f in zip(generated, finish)]

    def _prefill(self, tokens, key_valid, positions, cache, full: list[bool]) -> torch.Tensor:
        """tokens [B, L] -> logits of the last prompt slot [B, V], in forwards of at most
        ``engine.prefill_tokens`` tokens: groups of whole rows, or a row alone in pieces of
        its prompt where one row is longer than that (a piece attends over the slots its
        earlier pieces cached). ``full[i]``: row i has no padding; a group of such rows
        from slot 0 runs plain causal attention."""
        b, width = tokens.shape
        budget = self.config.engine.prefill_tokens
        group, piece = max(1, budget // width), min(width, budget)
        out = []
        for r0 in range(0, b, group):
            r1 = min(b, r0 + group)
            rows = cache.rows(r0, r1)
            for a in range(0, width, piece):
                e = min(width, a + piece)
                ctx = self.model.context(positions[r0:r1, a:e], key_valid[r0:r1, :e], positions[r0:r1, :e],
                                         start=a, no_padding=all(full[r0:r1]))
                logits = self.model(tokens[r0:r1, a:e], ctx, rows, last_only=True)[:, -1]
            out.append(logits)  # the last piece's: the row's last prompt slot
        return out[0] if len(out) == 1 else torch.cat(out)

    def _decode(self, tokens, slot: int, key_valid, positions, cache) -> torch.Tensor:
        """tokens [B] written at cache slot ``slot`` -> next logits [B, V]."""
        ctx = self.model.context(positions[:, slot:slot + 1], key_valid, positions, start=slot)
        return self.model(tokens[:, None], ctx, cache, last_only=True)[:, -1]
