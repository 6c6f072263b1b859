"""Programmatic dependent launch (Hopper and later) for the decode-path kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still
finishing: its programs are placed on the SMs the earlier kernel's tail leaves idle, and
each waits (``griddepcontrol.wait``) until that kernel has completed and its writes are
visible. Launch latency and the next kernel's ramp-up then overlap the previous one's
tail, which is what a decode step of ~200 short kernels loses most between launches.

Contract for every kernel launched here with PDL (``PDL=True``): call ``pdl_enter`` first,
in every program, before reading anything an earlier kernel wrote, and before any early
return. (A kernel that could finish without waiting would let the next one see its own
predecessor unfinished.) Each launch site takes ``pdl`` from its caller (the layer's
``KernelOptions.pdl``, which the engine config sets): False launches plainly, for A/B runs.

Early trigger (always, where PDL is on): each kernel lets the next one launch before its
own wait, not after it. That is still safe: kernel n + 1 waits for kernel n to complete,
and kernel n cannot complete before its own wait for kernel n - 1 has returned, so every
earlier kernel's writes are visible to n + 1 after its wait, transitively. What it gains:
the next kernel's blocks become resident (as far as the SMs have room) while the one
before is still running, and have their first weight loads in flight before they wait
(the decode step measured clearly faster with it). What it gives up: a kernel may not
read, before its wait, what the kernel two back wrote, unless the kernel between keeps
the late trigger. Only ``kernels.moe.cuda``'s down kernel does so (the routing ids), and the up
kernel before it always triggers after its wait.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    """Whether CUDA device ``index`` has compute capability 9.0 or later (a fact of the
    hardware, asked once per device)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(device: torch.device, pdl: bool) -> bool:
    """Whether a kernel on ``device`` launches with PDL: the caller asks for it (``pdl``,
    from ``KernelOptions``) and the device is a CUDA GPU of compute capability 9.0 or later."""
    if not pdl or device.type != "cuda":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device, pdl: bool) -> dict:
    """Keyword arguments for a Triton launch on ``device``: the kernel's ``PDL`` constexpr,
    and the launch option where PDL is on (``pdl_on``). The CPU interpreter takes no launch
    options. ``PDL`` is 0 (off) or 2 (on, with the early trigger: let the next kernel
    launch, then wait)."""
    return {"PDL": 2, "launch_pdl": True} if pdl_on(device, pdl) else {"PDL": 0}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Let the next kernel in the stream be launched, then wait for the previous one
    (``PDL`` 2, see ``pdl_launch``; 0: neither)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


_COUNTERS: dict = {}


def ticket_counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """int32 zeros, at least ``n``, kept per device and per kernel (``owner``), for kernels
    whose last program (by an atomic ticket) finishes the work and sets its counter back to
    zero: one buffer then serves every layer and every captured graph. Two launches of a
    kernel never use it at once: each program takes its ticket after its PDL wait, when the
    launch before has completed."""
    buf = _COUNTERS.get((device, owner))
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[(device, owner)] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf
