"""A Triton kernel launched straight through its compiled launcher, for the small launches
whose host cost is the whole cost in eager mode (routing at decode sizes).

``kernel[grid](...)`` binds the arguments, computes the specialization (each pointer's
16-byte alignment, each integer's value class) and hashes the cache key on every call:
measured at two to three times the host time of the compiled kernel's own launcher.
``CachedLaunch`` calls the JIT once per key
that the caller names, keeps the compiled kernel it returns, and launches that directly
afterwards.

The caller's key must determine everything the JIT specializes on: the constexpr values,
the dtypes, the integer arguments' values (or at least whether each is 1 and whether it
is a multiple of 16) and whether each pointer is 16-byte aligned. Where the key does not
cover an argument, the kernel compiled for another value would run: wrong results, with
no error. Off the GPU (the interpreter), and while a launch hook is set (a profiler wants
the JIT's launch metadata), every call goes through the JIT.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
from triton import knobs


class CachedLaunch:
    """``launch(key, args, plan, device)`` runs ``fn[grid](*args, **kwargs)`` with
    ``(grid, kwargs) = plan()``: the first time for ``key`` through the JIT, afterwards
    through the kernel it compiled, without calling ``plan`` again. ``args`` are the
    kernel's leading parameters in order; ``kwargs`` name the remaining ones (constexprs)
    and the launch options (num_warps, launch_pdl, ...), as a JIT call would."""

    def __init__(self, fn):
        self.fn = fn
        self.names = fn.arg_names
        self.cache: dict[Hashable, tuple[Any, tuple, tuple]] = {}

    def __call__(self, key: Hashable, args: tuple, plan: Callable[[], tuple[tuple, dict]],
                 device: torch.device) -> None:
        hit = self.cache.get(key)
        if hit is None or _hooked():
            grid, kwargs = plan()
            compiled = self.fn[grid](*args, **kwargs)
            if device.type == "cuda" and hasattr(compiled, "packed_metadata"):
                self.cache[key] = (_entry_point(compiled), tuple(grid) + (1,) * (3 - len(grid)),
                                   tuple(kwargs[n] for n in self.names[len(args):]))
            return
        launch, (gx, gy, gz), tail = hit
        launch(gx, gy, gz, self.stream(device.index), *args, *tail)

    @staticmethod
    def stream(index: int) -> int:
        """The current CUDA stream's handle on device ``index`` (what Triton's JIT passes)."""
        return torch._C._cuda_getCurrentRawStream(index)


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps them in a chain, earlier versions in
    a plain attribute that is None when unset)."""
    hook = knobs.runtime.launch_enter_hook
    return bool(hook.calls) if hasattr(hook, "calls") else hook is not None


def _entry_point(compiled) -> Callable:
    """``f(gx, gy, gz, stream, *params)`` launching ``compiled``: its C launcher itself where
    the kernel needs no scratch memory (Triton 3.6's ``CudaLauncher`` is a Python wrapper
    that would allocate it), else the wrapper."""
    run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
    direct = getattr(run, "launch", None)
    scratch = getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
    if direct is not None and not scratch:
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        return lambda gx, gy, gz, stream, *params: direct(gx, gy, gz, stream, function, coop, pdl, None, None, meta,
                                                          None, None, None, *params)
    return lambda gx, gy, gz, stream, *params: run(gx, gy, gz, stream, function, meta, None, None, None, *params)
