"""The MPI job a command runs in: which rank prints, and errors reported once per job.

A step that needs no other rank (reading the config, loading this rank's weights,
checking the prompts) runs through ``Job.stage``: every rank then learns whether any rank
failed, so all of them stop together and rank 0 prints each distinct error once, with the
ranks it came from when not all of them failed. A failure inside a step that talks to other
ranks cannot be shared that way (they may be waiting in a collective): the failing rank
prints its error prefixed with its rank and ends the whole job.
"""
from __future__ import annotations

import os
import sys
import time

USER_ERRORS = (ValueError,)  # ConfigError and CheckpointError are ValueErrors: a user's mistake


def launched_ranks() -> int:
    """Ranks the MPI launcher started (MPICH's Hydra or Open MPI set these in every rank)."""
    return int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)


class JobError(Exception):
    """A stage failed on some rank; the message is already merged over the ranks."""


class Job:
    def __init__(self):
        self.size = launched_ranks()
        self.comm = None
        if self.size > 1:
            from mpi4py import MPI

            self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank() if self.comm is not None else 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def stage(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, which must not wait on other ranks; raises ``JobError`` on
        every rank when it raised a user error on any."""
        try:
            result, error = fn(*args, **kwargs), None
        except USER_ERRORS as exc:
            result, error = None, str(exc)
        errors = [error] if self.comm is None else self.comm.allgather(error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return result
        lines = []
        for message in dict.fromkeys(e for _, e in failed):
            ranks = [r for r, e in failed if e == message]
            if len(ranks) == self.size:
                lines.append(message)
            else:
                lines.append(f"[rank {', '.join(map(str, ranks))}] {message}")
        raise JobError("\n".join(lines))

    def fail(self, message: str) -> int:
        """A user error outside a stage: this rank alone knows it. One rank prints it, prefixed
        with its rank when there are several, and the job ends."""
        if self.comm is None:
            print(f"moe-infer: error: {message}", file=sys.stderr)
            return 2
        os.write(2, f"[rank {self.rank}] moe-infer: error: {message}\n".encode())  # unbuffered before the abort
        time.sleep(0.5)  # let the launcher forward it before it tears the job down
        self.comm.Abort(2)
        return 2
