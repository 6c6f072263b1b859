"""What the CUDA C++ kernels (``kernels.linear.sbi_cuda``, ``kernels.moe.cuda``) share: their sources in
``kernels/cuda/`` (``cuda_source``), whose ``common.cuh`` holds the device helpers for
streaming 16-byte weight vectors, bf16 / fp16 / int8 conversions and warp sums and the
split-K reduction kernel; compilation through CuPy (NVRTC); and a launcher that can start
a kernel with programmatic dependent launch (PDL), which CuPy's own launch cannot.

PDL (see ``kernels/pdl.py``): a kernel launched with it may start while the kernel
before it is finishing. Every kernel here calls ``grid_dep_enter()`` (the wait) in every block before
it reads anything an earlier kernel wrote (a no-op without PDL), and may load weights,
which no kernel writes, before that: the first weight loads of a step then overlap the
previous kernel's tail.

Each kernel lets the next launch before its own wait (the early trigger, see
``kernels/pdl.py``; the ``PDL_EARLY`` macro), unless its options pin the late trigger.
Asking L2 for a block's weight lines before its wait was measured slower in the decode
step: the prefetch competes with the kernel still running.
"""
from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

import numpy as np
import torch

from kernels.pdl import pdl_on

KERNELS_DIR = Path(__file__).parent  # each operator's .cu sources in its package
CUDA_DIR = KERNELS_DIR / "cuda"  # the headers they share (.cuh)
_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.M)


def cuda_source(path: str) -> str:
    """The text of ``kernels/<path>`` (e.g. "moe/moe.cu") with each ``#include "file"`` line
    replaced by the text of ``kernels/cuda/<file>`` (recursively): one self-contained
    program. NVRTC then needs no include path, and CuPy's compile cache, keyed by the source
    text and options, sees every change to an included file (it does not read the files an
    ``-I`` path would pull in)."""
    return _included(KERNELS_DIR / path)


def _included(file: Path) -> str:
    return _INCLUDE.sub(lambda m: _included(CUDA_DIR / m.group(1)), file.read_text())


DTYPES = {torch.bfloat16: 0, torch.float16: 1}


@functools.lru_cache(maxsize=None)
def function(device: int, source: str, name: str, opts: tuple):
    """The handle of kernel ``name`` of ``source`` compiled with ``opts`` (one compile per
    process)."""
    import cupy

    with cupy.cuda.Device(device):  # the CUfunction loaded on this device (RawKernel.kernel)
        kernel = cupy.RawModule(code=source, options=opts).get_function(name).kernel
    return kernel, ctypes.c_void_p(kernel.ptr)  # the Function keeps its module loaded


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_...: the PDL launch attribute
_C_TYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32,
            np.float32: ctypes.c_float}


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    return lib


def launch(device: torch.device, source: str, name: str, opts: tuple, grid: tuple, block: int, args: tuple,
           shared: int = 0, *, pdl: bool):
    """Launches kernel ``name`` on the current stream of ``device``; with PDL where ``pdl``
    asks for it and the device has it (``kernels.pdl.pdl_on``). ``args`` are numpy scalars
    (pointers as np.uint64); ``shared``: bytes of dynamic shared memory (at most 48 KiB)."""
    opts = tuple(opts)
    if not any(o.startswith("-DPDL_EARLY=") for o in opts):  # a kernel may pin the late trigger
        opts += ("-DPDL_EARLY=1",)
    _, handle = function(device.index, source, name, opts)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    use_pdl = pdl_on(device, pdl)
    config = _Config(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(block, 1, 1), shared_bytes=shared,
                     stream=torch.cuda.current_stream(device).cuda_stream,
                     attrs=ctypes.pointer(attr) if use_pdl else None, num_attrs=int(use_pdl))
    values = [_C_TYPES[type(a)](a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    err = _driver().cuLaunchKernelEx(ctypes.byref(config), handle, params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx({name}) failed with CUDA error {err}")


def addressable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether kernels on ``device`` can read ``t`` where it lies: on that device, or in
    pinned host memory, which a GPU with unified addressing reads in place over the bus."""
    return t.device == device or (t.device.type == "cpu" and t.is_pinned())


def ptr(z: torch.Tensor | None) -> np.uint64:
    return np.uint64(z.data_ptr() if z is not None else 0)


def compile_check(source: str, opts: tuple, arch: str = "sm_90", name: str = "kernel.cu") -> None:
    """Compiles ``source`` to a binary for ``arch`` with NVRTC (ptxas included; no GPU
    needed). Raises RuntimeError with the compiler log on a failure."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        nvrtc.compileProgram(prog, [*opts, f"-arch={arch}"])
        nvrtc.getCUBIN(prog)
    except Exception as exc:
        raise RuntimeError(f"{' '.join(opts)}: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
    finally:
        nvrtc.destroyProgram(prog)
