"""Plain-torch reference for greedy sampling's argmax (what ``kernels.argmax`` runs on a
CPU, and what ``kernels.argmax.triton`` must match).

Shape letters: B rows, V vocabulary.
"""
from __future__ import annotations

import torch


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> [B] int64, the first index of each row's maximum."""
    return x.argmax(dim=-1)
