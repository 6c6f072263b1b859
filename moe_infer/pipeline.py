"""Pipeline parallelism's inference schedule (DeepSpeed-Inference, section IV-C).

Each rank of a pipeline runs its stage's blocks (``Transformer.stage_forward``); the
schedule moves work through the stages in slots. In a slot every stage runs the unit of
work the stage before ran in the slot before (a shift register), sends its output on
(point to point, each stage's send paired with the next one's receive in one batched
call) and the last stage's draws are broadcast to every stage, which keeps every rank's
view of the batch the same: every rank derives the same schedule from it.

A unit is a micro-batch's step: its prompts (prefill) or one new token a row (decode).
While generating, the batch's rows form ``micro_batches`` groups; a group's next token
enters the first stage in the slot after the last stage drew its previous one, so with as
many groups as stages no stage waits for another (the paper's Fig. 3: micro-batches
re-queued without draining). The draws feed that next token from the device (the
runner's ``prev`` lanes); the host reads them a slot later, while the device runs the next
slot, so a row whose draw ended it (EOS) may run one token more, whose draw is dropped.
Rows that finish leave their group and free their cache
slot; a waiting prompt takes it (through the stages as a prefill unit, then into that
slot's group), and a group whose rows are all done leaves the rotation. Prompts are
processed in ``prompt_micro_batches`` groups, more and smaller ones than while generating
(the hybrid schedule), so the pipeline's fill and drain take a smaller share of the prompt
phase.

Shape letters: B rows of a unit, T its new tokens per row, H hidden, V vocab.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_infer.outputs import Sampled
from moe_infer.runner import Row, to_device


@dataclass
class Unit:
    """One micro-batch's step through the stages. Prefill: its pieces (row, first token,
    end) of the prompts (a long prompt in several units, one after another); decode: its
    rows, one new token each."""

    group: int  # the decode group it belongs to (prefill units: -1)
    rows: list[int]
    pieces: list[tuple[int, int, int]] | None = None

    @property
    def prefill(self) -> bool:
        return self.pieces is not None


def split(rows: list[int], parts: int) -> list[list[int]]:
    """``rows`` in at most ``parts`` contiguous groups, sizes differing by at most one."""
    parts = max(1, min(parts, len(rows)))
    return [rows[i * len(rows) // parts:(i + 1) * len(rows) // parts] for i in range(parts)]


@dataclass
class Timeline:
    """What the stages did: ``busy[s]`` seconds stage s spent computing, ``wall`` seconds
    from the first slot's start to the last one's end, ``slots`` the slots run. The host
    time from the start to each draw of the last stage, split by what the pipeline held
    since the draw before: ``prefill_s`` where it held a prompt, ``decode_s`` where it held
    decode units alone, and ``decoded`` the tokens drawn at the end of those decode spans.
    (A row's first token comes while later prompts are still in the pipeline, so its first
    token to its last is not a decode rate.)"""

    stages: int
    busy: list[float] = field(default_factory=list)
    wall: float = 0.0
    slots: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decoded: int = 0

    @property
    def bubble(self) -> float:
        """1 - (summed stage busy time) / (stages x wall time)."""
        return 1.0 - sum(self.busy) / (self.stages * self.wall) if self.wall > 0 else 0.0


class Slots:
    """The shift register every rank keeps: the unit at each stage in the current slot,
    and the units waiting for the first stage (in order of readiness)."""

    def __init__(self, stages: int, ready):
        self.inflight: list[Unit | None] = [None] * stages
        self.ready = deque(ready)

    def busy(self) -> bool:
        return bool(self.ready) or any(u is not None for u in self.inflight)

    def advance(self) -> list:
        """Every unit one stage on, the next ready one into the first stage. -> the units
        by stage (a copy)."""
        self.inflight = [self.ready.popleft() if self.ready else None] + self.inflight[:-1]
        return list(self.inflight)

    def retire(self) -> None:
        """The last stage's unit leaves the pipeline (the end of a slot)."""
        self.inflight[-1] = None


def simulate(stages: int, work: list[list[float]]) -> Timeline:
    """The schedule on a simulated clock: ``work[g]`` is micro-batch g's units in order,
    each the time every stage takes for it; g's next unit is ready in the slot after its
    last one leaves the last stage, and a slot lasts as long as its slowest unit."""
    pending = [deque(w) for w in work]
    slots = Slots(stages, [Unit(g, [], None) for g in range(len(work)) if pending[g]])
    cost = {}  # id(unit) -> its time
    for u in slots.ready:
        cost[id(u)] = pending[u.group].popleft()
    tl = Timeline(stages, [0.0] * stages)
    while slots.busy():
        units = slots.advance()
        times = [cost[id(u)] if u is not None else 0.0 for u in units]
        for s, t in enumerate(times):
            tl.busy[s] += t
        tl.wall += max(times)
        tl.slots += 1
        done = units[-1]
        slots.retire()
        if done is not None and pending[done.group]:
            nxt = Unit(done.group, [], None)
            cost[id(nxt)] = pending[done.group].popleft()
            slots.ready.append(nxt)
    return tl


class PipelineSchedule:
    """Runs generate()'s batch through this rank's pipeline stage with the inference
    schedule (module docstring). Every rank of the pipeline calls ``run`` with the same
    batch and gets every row's tokens."""

    def __init__(self, engine, runner, micro_batches: int, prompt_micro_batches: int):
        self.engine, self.runner, self.model = engine, runner, runner.model
        self.pp = self.model.pp
        self.micro_batches, self.prompt_micro_batches = micro_batches, prompt_micro_batches
        self.timeline: Timeline | None = None  # the last run's

    def run(self, prompts: list[list[int]], max_new: int, knobs_of, capacity: int, table_for) -> tuple:
        """-> (generated token lists, finish reasons ("stop" or "length"), host clock at
        each row's first token, at its last). At most ``capacity`` rows hold the cache at a
        time: the others wait, and one joins (its prompt through the pipeline, then its
        slot's decode group) as soon as a row ends. ``table_for(i, slot)``: row i's block
        table in cache slot ``slot``; ``knobs_of(i, t)``: row i's sampling knobs for its
        token t."""
        from moe_infer.engine import prefill_plan

        pp = self.pp
        me, last = pp.rank, pp.size - 1
        dev = self.engine.device
        n = len(prompts)
        generated: list[list[int]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        first_at, last_at = [0.0] * n, [0.0] * n
        tables: dict[int, list[int]] = {}
        groups = max(1, min(self.micro_batches, capacity))
        members = [set() for _ in range(groups)]  # each decode group's rows with their first token
        queued = [False] * groups  # a group's decode unit waits or runs
        free = deque(range(capacity))
        waiting = deque(range(n))
        slot_of, group_of = {}, {}
        budget = self.engine.config.engine.prefill_tokens

        def admit(parts: int) -> list[Unit]:
            """Waiting rows into the free slots -> their prompts' units, in ``parts`` groups."""
            rows = []
            while waiting and free:
                i, slot = waiting.popleft(), free.popleft()
                slot_of[i], group_of[i], tables[i] = slot, slot % groups, table_for(i, slot)
                rows.append(i)
            units = []
            for part in split(rows, parts) if rows else []:
                for pieces in prefill_plan([len(prompts[i]) for i in part], budget):
                    units.append(Unit(-1, [part[j] for j, _, _ in pieces], [(part[j], a, e) for j, a, e in pieces]))
            return units

        def enqueue(g: int) -> None:
            """Group g's next token into the pipeline, with its rows still going."""
            if members[g] and not queued[g]:
                queued[g] = True
                pipe.ready.append(Unit(g, sorted(members[g])))

        pipe = Slots(pp.size, admit(self.prompt_micro_batches))
        hidden = None  # what this stage received for its next unit
        tl = Timeline(pp.size, [0.0] * pp.size)
        spans = []  # this stage's compute: (start, end) events on a GPU, host clock times elsewhere
        clock = (lambda: torch.cuda.Event(enable_timing=True)) if dev.type == "cuda" else time.perf_counter

        sampled = [0] * n  # tokens drawn for each row, read on the host or not
        lanes = self.runner.prev  # each cache slot's last draw, on the device: its row's next unit feeds it

        def rows_of(unit: Unit) -> list[Row]:
            if unit.prefill:
                return [Row(prompts[i][a:e], a, tables[i], sample=knobs_of(i, 0)) for i, a, e in unit.pieces]
            return [Row([0], len(prompts[i]) + sampled[i] - 1, tables[i], slot_of[i], knobs_of(i, sampled[i]))
                    for i in unit.rows]

        def leave(done: Unit, ids: torch.Tensor, complete: list[bool]) -> Sampled:
            """A unit's draws ``ids`` (on the device) into its rows' lanes, and on their way
            to the host; its rows' next unit queued, with every row that may go on: whether
            a draw ended its row (EOS) is known a slot later, when it is read, so such a row
            may run one token more, whose draw is dropped."""
            took = [k for k, (i, whole) in enumerate(zip(done.rows, complete)) if whole and finish[i] is None]
            if took:
                lanes.index_copy_(0, to_device([slot_of[done.rows[k]] for k in took], dev), ids[to_device(took, dev)])
            for k in took:
                i = done.rows[k]
                sampled[i] += 1
                if sampled[i] < max_new:  # (a prompt's row joins its slot's group)
                    members[group_of[i]].add(i)
                else:
                    members[group_of[i]].discard(i)
            if not done.prefill:
                queued[done.group] = False
            for g in sorted({group_of[i] for i in done.rows}):
                enqueue(g)
            return Sampled.start(done.rows, [], [], [ids])

        def read(done: Unit, complete: list[bool], draws: Sampled, prompted: bool) -> None:
            """A unit's draws on the host: tokens, EOS and ends; an ended row's slot goes to
            the next waiting one."""
            nonlocal drawn
            ids = [int(t) for t in draws.values()[0]]
            now = time.perf_counter()
            if prompted:
                tl.prefill_s += now - drawn
            else:
                tl.decode_s += now - drawn
            drawn = now
            made = sum(len(generated[i]) for i in done.rows)
            for i, tok, whole in zip(done.rows, ids, complete):
                if not whole or finish[i] is not None:  # a prompt's piece; a draw past the row's end
                    continue
                first_at[i] = first_at[i] or now
                last_at[i] = now
                if tok in self.engine.eos:
                    finish[i] = "stop"
                else:
                    generated[i].append(tok)
                    if len(generated[i]) == max_new:
                        finish[i] = "length"
                if finish[i] is not None:  # its slot to the next waiting row
                    members[group_of[i]].discard(i)
                    free.append(slot_of[i])
            if not prompted:
                tl.decoded += sum(len(generated[i]) for i in done.rows) - made
            pipe.ready.extend(admit(1))

        begin = drawn = time.perf_counter()
        prompted = False  # a prompt unit was in the pipeline since the last draw
        pending = None  # the last unit that left: its draws reach the host while the next slot runs
        while pipe.busy() or pending is not None:
            units = pipe.advance()
            prompted = prompted or any(u is not None and u.prefill for u in units)
            mine, out, ids = units[me], None, None
            if mine is not None:
                start = clock()
                if dev.type == "cuda":
                    start.record()
                out, ids = self.runner.stage(rows_of(mine), hidden)
                end = clock()
                if dev.type == "cuda":
                    end.record()
                spans.append((start, end))
            # This stage's output on to the next one, the one before's in, in one call.
            ops, hidden = [], None
            if me < last and mine is not None:
                ops.append(dist.P2POp(dist.isend, out, pp.ranks[me + 1]))
            before = units[me - 1] if me > 0 else None
            if before is not None:
                hidden = self.model.stage_input(self.runner.stage_shape(rows_of(before)))
                ops.append(dist.P2POp(dist.irecv, hidden, pp.ranks[me - 1]))
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            done = units[last]
            pipe.retire()
            if any(u is not None for u in units):
                tl.slots += 1
            # The unit that left a slot before: its draws read while the device runs this
            # slot, so the host never waits for the slot it has just queued.
            if pending is not None:
                read(*pending)
                pending = None
            if done is not None:
                # The last stage's draws, to every stage: each rank's view of the batch stays
                # the same, and with it the schedule every rank derives.
                complete = ([e == len(prompts[i]) for i, _, e in done.pieces] if done.prefill
                            else [True] * len(done.rows))
                ids = ids.contiguous() if me == last else torch.empty(len(done.rows), dtype=torch.long, device=dev)
                dist.broadcast(ids, src=pp.ranks[last], group=pp.group)
                pending = (done, complete, leave(done, ids, complete), prompted)
                prompted = False
        tl.wall = time.perf_counter() - begin
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            tl.busy[me] = sum(a.elapsed_time(b) for a, b in spans) / 1e3
        else:
            tl.busy[me] = sum(b - a for a, b in spans)
        if dist.is_initialized():  # every stage's busy time, for the bubble
            busy = torch.tensor(tl.busy, dtype=torch.float64, device=dev)
            dist.all_reduce(busy, group=pp.group)
            tl.busy = busy.tolist()
        self.timeline = tl
        return generated, finish, first_at, last_at


class ServingSlots:
    """The server's side of the inference schedule under mpirun: each call of ``slot`` is
    one slot of the shift register, on every rank of the job. Rank 0's scheduler decides
    the unit that enters the first stage (any rows: prompt pieces, decode rows, or none)
    and broadcasts it (``moe_infer.ranks``); every rank keeps the units in flight, runs the
    one at its own stage, passes its output on, and when a unit leaves the last stage its
    logits reach every stage of the pipeline. The scheduler keeps as many units in flight
    as there are stages (each request in at most one), so a request's next token enters
    the pipeline in the slot after its previous one left it, without draining it."""

    def __init__(self, runner):
        self.runner, self.model = runner, runner.model
        self.pp = self.model.pp
        self.inflight: list[list[Row] | None] = [None] * self.pp.size
        self.hidden: torch.Tensor | None = None  # what this stage received for its next unit
        # The last slot's sent and broadcast tensors stay referenced here: otherwise a gloo
        # worker thread may drop the last reference to one while the interpreter is already
        # finalizing at exit, which aborts the process (as ``ranks.row_channel`` keeps its own).
        self.held: list[torch.Tensor] = []

    def reset(self) -> None:
        """Forgets the units in flight (after a failed step)."""
        self.inflight, self.hidden = [None] * self.pp.size, None

    @torch.no_grad()
    def slot(self, rows: list[Row] | None) -> tuple[list[Row], torch.Tensor] | None:
        """``rows`` (None or []: nothing) into the first stage, every unit one stage on ->
        (the rows of the unit that left the last stage, float32 logits [B, V] of each row's
        last new token, on every rank), or None where no unit left."""
        pp = self.pp
        me, last = pp.rank, pp.size - 1
        self.inflight = [rows or None] + self.inflight[:-1]
        mine, out = self.inflight[me], None
        if mine is not None:
            out, _ = self.runner.stage(mine, self.hidden)
        ops, self.hidden = [], None
        if me < last and mine is not None:
            ops.append(dist.P2POp(dist.isend, out, pp.ranks[me + 1]))
        before = self.inflight[me - 1] if me > 0 else None
        if before is not None:
            self.hidden = self.model.stage_input(self.runner.stage_shape(before))
            ops.append(dist.P2POp(dist.irecv, self.hidden, pp.ranks[me - 1]))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        self.held = [t for t in (out, self.hidden) if t is not None]
        done = self.inflight[last]
        self.inflight[last] = None
        if done is None:
            return None
        if me == last:
            logits = out.contiguous()
        else:
            logits = torch.empty(len(done), self.model.cfg.model.vocab_size, dtype=torch.float32,
                                 device=self.runner.engine.device)
        dist.broadcast(logits, src=pp.ranks[last], group=pp.group)
        self.held.append(logits)
        return done, logits
