"""A paged decode step's context in one launch (``kernels.attention.paged_context``) against
its torch reference, on CPU under the interpreter and on a GPU: rows fed from ``prev`` or
from their own token, padding rows, tables longer than the keys, a sliding window, rotary
or learned positions, the bool and the additive mask."""
import pytest
import torch

from kernels.attention.paged_context import paged_decode_context_triton
from kernels.attention.reference import paged_decode_context_ref
from tests.kernels.common import CPU, GPU


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rotary,bias", [(True, False), (False, True), (True, True)])
def test_paged_decode_context_matches_the_torch_ops(device, window, rotary, bias):
    gen = torch.Generator().manual_seed(3)
    b, bs, keys, blocks, trash = 6, 4, 32, 9, 999
    inputs = torch.zeros(b, 4 + blocks, dtype=torch.long)
    for i in range(b - 2):  # the last two rows are padding
        pos = int(torch.randint(0, keys, (1,), generator=gen))
        inputs[i, :4] = torch.tensor([7 + i, pos, 1, i - 1 if i % 2 else -1])
        inputs[i, 4:] = torch.randperm(50, generator=gen)[:blocks]
    prev = torch.randint(0, 100, (8,), generator=gen)
    tables = None
    if rotary:
        tables = (torch.randn(keys, 16, generator=gen).to(device, torch.bfloat16),
                  torch.randn(keys, 16, generator=gen).to(device, torch.bfloat16))
    inputs, prev = inputs.to(device), prev.to(device)
    got = paged_decode_context_triton(inputs, prev, bs, keys, trash, torch.bfloat16, tables, window, bias)
    want = paged_decode_context_ref(inputs, prev, bs, keys, trash, torch.bfloat16, tables, window, bias)
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
            assert torch.equal(got[name], want[name]), name
    assert got["write"][-2:].eq(trash).all() and got["lens"][-2:].eq(0).all()


def test_paged_decode_context_names_a_short_table():
    with pytest.raises(ValueError, match=r"inputs \[2, 5\] torch.int64: expected \[B, 4 \+ N\] int64 with N >= 2"):
        paged_decode_context_triton(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long), 4, 8,
                                    99, torch.float32, None)
