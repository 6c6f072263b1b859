"""Greedy sampling's argmax kernel (``kernels.argmax``) against torch's argmax: the first index
of a tie, NaN as the maximum, long and short rows; on CPU under the interpreter and on a
GPU."""
import pytest
import torch

from kernels.argmax.triton import argmax_triton
from tests.kernels.common import BACKENDS


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("b,v", [(1, 50304), (3, 4097), (2, 7)])
def test_argmax_matches_torch(device, dtype, b, v):
    gen = torch.Generator().manual_seed(b * v)
    x = torch.randn(b, v, generator=gen).to(device, dtype)
    x[0, v // 3] = x[0, v - 1] = x[0].max() + 1  # a tie: the first index wins
    out = argmax_triton(x)
    assert out.dtype == torch.int64 and torch.equal(out.cpu(), x.float().argmax(dim=-1).cpu())
    x[-1, v // 2] = float("nan")  # torch's rule: NaN is the maximum
    assert argmax_triton(x)[-1].item() == v // 2


def test_argmax_rejects_empty_rows():
    with pytest.raises(ValueError, match=r"x \[2, 0\]: expected \[B, V\] logits with V >= 1"):
        argmax_triton(torch.empty(2, 0))
