"""Collectives over a ``Group``; each is a no-op on a group of one rank.

Shape letters: N rows, H hidden.
"""
from __future__ import annotations

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


def all_to_all(x: torch.Tensor, send_counts: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven all-to-all of rows: x [N, ...] holds ``send_counts[j]`` rows for rank j, in rank
    order. The counts are exchanged first, so each rank learns how much it receives.
    -> (rows received [M, ...], in source-rank order; recv_counts [group size])."""
    if group.size == 1:
        return x, send_counts.clone()
    send_counts = send_counts.to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group.group)
    send, recv = send_counts.tolist(), recv_counts.tolist()  # the host needs the split sizes
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.group)
    return out, recv_counts
