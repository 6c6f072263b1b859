"""SBI-GeMM with its deep-fusion prologue / epilogue against the torch reference: RMSNorm and
LayerNorm prologues, bias and residual epilogues, int8 weights, one split or several; on
CPU under the interpreter and on a GPU."""
import pytest
import torch

import kernels
from kernels.sbi_gemm import sbi_config, sbi_linear_ref, sbi_linear_triton

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", torch.float32, id="interp-fp32", marks=pytest.mark.interp),
    pytest.param("cpu", torch.bfloat16, id="interp-bf16", marks=pytest.mark.interp),
    pytest.param("cuda", torch.bfloat16, id="gpu-bf16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("t,k,n", [(1, 200, 24), (3, 97, 70), (16, 64, 130)])
@pytest.mark.parametrize("norm", [None, "rmsnorm", "layernorm"])
@pytest.mark.parametrize("int8,split", [(False, 1), (True, 1), (False, 2), (True, 4)])
def test_sbi_linear_matches_reference(device, dtype, t, k, n, norm, int8, split):
    gen = torch.Generator().manual_seed(t * 31 + k + n)
    x = (torch.randn(t, k, generator=gen) * 2 + 0.5).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
    scale = None
    if int8:
        q, s = kernels.quantize_int8(w[None])
        w, scale = q[0], s[0]
    bias = torch.randn(n, generator=gen).to(device, dtype)
    residual = torch.randn(t, n, generator=gen).to(device, dtype)
    nrm = None
    if norm:
        g = (torch.rand(k, generator=gen) + 0.5).to(device, dtype)
        gb = torch.randn(k, generator=gen).to(device, dtype) if norm == "layernorm" else None
        nrm = (norm, g, gb, 1e-5)
    cfg = dict(sbi_config(t, n, k, 132), split_k=split, bn=32, bk=32)
    out = sbi_linear_triton(x, w, scale, bias, residual, nrm, config=cfg)
    d = lambda z: None if z is None else z.double()  # noqa: E731
    ref = sbi_linear_ref(x.double(), w if int8 else w.double(), d(scale), bias.double(), residual.double(),
                         None if nrm is None else (norm, g.double(), d(gb), 1e-5))
    assert out.shape == (t, n) and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]


def test_sbi_linear_defaults_and_limits():
    x, w = torch.randn(2, 40), torch.randn(30, 40)
    torch.testing.assert_close(sbi_linear_triton(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"at most 64 rows"):
        sbi_linear_triton(torch.randn(65, 40), w)
    cfg = sbi_config(1, 4096, 14336, 132)  # a narrow output and a long K: split until SMs are busy
    assert cfg["split_k"] > 1 and cfg["bt"] == 16
