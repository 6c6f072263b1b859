"""Greedy sampling's argmax: x [B, V] -> [B] int64, the first index of each row's maximum
(NaN counts as the maximum, torch's rule).

Shape letters: B rows, V vocabulary.

Backends: a CPU tensor runs torch's argmax (``reference.py``); a CUDA tensor runs the
Triton kernels of ``triton.py`` (each row split over the SMs, then a second launch picks
the first chunk with the maximum), imported at that first call.

The package and the op share a name: ``kernels.argmax`` is the function (``kernels``
binds it after importing this package), so the modules here are reached by their full
names (``from kernels.argmax.triton import argmax_triton``), not as its attributes.
"""
from __future__ import annotations

from kernels.argmax.reference import argmax_ref


def argmax(x, *, pdl=True):
    """x [B, V] -> [B] int64: first index of each row's maximum (split over the SMs on a GPU)."""
    if x.is_cuda:
        from kernels.argmax.triton import argmax_triton
        return argmax_triton(x, pdl)
    return argmax_ref(x)


__all__ = ["argmax"]
