"""Continuous batching over a block KV cache: the serving engine loop.

Shape letters: B rows this step, T new tokens per row (left-padded), S key slots per row,
V vocab.

Each iteration of ``Scheduler.step`` is schedule / run / post-process:
- schedule: drop finished and cancelled requests (a cancelled one's blocks go back here, a
  finished one's already went back when it finished, before its client was told), then
  admit waiting requests while the batch has room and the free blocks cover each one's
  prompt + max_tokens (reserved at admission, so a running request never runs out);
- run: one prefill forward over chunks of the admitted prompts (at most ``prefill_chunk``
  tokens a step, so long prompts do not stall the batch), then one decode forward for
  every running request whose prompt is cached (it joins the batch at the next step);
- post-process: sample, detect EOS / stop strings / max_tokens (a finished request's blocks
  go back), stream the text delta.

``PagedRunner.forward`` is the only code that touches the model; on several ranks rank 0
broadcasts each step's rows so the others run the same forward (``follow``).
"""
from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

import kernels

from moe_infer.engine import Engine
from moe_infer.sampling import SamplingParams, sample


@dataclass
class Row:
    """One sequence's work in a forward: its new tokens, how many of its tokens the cache
    already holds, and its block table."""

    tokens: list[int]
    start: int
    table: list[int]


class PagedRunner:
    """Runs the model over a ``PagedKVCache``: rows of any lengths and cache depths."""

    def __init__(self, engine: Engine, num_blocks: int, block_size: int):
        self.engine, self.model = engine, engine.model
        self.cache = self.model.make_paged_cache(num_blocks, block_size)
        self.block_size = block_size

    @torch.no_grad()
    def forward(self, rows: list[Row]) -> torch.Tensor:
        """-> float32 logits [B, V] of each row's last new token."""
        dev, bs = self.engine.device, self.block_size
        t = max(len(r.tokens) for r in rows)
        tokens, positions, valid, write = [], [], [], []
        for r in rows:
            pad = t - len(r.tokens)
            tokens.append([0] * pad + r.tokens)
            positions.append([0] * pad + list(range(r.start, r.start + len(r.tokens))))
            valid.append([False] * pad + [True] * len(r.tokens))
            write.append([self.cache.trash] * pad + self.cache.slots(r.table, r.start, r.start + len(r.tokens)))
        s = max(r.start + len(r.tokens) for r in rows)  # keys of the longest row
        lens = torch.tensor([r.start + len(r.tokens) for r in rows], device=dev)  # [B]
        width = math.ceil(s / bs)
        tables = torch.tensor([r.table[:width] + [0] * (width - len(r.table[:width])) for r in rows],
                              device=dev)  # [B, blocks]
        k = torch.arange(s, device=dev)
        read = tables[:, k // bs] * bs + k % bs  # [B, S]
        read = torch.where(k[None, :] < lens[:, None], read, self.cache.trash)
        self.cache.set_step(torch.tensor(write, device=dev), read)
        positions = torch.tensor(positions, device=dev)
        ctx = self.model.paged_context(positions, torch.tensor(valid, device=dev), lens, s)
        logits = self.model(torch.tensor(tokens, device=dev), ctx, self.cache, last_only=True)
        return logits[:, -1].float()


class QueueFull(Exception):
    """The waiting queue is at its bound: the server answers 503 with Retry-After."""


@dataclass(eq=False)  # requests compare by identity
class Request:
    """One sequence to generate. ``on_event(kind, data)`` is called from the engine thread:
    ("token", {"text": delta, "token_id": id}) per token, then once ("done", {"finish_reason":
    ..., "prompt_tokens": n, "completion_tokens": m}) or ("error", {"message": ...}) if the
    forward failed."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    on_event: Callable[[str, dict], None]
    stop: list[str] = field(default_factory=list)
    id: int = field(default_factory=itertools.count().__next__)
    # State, owned by the engine thread.
    generated: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    cached: int = 0  # tokens of this sequence in the KV cache
    pending: int | None = None  # the last sampled token, not yet in the cache
    text: str = ""  # decoded text of ``generated`` (stop strings cut it)
    sent: int = 0  # characters already streamed
    finish: str | None = None
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    generator: torch.Generator | None = None


class Scheduler:
    def __init__(self, engine: Engine, num_blocks: int, block_size: int = 16, max_batch: int = 16,
                 max_queue: int = 256, metrics=None, prefill_chunk: int = 512):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("max_batch", max_batch),
                        ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"server.{name}={v!r}: expected an integer >= 1")
        self.engine, self.runner = engine, PagedRunner(engine, num_blocks, block_size)
        self.block_size, self.max_batch, self.max_queue = block_size, max_batch, max_queue
        self.prefill_chunk = prefill_chunk
        self.free_blocks = list(range(num_blocks))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.metrics = metrics
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.broadcast: Callable[[list[Row]], None] | None = None  # set on multi-rank jobs

    # ----------------------------------------------------------------- from the server

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        return math.ceil((prompt_len + max_tokens) / self.block_size)

    def submit(self, req: Request):
        """Queues a request (thread-safe). Raises ValueError if it could never fit, QueueFull
        when the queue is at its bound."""
        need = self.blocks_needed(len(req.prompt), req.max_tokens)
        total = self.runner.cache.num_blocks
        if need > total:
            raise ValueError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) need {need} "
                             f"KV blocks of {self.block_size} tokens; the cache has {total}")
        if req.params.seed is not None:
            req.generator = torch.Generator(device=self.engine.device).manual_seed(req.params.seed)
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

    @property
    def blocks_in_use(self) -> int:
        return self.runner.cache.num_blocks - len(self.free_blocks)

    # ----------------------------------------------------------------- the engine loop

    def run(self, stop: threading.Event):
        """The engine thread: iterate while there is work, sleep on the condition otherwise."""
        while not stop.is_set():
            with self.lock:
                while not stop.is_set() and not self.waiting and not self.running:
                    self.wake.wait(timeout=0.5)
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

    def _release(self, r: Request):
        """Gives a request's KV blocks back (under the lock)."""
        self.free_blocks += r.table
        r.table = []

    def step(self):
        self._schedule()
        # Prefill in chunks of at most prefill_chunk tokens a step (over all prefilling
        # requests, oldest first), so a long prompt cannot stall the running batch's next
        # token for long; a request samples its first token when its last chunk is cached.
        budget, chunks = self.prefill_chunk, []
        for r in self.running:
            if r.finish is None and r.cached < len(r.prompt) and budget > 0:
                n = min(budget, len(r.prompt) - r.cached)
                chunks.append((r, n))
                budget -= n
        if chunks:
            logits = self._forward([Row(r.prompt[r.cached:r.cached + n], r.cached, r.table) for r, n in chunks])
            for r, n in chunks:
                r.cached += n
            done = [i for i, (r, _) in enumerate(chunks) if r.cached == len(r.prompt)]
            if done:
                self._post_process([chunks[i][0] for i in done], logits[done])
        prefilled = {id(r) for r, _ in chunks}
        decoding = [r for r in self.running
                    if r.finish is None and r.pending is not None and id(r) not in prefilled]
        if decoding:
            rows = [Row([r.pending], r.cached, r.table) for r in decoding]
            logits = self._forward(rows)
            for r in decoding:
                r.cached += 1
            self._post_process(decoding, logits)
        self._report()

    def _forward(self, rows: list[Row]) -> torch.Tensor:
        if self.broadcast is not None:
            self.broadcast(rows)
        return self.runner.forward(rows)

    def _schedule(self):
        """Drops finished and cancelled requests (their blocks go back), then admits waiting
        ones while batch slots and free blocks allow, first come first served."""
        with self.lock:
            for r in self.running:
                if r.cancelled and r.finish is None:
                    r.finish = "cancelled"
            for r in [r for r in self.running if r.finish is not None]:
                self._release(r)
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
                self.running.append(r)

    def _post_process(self, reqs: list[Request], logits: torch.Tensor):
        tokens = self._sample(reqs, logits).tolist()  # the one host sync per step
        now = time.monotonic()
        tok = self.engine.tokenizer
        for r, t in zip(reqs, tokens):
            if r.cancelled:
                continue
            if self.metrics is not None:
                if r.last_token_at is None:
                    self.metrics.first_token(now - r.arrived)
                else:
                    self.metrics.next_token(now - r.last_token_at)
            r.last_token_at = now
            if t in self.engine.eos:
                self._finish(r, "stop")
                continue
            r.generated.append(t)
            r.pending = t
            if self.metrics is not None:
                self.metrics.tokens(1)
            delta = ""
            if tok is not None:
                r.text = tok.decode(r.generated)
                cut = min((i for i in (r.text.find(s) for s in r.stop) if i >= 0), default=-1)
                if cut >= 0:
                    r.text = r.text[:cut]
                    self._emit_text(r, final=True)
                    self._finish(r, "stop")
                    continue
                delta = self._emit_text(r, final=False)
            r.on_event("token", {"text": delta, "token_id": t})
            if len(r.generated) >= r.max_tokens:
                self._emit_text(r, final=True)
                self._finish(r, "length")

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
            r.on_event("token", {"text": delta, "token_id": None})
        return delta

    def _finish(self, r: Request, reason: str):
        r.finish = reason
        with self.lock:  # its blocks go back before its client hears that it is done
            self._release(r)
        r.on_event("done", {"finish_reason": reason, "prompt_tokens": len(r.prompt),
                            "completion_tokens": len(r.generated)})

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        greedy = all(r.params.greedy for r in reqs)
        if greedy:
            return kernels.argmax(logits)
        return torch.cat([sample(logits[i:i + 1], r.params, r.generator) for i, r in enumerate(reqs)])

    def _report(self):
        if self.metrics is not None:
            with self.lock:
                self.metrics.state(len(self.waiting), len(self.running), self.blocks_in_use)


def follow(runner: PagedRunner, receive: Callable[[], list[Row] | None]):
    """Ranks other than 0: run every step rank 0 broadcasts, until it sends None."""
    while (rows := receive()) is not None:
        runner.forward(rows)
