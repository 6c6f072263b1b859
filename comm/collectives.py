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
        if group.fast_sum is not None and group.fast_sum.takes(x):
            return group.fast_sum(x)
        dist.all_reduce(x, group=group.group)
    return x


class SymmetricAllReduce:
    """Sums small GPU tensors over a group in one kernel launch: each rank copies its tensor
    into a buffer every peer can read (torch's symmetric memory), and the one-shot kernel
    reads all the copies and adds them. At decode sizes this takes a few microseconds
    where NCCL's all-reduce takes tens, and it can be captured in a CUDA graph. Its buffers
    (one per dtype, ``MAX_BYTES``) are made at the first sum of each dtype, which every
    rank of the group makes together; where the GPUs cannot reach each other's memory, the
    ranks agree to keep NCCL."""

    MAX_BYTES = 2 << 20
    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, group: Group):
        self.group = group
        self.buffers: dict[torch.dtype, torch.Tensor | None] = {}

    def takes(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype in self.DTYPES and x.is_contiguous() and x.nbytes <= self.MAX_BYTES
                and x.nbytes % 16 == 0 and self._buffer(x) is not None)

    def _buffer(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.dtype not in self.buffers:
            import torch.distributed._symmetric_memory as symm_mem

            name = self.group.group.group_name
            buf = None
            try:
                buf = symm_mem.empty(self.MAX_BYTES // x.element_size(), dtype=x.dtype, device=x.device)
                symm_mem.rendezvous(buf, name)
            except Exception:  # no peer access (or no support): NCCL on every rank of the group
                buf = None
            ok = torch.tensor([buf is not None], dtype=torch.int32, device=x.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group.group)
            self.buffers[x.dtype] = buf if ok.item() else None
        return self.buffers[x.dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # One launch: the kernel copies x into this rank's buffer, waits for every peer's,
        # then writes the sum over x (each thread reads its elements before it writes them).
        view = self.buffers[x.dtype][:x.numel()].view(x.shape)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", self.group.group.group_name, x)
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
