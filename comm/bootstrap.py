"""Rank bootstrap for jobs launched by ``mpirun``: mpi4py gives rank, world size and local
rank; rank 0 picks the rendezvous port and broadcasts it; torch.distributed starts from
that (NCCL on GPUs, gloo on CPUs).

A failure on any rank ends the whole job with that rank's error: an uncaught exception
prints the traceback with its rank and aborts ``MPI.COMM_WORLD``, so mpirun stops every
rank instead of leaving the others blocked in a collective.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.groups import forget_groups


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int  # rank among the processes of this host
    device: torch.device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def install_abort_on_error(comm) -> None:
    """An uncaught exception on this rank aborts the whole MPI job (no hung peers)."""
    def hook(kind, value, tb):
        text = f"[rank {comm.Get_rank()}] " + "".join(traceback.format_exception(kind, value, tb))
        os.write(2, text.encode())  # unbuffered: the abort may not let Python flush
        time.sleep(0.5)  # give the launcher time to forward it before the job is torn down
        comm.Abort(1)
    sys.excepthook = hook


def bootstrap(backend: str | None = None, timeout_s: float = 300.0) -> RankInfo:
    """Initialises torch.distributed from the MPI job this process belongs to (once; a
    second call returns the ranks of the first).

    ``timeout_s`` bounds every collective: a peer that stops answering fails the job after
    that long instead of hanging it."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if dist.is_initialized():  # once per process: later callers get the same ranks
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank = local.Get_rank()
        local.Free()
        device = torch.device("cuda", local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")
        return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)
    install_abort_on_error(comm)
    rank, world = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if torch.cuda.device_count() < local_size:
            raise RuntimeError(f"{local_size} ranks on this host but {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # One host: loopback. Several: rank 0's address as the other hosts resolve it.
    single_host = comm.allreduce(local_size, op=MPI.MIN) == world
    addr = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
    addr, port = comm.bcast((addr, _free_port()) if rank == 0 else None, root=0)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return RankInfo(rank, world, local_rank, device)


def shutdown() -> None:
    """Ends this rank's part of the job's process group: waits for every rank, then
    destroys it. (A rank that exits while a peer's gloo connection to it is still open
    makes gloo terminate that peer.) Free what holds captured graphs first
    (``Engine.release_graphs``)."""
    if dist.is_initialized():
        # NCCL destroys a communicator only once every CUDA graph holding its collectives is
        # gone, and an engine's graphs may still wait for the collector in a reference cycle.
        gc.collect()
        dist.barrier()
        forget_groups()
        dist.destroy_process_group()
