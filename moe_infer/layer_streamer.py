"""ZeRO-Inference (``engine.offload: layers``, DeepSpeed-Inference VI): every block's weights
in host memory, copied to the device just before the block runs, the next blocks' copies
queued meanwhile, so nearly all device memory holds activations and KV for large batches.
"""
from __future__ import annotations

import torch
from torch import nn


class LayerStreamer:
    """ZeRO-Inference (``engine.offload: layers``): every block's weights live in host memory
    (pinned on a GPU host) and are copied to the device just before the block runs, the
    next ``prefetch`` blocks' copies queued on a copy stream meanwhile, and dropped once it
    has run; the device holds at most ``prefetch + 1`` blocks' weights, the rest of its
    memory is free for activations and KV. Installed as forward hooks on each block.

    A block arrives in one device buffer, its tensors laid out back to back (16-byte
    aligned). With ``group`` (ranks holding the same weights that run the same blocks in
    the same order: replicas in lockstep), each rank copies only its 1 / P of the buffer's
    bytes over its own host link and an all-gather over the GPUs' links fills in the rest
    (paper VI-B): P host links carry a block together."""

    ALIGN = 16  # bytes: every tensor's offset in a block's buffer, so any dtype views it

    def __init__(self, blocks: nn.ModuleList, device: torch.device, prefetch: int, group=None):
        self.blocks, self.device, self.prefetch = list(blocks), device, prefetch
        self.group = group if group is not None and group.size > 1 else None
        parts = self.group.size if self.group is not None else 1
        # Per block: (module, attribute, is a parameter, its host tensor, byte offset), and
        # the buffer's size (a multiple of ALIGN x the ranks that share the copy).
        self.host, self.size = [], []
        for b in self.blocks:
            entries, at = [], 0
            for m in b.modules():
                for is_param, table in ((True, m._parameters), (False, m._buffers)):
                    for n, t in table.items():
                        if t is not None:
                            entries.append((m, n, is_param, t, at))
                            at += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
            self.host.append(entries)
            self.size.append(-(-at // (self.ALIGN * parts)) * self.ALIGN * parts)
        self.cuda = device.type == "cuda"
        self.copies = torch.cuda.Stream(device) if self.cuda else None
        self.ready: dict[int, tuple] = {}  # block -> (device buffer, its tensors, the copy's event)
        for i, b in enumerate(self.blocks):
            b.register_forward_pre_hook(lambda module, args, i=i: self._enter(i))
            b.register_forward_hook(lambda module, args, out, i=i: self._leave(i))

    def _copy_in(self, i: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Block i's device buffer filled from the host -> (it, its tensors: views of it)."""
        flat = torch.empty(self.size[i], dtype=torch.uint8, device=self.device)
        lo, hi = 0, self.size[i]
        if self.group is not None:  # this rank's share of the bytes
            share = self.size[i] // self.group.size
            lo, hi = self.group.rank * share, (self.group.rank + 1) * share
        for *_, t, at in self.host[i]:
            nbytes = t.numel() * t.element_size()
            a, b = max(lo, at), min(hi, at + nbytes)
            if a < b:
                src = t.reshape(-1).view(torch.uint8)[a - at:b - at]
                flat[a:b].copy_(src, non_blocking=self.cuda)
        if self.group is not None:
            self._gather(flat, lo, hi)
        return flat, [flat[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                      for *_, t, at in self.host[i]]

    def _gather(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        import torch.distributed as dist

        g = self.group
        if dist.get_backend(g.group) == "nccl":
            dist.all_gather_into_tensor(flat, flat[lo:hi], group=g.group)  # in place: this rank's share is its slot
        else:
            dist.all_gather(list(flat.chunk(g.size)), flat[lo:hi].clone(), group=g.group)

    def _fetch(self, i: int) -> None:
        if i >= len(self.blocks) or i in self.ready:
            return
        if not self.cuda:
            self.ready[i] = (*self._copy_in(i), None)
            return
        self.copies.wait_stream(torch.cuda.current_stream(self.device))  # its buffers are free to reuse
        with torch.cuda.stream(self.copies):
            flat, tensors = self._copy_in(i)
            done = torch.cuda.Event()
            done.record()
        self.ready[i] = (flat, tensors, done)

    def _enter(self, i: int) -> None:
        self._fetch(i)
        flat, tensors, done = self.ready[i]
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
            flat.record_stream(torch.cuda.current_stream(self.device))  # made on the copy stream, used (and freed) here
        for (m, name, is_param, *_), t in zip(self.host[i], tensors):
            if is_param:
                m._parameters[name] = nn.Parameter(t, requires_grad=False)
            else:
                m._buffers[name] = t
        for j in range(i + 1, i + 1 + self.prefetch):  # round to the first blocks: the next forward's
            self._fetch(j % len(self.blocks))

    def _leave(self, i: int) -> None:
        for m, name, is_param, t, _ in self.host[i]:
            if is_param:
                m._parameters[name] = t
            else:
                m._buffers[name] = t
        del self.ready[i]
