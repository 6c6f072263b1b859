"""The decode attention in CUDA C++ (``kernels.attention_cuda``) against the float64
reference and against the Triton kernel it stands in for: GQA 1, 3, 8 and 16 query heads
a KV head, each q / k norm, clip, rotary or none, bf16 and fp16, a mask in the model
dtype or float32, the first slot, a full cache, a short cache; the cache append; and
which steps it declines (they stay with the Triton kernel). The source compiles for
Hopper on a CPU (NVRTC runs ptxas)."""
import pytest
import torch

import kernels
from kernels import attention_cuda
from kernels.qkv_attention import qkv_attention_ref, qkv_attention_triton
from tests.test_fused_decode import TOL, _qkv_case, rel
from tests.test_qkv_attention import _mask


def test_source_compiles_for_hopper():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the test extras install cupy and NVRTC")
    assert attention_cuda.compile_all("sm_90") == 4


def test_declines_what_it_cannot_take_and_says_why():
    qkv, kc = torch.randn(1, 6 * 128), torch.zeros(1, 2, 64, 128)
    slot, bias = torch.tensor(3), torch.zeros(1, 64)
    assert attention_cuda.why_not(qkv, 2, 2, 128, kc, kc, slot, bias) == "not on a CUDA device"
    with pytest.raises(ValueError, match="qkv_attention_cuda: not on a CUDA device"):
        attention_cuda.qkv_attention_cuda(qkv, 2, 2, 128, kc, kc.clone(), slot, bias)
    with pytest.raises(ValueError, match=r"bias \[1, 9\]"):  # the shared operand checks come first
        attention_cuda.qkv_attention_cuda(qkv, 2, 2, 128, kc, kc.clone(), slot, torch.zeros(1, 9))


def _case(dtype, b, hq, hkv, s, slot, qk_norm, rope, clip, bias_dtype, seed):
    qkv, kc, vc, cos, sin, qw, kw = _qkv_case("cuda", dtype, b, hq, hkv, 128, s, qk_norm, rope, seed)
    bias = _mask(b, s, slot, bias_dtype, "cuda", torch.Generator().manual_seed(seed + 1))
    return qkv, kc, vc, cos, sin, qw, kw, bias, torch.tensor(slot, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,hq,hkv", [(1, 16, 16), (1, 32, 4), (2, 12, 4), (1, 16, 1), (3, 8, 8)])
@pytest.mark.parametrize("qk_norm,rope,clip", [(None, True, None), ("head", True, 1.5), ("full", True, None),
                                               ("full", False, None)])
@pytest.mark.parametrize("s,slot", [(128, 47), (128, 0), (128, 127), (40, 29)])
def test_matches_reference_and_triton(dtype, b, hq, hkv, qk_norm, rope, clip, s, slot):
    seed = b * hq + hkv + s + slot
    qkv, kc, vc, cos, sin, qw, kw, bias, slot_t = _case(dtype, b, hq, hkv, s, slot, qk_norm, rope, clip,
                                                        torch.float32 if slot % 2 else dtype, seed)
    assert attention_cuda.why_not(qkv, hq, hkv, 128, kc, vc, slot_t, bias, cos, qk_norm, qw, kw) is None
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kc.double(), vc.double()
    ref = qkv_attention_ref(qkv.double(), hq, hkv, 128, kr, vr, slot_t, bias.double(), up(cos), up(sin), qk_norm,
                            up(qw), up(kw), 1e-6, clip)
    kt, vt = kc.clone(), vc.clone()
    tri = qkv_attention_triton(qkv, hq, hkv, 128, kt, vt, slot_t, bias, cos, sin, qk_norm, qw, kw, 1e-6, clip)
    kc0, vc0 = kc.clone(), vc.clone()
    out = attention_cuda.qkv_attention_cuda(qkv, hq, hkv, 128, kc, vc, slot_t, bias, cos, sin, qk_norm, qw, kw,
                                            1e-6, clip)
    assert out.shape == (b, hq, 128) and out.dtype == dtype
    assert rel(out, ref) < 3 * TOL[dtype]
    assert rel(out, tri) < TOL[dtype]  # the same roundings as the Triton kernel's
    # The append: the slot gets the Triton kernel's v and its k within a rounding step, no other slot changes.
    assert rel(kc[:, :, slot], kt[:, :, slot]) < TOL[dtype] and torch.equal(vc[:, :, slot], vt[:, :, slot])
    assert rel(kc[:, :, slot], kr[:, :, slot]) < 3 * TOL[dtype]
    others = [i for i in range(s) if i != slot]
    assert torch.equal(kc[:, :, others], kc0[:, :, others]) and torch.equal(vc[:, :, others], vc0[:, :, others])


@pytest.mark.gpu
def test_dispatch_takes_it_where_it_fits_and_triton_elsewhere(monkeypatch):
    """``kernels.qkv_attention`` runs this kernel for a cache of at most 128 slots with head
    dim 128, and the Triton kernel for a longer cache, or with the switch off."""
    calls = []
    monkeypatch.setattr(attention_cuda, "qkv_attention_cuda",
                        lambda *a, **k: calls.append("cuda") or qkv_attention_triton(*a, **k))
    for s, enabled, expect in ((128, True, "cuda"), (256, True, None), (128, False, None)):
        monkeypatch.setattr(attention_cuda, "ENABLED", enabled)
        calls.clear()
        qkv, kc, vc, cos, sin, qw, kw, bias, slot_t = _case(torch.bfloat16, 1, 16, 16, s, 20, "full", True, None,
                                                            torch.bfloat16, s)
        kernels.qkv_attention(qkv, 16, 16, 128, kc, vc, slot_t, bias, cos, sin, "full", qw, kw)
        assert calls == ([expect] if expect else [])
