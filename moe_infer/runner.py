"""The model runner behind both ``Engine.generate`` and the server's scheduler: the model's
forward over a paged KV cache, with the decode step captured in CUDA graphs.

Shape letters: B rows this step, T new tokens per row (left-padded), S key slots per row,
N blocks per row's table, V vocab.

A forward takes rows of any lengths and cache depths (prefill chunks, and decode steps that
fit no bucket) and runs eagerly. A decode step, one new token per row, runs as a
``PagedDecodeStep`` of fixed shapes: B padded to a power of two, S to a power of two of at
least ``MIN_KEYS``, its inputs in device buffers filled by one copy. On one GPU each
(B, S) bucket is captured once in a CUDA graph and replayed, so the step costs one copy and
one launch from the host. The step also takes each row's greedy token (the argmax) inside
the graph, so greedy decoding costs one copy to the host a step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import kernels
from moe_infer.graphs import capture, prime_cuda_graphs
from moe_infer.sampling import Knobs, draw, sample_rows

if TYPE_CHECKING:
    from moe_infer.engine import Engine


@dataclass
class Row:
    """One sequence's work in a forward: its new tokens, how many of its tokens the cache
    already holds, and its block table."""

    tokens: list[int]
    start: int
    table: list[int]
    src: int = -1  # >= 0: the last new token is ``PagedRunner.prev[src]`` (sampled on the device)
    sample: Knobs | None = None  # how its next token is drawn (``moe_infer.sampling.knobs``); None: greedy


class PagedDecodeStep:
    """The decode step of at most ``batch`` rows over at most ``keys`` key slots each, with
    fixed shapes. ``inputs`` [B, 4 + N] holds per row: the new token, its position (the
    tokens cached before it), 1 for a real row or 0 for padding, the index in
    ``runner.prev`` to take the token from instead (-1: none), then the block table. A
    step where some row samples also fills ``ints`` [B, 3] and ``floats`` [B, 2], each
    row's ``moe_infer.sampling.draw`` knobs, and runs its sampling variant: the draw
    inside the step too (greedy steps skip its sort).
    With ``graph`` each variant is captured once, at its first use, and replayed;
    otherwise it runs eagerly (the same math, for CPU tests)."""

    def __init__(self, runner: "PagedRunner", batch: int, keys: int, graph: bool, pool=None):
        self.runner, self.batch, self.keys = runner, batch, keys
        dev = runner.engine.device
        self.blocks = keys // runner.block_size
        self.inputs = torch.zeros(batch, 4 + self.blocks, dtype=torch.long, device=dev)
        self.ints = torch.zeros(batch, 3, dtype=torch.long, device=dev)
        self.floats = torch.zeros(batch, 2, dtype=torch.float32, device=dev)
        pinned = dev.type == "cuda"
        self.host = [torch.zeros_like(t, device="cpu", pin_memory=pinned) for t in (self.inputs, self.ints,
                                                                                    self.floats)]
        self.tables = runner.model.rotary_tables(keys)  # rotary rows looked up by position each step
        self.pool = pool
        self.graphs: dict[bool, tuple] | None = {} if graph else None  # sampling variant -> (graph, outputs)
        if graph:  # every row padding: the warm-up steps write only the cache's trash slot
            self.capture(sampling=False)

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The greedy variant's graph (None: the step runs eagerly)."""
        return self.graphs[False][0] if self.graphs else None

    def capture(self, sampling: bool):
        """Captures the greedy or the sampling variant (once)."""
        if sampling not in self.graphs:
            self.graphs[sampling] = capture(lambda: self._step(sampling), self.runner.engine.device, self.pool)

    def _step(self, sampling: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model, cache = self.runner.model, self.runner.cache
        tokens, ctx = model.paged_decode_context(self.inputs, self.runner.prev, cache, self.keys, self.tables)
        logits = model(tokens, ctx, cache, last_only=True)[:, -1].float()
        ids = kernels.argmax(logits, pdl=model.options.pdl)
        return logits, draw(logits, self.ints, self.floats, ids) if sampling else ids

    def run(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (float32 logits [len(rows), V], ids [len(rows)]: each row's draw, greedy or sampled).
        With a graph they are views of its output buffers, which its next replay rewrites:
        a caller that keeps them past another step copies them."""
        h, hi, hf = (t.numpy() for t in self.host)  # the pinned buffers themselves
        h.fill(0)
        for i, r in enumerate(rows):
            blocks = r.table[:self.blocks]
            h[i, :4] = r.tokens[0], r.start, 1, r.src
            h[i, 4:4 + len(blocks)] = blocks
        self.inputs.copy_(self.host[0], non_blocking=True)
        sampling = any(r.sample is not None for r in rows)
        if sampling:
            hi.fill(0)
            hf[:] = (0.0, 1.0)
            for i, r in enumerate(rows):
                if r.sample is not None:
                    hi[i], hf[i] = r.sample[:3], r.sample[3:]
            self.ints.copy_(self.host[1], non_blocking=True)
            self.floats.copy_(self.host[2], non_blocking=True)
        n = len(rows)
        if self.graphs is None:
            logits, ids = self._step(sampling)
        else:
            self.capture(sampling)
            graph, (logits, ids) = self.graphs[sampling]
            graph.replay()
        return logits[:n], ids[:n]


class PagedRunner:
    """Runs the model over a ``PagedKVCache``: rows of any lengths and cache depths. Decode
    steps go through ``PagedDecodeStep`` where ``static``: captured in CUDA graphs where the
    engine's ``decode_mode`` is "graph" (one GPU), run eagerly with the same fixed shapes
    where it is "static" (how CPU tests check the graph's math)."""

    MIN_KEYS = 64  # the smallest key bucket of a decode step

    def __init__(self, engine: Engine, num_blocks: int, block_size: int, max_batch: int):
        self.engine, self.model = engine, engine.model
        self.cache = self.model.make_paged_cache(num_blocks, block_size)
        self.block_size, self.max_batch = block_size, max_batch
        self.max_keys = -(-engine.config.max_seq_len // block_size) * block_size
        self.graph = engine.decode_mode == "graph"
        self.static = engine.decode_mode in ("graph", "static")
        self._steps: dict[tuple[int, int], PagedDecodeStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graph else None  # one pool: steps never overlap
        # The tokens sampled by the last step, which the next one feeds without a trip
        # through the host (``Row.src``): its caller writes them.
        self.prev = torch.zeros(1 << (max_batch - 1).bit_length(), dtype=torch.long, device=engine.device)

    def step_for(self, batch: int, keys: int) -> PagedDecodeStep | None:
        """The fixed-shape decode step of the bucket holding ``batch`` rows of at most
        ``keys`` keys (None where none fits)."""
        b = 1 << (batch - 1).bit_length()
        if b > 1 << (self.max_batch - 1).bit_length() or keys > self.max_keys:
            return None
        s = min(max(self.MIN_KEYS, 1 << (keys - 1).bit_length()), self.max_keys)
        s = -(-s // self.block_size) * self.block_size
        key = (b, s)
        if key not in self._steps:
            if self.graph and not self.engine._primed:
                prime_cuda_graphs(self.engine.device, self.engine.graph_primers)
                self.engine._primed = True
            self._steps[key] = PagedDecodeStep(self, b, s, self.graph, self._pool)
        return self._steps[key]

    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, keys) decode step bucket: powers of two up to ``max_batch`` rows and
        from ``MIN_KEYS`` up to ``max_keys`` keys."""
        def powers(lo, hi):
            out = [lo]
            while out[-1] < hi:
                out.append(min(2 * out[-1], hi))
            return out
        return [(b, k) for k in powers(self.MIN_KEYS, self.max_keys) for b in powers(1, self.max_batch)]

    def capture_all(self):
        """Makes every decode step bucket now, both variants (greedy and sampling), so that
        no request waits for a capture while it is served (the server calls it before it
        takes requests)."""
        if self.static:
            for batch, keys in self.buckets():
                step = self.step_for(batch, keys)
                if step.graphs is not None:
                    step.capture(sampling=True)

    @torch.no_grad()
    def warm_up(self, widths: list[int]):
        """A prefill forward of one row of each width, so that the kernels compile for those
        sizes now instead of while a request waits. It writes into the first blocks: call it
        before any sequence holds one (a sequence writes its slots before it reads them)."""
        for t in widths:
            need = -(-t // self.block_size)
            if t <= self.max_keys and need <= self.cache.num_blocks:
                self._run([Row([0] * t, 0, list(range(need)))], last_only=True)

    @torch.no_grad()
    def forward(self, rows: list[Row]) -> torch.Tensor:
        """-> float32 logits [B, V] of each row's last new token."""
        return self.decode(rows)[0]

    @torch.no_grad()
    def decode(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (float32 logits [B, V] of each row's last new token, the token drawn from them
        by the row's ``sample`` knobs [B]). A step of one new token per row that fits a
        bucket replays its fixed-shape step (the draw taken inside it); any other runs
        eagerly."""
        if self.static and all(len(r.tokens) == 1 for r in rows):
            step = self.step_for(len(rows), max(r.start + 1 for r in rows))
            if step is not None:
                return step.run(rows)
        logits = self._run(rows, last_only=True)[:, -1].float()
        return logits, sample_rows(logits, [r.sample for r in rows], pdl=self.model.options.pdl)

    @torch.no_grad()
    def forward_all(self, rows: list[Row]) -> torch.Tensor:
        """-> float32 logits [B, T, V] of every new token, each row's at the end (rows are
        left-padded), for prompt log-probabilities: only steps that prefill a prompt whose
        logprobs were asked for pay for the T x V rows. The LM head is replicated, so ranks
        following with ``forward`` run the same layers."""
        return self._run(rows, last_only=False).float()

    def _run(self, rows: list[Row], last_only: bool) -> torch.Tensor:
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
        lens = to_device([r.start + len(r.tokens) for r in rows], dev)  # [B]
        width = math.ceil(s / bs)
        tables = to_device([r.table[:width] + [0] * (width - len(r.table[:width])) for r in rows], dev)  # [B, N]
        self.cache.set_step(to_device(write, dev), tables, lens, s)
        causal = all(r.start == 0 and len(r.tokens) == t for r in rows)
        ctx = self.model.paged_context(to_device(positions, dev), to_device(valid, dev), lens, s, causal)
        tokens = to_device(tokens, dev)
        fed = [(i, r.src) for i, r in enumerate(rows) if r.src >= 0]
        if fed:
            at, src = to_device(fed, dev).T
            tokens[at, -1] = self.prev[src]
        return self.model(tokens, ctx, self.cache, last_only=last_only)


def to_device(data: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list on the device without waiting for the work queued there: a blocking
    copy (torch.tensor(..., device=...)) would synchronize the stream, and the host could
    no longer prepare one step while the device runs the one before."""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)
