"""The model runner behind both ``Engine.generate`` and the server's scheduler: the model's
forward over a paged KV cache, with the decode step captured in CUDA graphs.

Shape letters: B rows this step, T new tokens per row (left-padded), S key slots per row,
N blocks per row's table, V vocab.

A forward takes rows of any lengths and cache depths (prefill chunks, and decode steps that
fit no bucket) and runs eagerly. A decode step, one new token per row, runs as a
``PagedDecodeStep`` of fixed shapes: B padded to a power of two, S to a power of two of at
least ``MIN_KEYS``, its inputs in device buffers filled by one copy. On GPUs each (B, S)
bucket is captured once in a CUDA graph and replayed, so the step costs one copy and one
launch from the host. On several ranks the graphs hold the collectives too (every rank
captures and replays the same steps in the same order), and the expert all-to-alls of
decode sizes exchange fixed-capacity buffers, which need no host wait. The step also
takes each row's greedy token (the argmax) inside the graph, so greedy decoding costs one
copy to the host a step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

import kernels
from moe_infer.graphs import capture, prime_cuda_graphs
from moe_infer.offload import rebalance
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


class HostStaging:
    """Pinned host buffers shaped like ``targets`` (device tensors), filled on the host and
    copied in without a host wait. Each fill takes fresh buffers from torch's pinned-memory
    cache, which hands a block out again only once the copies out of it have run: a caller
    that runs ahead of its device (a pipeline stage whose stream waits on a send, the
    decode loop that queues a step before reading the last) would otherwise overwrite
    inputs the device has not read yet. Each fill's buffers start zeroed."""

    def __init__(self, targets: tuple[torch.Tensor, ...]):
        self.targets = targets
        self.pinned = targets[0].device.type == "cuda"
        self.host: list[torch.Tensor] = []

    def arrays(self) -> list:
        """This fill's buffers, as numpy arrays."""
        self.host = [torch.zeros(t.shape, dtype=t.dtype, pin_memory=self.pinned) for t in self.targets]
        return [t.numpy() for t in self.host]

    def upload(self, *which: int) -> None:
        """Copies the buffers ``which`` (all where none is named) into their targets."""
        for i in which or range(len(self.host)):
            self.targets[i].copy_(self.host[i], non_blocking=True)


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

    def __init__(self, runner: "PagedRunner", batch: int, keys: int, graph: bool, pool=None, stage: bool = False):
        self.runner, self.batch, self.keys = runner, batch, keys
        dev = runner.engine.device
        # ``stage``: this pipeline stage's blocks alone (``Transformer.stage_forward``), from
        # ``hidden`` [B, 1, H] (the previous stage's output) after the first stage; before
        # the last one the step's output is the hidden states for the next stage.
        pp = runner.model.pp
        self.stage, self.last = stage, not stage or pp.rank == pp.size - 1
        self.hidden = runner.model.stage_input((batch, 1)).zero_() if stage and pp.rank > 0 else None
        self.blocks = keys // runner.block_size
        self.inputs = torch.zeros(batch, 4 + self.blocks, dtype=torch.long, device=dev)
        self.ints = torch.zeros(batch, 3, dtype=torch.long, device=dev)
        self.floats = torch.zeros(batch, 2, dtype=torch.float32, device=dev)
        self.staging = HostStaging((self.inputs, self.ints, self.floats))
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
        if not self.stage:
            logits = model(tokens, ctx, cache, last_only=True)[:, -1].float()
        else:
            out = model.stage_forward(tokens, ctx, cache, last_only=True, hidden=self.hidden)
            if not self.last:
                return out, None
            logits = out[:, -1].float()
        ids = kernels.argmax(logits, pdl=model.options.pdl)
        return logits, draw(logits, self.ints, self.floats, ids) if sampling else ids

    def run(self, rows: list[Row], hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (float32 logits [len(rows), V], ids [len(rows)]: each row's draw, greedy or sampled).
        With a graph they are views of its output buffers, which its next replay rewrites:
        a caller that keeps them past another step copies them. A stage before the last
        returns (its hidden states [B, 1, H] for the whole bucket, None)."""
        if self.hidden is not None:
            self.hidden.copy_(hidden)
        h, hi, hf = self.staging.arrays()
        for i, r in enumerate(rows):
            blocks = r.table[:self.blocks]
            h[i, :4] = r.tokens[0], r.start, 1, r.src
            h[i, 4:4 + len(blocks)] = blocks
        sampling = self.last and any(r.sample is not None for r in rows)
        if sampling:
            hf[:] = (0.0, 1.0)
            for i, r in enumerate(rows):
                if r.sample is not None:
                    hi[i], hf[i] = r.sample[:3], r.sample[3:]
        self.staging.upload(*((0, 1, 2) if sampling else (0,)))
        n = len(rows)
        if self.graphs is None:
            logits, ids = self._step(sampling)
        else:
            self.capture(sampling)
            graph, (logits, ids) = self.graphs[sampling]
            graph.replay()
        if not self.last:
            return logits, None
        return logits[:n], ids[:n]


class PagedPrefillStep:
    """The prefill of at most ``batch`` fresh prompts (nothing cached before them) of at
    most ``width`` tokens each, with fixed shapes: each row right-padded to ``width``, so
    each attends causally over its own keys and the padding writes only the cache's trash
    slot. ``inputs`` [B, 1 + N] holds per row its number of tokens (0: a padding row), then
    its block table; ``tokens`` [B, T]. With ``graph`` it is captured once and replayed, so
    a small prefill costs the device's time rather than the host's launches; otherwise it
    runs eagerly (the same math, for CPU tests). The greedy token is taken inside it; a
    row that samples draws from its logits after (a prefill is one step of many)."""

    def __init__(self, runner: "PagedRunner", batch: int, width: int, graph: bool, pool=None, stage: bool = False):
        self.runner, self.batch, self.width = runner, batch, width
        dev = runner.engine.device
        # ``stage``: this pipeline stage's blocks alone, as ``PagedDecodeStep``'s: from
        # ``hidden`` [B, T, H] after the first stage, the hidden states out before the last.
        pp = runner.model.pp
        self.stage, self.last = stage, not stage or pp.rank == pp.size - 1
        self.hidden = runner.model.stage_input((batch, width)).zero_() if stage and pp.rank > 0 else None
        self.blocks = -(-width // runner.block_size)
        self.inputs = torch.zeros(batch, 1 + self.blocks, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(batch, width, dtype=torch.long, device=dev)
        self.staging = HostStaging((self.inputs, self.tokens))
        self.graph, self.graphed = None, graph
        if graph:  # every row padding: the warm-up runs write only the cache's trash slot
            self.graph, self.outputs = capture(self._step, dev, pool)

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        model, cache, bs = self.runner.model, self.runner.cache, self.runner.block_size
        n, tables = self.inputs[:, 0], self.inputs[:, 1:]  # [B], [B, N]
        p = torch.arange(self.width, device=n.device)  # [T]
        valid = p[None, :] < n[:, None]  # [B, T]
        slots = torch.where(valid, tables[:, p // bs] * bs + p % bs, cache.trash)
        cache.use_slots(slots, slots)  # the keys each row reads are the ones it writes
        ctx = replace(model.paged_context(p.expand(self.batch, -1), valid, n, self.width, causal=True),
                      graphed=self.graphed)
        last = (n - 1).clamp(min=0)
        if not self.stage:
            logits = model(self.tokens, ctx, cache, last=last)[:, -1].float()
        else:
            out = model.stage_forward(self.tokens, ctx, cache, last=last, hidden=self.hidden)
            if not self.last:
                return out, None
            logits = out[:, -1].float()
        return logits, kernels.argmax(logits, pdl=model.options.pdl)

    def run(self, rows: list[Row], hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (float32 logits [len(rows), V] of each row's last token, its draw [len(rows)]),
        views of the graph's outputs where there is one: see ``PagedDecodeStep.run``. A stage
        before the last returns (its hidden states [B, T, H] for the whole bucket, None)."""
        if self.hidden is not None:
            self.hidden.copy_(hidden)
        h, ht = self.staging.arrays()
        for i, r in enumerate(rows):
            blocks = r.table[:self.blocks]
            h[i, 0] = len(r.tokens)
            h[i, 1:1 + len(blocks)] = blocks
            ht[i, :len(r.tokens)] = r.tokens
        self.staging.upload()
        if self.graph is None:
            logits, ids = self._step()
        else:
            self.graph.replay()
            logits, ids = self.outputs
        if not self.last:
            return logits, None
        n = len(rows)
        if any(r.sample is not None for r in rows):
            return logits[:n], sample_rows(logits[:n], [r.sample for r in rows], pdl=self.runner.model.options.pdl)
        return logits[:n], ids[:n]


class PagedRunner:
    """Runs the model over a ``PagedKVCache``: rows of any lengths and cache depths. Decode
    steps go through ``PagedDecodeStep`` where ``static``: captured in CUDA graphs where the
    engine's ``decode_mode`` is "graph" (GPUs), run eagerly with the same fixed shapes
    where it is "static" (how CPU tests check the graph's math)."""

    MIN_KEYS = 64  # the smallest key bucket of a decode step
    MIN_WIDTH = 16  # the narrowest fixed-shape prefill
    HALF_STEPS = 256  # from this width on, prefill widths step by half a power of two

    def __init__(self, engine: Engine, num_blocks: int, block_size: int, max_batch: int):
        self.engine, self.model = engine, engine.model
        self.cache = self.model.make_paged_cache(num_blocks, block_size)
        self.block_size, self.max_batch = block_size, max_batch
        self.max_keys = -(-engine.config.max_seq_len // block_size) * block_size
        self.graph = engine.decode_mode == "graph"
        self.static = engine.decode_mode in ("graph", "static")
        self._steps: dict[tuple[int, int], PagedDecodeStep] = {}
        self._stage_steps: dict[tuple[int, int], PagedDecodeStep] = {}  # pipeline stages' own blocks
        self._prefills: dict[tuple[int, int], PagedPrefillStep] = {}
        self._stage_prefills: dict[tuple[int, int], PagedPrefillStep] = {}
        e = engine.config.engine  # the largest fixed-shape prefill, padding counted, bounded as any prefill
        self.prefill_tokens = min(e.prefill_graph_tokens, e.prefill_tokens)
        self._pool = torch.cuda.graph_pool_handle() if self.graph else None  # one pool: steps never overlap
        if self.graph:  # every decode bucket's expert all-to-alls without a host wait, so they capture
            self.model.fix_exchanges(1 << (max_batch - 1).bit_length())
        # The tokens sampled by the last step, which the next one feeds without a trip
        # through the host (``Row.src``): its caller writes them.
        self.prev = torch.zeros(1 << (max_batch - 1).bit_length(), dtype=torch.long, device=engine.device)
        self.steps = 0  # forwards run: an offloaded model re-places its experts every REBALANCE_STEPS

    def release_graphs(self) -> None:
        """Drops every fixed-shape step made so far, and with them their CUDA graphs; a later
        step is made again at its first use. A multi-rank job calls it before it destroys
        its process group: NCCL waits for every graph that holds its collectives to go."""
        self._steps.clear()
        self._stage_steps.clear()
        self._prefills.clear()
        self._stage_prefills.clear()

    def decode_bucket(self, batch: int, keys: int) -> tuple[int, int] | None:
        """The (rows, keys) bucket of the fixed-shape decode step holding ``batch`` rows of at
        most ``keys`` keys (None where none fits)."""
        b = 1 << (batch - 1).bit_length()
        if b > 1 << (self.max_batch - 1).bit_length() or keys > self.max_keys:
            return None
        s = min(max(self.MIN_KEYS, 1 << (keys - 1).bit_length()), self.max_keys)
        return b, -(-s // self.block_size) * self.block_size

    def step_for(self, batch: int, keys: int, stage: bool = False) -> PagedDecodeStep | None:
        """The fixed-shape decode step of ``decode_bucket(batch, keys)`` (``stage``: of this
        pipeline stage's blocks alone), made at its first use."""
        key = self.decode_bucket(batch, keys)
        steps = self._stage_steps if stage else self._steps
        if key is not None and key not in steps:
            self._prime()
            steps[key] = PagedDecodeStep(self, *key, self.graph, self._pool, stage=stage)
        return steps.get(key)

    def _prime(self):
        if self.graph and not self.engine._primed:
            prime_cuda_graphs(self.engine.device, self.engine.graph_primers)
            self.engine._primed = True

    def prefill_widths(self) -> list[int]:
        """The prompt widths of the fixed-shape prefills: powers of two from ``MIN_WIDTH``,
        and from ``HALF_STEPS`` on the points halfway between too (where the device's time
        grows with the width, padding costs at most a third of it), up to the longest
        prompt that fits ``prefill_tokens`` and ``max_keys``."""
        out, w = [], self.MIN_WIDTH
        while w <= min(self.prefill_tokens, self.max_keys):
            out.append(w)
            w = w + w // 2 if w >= self.HALF_STEPS and w & (w - 1) == 0 else 1 << w.bit_length()
        return out

    def prefill_bucket(self, batch: int, width: int) -> tuple[int, int] | None:
        """The (rows, width) bucket of the fixed-shape prefill that holds ``batch`` fresh
        prompts of at most ``width`` tokens (None where none does: rows x width past
        ``prefill_tokens``)."""
        b = 1 << (batch - 1).bit_length()
        t = next((w for w in self.prefill_widths() if w >= width), None)
        if t is None or b * t > self.prefill_tokens or b > 1 << (self.max_batch - 1).bit_length():
            return None
        return b, t

    def prefill_step_for(self, batch: int, width: int, stage: bool = False) -> PagedPrefillStep | None:
        """The fixed-shape prefill of ``prefill_bucket(batch, width)`` (``stage``: of this
        pipeline stage's blocks alone), made at its first use."""
        key = self.prefill_bucket(batch, width)
        steps = self._stage_prefills if stage else self._prefills
        if key is not None and key not in steps:
            self._prime()
            # A prefill whose expert all-to-alls exchange their counts first runs eagerly,
            # with the same fixed shapes.
            graph = self.graph and self.model.capturable(key[0] * key[1])
            steps[key] = PagedPrefillStep(self, *key, graph, self._pool, stage=stage)
        return steps.get(key)

    def prefill_buckets(self) -> list[tuple[int, int]]:
        """Every (rows, width) fixed-shape prefill bucket."""
        top = 1 << (self.max_batch - 1).bit_length()
        return [(b, t) for t in self.prefill_widths() for b in (1 << i for i in range(top.bit_length()))
                if b * t <= self.prefill_tokens]

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
        """Makes every decode step bucket now, both variants (greedy and sampling), and every
        prefill bucket, so that no request waits for a capture while it is served (the
        server calls it before it takes requests); under pp, each stage's steps."""
        if self.static:
            # The server's pipeline slots replay each stage's own steps (micro_batches 1: the
            # whole model's, stage after stage).
            stage = self.model.pp.size > 1 and self.engine.config.parallel.micro_batches > 1
            for batch, keys in self.buckets():
                step = self.step_for(batch, keys, stage=stage)
                if step.graphs is not None:
                    step.capture(sampling=True)
            for batch, width in self.prefill_buckets():
                self.prefill_step_for(batch, width, stage=stage)

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
    def forward(self, rows: list[Row], lockstep: bool = False) -> torch.Tensor:
        """-> float32 logits [B, V] of each row's last new token. ``lockstep``: data-parallel
        replicas that share experts run this forward together, each with its own rows (a
        prefill): it runs eagerly, its all-to-alls exchanging exact sizes, as the replicas'
        token counts differ."""
        if lockstep:
            self._count()
            return self._eager(rows, exact=True)
        return self.decode(rows)[0]

    def _count(self):
        """One more step; an offloaded model's experts follow the routing counts every
        ``Engine.REBALANCE_STEPS`` steps (here, so the server and every rank do it too)."""
        self.steps += 1
        if self.engine.offloaded and self.steps % self.engine.REBALANCE_STEPS == 0:
            rebalance(self.model)

    @torch.no_grad()
    def decode(self, rows: list[Row], lockstep: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (float32 logits [B, V] of each row's last new token, the token drawn from them
        by the row's ``sample`` knobs [B]). A step of one new token per row that fits a
        bucket replays its fixed-shape step (the draw taken inside it), and so does a
        prefill of fresh prompts that fits a prefill bucket; any other runs eagerly.

        ``lockstep`` (rows, keys): a decode step that data-parallel replicas sharing experts
        run together, each with its own rows, the largest batch and longest row of any
        replica these: each takes the fixed-shape step of their bucket (the same token
        count in every all-to-all, and the same steps captured at the same time), or where
        none fits, runs eagerly with exact-size all-to-alls."""
        self._count()
        if self.static:
            step = None
            if all(len(r.tokens) == 1 for r in rows):
                batch, keys = lockstep or (0, 0)
                step = self.step_for(max(len(rows), batch), max(keys, *(r.start + 1 for r in rows)))
            elif not lockstep and all(r.start == 0 and r.src < 0 for r in rows):
                step = self.prefill_step_for(len(rows), max(len(r.tokens) for r in rows))
            if step is not None:
                return step.run(rows)
        logits = self._eager(rows, exact=lockstep is not None)
        return logits, sample_rows(logits, [r.sample for r in rows], pdl=self.model.options.pdl)

    def _eager(self, rows: list[Row], exact: bool) -> torch.Tensor:
        """The eager forward's float32 logits [B, V] of each row's last new token; ``exact``:
        its expert all-to-alls exchange exact sizes (ranks whose token counts differ)."""
        with self.model.exact_exchanges() if exact else contextlib.nullcontext():
            return self._run(rows, last_only=True)[:, -1].float()

    @torch.no_grad()
    def forward_all(self, rows: list[Row]) -> torch.Tensor:
        """-> float32 logits [B, T, V] of every new token, each row's at the end (rows are
        left-padded), for prompt log-probabilities: only steps that prefill a prompt whose
        logprobs were asked for pay for the T x V rows. Ranks that follow a server's steps
        run it too (``moe_infer.ranks``): a vocabulary-parallel head gathers T x V logits."""
        self._count()
        return self._run(rows, last_only=False).float()

    def _stage_step(self, rows: list[Row]) -> PagedDecodeStep | PagedPrefillStep | None:
        """The fixed-shape stage step that runs ``rows``: a decode step, or a prefill of
        fresh prompts, that fits a bucket (as ``decode`` chooses)."""
        if not self.static:
            return None
        if all(len(r.tokens) == 1 for r in rows):
            return self.step_for(len(rows), max(r.start + 1 for r in rows), stage=True)
        if all(r.start == 0 and r.src < 0 for r in rows):
            return self.prefill_step_for(len(rows), max(len(r.tokens) for r in rows), stage=True)
        return None

    def stage_shape(self, rows: list[Row]) -> tuple[int, int]:
        """(B, T) of the hidden states a pipeline stage sends on for ``rows``: a fixed-shape
        step's whole bucket, else the rows by their longest."""
        step = self._stage_step(rows)
        if isinstance(step, PagedPrefillStep):
            return step.batch, step.width
        return (step.batch, 1) if step is not None else (len(rows), max(len(r.tokens) for r in rows))

    @torch.no_grad()
    def stage(self, rows: list[Row], hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This pipeline stage's part of a forward of ``rows`` (``Transformer.stage_forward``),
        nothing sent or received: ``hidden`` [``stage_shape(rows)``, H] is the previous
        stage's output (None on the first). A decode step or a prefill of fresh prompts that
        fits a bucket replays its fixed-shape step (captured where decode steps are). ->
        (the hidden states for the next stage, None), or on the last stage (float32 logits
        [B, V] of each row's last new token, each row's draw [B])."""
        self._count()
        step = self._stage_step(rows)
        if step is not None:
            return step.run(rows, hidden)
        out = self._run(rows, last_only=True, hidden=hidden, stage=True)
        if self.model.pp.rank < self.model.pp.size - 1:
            return out, None
        logits = out[:, -1].float()
        return logits, sample_rows(logits, [r.sample for r in rows], pdl=self.model.options.pdl)

    def _run(self, rows: list[Row], last_only: bool, hidden: torch.Tensor | None = None,
             stage: bool = False) -> torch.Tensor:
        """The eager forward (``stage``: this pipeline stage's part, from ``hidden``). Fresh
        prompts (nothing cached) are right-padded, so they attend causally over their own
        keys (no mask, nothing gathered), where only their last logits are wanted or none
        is padded; any other rows are left-padded, each token's keys masked."""
        dev = self.engine.device
        t = max(len(r.tokens) for r in rows)
        fresh = all(r.start == 0 for r in rows) and (last_only or all(len(r.tokens) == t for r in rows))
        tokens, positions, valid, write, tables = eager_inputs(rows, t, fresh, self.block_size, self.cache.trash)
        s = max(r.start + len(r.tokens) for r in rows)  # keys of the longest row
        lens = to_device([r.start + len(r.tokens) for r in rows], dev)  # [B]
        tables = tables.to(dev, non_blocking=True)
        self.cache.set_step(write.to(dev, non_blocking=True), tables, lens, s)
        real = None  # the real tokens' flat indices, where some rows are padded
        if any(len(r.tokens) < t for r in rows):
            real = valid.view(-1).nonzero().view(-1).to(dev, non_blocking=True)
        ctx = self.model.paged_context(positions.to(dev, non_blocking=True), valid.to(dev, non_blocking=True), lens,
                                       s, fresh, real)
        tokens = tokens.to(dev, non_blocking=True)
        last = [len(r.tokens) - 1 if fresh else t - 1 for r in rows]  # each row's last token's slot
        fed = [(i, last[i], r.src) for i, r in enumerate(rows) if r.src >= 0]
        if fed:
            at, slot, src = to_device(fed, dev).T
            tokens[at, slot] = self.prev[src]
        model = (lambda *a, **k: self.model.stage_forward(*a, **k, hidden=hidden)) if stage else self.model
        if fresh and last_only:
            out = model(tokens, ctx, self.cache, last=to_device(last, dev))
        else:
            out = model(tokens, ctx, self.cache, last_only=last_only)
        self.cache.finish_step()
        return out


def eager_inputs(rows: list[Row], t: int, fresh: bool, block_size: int, trash: int) -> tuple[torch.Tensor, ...]:
    """An eager forward's inputs on the host, [B, t] each, built by tensor ops (a long
    prompt's per-token Python lists took the host longer than a kernel launch chain): the
    token ids, their positions, which are real, the cache slot each writes (``trash`` for
    padding), and the rows' block tables [B, N] up to the longest row's keys. ``fresh``:
    rows right-padded, every position counted from 0 (a padding token's is its index);
    else left-padded, a padding token at position 0."""
    b = len(rows)
    n = torch.tensor([len(r.tokens) for r in rows])
    start = torch.tensor([r.start for r in rows])
    width = -(-max(r.start + len(r.tokens) for r in rows) // block_size)
    tables = torch.zeros(b, width, dtype=torch.long)
    tokens = torch.zeros(b, t, dtype=torch.long)
    for i, r in enumerate(rows):
        held = r.table[:width]
        tables[i, :len(held)] = torch.tensor(held, dtype=torch.long)
        at = 0 if fresh else t - len(r.tokens)
        tokens[i, at:at + len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
    j = torch.arange(t)
    if fresh:
        valid = j[None, :] < n[:, None]
        positions = j.expand(b, t)
    else:
        valid = j[None, :] >= (t - n)[:, None]
        positions = torch.where(valid, start[:, None] + j[None, :] - (t - n)[:, None], 0)
    held = positions.clamp(max=width * block_size - 1)  # (a padding token's slot is not read)
    slots = tables.gather(1, held // block_size) * block_size + held % block_size
    return tokens, positions.contiguous(), valid, torch.where(valid, slots, trash), tables


def to_device(data: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list on the device without waiting for the work queued there: a blocking
    copy (torch.tensor(..., device=...)) would synchronize the stream, and the host could
    no longer prepare one step while the device runs the one before."""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)
