"""Continuous batching over a block KV cache: the serving engine loop.

Shape letters: B rows this step, T new tokens per row (left-padded), S key slots per row,
V vocab.

Each iteration of ``Scheduler.step`` is schedule / launch / deliver:
- schedule: drop finished and cancelled requests (a cancelled one's blocks go back here, a
  finished one's already went back when it finished, before its client was told), then
  admit waiting requests while the batch has room and the free blocks cover each one's
  prompt + max_tokens (reserved at admission, so a running request never runs out);
- launch: one prefill forward over the admitted prompts (at most ``prefill_chunk`` tokens
  a step, rows x width, so long prompts do not stall the batch), then one decode
  forward for every running request whose prompt is cached (it joins the batch at the next
  step); then each request's logit processors (logit bias, the min_tokens EOS mask,
  penalties) and sampling, all queued on the device. Everything the host needs from the
  step starts its way back in one copy;
- deliver: read the previous step's tokens, detect EOS / stop strings / max_tokens (a
  finished request's blocks go back), stream the text delta and any log-probabilities
  asked for.

The host delivers step k while the device runs step k + 1: step k + 1 feeds each row the
token step k sampled straight from the device (the request's lane of ``PagedRunner.prev``;
on several ranks the step's rows carry rank 0's to every rank's, device to device), so the
host's work per token (detokenizing, stop strings, streaming) hides behind the device's.
Pipeline stages do the same a slot apart: a unit's tokens reach the host while the next
slot runs, and its requests re-enter the pipeline from their lanes.
A request that step k ends (EOS, a stop string) has already joined step k + 1: that row's
token is dropped, and its KV write lands in the blocks it reserved (a request never feeds
a token past ``max_tokens``), before any later step can reuse them. The first tokens of the
requests whose prefill step k ends are the exception where no other prompt waits: their
copy is queued before step k's decode forward, and the host delivers them as soon as the
prefill is done.

Log-probabilities are those of the raw model output (vLLM's default ``raw_logprobs``):
log_softmax of the logits before logit bias, penalties, temperature, top-k and top-p. So a
token sampled at temperature 1.5 reports how likely the model found it, not how likely the
sampler was to draw it.

``PagedRunner`` is the only code that touches the model; on several ranks rank 0
broadcasts each step's rows so the others run the same forward (``moe_infer.ranks``).
"""
from __future__ import annotations

import bisect
import itertools
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from moe_infer.engine import Engine
from moe_infer.outputs import Logprob, Sampled, token_logprobs, top_pairs
from moe_infer.pipeline import ServingSlots
from moe_infer.ranks import ALL_POSITIONS, FORWARD, IDLE, SLOT
from moe_infer.runner import PagedRunner, Row, to_device
from moe_infer.sampling import SamplingParams, apply_penalties, knobs, sample_rows
from moe_infer.tokenizer import decode_delta


class QueueFull(Exception):
    """The waiting queue is at its bound: the server answers 503 with Retry-After."""


@dataclass(eq=False)  # requests compare by identity
class Request:
    """One sequence to generate. ``on_event(kind, data)`` is called from the engine thread:
    with ``prompt_logprobs`` first ("prompt", {"logprobs": [Logprob]}) with one entry per
    prompt token (the first one's logprob is None); then ("token", {"text": delta, "token_id":
    id, "logprob": Logprob | None}) per token, where a last one with token_id None flushes
    held-back text; then once ("done", {"finish_reason": ..., "prompt_tokens": n,
    "completion_tokens": m}), or ("error", {"message": ...}) if the forward failed.

    ``max_tokens`` 0 (only with ``prompt_logprobs``) scores the prompt and generates nothing."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    on_event: Callable[[str, dict], None]
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # EOS and stop strings cannot end it before this many tokens
    ignore_eos: bool = False  # EOS is generated like any other token (vLLM)
    logprobs: int | None = None  # each generated token's log-probability and the top-N; None: none
    prompt_logprobs: int | None = None  # the same for the prompt tokens (echo)
    id: int = field(default_factory=itertools.count().__next__)
    # State, owned by the engine thread.
    generated: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    cached: int = 0  # tokens of this sequence in the KV cache
    sampled: int = 0  # tokens sampled, delivered or not (``generated`` holds the delivered ones)
    src: int = -1  # its lane while it runs: the row of ``PagedRunner.prev`` its sampled tokens go to
    text: str = ""  # decoded text of ``generated`` (stop strings cut it)
    detok: tuple[int, int] = (0, 0)  # ``decode_delta``'s (prefix, read) over ``generated``
    sent: int = 0  # characters already streamed
    stop_floor: int = 0  # stop strings match from this character of ``text`` on (min_tokens)
    counts: torch.Tensor | None = None  # [V] each token's count among those sampled (penalties)
    seen: torch.Tensor | None = None  # [V] bool: in the prompt or generated (repetition penalty)
    bias: torch.Tensor | None = None  # [V] the logit bias, dense
    prompt_lp: list = field(default_factory=list)  # per prefill chunk: device logprob tensors
    finish: str | None = None
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    seed: int = 0  # the sampling noise's (``moe_infer.sampling.knobs``): the request's, or drawn at submit
    inflight: bool = False  # pipeline stages: a unit holding it is in the pipeline


class Scheduler:
    def __init__(self, engine: Engine, num_blocks: int, block_size: int = 16, max_batch: int = 16,
                 max_queue: int = 256, metrics=None, prefill_chunk: int = 512):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("max_batch", max_batch),
                        ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"server.{name}={v!r}: expected an integer >= 1")
        self.engine, self.runner = engine, PagedRunner(engine, num_blocks, block_size, max_batch)
        self.block_size, self.max_batch, self.max_queue = block_size, max_batch, max_queue
        self.prefill_chunk = prefill_chunk
        self.free_blocks = list(range(num_blocks))
        self.free_lanes = list(range(max_batch))  # rows of ``runner.prev``, one a running request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.metrics = metrics
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.broadcast: Callable[[list[Row], int], None] | None = None  # set on multi-rank jobs (ranks.row_channel)
        # The followers wait for each step in a collective, which fails the job past the
        # collective timeout: an idle rank 0 sends a step of nothing well within it.
        self.keepalive_s = engine.config.parallel.timeout_s / 4
        self.sent_at = time.monotonic()
        self.inflight: list[Sampled] = []  # launched, not yet delivered
        # Pipeline stages under mpirun: each step is one slot of the inference schedule,
        # with up to ``parallel.micro_batches`` units in flight (``_slot_step``).
        pp, micro = engine.model.pp.size, engine.config.parallel.micro_batches
        self.slots = ServingSlots(self.runner) if pp > 1 and micro > 1 else None
        self.units: list[list[tuple[Request, bool]] | None] = [None] * pp  # rank 0's view of the slots

    # ----------------------------------------------------------------- from the server

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        return math.ceil((prompt_len + max_tokens) / self.block_size)

    def submit(self, req: Request):
        """Queues a request (thread-safe). Raises ValueError if it could never fit, QueueFull
        when the queue is at its bound."""
        vocab = self.engine.config.model.vocab_size
        if any(t >= vocab for t, _ in req.params.logit_bias):  # it would fail the whole batch's step
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        need = self.blocks_needed(len(req.prompt), req.max_tokens)
        total = self.runner.cache.num_blocks
        if need > total:
            raise ValueError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) need {need} "
                             f"KV blocks of {self.block_size} tokens; the cache has {total}")
        req.seed = req.params.seed if req.params.seed is not None else random.getrandbits(63)
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests already wait")
            self.waiting.append(req)
            self.wake.notify()

    def cancel(self, req: Request):
        """The client went away: the next iteration frees its blocks."""
        with self.lock:
            req.cancelled = True
            self.wake.notify()

    def warm_up(self):
        """Before the first request, on a GPU: every decode and prefill bucket captured (on
        several ranks ``ranks.lead_or_follow`` made them on every rank already), and on one rank
        the kernels compiled for eager prefills of each power-of-two width up to
        ``prefill_chunk`` (not on several: a forward there needs every rank, and the others
        wait for steps)."""
        self.runner.capture_all()
        if self.engine.device.type == "cuda" and self.broadcast is None:
            widths = [1 << i for i in range(self.prefill_chunk.bit_length())]
            self.runner.warm_up(widths + [self.prefill_chunk] * (widths[-1] != self.prefill_chunk))

    def release_graphs(self) -> None:
        """Drops the captured steps of this scheduler's runner and of the engine's generate()
        (``PagedRunner.release_graphs``): once it stops serving, before a multi-rank job
        destroys its process group."""
        self.runner.release_graphs()
        self.engine.release_graphs()

    @property
    def blocks_in_use(self) -> int:
        return self.runner.cache.num_blocks - len(self.free_blocks)

    # ----------------------------------------------------------------- the engine loop

    def run(self, stop: threading.Event):
        """The engine thread: iterate while there is work, sleep on the condition otherwise."""
        while not stop.is_set():
            with self.lock:
                while not stop.is_set() and not self.waiting and not self.running and not self.inflight:
                    if self.broadcast is not None and time.monotonic() - self.sent_at > self.keepalive_s:
                        self._send([], IDLE)
                    self.wake.wait(timeout=min(0.5, self.keepalive_s))
            if not stop.is_set():
                try:
                    self.step()
                except Exception as exc:  # e.g. out of memory: fail the batch, keep serving
                    self._fail_running(f"{type(exc).__name__}: {exc}")

    def _fail_running(self, message: str):
        """Ends every running request with an error event; their blocks go back."""
        with self.lock:
            for r in self.running:
                if r.finish is None:
                    r.finish = "error"
                    r.on_event("error", {"message": message})
                self._release(r)
            self.running = []
            self.inflight = []
            if self.slots is not None:
                self.slots.reset()
                self.units = [None] * len(self.units)

    def _release(self, r: Request):
        """Gives a request's KV blocks and lane back (under the lock)."""
        self.free_blocks += r.table
        if r.src >= 0:
            bisect.insort(self.free_lanes, r.src)  # (the lowest first: broadcasts send the lanes up to the last)
            r.src = -1
        r.table = []

    def step(self):
        if self.slots is not None and self.broadcast is not None:
            return self._slot_step()
        self._step_in_turn()

    def _step_in_turn(self):
        self._schedule()
        first, launched = self._launch()
        for sampled in self.inflight:  # the device is busy with this step meanwhile
            self._deliver(sampled)
        # New requests' first tokens go out as soon as their prefill is done (not after the
        # step's decode too), unless more prompts wait: then the next step's launches, an
        # eager prefill's host work among them, overlap this step on the device first.
        early = first is not None and (self.broadcast is not None or not self._prefill_waits())
        if early:
            self._deliver(first)
        self.inflight = [s for s in (None if early else first, launched) if s is not None]
        self._report()

    def _prefill_chunks(self, fixed: bool) -> list[tuple[Request, int]]:
        """The prompt pieces a step prefills: (request, tokens) -- at most ``prefill_chunk``
        tokens counted as the forward computes them (rows x the widest row), so a long
        prompt cannot stall the running batch's next token for long: the oldest prefilling
        request first (in pieces if it is longer), then every later one whose whole prompt
        still fits beside it; with ``fixed``, a prefill of fresh prompts stays within a
        fixed-shape bucket (``PagedRunner.prefill_bucket``): a captured prefill costs the
        device's time, an eager one the host's launches, which on a large model outlast
        several captured ones. Requests in the pipeline wait for their unit."""
        chunks, width = [], 0
        for r in self.running:
            if r.finish is None and not r.inflight and r.cached < len(r.prompt):
                left = len(r.prompt) - r.cached
                if chunks:
                    rows, w = len(chunks) + 1, max(width, left)
                    if rows * w > self.prefill_chunk:
                        continue
                    if (fixed and r.cached == 0 and self.runner.prefill_bucket(rows, w) is None
                            and self.runner.prefill_bucket(len(chunks), width) is not None):
                        continue
                fixed = fixed and r.cached == 0
                n = min(left, self.prefill_chunk)
                chunks.append((r, n))
                width = max(width, n)
        return chunks

    def _slot_step(self):
        """One slot of the inference schedule (pipeline stages, ``moe_infer.pipeline``): the
        rows that are ready enter the first stage -- prompt pieces, and the decoding
        requests whose last token came back, at most a micro-batch's share of them, so the
        units in flight stay even -- and the unit that leaves the last stage samples and
        delivers its tokens. A request is in at most one unit: its next token enters the
        slot after its last one left. A prefill whose prompt logprobs were asked for needs
        every position's logits: the pipeline drains and that step runs the stages in
        turn."""
        self._schedule()
        if any(r.prompt_logprobs is not None and r.finish is None and r.cached < len(r.prompt)
               for r in self.running):
            while any(u is not None for u in self.units):
                self._slot([], [])
            return self._step_in_turn()
        entries, rows = [], []
        for r, n in self._prefill_chunks(self.runner.static):  # (fresh prompts in a bucket replay its steps)
            rows.append(Row(r.prompt[r.cached:r.cached + n], r.cached, r.table, sample=self._knobs(r)))
            r.cached += n
            entries.append((r, r.cached == len(r.prompt)))  # a last piece draws the first token
        going = [r for r in self.running if r.finish is None and not r.cancelled and r.sampled > 0]
        share = -(-len(going) // self.engine.config.parallel.micro_batches)
        ready = [r for r in going if not r.inflight and r.sampled < r.max_tokens]
        for r in ready[:share]:  # each feeds its token from its lane, delivered or not
            rows.append(Row([0], r.cached, r.table, r.src, self._knobs(r)))
            r.cached += 1
            entries.append((r, True))
        # The tokens of the unit that left in the last slot reach the host while this slot
        # runs: the device never waits for this loop.
        last, self.inflight = self.inflight, []
        if entries or any(u is not None for u in self.units):
            self._slot(entries, rows)
        for sampled in last:
            self._deliver(sampled)
        self._report()

    def _slot(self, entries: list[tuple[Request, bool]], rows: list[Row]):
        """Every rank one slot on with ``rows`` entering; the unit leaving samples (its tokens
        reach the host during the next slot: ``self.inflight``)."""
        for r, _ in entries:
            r.inflight = True
        self._send(rows, SLOT)
        self.units = [entries or None] + self.units[:-1]
        left = self.slots.slot(rows)
        finished, self.units[-1] = self.units[-1], None
        if left is None:
            return
        done_rows, logits = left
        for r, _ in finished:
            r.inflight = False
        keep = [i for i, (_, token) in enumerate(finished) if token]
        if keep:
            # (indices on the device: a host list would make the indexing wait for the stream)
            reqs, logits = [finished[i][0] for i in keep], logits[to_device(keep, logits.device)]
            drawn = sample_rows(logits, [done_rows[i].sample for i in keep], pdl=self.engine.model.options.pdl)
            self.inflight.append(self._sample_step(reqs, logits, drawn))

    def _prefill_waits(self) -> bool:
        """Whether a request waits for admission or has prompt tokens still to prefill."""
        return bool(self.waiting) or any(r.finish is None and r.cached < len(r.prompt) for r in self.running)

    def _launch(self) -> tuple[Sampled | None, Sampled | None]:
        """Queues one step's forwards and sampling on the device -> (the first tokens of the
        requests whose prefill it ends, the decoding rows' next tokens), each on its way to
        the host (None where no row). The first tokens' copy is queued before the decode
        forward, so a new request's first token reaches its client a decode step sooner."""
        # The prompt pieces (``_prefill_chunks``); a request samples its first token when
        # its last piece is cached.
        chunks, done = self._prefill_chunks(self.runner.static), []
        if chunks:
            rows = [Row(r.prompt[r.cached:r.cached + n], r.cached, r.table, sample=self._knobs(r)) for r, n in chunks]
            if any(r.prompt_logprobs is not None for r, _ in chunks):
                full = self._forward(rows, all_positions=True)  # [B, T, V]
                for (r, n), row_logits in zip(chunks, full):
                    if r.prompt_logprobs is not None:
                        self._score_prompt(r, row_logits[-n:], r.cached)
                logits = full[:, -1]
                ids = sample_rows(logits, [row.sample for row in rows], pdl=self.engine.model.options.pdl)
            else:
                logits, ids = self._forward(rows)
            for r, n in chunks:
                r.cached += n
            done = [i for i, (r, _) in enumerate(chunks) if r.cached == len(r.prompt)]
        # Every request with a sampled token to feed, delivered or not; never past max_tokens
        # (the requests whose prefill ends now feed theirs at the next step).
        decoding = [r for r in self.running if r.finish is None and not r.cancelled and 0 < r.sampled < r.max_tokens]
        first = launched = None
        if done:  # indexing copies: a one-token prompt may have run as a captured decode step,
            # whose outputs the decode below rewrites if it replays the same one
            at = to_device(done, logits.device)  # (a host list would make the indexing wait for the stream)
            first = self._sample_step([chunks[i][0] for i in done], logits[at], ids[at])
        if decoding:
            # Each row feeds the token the last step left in ``runner.prev`` (on several ranks
            # the rows' broadcast carries it to every rank's): the host need not have it.
            rows = [Row([0], r.cached, r.table, r.src, self._knobs(r)) for r in decoding]
            logits, ids = self._forward(rows)
            for r in decoding:
                r.cached += 1
            launched = self._sample_step(decoding, logits, ids)
        return first, launched

    @staticmethod
    def _knobs(r: Request):
        """How the request's next token is drawn (its ``sampled``-th)."""
        return knobs(r.params, r.seed, r.sampled)

    def _forward(self, rows: list[Row], all_positions: bool = False):
        """-> (logits [B, V] of each row's last token, the token each row's knobs draw [B]);
        with ``all_positions`` the logits [B, T, V] of every token alone."""
        if self.broadcast is not None:
            self._send(rows, ALL_POSITIONS if all_positions else FORWARD)
        return self.runner.forward_all(rows) if all_positions else self.runner.decode(rows)

    def _send(self, rows: list[Row], mode: int):
        """A step's rows to the other ranks (``ranks.row_channel``)."""
        self.broadcast(rows, mode)
        self.sent_at = time.monotonic()

    def _score_prompt(self, r: Request, logits: torch.Tensor, start: int):
        """Keeps, on the device, the logprobs of the prompt tokens that a chunk's logits
        [n, V] (prompt positions start .. start + n - 1) predict: each position predicts the
        next token; the last prompt position predicts the first generated one instead."""
        targets = r.prompt[start + 1:start + 1 + len(logits)]
        if targets:
            ids = to_device(targets, logits.device)
            r.prompt_lp.append(token_logprobs(logits[:len(targets)], ids, r.prompt_logprobs))

    def _schedule(self):
        """Drops finished and cancelled requests (their blocks go back), then admits waiting
        ones while batch slots and free blocks allow, first come first served."""
        with self.lock:
            for r in self.running:
                if r.cancelled and r.finish is None:
                    r.finish = "cancelled"
            for r in [r for r in self.running if r.finish is not None and not r.inflight]:
                self._release(r)  # (one in the pipeline still writes its blocks)
                self.running.remove(r)
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
            while self.waiting and len(self.running) < self.max_batch:
                r = self.waiting[0]
                need = self.blocks_needed(len(r.prompt), r.max_tokens)
                if need > len(self.free_blocks):
                    break  # first come, first served: wait for blocks to come back
                self.waiting.popleft()
                r.table, self.free_blocks = self.free_blocks[:need], self.free_blocks[need:]
                r.src = self.free_lanes.pop(0)
                self.running.append(r)

    def _sample_step(self, reqs: list[Request], logits: torch.Tensor, drawn: torch.Tensor) -> Sampled:
        """-> each row's next token on its way to the host, with the logprobs asked for
        (taken from ``logits`` as the model gave them, not the processed ones). The tokens
        are ``drawn`` by the forward, drawn again from the processed logits for rows with
        logit processors; on the device they go to each request's lane of ``runner.prev``
        (the next step feeds them from there) and into the penalty state."""
        tokens = self._redraw(reqs, logits, drawn)  # [B] on the device
        self.runner.prev.index_copy_(0, to_device([r.src for r in reqs], tokens.device), tokens)
        lp_rows = [i for i, r in enumerate(reqs) if r.logprobs is not None]
        scored = [r for r in reqs if r.prompt_logprobs is not None and r.sampled == 0]
        for i, r in enumerate(reqs):
            r.sampled += 1
            if r.counts is not None:  # penalty state, on the device
                r.counts.index_add_(0, tokens[i:i + 1], self._one(r.counts))
                r.seen.index_fill_(0, tokens[i:i + 1], True)
        parts = self._logprob_parts(reqs, lp_rows, scored, logits, tokens)
        return Sampled.start(reqs, lp_rows, scored, [tokens] + parts)

    @staticmethod
    def _one(like: torch.Tensor) -> torch.Tensor:
        return torch.ones(1, dtype=like.dtype, device=like.device)

    def _deliver(self, step: Sampled):
        """The host's part of a step: tokens to requests, text and events to clients."""
        host = step.values()
        reqs, tokens = step.reqs, [int(t) for t in host[0]]
        picked, prompt_scores = self._read_logprobs(reqs, step.lp_rows, step.scored, tokens, host[1:])
        now = time.monotonic()
        tok = self.engine.tokenizer
        for i, (r, t) in enumerate(zip(reqs, tokens)):
            if r.cancelled or r.finish is not None:  # ended while this step ran: its token is dropped
                continue
            if self.metrics is not None:
                if r.last_token_at is None:
                    self.metrics.first_token(now - r.arrived)
                else:
                    self.metrics.next_token(now - r.last_token_at)
            r.last_token_at = now
            if id(r) in prompt_scores:
                r.on_event("prompt", {"logprobs": prompt_scores[id(r)]})
            if r.max_tokens == 0:  # scoring the prompt only
                self._finish(r, "length")
                continue
            if t in self.engine.eos and not r.ignore_eos:  # min_tokens masked EOS while it applies
                self._flush_text(r)
                self._finish(r, "stop")
                continue
            r.generated.append(t)
            if self.metrics is not None:
                self.metrics.tokens(1)
            delta = ""
            if tok is not None:
                added, r.detok = decode_delta(tok, r.generated, r.detok)
                r.text += added
                if len(r.generated) < r.min_tokens:  # stop strings match only in later text
                    r.stop_floor = len(r.text)
                cut = min((c for c in (r.text.find(s, r.stop_floor) for s in r.stop) if c >= 0), default=-1)
                if cut >= 0 and len(r.generated) >= r.min_tokens:
                    r.text = r.text[:cut]
                    self._emit_text(r, final=True)
                    self._finish(r, "stop")
                    continue
                delta = self._emit_text(r, final=False)
            r.on_event("token", {"text": delta, "token_id": t, "logprob": picked.get(i)})
            if len(r.generated) >= r.max_tokens:
                self._flush_text(r)
                self._finish(r, "length")

    def _logprob_parts(self, reqs, lp_rows: list[int], scored: list[Request], logits, tokens) -> list:
        """Device tensors for the host copy: (logprob, top-k values, top-k ids) of the rows
        ``lp_rows`` with k their largest top-N, then the same over the prompt of each request
        in ``scored`` (whose prompt's logprobs travel with its first token)."""
        parts = []
        if lp_rows:
            rows = to_device(lp_rows, tokens.device)
            parts += token_logprobs(logits[rows], tokens[rows], max(reqs[i].logprobs for i in lp_rows))
        for r in scored:
            chunks = r.prompt_lp or [token_logprobs(logits[:0], tokens[:0], r.prompt_logprobs)]  # 1-token prompt
            parts += [torch.cat([c[j] for c in chunks]) for j in range(3)]
            r.prompt_lp = []
        return parts

    def _read_logprobs(self, reqs, lp_rows: list[int], scored: list[Request], tokens: list[int], host: list):
        """The host lists of ``_logprob_parts`` -> ({row: the Logprob of its token},
        {id(request): the Logprobs of its prompt})."""
        picked, prompt_scores = {}, {}
        if lp_rows:
            got, vals, ids = host[:3]
            k = max(reqs[i].logprobs for i in lp_rows)
            for j, i in enumerate(lp_rows):
                picked[i] = Logprob(tokens[i], got[j], top_pairs(ids, vals, j, k)[:reqs[i].logprobs])
            host = host[3:]
        for j, r in enumerate(scored):
            got, vals, ids = host[3 * j:3 * j + 3]
            prompt_scores[id(r)] = [Logprob(r.prompt[0], None, None)] + [
                Logprob(t, got[m], top_pairs(ids, vals, m, r.prompt_logprobs)) for m, t in enumerate(r.prompt[1:])]
        return picked, prompt_scores

    def _flush_text(self, r: Request):
        """Sends the text still held back (an incomplete character, a possible stop string's
        start): the request ends."""
        if self.engine.tokenizer is not None:
            added, r.detok = decode_delta(self.engine.tokenizer, r.generated, r.detok, final=True)
            r.text += added
        self._emit_text(r, final=True)

    def _emit_text(self, r: Request, final: bool) -> str:
        """The text not yet sent; while more may come, hold back what could still become a
        stop string or an incomplete UTF-8 character."""
        end = len(r.text)
        if not final:
            hold = max((len(s) - 1 for s in r.stop), default=0)
            end = max(r.sent, end - hold)
            while end > r.sent and r.text[end - 1] == "\ufffd":
                end -= 1
        delta, r.sent = r.text[r.sent:end], max(r.sent, end)
        if final and delta:
            r.on_event("token", {"text": delta, "token_id": None, "logprob": None})
        return delta

    def _finish(self, r: Request, reason: str):
        r.finish = reason
        # Its blocks and lane go back before its client hears that it is done, unless a unit
        # holding it is in the pipeline (it learnt of its last token a slot late): that unit
        # still writes its blocks and samples into its lane, and ``_schedule`` frees them
        # once it has left.
        if not r.inflight:
            with self.lock:
                self._release(r)
        r.on_event("done", {"finish_reason": reason, "prompt_tokens": len(r.prompt),
                            "completion_tokens": len(r.generated)})

    def _redraw(self, reqs: list[Request], logits: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
        """``drawn`` [B], with the rows that use a logit processor drawn again (the same
        knobs) from their processed logits, in vLLM's order: logit bias, EOS masked while
        a request is short of min_tokens, then penalties; batched on the device."""
        bias = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        no_eos = [i for i, r in enumerate(reqs) if r.sampled < r.min_tokens and not r.ignore_eos and self.engine.eos]
        pen = [i for i, r in enumerate(reqs) if r.params.penalized]
        if not (bias or no_eos or pen):
            return drawn
        dev, vocab = logits.device, logits.shape[-1]
        logits = logits.clone()
        if bias:
            for i in bias:
                r = reqs[i]
                if r.bias is None:
                    ids, vals = zip(*r.params.logit_bias)
                    r.bias = torch.zeros(vocab, device=dev).index_put_(
                        (to_device(list(ids), dev),), to_device(list(vals), dev, torch.float32), accumulate=True)
            logits.index_add_(0, to_device(bias, dev), torch.stack([reqs[i].bias for i in bias]))
        if no_eos:
            eos = to_device(sorted(self.engine.eos), dev)
            logits[to_device(no_eos, dev)[:, None], eos[None, :]] = float("-inf")
        if pen:
            for i in pen:
                r = reqs[i]
                if r.counts is None:  # made at the first token, so nothing is generated yet
                    r.counts = torch.zeros(vocab, device=dev)
                    r.seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
                    r.seen[to_device(r.prompt, dev)] = True
            p = to_device([[reqs[i].params.presence_penalty, reqs[i].params.frequency_penalty,
                          reqs[i].params.repetition_penalty] for i in pen], dev, torch.float32)  # [B', 3]
            rows = to_device(pen, dev)
            penalized = apply_penalties(logits.index_select(0, rows), torch.stack([reqs[i].counts for i in pen]),
                                        torch.stack([reqs[i].seen for i in pen]), p[:, 0:1], p[:, 1:2], p[:, 2:3])
            logits.index_copy_(0, rows, penalized)
        again = sorted(set(bias + no_eos + pen))
        at = to_device(again, dev)
        redrawn = sample_rows(logits[at], [self._knobs(reqs[i]) for i in again], pdl=self.engine.model.options.pdl)
        return drawn.index_copy(0, at, redrawn)

    def _report(self):
        if self.metrics is not None:
            with self.lock:
                self.metrics.state(len(self.waiting), len(self.running), self.blocks_in_use)
