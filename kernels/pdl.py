"""Programmatic dependent launch (Hopper and later) for the decode-path kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still
finishing: its programs are placed on the SMs the earlier kernel's tail leaves idle, and
each waits (``griddepcontrol.wait``) until that kernel has completed and its writes are
visible. Launch latency and the next kernel's ramp-up then overlap the previous one's
tail, which is what a decode step of ~200 short kernels loses most between launches.

Contract for every kernel launched here with PDL (``PDL=True``): call ``pdl_enter`` first,
in every program, before reading anything an earlier kernel wrote, and before any early
return. (A kernel that could finish without waiting would let the next one see its own
predecessor unfinished.) ``MOE_INFER_PDL=0`` turns it off, for A/B runs.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


OFF = {"PDL": False}
ON = {"PDL": True, "launch_pdl": True}


@functools.lru_cache(maxsize=None)
def _launch(device_type: str, index: int | None) -> dict:
    if device_type != "cuda" or os.environ.get("MOE_INFER_PDL", "1") == "0":
        return OFF
    index = index if index is not None else torch.cuda.current_device()
    return ON if torch.cuda.get_device_capability(index)[0] >= 9 else OFF


def pdl_on(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (as ``pdl_launch`` decides)."""
    return _launch(device.type, device.index)["PDL"]


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch on ``device``: the kernel's ``PDL`` constexpr,
    and the launch option where PDL is on: a CUDA GPU of compute capability 9.0 or later,
    unless ``MOE_INFER_PDL=0`` (read once per process and device). The CPU interpreter
    takes no launch options."""
    return _launch(device.type, device.index)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream, then let the next one be launched."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
