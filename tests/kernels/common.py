"""What the kernel tests share: the backends a test runs on (the Triton interpreter on the
CPU, the GPU), the relative error they measure, random routing tables and paged KV pools."""
import pytest
import torch

CPU = pytest.param("cpu", id="interp", marks=pytest.mark.interp)
GPU = pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)
# (device, dtype): the interpreter in float32 and bf16, the GPU in its half types.
BACKENDS = [
    pytest.param("cpu", torch.float32, id="interp-fp32", marks=pytest.mark.interp),
    pytest.param("cpu", torch.bfloat16, id="interp-bf16", marks=pytest.mark.interp),
    pytest.param("cuda", torch.bfloat16, id="gpu-bf16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float16, id="gpu-fp16", marks=pytest.mark.gpu),
]


def rel(a, b):
    """The relative error of a against b, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def routing(t, e, k, device, gen):
    """T tokens' k distinct experts of E each ([T, k] int32) and their weights [T, k]."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=gen)
    return ids.to(device), weights.to(device)


def paged_pool(device, dtype, hkv, d, s, block, lens, gen):
    """Each row's S key slots in scattered blocks of a shared pool, as PagedKVCache lays
    them out: lens [B] each row's keys -> (read_slots [B, S] int64, the trash row past each
    row's length; k, v pools [N, Hkv, D] of random values, the trash row (the last) NaN: a
    read of it would poison the output)."""
    b = len(lens)
    blocks = -(-s // block)
    n = b * blocks * block + 1  # the last pool row takes what nothing should read
    order = torch.randperm(b * blocks, generator=gen).view(b, blocks)  # each row's block table
    pos = torch.arange(s)
    read = torch.where(pos[None, :] < lens[:, None], order[:, pos // block] * block + pos % block, n - 1)
    k, v = (torch.randn(n, hkv, d, generator=gen).to(device, dtype) for _ in range(2))
    k[-1], v[-1] = float("nan"), float("nan")
    return read.to(device), k, v
