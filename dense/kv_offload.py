"""A paged KV cache held in host memory, for batches whose keys and values exceed the device
(DeepSpeed-Inference's KV offload, sections IV-C2 and IV-C3 of its paper).

The offloaded layers' pools live in host memory (pinned on a GPU). A forward finds each such
layer's pools on the device when its attention runs: two device buffers take the offloaded
layers in turn, and while one offloaded layer attends, the next one's pools are copied into
the other buffer on a copy stream, once the keys the layer before wrote have left it. The
keys a step writes go back to the host copy alone: a gather of the written slots, copied out
after the layer and stored into the host pools when the step ends. Each step so moves the
offloaded layers' whole cache in over the host link once.

Which layers: every one, or (``alternate``, the paper's IV-C3 for GPUs that share a PCIe
link) every other one, those whose parity is the GPU's: two neighbouring GPUs then never
copy the same layer's pools at once, and the other layers stay on the device.

On a CPU the "device" buffers are host tensors too and every copy is a plain one: the tests
check the data movement there.
"""
from __future__ import annotations

import torch

from dense.attention import PagedKVCache


class OffloadedKVCache(PagedKVCache):
    """``PagedKVCache`` with the pools of layers ``offloaded`` (local indices; None: all) in host
    memory; ``pools(layer)`` brings an offloaded layer's to the device. The layers of one
    forward ask in ascending order, each once or more (latent attention writes, then
    gathers); ``finish_step`` ends the step."""

    def __init__(self, *args, offloaded: list[int] | None = None, **kw):
        self.offloaded = offloaded
        super().__init__(*args, **kw)

    def _allocate(self, shape: tuple, v_dim: int, dtype: torch.dtype, device: torch.device):
        layers = shape[0]
        off = sorted(set(range(layers) if self.offloaded is None else self.offloaded))
        if not off or off[0] < 0 or off[-1] >= layers:
            raise ValueError(f"offloaded layers {off}: expected some of 0 .. {layers - 1}")
        self.offloaded = off
        self._pos = {layer: i for i, layer in enumerate(off)}  # offloaded layer -> its host pool
        kept = [layer for layer in range(layers) if layer not in self._pos]
        self._kept = {layer: i for i, layer in enumerate(kept)}  # kept layer -> its device pool
        pin = device.type == "cuda"
        self.host_k = torch.zeros((len(off), *shape[1:]), dtype=dtype, pin_memory=pin)
        self.host_v = torch.zeros((len(off), *shape[1:-1], v_dim), dtype=dtype, pin_memory=pin)
        self.kept_k = torch.zeros((len(kept), *shape[1:]), dtype=dtype, device=device)
        self.kept_v = torch.zeros((len(kept), *shape[1:-1], v_dim), dtype=dtype, device=device)
        buffers = min(2, len(off))
        self.copies = torch.cuda.Stream(device) if pin else None
        self.device = device
        self._held: list[int | None] = [None] * buffers  # the layer each buffer holds
        self._ready: dict[int, torch.cuda.Event | None] = {}  # layer -> its copy-in's end
        self._freed: list[torch.cuda.Event | None] = [None] * buffers  # buffer -> its write-back's end
        self._out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> written rows on the host
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> pinned rows, reused
        self._current: int | None = None  # the offloaded layer attending now
        self._last = -1  # the last layer asked for this step
        return (torch.zeros((buffers, *shape[1:]), dtype=dtype, device=device),
                torch.zeros((buffers, *shape[1:-1], v_dim), dtype=dtype, device=device))

    def use_slots(self, write_slots: torch.Tensor, read_slots: torch.Tensor):
        super().use_slots(write_slots, read_slots)
        self._current, self._last, self._out, self._ready = None, -1, {}, {}
        self._held = [None] * len(self._held)  # the host copies changed since: fetch afresh
        self._fetch(self.offloaded[0])

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer}: the cache holds layers 0 .. {self.num_layers - 1}")
        if layer < self._last:
            raise RuntimeError(f"layer {layer} after layer {self._last}: an offloaded KV cache is read in "
                               "ascending layer order within a step")
        self._last = layer
        if layer in self._kept:
            i = self._kept[layer]
            return self.kept_k[i], self.kept_v[i]
        pos = self._pos[layer]
        buf = pos % len(self._held)
        if layer != self._current:
            if self._current is not None:
                self._write_back(self._current)
            if self._held[buf] != layer:
                self._fetch(layer)
            self._current = layer
            if pos + 1 < len(self.offloaded) and len(self._held) > 1:
                self._fetch(self.offloaded[pos + 1])  # into the other buffer, once its layer's keys have left
        ready = self._ready.get(layer)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return self.k[buf], self.v[buf]

    def finish_step(self) -> None:
        """The last offloaded layer's written keys out, then every written layer's into the
        host pools."""
        if self._current is not None:
            self._write_back(self._current)
            self._current = None
        self._last = -1
        if not self._out:
            return
        for event in self._freed:
            if event is not None:
                event.synchronize()
        slots = self.write_slots.reshape(-1).cpu()
        for layer, (k_rows, v_rows) in self._out.items():
            self.host_k[self._pos[layer]].index_copy_(0, slots, k_rows)
            self.host_v[self._pos[layer]].index_copy_(0, slots, v_rows)
        self._out = {}

    def _fetch(self, layer: int) -> None:
        """Offloaded layer ``layer``'s host pools into its buffer (a GPU: on the copy stream,
        after the buffer's last write-back; ``_ready[layer]`` marks the end)."""
        pos = self._pos[layer]
        buf = pos % len(self._held)
        if self.copies is None:
            self.k[buf].copy_(self.host_k[pos])
            self.v[buf].copy_(self.host_v[pos])
            self._ready[layer] = None
        else:
            # The buffer's previous layer is done with once its write-back (queued after
            # that layer's attention) is; a buffer not yet written back waits for all work.
            if self._freed[buf] is None:
                self.copies.wait_stream(torch.cuda.current_stream(self.device))
            else:
                self.copies.wait_event(self._freed[buf])
            with torch.cuda.stream(self.copies):
                self.k[buf].copy_(self.host_k[pos], non_blocking=True)
                self.v[buf].copy_(self.host_v[pos], non_blocking=True)
                self._ready[layer] = torch.cuda.Event()
                self._ready[layer].record()
        self._held[buf] = layer

    def _write_back(self, layer: int) -> None:
        """The slots this step wrote in offloaded layer ``layer``'s buffer, gathered and
        copied out (queued after the layer's attention on the compute stream)."""
        buf = self._pos[layer] % len(self._held)
        slots = self.write_slots.reshape(-1)
        k_rows, v_rows = self.k[buf].index_select(0, slots), self.v[buf].index_select(0, slots)
        if self.copies is None:
            self._out[layer] = (k_rows, v_rows)
            return
        staged = self._staging.get(layer)
        if staged is None or staged[0].shape[0] < len(slots):
            staged = tuple(torch.empty((max(len(slots), 2 * (staged[0].shape[0] if staged else 0)), *z.shape[1:]),
                                       dtype=z.dtype, pin_memory=True) for z in (k_rows, v_rows))
            self._staging[layer] = staged
        out = (staged[0][:len(slots)], staged[1][:len(slots)])
        out[0].copy_(k_rows, non_blocking=True)
        out[1].copy_(v_rows, non_blocking=True)
        self._out[layer] = out
        event = torch.cuda.Event()
        event.record()
        self._freed[buf] = event
