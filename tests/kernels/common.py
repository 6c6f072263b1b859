"""What the kernel tests share: the backends a test runs on (the Triton interpreter on the
CPU, the GPU), the relative error they measure, and random routing tables."""
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
