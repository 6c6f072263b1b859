"""The fused decode attention (QKV epilogue + attention + split combine in one launch)
against its float64 reference: GQA 1, 3 (padded to 4) and 4, MQA, each q/k norm, clip,
rotary or none, one split or several (the in-kernel combine), a short context in a long
cache and one that fills it, padding and a sliding window in the mask; repeated calls
(the split counters reset); on CPU under the interpreter and on a GPU."""
import math

import pytest
import torch

from kernels.qkv_attention import default_splits, fits, qkv_attention_ref, qkv_attention_triton
from tests.hopper import compile_in_subprocess
from tests.test_fused_decode import BACKENDS, TOL, _qkv_case, rel


def _mask(b, s, slot, dtype, device, gen, window=None):
    """Additive [B, 1, 1, S] mask as StepContext.decode_static builds it: left padding per
    row, nothing after the slot, the slot itself always visible."""
    pos = torch.arange(s)
    pad = (torch.rand(b, generator=gen) * slot).long()
    visible = (pos[None, :] >= pad[:, None]) & (pos[None, :] <= slot)
    if window is not None:
        visible &= slot - pos[None, :] < window
    visible |= pos[None, :] == slot
    bias = torch.zeros(b, s).masked_fill_(~visible, float("-inf"))
    return bias.view(b, 1, 1, s).to(device, dtype)


def _run(device, dtype, b, hq, hkv, d, s, slot, qk_norm, rope, clip, splits, seed, window=None):
    qkv, kc, vc, cos, sin, qw, kw = _qkv_case(device, dtype, b, hq, hkv, d, s, qk_norm, rope, seed)
    bias = _mask(b, s, slot, dtype, device, torch.Generator().manual_seed(seed + 1), window)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kc.double(), vc.double()
    slot_t = torch.tensor(slot, device=device)
    ref = qkv_attention_ref(qkv.double(), hq, hkv, d, kr, vr, slot_t, bias.double(), up(cos), up(sin), qk_norm, up(qw),
                            up(kw), 1e-6, clip)
    kc0, vc0 = kc.clone(), vc.clone()
    out = qkv_attention_triton(qkv, hq, hkv, d, kc, vc, slot_t, bias, cos, sin, qk_norm, qw, kw, 1e-6, clip,
                               splits=splits)
    return out, ref, (kc, vc, kc0, vc0, kr, vr)


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("b,hq,hkv,d", [(1, 4, 4, 16), (2, 6, 2, 32), (2, 8, 2, 16), (3, 4, 1, 16)])
@pytest.mark.parametrize("qk_norm,rope,clip", [(None, True, None), ("head", True, 1.5), ("full", False, None),
                                               ("full", True, None)])
@pytest.mark.parametrize("splits", [1, 4])
def test_qkv_attention_matches_reference(device, dtype, b, hq, hkv, d, qk_norm, rope, clip, splits):
    s, slot = 40, 29
    out, ref, (kc, vc, kc0, vc0, kr, vr) = _run(device, dtype, b, hq, hkv, d, s, slot, qk_norm, rope, clip, splits,
                                                seed=b * hq + d + splits)
    assert out.shape == (b, hq, d) and out.dtype == dtype
    # q and k round to the dtype at each step of norm and rotation, as the torch modules do.
    assert rel(out, ref) < (3 * TOL[dtype] if dtype != torch.float32 else 1e-5)
    assert rel(kc[:, :, slot], kr[:, :, slot]) < 3 * TOL[dtype] and rel(vc[:, :, slot], vr[:, :, slot]) < TOL[dtype]
    others = [i for i in range(s) if i != slot]  # the append touches the one slot only
    assert torch.equal(kc[:, :, others], kc0[:, :, others]) and torch.equal(vc[:, :, others], vc0[:, :, others])


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("s,slot,splits,window", [(8, 0, 4, None), (96, 95, 8, None), (300, 70, 16, None),
                                                  (64, 50, 2, 7), (33, 17, None, None), (300, 250, 2, None)])
def test_qkv_attention_context_lengths(device, dtype, s, slot, splits, window):
    """The first token (only its own key), a full cache, a short context in a long cache
    spread over many splits (most see no key), a sliding window, the default split count;
    in all of these the P blocks of keys cover the cache, so each split loads its one block
    before its wait. The last case has a cache longer than that: each split walks several
    blocks after its wait."""
    out, ref, _ = _run(device, dtype, 2, 8, 2, 16, s, slot, "head", True, None, splits, seed=s + slot, window=window)
    assert rel(out, ref) < (3 * TOL[dtype] if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("device,dtype", BACKENDS)
def test_qkv_attention_repeated_calls_and_steps(device, dtype):
    """Consecutive decode steps (slot 10, 11, 12) through the same cache, several splits:
    each step's counters are left at zero for the next, and each step sees the keys the
    steps before it appended."""
    b, hq, hkv, d, s = 2, 4, 2, 16, 24
    gen = torch.Generator().manual_seed(3)
    kc = torch.randn(b, hkv, s, d, generator=gen).to(device, dtype)
    vc = torch.randn(b, hkv, s, d, generator=gen).to(device, dtype)
    kr, vr = kc.double(), vc.double()
    for slot in (10, 11, 12):
        qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
        bias = _mask(b, s, slot, dtype, device, gen)
        ref = qkv_attention_ref(qkv.double(), hq, hkv, d, kr, vr, torch.tensor(slot, device=device), bias.double())
        out = qkv_attention_triton(qkv, hq, hkv, d, kc, vc, torch.tensor(slot, device=device), bias, splits=4)
        assert rel(out, ref) < (2 * TOL[dtype] if dtype != torch.float32 else 1e-5)


def test_qkv_attention_rejects_bad_input():
    kc = torch.zeros(1, 2, 8, 16)
    qkv, bias, slot = torch.randn(1, 128), torch.zeros(1, 1, 1, 8), torch.tensor(3)
    with pytest.raises(ValueError, match=r"qkv \[1, 2, 128\]: one token per row"):
        qkv_attention_triton(qkv.view(1, 2, 64).repeat(1, 1, 2), 4, 2, 16, kc, kc.clone(), slot, bias)
    with pytest.raises(ValueError, match=r"slot: expected a one-element device tensor"):
        qkv_attention_triton(qkv, 4, 2, 16, kc, kc.clone(), 3, bias)
    with pytest.raises(ValueError, match=r"bias \[1, 1, 1, 9\]"):
        qkv_attention_triton(qkv, 4, 2, 16, kc, kc.clone(), slot, torch.zeros(1, 1, 1, 9))
    with pytest.raises(ValueError, match=r"head_dim 8: expected at least 16"):
        qkv_attention_triton(torch.randn(1, 64), 4, 2, 8, kc[..., :8], kc[..., :8].clone(), slot, bias)
    with pytest.raises(ValueError, match=r"splits=3: expected a power of two"):
        qkv_attention_triton(qkv, 4, 2, 16, kc, kc.clone(), slot, bias, splits=3)
    with pytest.raises(ValueError, match=r"qk_norm='layer'"):
        qkv_attention_triton(qkv, 4, 2, 16, kc, kc.clone(), slot, bias, qk_norm="layer")


def test_default_splits_fill_the_gpu_and_bound_each_split():
    assert default_splits(1, 16, 192, 32, 132) == 8  # OLMoE batch 1, short cache: 128 programs, 24 keys each
    assert default_splits(1, 4, 192, 8, 132) == 32  # Qwen3 batch 1
    assert default_splits(1, 4, 40, 8, 132) == 8  # splitting stops once the splits cover the key blocks
    assert default_splits(1, 16, 2176, 32, 132) == 32  # a long cache: at most MAX_KEYS slots per split
    assert default_splits(1, 16, 8192, 128, 132) == 64  # P stops at 64
    assert default_splits(64, 16, 256, 32, 132) == 2  # a full grid splits only to bound each walk
    assert math.log2(default_splits(3, 5, 1000, 16, 132)).is_integer()
    assert fits(1, 16, 16, 128, 192, 132) and fits(1, 32, 4, 128, 192, 132)  # OLMoE, Qwen3 at batch 1
    assert not fits(8, 16, 16, 128, 192, 132)  # 256 programs: the epilogue launch and SDPA instead
    assert not fits(1, 16, 16, 128, 2176, 132)  # 512 programs
    assert not fits(1, 4, 4, 128, 16384, 132)  # 256 slots per split even at P = 64
    assert not fits(1, 4, 4, 8, 64, 132)  # a head dim below a tensor-core product's 16


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.qkv_attention import _qkv_attention_kernel as kernel

g, splits, qk_norm, pdl, pre_kv = (int(v) for v in sys.argv[1:])
hkv, d = 4, 128
const = dict(HQ=g * hkv, HKV=hkv, HQ_P=g * hkv, HKV_P=hkv, G=g, G_P=g, G_M=max(16, g), D=d, QK_NORM=qk_norm, CLIP=False,
             ROPE=True, BLOCK_S=64, P=splits, P_CHUNK=min(splits, 4), PRE_KV=bool(pre_kv), UPCAST=False, PDL=pdl)
types = {"slot_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "count_ptr": "*i32",
         "eps": "fp32", "clip": "fp32", "scale": "fp32"}
sig = {n: "constexpr" if n in const else types.get(n, "i64" if n.startswith("stride") else "*bf16")
       for n in kernel.arg_names}
compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
print("cubin bytes", len(compiled.asm["cubin"]))
"""


@pytest.mark.parametrize("g,splits,qk_norm,pdl,pre_kv", [(1, 16, 2, 2, 1), (8, 1, 1, 2, 0), (4, 4, 0, 0, 1)])
def test_qkv_attention_compiles_for_hopper(g, splits, qk_norm, pdl, pre_kv):
    """The whole Triton compile for sm_90 (tests.hopper)."""
    out = compile_in_subprocess(_COMPILE, g, splits, qk_norm, pdl, pre_kv)
    assert int(out.split()[-1]) > 0
