"""The fused decode attention (QKV epilogue + attention + split combine in one launch)
against its float64 reference: GQA 1, 3 (padded to 4) and 4, MQA, each q/k norm, clip,
rotary or none, one split or several (the in-kernel combine), a short context in a long
cache and one that fills it, padding and a sliding window in the mask; repeated calls
(the split counters reset); on CPU under the interpreter and on a GPU."""
import math

import pytest
import torch

from kernels.qkv_attention import (attention_o_fits, attention_o_ref, attention_o_triton, default_o_rows, default_splits,
                                   fits, qkv_attention_ref, qkv_attention_triton)
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


def _int8_rows(w):
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("hq,hkv,d,qk_norm,rope,clip", [(8, 2, 16, "head", True, None), (6, 2, 32, "full", True, 1.5),
                                                        (4, 4, 16, None, False, None), (3, 1, 16, "head", True, None)])
@pytest.mark.parametrize("int8,bn", [(False, 8), (True, 16), (False, 64)])
def test_attention_o_matches_reference(device, dtype, hq, hkv, d, qk_norm, rope, clip, int8, bn):
    """The attention and the output projection in one launch, by KV head: each part against
    the float64 reference, their sum against the projection of the two-launch kernel's
    output, and the cache append as ``qkv_attention``'s. N = 37 (a last tile part empty),
    bf16 / fp16 or int8 weights with row scales."""
    s, slot, n = 40, 29, 37
    seed = hq * d + bn + int8
    qkv, kc, vc, cos, sin, qw, kw = _qkv_case(device, dtype, 1, hq, hkv, d, s, qk_norm, rope, seed)
    bias = _mask(1, s, slot, dtype, device, torch.Generator().manual_seed(seed + 1))
    w = torch.randn(n, hq * d, generator=torch.Generator().manual_seed(seed + 2)) / (hq * d) ** 0.5
    w, scale = _int8_rows(w) if int8 else (w, None)
    w, scale = w.to(device, None if int8 else dtype), None if scale is None else scale.to(device)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    slot_t = torch.tensor(slot, device=device)
    kr, vr = kc.double(), vc.double()
    ref = attention_o_ref(qkv.double(), hq, hkv, d, kr, vr, slot_t, bias.double(), w if int8 else w.double(),
                          up(scale), up(cos), up(sin), qk_norm, up(qw), up(kw), 1e-6, clip)
    kc0, vc0 = kc.clone(), vc.clone()
    parts = attention_o_triton(qkv, hq, hkv, d, kc, vc, slot_t, bias, w, scale, cos, sin, qk_norm, qw, kw, 1e-6, clip,
                               bn=bn)
    assert parts.shape == (hkv, 1, n) and parts.dtype == torch.float32
    tol = 3 * TOL[dtype] if dtype != torch.float32 else 1e-5
    assert rel(parts, ref) < tol and rel(parts.sum(0), ref.sum(0)) < tol
    # The same as the two launches: the attention output, then the projection.
    kc1, vc1 = kc0.clone(), vc0.clone()
    out = qkv_attention_triton(qkv, hq, hkv, d, kc1, vc1, slot_t, bias, cos, sin, qk_norm, qw, kw, 1e-6, clip)
    wf = w.double() * (scale.double()[:, None] if int8 else 1)
    two = out.reshape(1, -1).double() @ wf.t()
    assert rel(parts.sum(0), two) < (1e-5 if dtype == torch.float32 else TOL[dtype])
    assert torch.equal(kc, kc1) and torch.equal(vc, vc1)  # one program per KV head appends, as qkv_attention does
    others = [i for i in range(s) if i != slot]
    assert torch.equal(kc[:, :, others], kc0[:, :, others]) and torch.equal(vc[:, :, others], vc0[:, :, others])


def test_attention_o_rejects_bad_input_and_fits_short_caches():
    kc = torch.zeros(1, 2, 8, 16)
    qkv, bias, slot = torch.randn(1, 128), torch.zeros(1, 1, 1, 8), torch.tensor(3)
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"w \[32, 48\]: expected the output projection \[N, Hq \* D = 64\]"):
        attention_o_triton(qkv, 4, 2, 16, kc, kc.clone(), slot, bias, w[:, :48])
    with pytest.raises(ValueError, match=r"w_scale None: int8 w needs row scales \[32\]"):
        attention_o_triton(qkv, 4, 2, 16, kc, kc.clone(), slot, bias, w.to(torch.int8))
    with pytest.raises(ValueError, match=r"w_scale: given for torch.float32 weights"):
        attention_o_triton(qkv, 4, 2, 16, kc, kc.clone(), slot, bias, w, torch.ones(32))
    with pytest.raises(ValueError, match=r"bn=3: expected a power of two"):
        attention_o_triton(qkv, 4, 2, 16, kc, kc.clone(), slot, bias, w, bn=3)
    with pytest.raises(ValueError, match=r"B = 2, head_dim 16, 8 cache slots: expected one row"):
        attention_o_triton(torch.randn(2, 128), 4, 2, 16, kc.repeat(2, 1, 1, 1), kc.repeat(2, 1, 1, 1), slot,
                           torch.zeros(2, 8), w)
    assert attention_o_fits(1, 32, 4, 128, 80) and attention_o_fits(1, 16, 16, 128, 128)  # Qwen3, OLMoE, short
    assert not attention_o_fits(1, 32, 4, 128, 129)  # more keys than one block: each program would walk them
    assert not attention_o_fits(2, 32, 4, 128, 80) and not attention_o_fits(1, 32, 4, 256, 80)
    assert default_o_rows(2048, 4, 132) == 32 and default_o_rows(2048, 16, 132) == 128  # about 2 programs an SM
    assert default_o_rows(64, 1, 132) == 8


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

g, splits, qk_norm, pdl, pre_kv, bn, w_int8, block_s = (int(v) for v in sys.argv[1:])
hkv, d = 4, 128
const = dict(HQ=g * hkv, HKV=hkv, HQ_P=g * hkv, HKV_P=hkv, G=g, G_P=g, G_M=max(16, g), D=d, QK_NORM=qk_norm, CLIP=False,
             ROPE=True, BLOCK_S=block_s, P=splits, P_CHUNK=min(splits, 4), PRE_KV=bool(pre_kv), UPCAST=False,
             O_PROJ=bn > 0, BN=max(bn, 1), W_INT8=bool(w_int8), PDL=pdl)
types = {"slot_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "count_ptr": "*i32",
         "ws_ptr": "*fp32", "part_ptr": "*fp32", "w_ptr": "*i8" if w_int8 else "*bf16", "N": "i32",
         "eps": "fp32", "clip": "fp32", "scale": "fp32"}
sig = {n: "constexpr" if n in const else types.get(n, "i64" if n.startswith("stride") else "*bf16")
       for n in kernel.arg_names}
compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
print("cubin bytes", len(compiled.asm["cubin"]))
"""


@pytest.mark.parametrize("g,splits,qk_norm,pdl,pre_kv,bn,w_int8,block_s", [
    (1, 16, 2, 2, 1, 0, 0, 64), (8, 1, 1, 1, 0, 0, 0, 64), (4, 4, 0, 0, 1, 0, 0, 64),
    (8, 1, 1, 2, 1, 32, 0, 128), (8, 1, 1, 2, 1, 32, 1, 128), (1, 1, 2, 2, 1, 128, 0, 128)])
def test_qkv_attention_compiles_for_hopper(g, splits, qk_norm, pdl, pre_kv, bn, w_int8, block_s):
    """The whole Triton compile for sm_90 (tests.hopper), with the output projection
    (``bn`` > 0: Qwen3's and OLMoE's head groups, bf16 and int8 weights) and without."""
    out = compile_in_subprocess(_COMPILE, g, splits, qk_norm, pdl, pre_kv, bn, w_int8, block_s)
    assert int(out.split()[-1]) > 0
