"""Collectives over a ``Group``; each is a no-op on a group of one rank.

Shape letters: N rows, H hidden.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from comm.groups import Group


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, in place."""
    if group.size > 1:
        dist.all_reduce(x, group=group.group)
    return x


def all_gather(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's ``x`` (same shape on all ranks) along ``dim``, in rank order."""
    if group.size == 1:
        return x
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group.group)  # rank blocks along dim 0
    return out if dim == 0 else torch.cat(out.chunk(group.size, 0), dim=dim)


def all_to_all(x: torch.Tensor, send_counts, group: Group, recv_counts=None) -> tuple[torch.Tensor, list[int]]:
    """Uneven all-to-all of rows: x [N, ...] holds ``send_counts[j]`` rows for rank j, in rank
    order. Unless the caller knows ``recv_counts`` (the return trip of an earlier exchange),
    the counts are exchanged first, so each rank learns how much it receives; that costs one
    small collective and one wait for the host, which needs the split sizes.
    -> (rows received [M, ...], in source-rank order; recv_counts, a list per source rank)."""
    if recv_counts is None:
        send_counts, recv_counts = exchange_counts(send_counts, group)
    send, recv = _as_list(send_counts), _as_list(recv_counts)
    if group.size == 1:
        return x, recv
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.group)
    return out, recv


def exchange_counts(send_counts, group: Group) -> tuple[list[int], list[int]]:
    """Each rank tells each peer how many rows it will send it. -> (send, recv) as lists."""
    if group.size == 1:
        counts = _as_list(send_counts)
        return counts, list(counts)
    device = _comm_device(group)
    if isinstance(send_counts, torch.Tensor) and send_counts.device == device and send_counts.dtype in (
            torch.int32, torch.int64):
        send = send_counts.contiguous()  # sent as it is: no cast launch
    else:
        send = torch.as_tensor(send_counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.group)
    both = torch.cat([send, recv]).tolist()  # one wait for the host, for both lists
    return both[:group.size], both[group.size:]


def _as_list(counts) -> list[int]:
    return counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]


def _comm_device(group: Group) -> torch.device:
    """Where the group's backend moves tensors: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj, group: Group, device: torch.device | str = "cpu") -> list:
    """Every rank's JSON-serialisable ``obj``, in group-rank order, as JSON bytes (nothing
    received is unpickled). ``device``: where the bytes travel (a GPU for NCCL groups)."""
    if group.size == 1:
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(group.size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group.group)
    width = max(int(n) for n in sizes)
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    parts = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(group.size)]
    dist.all_gather(parts, padded, group=group.group)
    return [json.loads(p[:int(n)].cpu().numpy().tobytes().decode()) for p, n in zip(parts, sizes)]
