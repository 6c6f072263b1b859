"""Serving under mpirun: rank 0 runs the scheduler and broadcasts each step's rows as one
int64 host tensor; every other rank runs the same forward (tensor- and expert-parallel
layers need every rank in each collective, and so does the vocabulary-parallel LM head:
a forward that keeps every position's logits is marked as such)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from moe_infer.runner import PagedRunner, Row

if TYPE_CHECKING:
    from moe_infer.scheduler import Scheduler


FORWARD, ALL_POSITIONS, SLOT, IDLE = 0, 1, 2, 3  # what the other ranks run with a step's rows


# The knobs a follower's row gets where rank 0's row samples: a follower discards its own
# draw (rank 0 sends the tokens), but it must replay the same variant of a captured step
# as rank 0 (the sampling one), or a capture of that variant on rank 0 alone would leave
# its collectives unmatched.
FOLLOWER_KNOBS = (0, 0, 0, 1.0, 1.0)


HEAD = 5  # values a row's header holds


def pack_rows(rows: list[Row] | None, mode: int = FORWARD) -> torch.Tensor:
    """A step's rows as one int64 tensor: the row count (-1: stop), what to run them through
    (``FORWARD``: ``PagedRunner.forward``; ``ALL_POSITIONS``: ``forward_all``, every
    position's logits; ``SLOT``: a pipeline slot, ``moe_infer.pipeline.ServingSlots``;
    ``IDLE``: nothing, a message that keeps the followers' wait under the collective
    timeout while no request comes), then per row its token count, start, table length,
    whether it samples and its ``src``, then every row's tokens and tables."""
    if rows is None:
        return torch.tensor([-1])
    head = [len(rows), mode] + [v for r in rows
                                for v in (len(r.tokens), r.start, len(r.table), r.sample is not None, r.src)]
    return torch.tensor(head + [t for r in rows for t in r.tokens] + [b for r in rows for b in r.table])


def unpack_rows(data: torch.Tensor) -> tuple[list[Row], int] | None:
    """-> (the rows, the mode), or None: stop. A row that samples on rank 0 gets
    ``FOLLOWER_KNOBS``."""
    values = data.tolist()
    n = values[0]
    if n < 0:
        return None
    rows, at = [], 2 + HEAD * n
    heads = [values[2 + HEAD * i:2 + HEAD * (i + 1)] for i in range(n)]
    for count, start, _, samples, src in heads:
        rows.append(Row(values[at:at + count], start, [], src, FOLLOWER_KNOBS if samples else None))
        at += count
    for row, (_, _, blocks, _, _) in zip(rows, heads):
        row.table = values[at:at + blocks]
        at += blocks
    return rows, values[1]


def fed_tokens(rows: list[Row] | None) -> int:
    """How many of ``runner.prev``'s leading tokens the rows feed (``Row.src``): 0 for none."""
    return max((r.src + 1 for r in rows or []), default=0)


def row_channel(prev: torch.Tensor, timeout_s: float):
    """(send, receive) of each step's rows from rank 0 over torch.distributed. The rows
    travel host to host, through a gloo group beside NCCL's on GPUs: rank 0 sends a step
    without waiting for its device to finish the one before, and a follower learns its
    next step while its device still runs the last, so every rank's host keeps a step
    ahead of its device, as one process does. Where rows feed tokens that rank 0 sampled
    on its device (``Row.src``), rank 0's ``prev`` (the runner's) follows them into every
    rank's device to device, in stream order after the step that sampled them: no host
    waits for them. A wait for rows fails past ``timeout_s`` (``parallel.timeout_s``), as
    the job's other collectives do."""
    import datetime

    import torch.distributed as dist

    group = None
    if dist.get_backend() == "nccl":  # (collective: every rank makes it)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    # The last step's tensors stay referenced here: otherwise a gloo worker thread may drop
    # the last reference to one, and free it, while the interpreter is already finalizing
    # at exit, which aborts the process.
    held: list[torch.Tensor] = []
    # Rank 0 posts its sends and goes on (a blocking one would hand the interpreter to the
    # HTTP thread while it waits); the next send waits for them first, the last at once.
    posted: list = []

    def send(rows, mode: int = FORWARD):
        data = pack_rows(rows, mode)
        size = torch.tensor([data.numel()])
        for work in posted:
            work.wait()
        posted[:] = [dist.broadcast(t, src=0, group=group, async_op=True) for t in (size, data)]
        held[:] = [size, data]
        if rows is None:
            for work in posted:
                work.wait()
        if n := fed_tokens(rows):
            dist.broadcast(prev[:n], src=0)

    def receive():
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=group)
        data = torch.empty(int(size), dtype=torch.int64)
        dist.broadcast(data, src=0, group=group)
        held[:] = [size, data]
        step = unpack_rows(data)
        if step is not None and (n := fed_tokens(step[0])):
            dist.broadcast(prev[:n], src=0)
        return step

    return send, receive


def follow(runner: PagedRunner, receive: Callable[[], tuple[list[Row], int] | None], slots=None):
    """Ranks other than 0: run every step rank 0 broadcasts, until it sends None."""
    while (step := receive()) is not None:
        rows, mode = step
        if mode == IDLE:
            continue
        if mode == SLOT:
            slots.slot(rows)
        elif mode == ALL_POSITIONS:
            runner.forward_all(rows)
        else:
            runner.forward(rows)


def lead_or_follow(scheduler: "Scheduler") -> Callable[[], None] | None:
    """Multi-rank serving. Every rank captures the steps the server replays (captures run
    collectives: the same ones, in the same order, on every rank); ranks other than 0 then
    run every step rank 0 broadcasts until it stops, and return None. Rank 0 gets its
    scheduler broadcasting each step and returns the function that releases the others
    once it stops serving (one rank: a function that does nothing)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return lambda: None
    send, receive = row_channel(scheduler.runner.prev, scheduler.engine.config.parallel.timeout_s)
    scheduler.runner.capture_all()  # on every rank here, so that no rank's warm-up is left unmatched
    if dist.get_rank() != 0:
        follow(scheduler.runner, receive, scheduler.slots)
        return None
    scheduler.broadcast = send
    return lambda: send(None)  # the followers leave their loop
