"""The fused QKV kernels of the decode path (``kernels.attention.qkv_decode_triton``,
``qkv_attention_triton``) against their float64 references, on CPU under the interpreter and
on a GPU, and their Triton compiles for sm_90 (tests.hopper):
- the QKV epilogue (q/k norms, clip, rotary, the append into a paged pool at each token's
  pool row) of a decode step and of a prefill;
- the fused decode attention over a paged pool (QKV epilogue + attention + split combine in
  one launch): GQA 1, 3 (padded to 4), 4 and 8, MQA, each q/k norm, clip, rotary or none,
  one split or several (the in-kernel combine), a short row and one that fills its key
  slots, padding rows and a sliding window in the mask, additive or bool; consecutive
  steps (the split counters reset);
- partial rotary (GLM-4.5: the first R dimensions of each head turn) in both kernels, and
  attention sinks (GPT-OSS: a logit per head in the softmax) in the one-launch attention."""
import math

import pytest
import torch

from kernels.attention.qkv_attention_triton import default_splits, fits, qkv_attention_triton
from kernels.attention.qkv_decode_triton import qkv_decode_triton
from kernels.attention.reference import qkv_attention_ref, qkv_decode_ref
from tests.hopper import compile_kernel
from tests.kernels.common import BACKENDS, paged_pool, rel

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # the QKV epilogue, fused attention


def _qkv_case(device, dtype, b, hq, hkv, d, qk_norm, rope, seed, rot=None):
    """One token per row: qkv [B, W], its rotary rows at random positions (None, None
    without ``rope``; [B, rot] where only the first ``rot`` dimensions turn) and the q / k
    norm weights -> (qkv, cos, sin, qw, kw)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=gen) * 2).to(device, dtype)
    pos = torch.randint(0, 500, (b, 1), generator=gen).float()
    r = rot or d
    inv = 1.0 / 10000 ** (torch.arange(0, r, 2).float() / r)
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    cos, sin = (ang.cos().to(device, dtype), ang.sin().to(device, dtype)) if rope else (None, None)
    qw = kw = None
    if qk_norm == "head":
        qw, kw = ((torch.rand(d, generator=gen) + 0.5).to(device, dtype) for _ in range(2))
    elif qk_norm == "full":
        qw = (torch.rand(hq * d, generator=gen) + 0.5).to(device, dtype)
        kw = (torch.rand(hkv * d, generator=gen) + 0.5).to(device, dtype)
    return qkv, cos, sin, qw, kw


def _pool(device, dtype, n, hkv, d, gen):
    """Random k, v pools [N, Hkv, D]."""
    return tuple(torch.randn(n, hkv, d, generator=gen).to(device, dtype) for _ in range(2))


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("b,hq,hkv,d", [(1, 4, 4, 16), (3, 6, 2, 32), (2, 5, 1, 64)])
@pytest.mark.parametrize("qk_norm", [None, "head", "full"])
@pytest.mark.parametrize("rope,clip", [(True, None), (True, 1.5), (False, None)])
def test_qkv_decode_matches_reference(device, dtype, b, hq, hkv, d, qk_norm, rope, clip):
    """One token per row into a paged pool, each at its own scattered pool row: q, k and v
    against the float64 reference and, closer, against the same ops in the dtype; no other
    pool row touched."""
    n = 9
    qkv, cos, sin, qw, kw = _qkv_case(device, dtype, b, hq, hkv, d, qk_norm, rope, b * hq + d)
    gen = torch.Generator().manual_seed(d)
    kp, vp = _pool(device, dtype, n, hkv, d, gen)
    slot = torch.randperm(n, generator=gen)[:b].to(device)  # [B] each row's pool row
    kp0, vp0 = kp.clone(), vp.clone()
    q = qkv_decode_triton(qkv, hq, hkv, d, kp, vp, slot, cos, sin, qk_norm, qw, kw, 1e-6, clip)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kp0.double(), vp0.double()
    qr = qkv_decode_ref(qkv.double(), hq, hkv, d, kr, vr, slot, up(cos), up(sin), qk_norm, up(qw), up(kw), 1e-6,
                        clip)
    assert q.shape == (b, hq, 1, d) and q.dtype == dtype
    # Norm and rotation round to the dtype at each step, as the torch modules do: against the
    # float64 math that is a few roundings of error; against the same ops in the dtype, less
    # (on a GPU; the interpreter's bf16 casts truncate rather than round).
    loose, tight = (2 * TOL[dtype], TOL[dtype] / 2) if device == "cuda" else (3 * TOL[dtype], 3 * TOL[dtype])
    assert rel(q, qr) < loose and rel(kp[slot], kr[slot]) < loose
    kd, vd = kp0.clone(), vp0.clone()
    qd = qkv_decode_ref(qkv, hq, hkv, d, kd, vd, slot, cos, sin, qk_norm, qw, kw, 1e-6, clip)
    assert rel(q, qd) < tight and rel(kp[slot], kd[slot]) < tight
    assert rel(vp[slot], vr[slot]) < TOL[dtype]
    others = torch.ones(n, dtype=torch.bool, device=device).index_fill_(0, slot, False)  # the append's rows only
    assert torch.equal(kp[others], kp0[others]) and torch.equal(vp[others], vp0[others])


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("qk_norm", [None, "head", "full"])
def test_qkv_epilogue_of_a_prefill(device, dtype, qk_norm):
    """T tokens per row (a prefill): one program per token, each at its own position and
    pool row; q comes back [B, Hq, T, D]. Token by token through the decode form gives the
    same q and pool."""
    b, t, hq, hkv, d, n = 2, 5, 4, 2, 16, 13
    _, _, _, qw, kw = _qkv_case(device, dtype, b, hq, hkv, d, qk_norm, False, 7)
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen) * 2).to(device, dtype)
    cos, sin = _rotary_rows(device, dtype, torch.arange(3, 3 + t).expand(b, t), d)
    kp, vp = _pool(device, dtype, n, hkv, d, gen)
    slot = torch.randperm(n, generator=gen)[:b * t].view(b, t).to(device)
    kp0, vp0 = kp.clone(), vp.clone()
    q = qkv_decode_triton(qkv, hq, hkv, d, kp, vp, slot, cos, sin, qk_norm, qw, kw, 1e-6, 1.5)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kp0.double(), vp0.double()
    qr = qkv_decode_ref(qkv.double(), hq, hkv, d, kr, vr, slot, up(cos), up(sin), qk_norm, up(qw), up(kw), 1e-6,
                        1.5)
    assert q.shape == (b, hq, t, d) and qr.shape == q.shape
    tol = 2 * TOL[dtype] if device == "cuda" else 3 * TOL[dtype]
    assert rel(q, qr) < tol and rel(kp[slot], kr[slot]) < tol and rel(vp[slot], vr[slot]) < tol
    others = torch.ones(n, dtype=torch.bool, device=device).index_fill_(0, slot.view(-1), False)
    assert torch.equal(kp[others], kp0[others]) and torch.equal(vp[others], vp0[others])
    kd, vd = kp0.clone(), vp0.clone()
    for i in range(t):
        qi = qkv_decode_triton(qkv[:, i].contiguous(), hq, hkv, d, kd, vd, slot[:, i], cos[:, i], sin[:, i],
                               qk_norm, qw, kw, 1e-6, 1.5)
        assert torch.equal(qi[:, :, 0], q[:, :, i])
    assert torch.equal(kd, kp) and torch.equal(vd, vp)


def test_qkv_decode_rejects_bad_shapes():
    """ValueErrors naming the operand; a contiguous cache [B, Hkv, S, D] is no pool."""
    kp, slot = torch.zeros(6, 2, 8), torch.tensor([3])
    with pytest.raises(ValueError, match=r"qkv \[1, 40\]: expected \[B, \(Hq \+ 2 Hkv\) \* D = 64\]"):
        qkv_decode_triton(torch.randn(1, 40), 4, 2, 8, kp, kp.clone(), slot)
    with pytest.raises(ValueError, match=r"k_cache / v_cache \[6, 3, 8\] / \[6, 2, 8\]: expected a paged pool"):
        qkv_decode_triton(torch.randn(1, 64), 4, 2, 8, torch.zeros(6, 3, 8), kp, slot)
    kc = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"k_cache / v_cache \[1, 2, 4, 8\] / \[1, 2, 4, 8\]: expected a paged pool "
                                         r"\[N, Hkv, D\]"):
        qkv_decode_triton(torch.randn(1, 64), 4, 2, 8, kc, kc.clone(), slot)
    with pytest.raises(ValueError, match=r"qk_norm='layer'"):
        qkv_decode_triton(torch.randn(1, 64), 4, 2, 8, kp, kp.clone(), slot, qk_norm="layer")


def _rotary_rows(device, dtype, positions, d):
    """cos, sin [..., D] of the rotate-half rotary at ``positions`` [...]."""
    ang = positions.float()[..., None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(device, dtype), ang.sin().to(device, dtype)


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("qk_norm,rope,clip", [(None, True, None), ("head", True, 1.5), ("full", False, None)])
def test_qkv_decode_into_apaged_pool(device, dtype, t, qk_norm, rope, clip):
    """Each token's k and v at its own pool row (scattered; one padding token's at the trash
    row), also stored into ``kv_out``: bit for bit the q, k and v of the same tokens stored
    at other pool rows (in order from row 0), close to the float64 reference, no other pool
    row touched."""
    b, hq, hkv, d = 3, 4, 2, 16
    _, _, _, qw, kw = _qkv_case(device, dtype, b, hq, hkv, d, qk_norm, False, seed=t)
    gen = torch.Generator().manual_seed(10 + t)
    qkv = (torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen) * 2).to(device, dtype)
    cos, sin = _rotary_rows(device, dtype, torch.randint(0, 500, (b, t), generator=gen), d) if rope else (None, None)
    n = 2 * b * t + 1
    kp, vp = (torch.randn(n, hkv, d, generator=gen).to(device, dtype) for _ in range(2))
    slot = torch.randperm(n - 1, generator=gen)[:b * t].view(b, t)
    slot[1, 0] = n - 1  # a padding token: the trash row
    slot = slot.to(device)
    kp0, vp0 = kp.clone(), vp.clone()
    kv_out = tuple(torch.empty(b, t, hkv, d, dtype=dtype, device=device) for _ in range(2))
    q = qkv_decode_triton(qkv, hq, hkv, d, kp, vp, slot, cos, sin, qk_norm, qw, kw, 1e-6, clip, kv_out=kv_out)
    kc, vc = (torch.zeros(b * t + 1, hkv, d, dtype=dtype, device=device) for _ in range(2))
    in_order = torch.arange(b * t, device=device).view(b, t)
    qc = qkv_decode_triton(qkv, hq, hkv, d, kc, vc, in_order, cos, sin, qk_norm, qw, kw, 1e-6, clip)
    kn, vn = kc[:-1].view(b, t, hkv, d), vc[:-1].view(b, t, hkv, d)
    assert q.shape == (b, hq, t, d) and torch.equal(q, qc)
    assert torch.equal(kp[slot], kn) and torch.equal(vp[slot], vn)
    assert torch.equal(kv_out[0], kn) and torch.equal(kv_out[1], vn)
    others = torch.ones(n, dtype=torch.bool, device=device).index_fill_(0, slot.view(-1), False)
    assert torch.equal(kp[others], kp0[others]) and torch.equal(vp[others], vp0[others])
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kp0.double(), vp0.double()
    kv_ref = tuple(torch.empty(b, t, hkv, d, dtype=torch.float64, device=device) for _ in range(2))
    qr = qkv_decode_ref(qkv.double(), hq, hkv, d, kr, vr, slot.view(-1), up(cos), up(sin), qk_norm, up(qw), up(kw),
                        1e-6, clip, kv_ref)
    tol = 2 * TOL[dtype] if device == "cuda" else 3 * TOL[dtype]
    assert rel(q, qr) < tol and rel(kp[slot], kr[slot]) < tol and rel(vp[slot], vr[slot]) < TOL[dtype]
    assert rel(kv_out[0], kv_ref[0]) < tol and rel(kv_out[1], kv_ref[1]) < TOL[dtype]
    assert torch.equal(kr[slot].to(dtype), kv_ref[0].to(dtype)) and torch.equal(kr[others], kp0[others].double())


def test_paged_modes_reject_bad_input():
    """A paged pool's operands, for the epilogue and the one-launch attention: ValueErrors
    naming the operand."""
    kp, qkv, bias = torch.zeros(9, 2, 16), torch.randn(2, 128), torch.zeros(2, 1, 1, 3)
    slot, read, pos = torch.tensor([3, 4]), torch.tensor([[0, 3, 8], [1, 4, 8]]), torch.tensor([[1], [1]])
    with pytest.raises(ValueError, match=r"slot 3: a paged pool takes each token's pool row"):
        qkv_decode_triton(qkv, 4, 2, 16, kp, kp.clone(), 3)
    with pytest.raises(ValueError, match=r"slot \[2\] torch.int32: a paged pool"):
        qkv_decode_triton(qkv, 4, 2, 16, kp, kp.clone(), slot.int())
    with pytest.raises(ValueError, match=r"slot \[3\] torch.int64: .* B x T = 2 x 1"):
        qkv_decode_triton(qkv, 4, 2, 16, kp, kp.clone(), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"k_cache / v_cache \[9, 2, 16\] / \[9, 3, 16\]"):
        qkv_decode_triton(qkv, 4, 2, 16, kp, torch.zeros(9, 3, 16), slot)
    with pytest.raises(ValueError, match=r"kv_out \[\[2, 1, 2, 16\], \[2, 2, 16\]\]"):
        qkv_decode_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, kv_out=(torch.empty(2, 1, 2, 16), torch.empty(2, 2, 16)))
    with pytest.raises(ValueError, match=r"read_slots None: expected int64 \[B = 2, S\]"):
        qkv_attention_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, bias, read_slots=None, positions=pos)
    with pytest.raises(ValueError, match=r"read_slots \[2, 3\] torch.int32"):
        qkv_attention_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, bias, read_slots=read.int(), positions=pos)
    with pytest.raises(ValueError, match=r"positions \[3\] torch.int64: expected int64 of B = 2"):
        qkv_attention_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, bias, read_slots=read,
                             positions=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"bias \[2, 1, 1, 4\]"):
        qkv_attention_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, torch.zeros(2, 1, 1, 4), read_slots=read,
                             positions=pos)
    kc = torch.zeros(2, 2, 3, 16)  # a contiguous cache [B, Hkv, S, D] is no pool
    with pytest.raises(ValueError, match=r"k_cache / v_cache \[2, 2, 3, 16\] / \[2, 2, 3, 16\]: expected a paged pool"):
        qkv_attention_triton(qkv, 4, 2, 16, kc, kc.clone(), slot, bias, read_slots=read, positions=pos)


_COMPILE_QKV_DECODE = """
import sys
from kernels.attention.qkv_decode_triton import _qkv_decode_kernel as kernel

qk_norm, pdl, kv_out, rot = (int(v) for v in sys.argv[1:])
const = dict(HQ=16, HKV=4, HQ_P=16, HKV_P=4, D=128, R=rot, QK_NORM=qk_norm, CLIP=True, ROPE=True, KV_OUT=bool(kv_out),
             PDL=pdl)
types = {"slot_ptr": "*i64", "eps": "fp32", "clip": "fp32"}
"""


@pytest.mark.parametrize("qk_norm,pdl,kv_out,rot", [(0, 0, 0, 128), (1, 2, 0, 64), (2, 2, 1, 128)])
def test_qkv_decode_compiles_for_hopper(qk_norm, pdl, kv_out, rot):
    """The QKV epilogue kernel's whole Triton compile for sm_90 (tests.hopper), with each
    q / k norm, into a paged pool, with the fresh k, v stored out too or not, rotary over
    whole heads or half of each."""
    assert compile_kernel(_COMPILE_QKV_DECODE, qk_norm, pdl, kv_out, rot) > 0


def _paged_run(device, dtype, hq, hkv, s, lens, qk_norm, rope, clip, splits, seed, window=None, bool_mask=False,
               d=16, rot=None, sinks=False):
    """The one-launch attention over a paged pool (``_paged_pool``: rows of ``lens`` keys,
    the new one each row's last; a row of 0 is a padding row, as PagedDecodeStep pads: it
    writes the trash row and sees only its own key) and its float64 reference -> (out, ref,
    (k, v pools after the step, the reference's, the pools before it, the write rows)).
    ``bool_mask``: the mask as a bool one, not additive; ``rot``: the rotary dimensions of a
    head (None: all); ``sinks``: a random sink logit per head."""
    b = len(lens)
    gen = torch.Generator().manual_seed(seed)
    qkv, cos, sin, qw, kw = _qkv_case(device, dtype, b, hq, hkv, d, qk_norm, rope, seed, rot)
    sink = (torch.randn(hq, generator=gen) * 2).to(device, dtype) if sinks else None
    lens = torch.tensor(lens)
    read, kp, vp = paged_pool(device, dtype, hkv, d, s, 8, lens, gen)
    last = (lens - 1).clamp(min=0)  # each row's new key: its position
    write = read.gather(1, last[:, None].to(device))[:, 0]  # the pool row it goes to
    # As the runner passes them: a column of a wider int64 tensor.
    positions = torch.stack([torch.zeros_like(last), last], 1)[:, 1:].to(device)
    keys = torch.arange(s)
    visible = keys[None, :] <= last[:, None]
    if window is not None:
        visible &= last[:, None] - keys[None, :] < window
    bias = torch.zeros(b, 1, 1, s).masked_fill_(~visible[:, None, None], float("-inf")).to(device, dtype)
    if bool_mask:
        bias = visible[:, None, None].to(device)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kp.double(), vp.double()
    ref = qkv_attention_ref(qkv.double(), hq, hkv, d, kr, vr, write, bias if bool_mask else bias.double(), up(cos),
                            up(sin), qk_norm, up(qw), up(kw), 1e-6, clip, read_slots=read, positions=positions,
                            sinks=up(sink))
    kp0, vp0 = kp.clone(), vp.clone()
    out = qkv_attention_triton(qkv, hq, hkv, d, kp, vp, write, bias, cos, sin, qk_norm, qw, kw, 1e-6, clip,
                               splits=splits, read_slots=read, positions=positions, sinks=sink)
    return out, ref, (kp, vp, kr, vr, kp0, vp0, write)


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("hq,hkv,qk_norm,rope,clip,splits", [
    (2, 2, None, True, None, 1), (2, 2, "full", True, None, 4), (8, 2, "head", True, 1.5, 1),
    (8, 2, None, False, None, 4), (8, 1, "full", True, 1.5, 1), (8, 1, "head", True, None, 4)])
def test_qkv_attention_over_apaged_pool(device, dtype, hq, hkv, qk_norm, rope, clip, splits):
    """GQA 1, 4 and 8, each with one split and several, over a pool read in place (each q/k
    norm, clip, rotary or none): rows of different lengths (a full one, a middle one, a
    first token that sees only itself) in scattered blocks, their slots past their lengths
    at the NaN trash row; each new k, v written at its own pool row only."""
    out, ref, (kp, vp, kr, vr, kp0, vp0, write) = _paged_run(device, dtype, hq, hkv, 40, [40, 17, 1], qk_norm,
                                                             rope, clip, splits, seed=hq * 10 + hkv + splits)
    assert out.shape == (3, hq, 16) and out.dtype == dtype and not out.isnan().any()
    assert rel(out, ref) < (3 * TOL[dtype] if dtype != torch.float32 else 1e-5)
    assert rel(kp[write], kr[write]) < 3 * TOL[dtype] and rel(vp[write], vr[write]) < TOL[dtype]
    others = torch.ones(kp.shape[0], dtype=torch.bool, device=kp.device).index_fill_(0, write, False)
    assert torch.equal(kp[others].nan_to_num(), kp0[others].nan_to_num())  # the trash row still NaN: unwritten
    assert torch.equal(vp[others].nan_to_num(), vp0[others].nan_to_num()) and kp[-1].isnan().all()


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("s,lens,splits,window,bool_mask", [(300, [300, 70, 5], 2, None, False),
                                                            (64, [50, 64, 1], None, 7, True),
                                                            (96, [96, 0, 33], 8, None, False),
                                                            (300, [1, 250, 0], 2, 9, True)])
def test_qkv_attention_paged_context_lengths(device, dtype, s, lens, splits, window, bool_mask):
    """Over a paged pool: more keys than P blocks cover (each split walks its blocks after
    the wait, a row's blocks split by its own length), a sliding window, the default split
    count, padding rows (the trash row is their own key); a bool mask in place of the
    additive one (read as its bytes), before the wait and after it."""
    out, ref, _ = _paged_run(device, dtype, 8, 2, s, lens, "head", True, None, splits, seed=s + sum(lens),
                             window=window, bool_mask=bool_mask)
    assert not out.isnan().any() and rel(out, ref) < (3 * TOL[dtype] if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("b,hq,hkv,d", [(1, 4, 4, 16), (2, 6, 2, 32), (2, 8, 2, 16), (3, 4, 1, 16)])
@pytest.mark.parametrize("qk_norm,rope,clip", [(None, True, None), ("head", True, 1.5), ("full", False, None),
                                               ("full", True, None)])
@pytest.mark.parametrize("splits", [1, 4])
def test_qkv_attention_matches_reference(device, dtype, b, hq, hkv, d, qk_norm, rope, clip, splits):
    """Batch 1 to 3, GQA 1, 3 (padded to 4), 4 and MQA, head dims 16 and 32, each q/k norm
    with and without rotary, one split or several: the output and the new k, v against the
    float64 reference, no other pool row touched."""
    out, ref, (kp, vp, kr, vr, kp0, vp0, write) = _paged_run(device, dtype, hq, hkv, 40, [30, 40, 17][:b], qk_norm,
                                                             rope, clip, splits, seed=b * hq + d + splits, d=d)
    assert out.shape == (b, hq, d) and out.dtype == dtype
    # q and k round to the dtype at each step of norm and rotation, as the torch modules do.
    assert rel(out, ref) < (3 * TOL[dtype] if dtype != torch.float32 else 1e-5)
    assert rel(kp[write], kr[write]) < 3 * TOL[dtype] and rel(vp[write], vr[write]) < TOL[dtype]
    others = torch.ones(kp.shape[0], dtype=torch.bool, device=kp.device).index_fill_(0, write, False)
    assert torch.equal(kp[others].nan_to_num(), kp0[others].nan_to_num())
    assert torch.equal(vp[others].nan_to_num(), vp0[others].nan_to_num())


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("hq,hkv,rot,sinks,splits,window", [(8, 2, 8, False, 1, None), (8, 2, None, True, 1, None),
                                                            (4, 1, 16, True, 4, None), (8, 2, None, True, 2, 5)])
def test_qkv_attention_partial_rotary_and_sinks(device, dtype, hq, hkv, rot, sinks, splits, window):
    """GLM-4.5's partial rotary (the first R of D = 32 dimensions turn) and GPT-OSS's sinks
    (the softmax starts from each head's sink logit, in the first split only, and merges
    over several), with a sliding window; rows of different lengths and a first token."""
    out, ref, (kp, vp, kr, vr, _, _, write) = _paged_run(device, dtype, hq, hkv, 40, [40, 17, 1], "head", True, None,
                                                         splits, seed=hq + splits, window=window, d=32, rot=rot,
                                                         sinks=sinks)
    assert not out.isnan().any() and rel(out, ref) < (3 * TOL[dtype] if dtype != torch.float32 else 1e-5)
    assert rel(kp[write], kr[write]) < 3 * TOL[dtype] and rel(vp[write], vr[write]) < TOL[dtype]


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("qk_norm,t", [(None, 1), ("head", 3), ("full", 1)])
def test_qkv_decode_partial_rotary(device, dtype, qk_norm, t):
    """The QKV epilogue with the first R = 8 of D = 32 dimensions turning (a decode step and
    a prefill's rows): the rest of each head passes unrotated, as the reference has it."""
    b, hq, hkv, d, n = 2, 4, 2, 32, 12
    qkv, cos, sin, qw, kw = _qkv_case(device, dtype, b * t, hq, hkv, d, qk_norm, True, t + d, rot=8)
    gen = torch.Generator().manual_seed(t)
    kp, vp = _pool(device, dtype, n, hkv, d, gen)
    slot = torch.randperm(n, generator=gen)[:b * t].to(device).view(b, t)
    kr, vr = kp.double(), vp.double()
    q = qkv_decode_triton(qkv.view(b, t, -1), hq, hkv, d, kp, vp, slot, cos.view(b, t, -1), sin.view(b, t, -1),
                          qk_norm, qw, kw, 1e-6)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    qr = qkv_decode_ref(qkv.double().view(b, t, -1), hq, hkv, d, kr, vr, slot, cos.double().view(b, t, -1),
                        sin.double().view(b, t, -1), qk_norm, up(qw), up(kw), 1e-6)
    assert q.shape == (b, hq, t, d)
    assert rel(q, qr) < 3 * TOL[dtype] and rel(kp[slot.view(-1)], kr[slot.view(-1)]) < 3 * TOL[dtype]
    q_in = qkv.view(b, t, -1)[..., :hq * d].view(b, t, hq, d).transpose(1, 2)
    if qk_norm is None:  # past R the epilogue is a copy
        assert torch.equal(q[..., 8:], q_in[..., 8:])
    odd = torch.zeros(b, t, 7, dtype=dtype, device=device)  # an odd number of rotary dimensions
    with pytest.raises(ValueError, match=rf"cos / sin \[2, {t}, 7\] / \[2, {t}, 7\]: expected {b * t} rows of an even"):
        qkv_decode_triton(qkv.view(b, t, -1), hq, hkv, d, kp, vp, slot, odd, odd, qk_norm, qw, kw, 1e-6)


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("s,slot,splits,window", [(8, 0, 4, None), (96, 95, 8, None), (300, 70, 16, None),
                                                  (64, 50, 2, 7), (33, 17, None, None), (300, 250, 2, None)])
def test_qkv_attention_context_lengths(device, dtype, s, slot, splits, window):
    """A row whose new key is at index ``slot`` of S key slots, beside one half as deep: the
    first token (only its own key), a row that fills S, a short row spread over many splits
    (most see no key), a sliding window, the default split count; in all of these the P
    blocks of keys cover S, so each split loads its one block before its wait. The last case
    has more key slots than that: each split walks several blocks after its wait."""
    out, ref, _ = _paged_run(device, dtype, 8, 2, s, [slot + 1, slot // 2 + 1], "head", True, None, splits,
                             seed=s + slot, window=window)
    assert rel(out, ref) < (3 * TOL[dtype] if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("device,dtype", BACKENDS)
def test_qkv_attention_repeated_calls_and_steps(device, dtype):
    """Consecutive decode steps through the same pool (rows at positions 10 and 6, then 11
    and 7, then 12 and 8), several splits: each step's counters are left at zero for the
    next, and each step sees the keys the steps before it wrote."""
    b, hq, hkv, d, s = 2, 4, 2, 16, 24
    gen = torch.Generator().manual_seed(3)
    read, kp, vp = paged_pool(device, dtype, hkv, d, s, 8, torch.tensor([s, s]), gen)  # every key slot held
    kr, vr = kp.double(), vp.double()
    keys = torch.arange(s)
    for step in (10, 11, 12):
        pos = torch.tensor([step, step - 4])
        qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
        bias = torch.zeros(b, 1, 1, s).masked_fill_(~(keys[None, :] <= pos[:, None])[:, None, None],
                                                    float("-inf")).to(device, dtype)
        pos = pos.to(device)
        write = read.gather(1, pos[:, None])[:, 0]
        ref = qkv_attention_ref(qkv.double(), hq, hkv, d, kr, vr, write, bias.double(), read_slots=read,
                                positions=pos)
        out = qkv_attention_triton(qkv, hq, hkv, d, kp, vp, write, bias, splits=4, read_slots=read, positions=pos)
        assert rel(out, ref) < (2 * TOL[dtype] if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("hq,hkv,tp,rank,splits", [(8, 4, 2, 1, 1), (6, 2, 2, 0, 4), (8, 2, 4, 2, 2)])
def test_qkv_attention_with_other_ranks_heads(device, dtype, hq, hkv, tp, rank, splits):
    """An all-heads q / k norm over heads split across ranks (OLMoE under tensor
    parallelism): the rank's row carries the other ranks' q and k after its v, and its
    output and new k, v are the whole model's for its heads (the reference over every head,
    then this rank's). With more ranks than KV heads a KV head sits on several ranks."""
    d, lens = 16, [40, 17, 1]
    b, gen = len(lens), torch.Generator().manual_seed(hq + tp + rank)
    qkv, cos, sin, qw, kw = _qkv_case(device, dtype, b, hq, hkv, d, "full", True, hq * tp + rank)
    read, kp, vp = paged_pool(device, dtype, hkv, d, 40, 8, torch.tensor(lens), gen)
    last = torch.tensor(lens) - 1
    write = read.gather(1, last[:, None].to(device))[:, 0]
    positions = last[:, None].to(device)
    bias = torch.zeros(b, 1, 1, 40).masked_fill_(~(torch.arange(40)[None, :] <= last[:, None])[:, None, None],
                                                 float("-inf")).to(device, dtype)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    kr, vr = kp.double(), vp.double()
    whole = qkv_attention_ref(qkv.double(), hq, hkv, d, kr, vr, write, bias.double(), up(cos), up(sin), "full",
                              up(qw), up(kw), 1e-6, read_slots=read, positions=positions)
    # This rank's heads: q heads [q0, q0 + hq / tp), KV heads [k0, k0 + n_kv) (n_kv = 1, shared, past hkv ranks).
    n_q, n_kv = hq // tp, max(hkv // tp, 1)
    q0, k0 = rank * n_q, (rank * n_kv if hkv >= tp else rank // (tp // hkv))
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    mine = lambda z, lo, n: z[:, lo * d:(lo + n) * d]  # noqa: E731
    rest = lambda z, lo, n: torch.cat([z[:, :lo * d], z[:, (lo + n) * d:]], dim=-1)  # noqa: E731
    row = torch.cat([mine(q, q0, n_q), mine(k, k0, n_kv), mine(v, k0, n_kv), rest(q, q0, n_q), rest(k, k0, n_kv)], -1)
    others = (hq - n_q, hkv - n_kv)
    kl, vl = kp[:, k0:k0 + n_kv].clone(), vp[:, k0:k0 + n_kv].clone()
    out = qkv_attention_triton(row.contiguous(), n_q, n_kv, d, kl, vl, write, bias, cos, sin, "full",
                               qw[q0 * d:(q0 + n_q) * d], kw[k0 * d:(k0 + n_kv) * d], 1e-6, splits=splits,
                               read_slots=read, positions=positions, other_heads=others)
    tol = 3 * TOL[dtype] if dtype != torch.float32 else 1e-5
    assert out.shape == (b, n_q, d) and rel(out, whole[:, q0:q0 + n_q]) < tol
    assert rel(kl[write], kr[write][:, k0:k0 + n_kv]) < tol and rel(vl[write], vr[write][:, k0:k0 + n_kv]) < tol
    kd, vd = kp[:, k0:k0 + n_kv].double(), vp[:, k0:k0 + n_kv].double()  # the reference takes the same row
    ref = qkv_attention_ref(row.double(), n_q, n_kv, d, kd, vd, write, bias.double(), up(cos), up(sin), "full",
                            up(qw[q0 * d:(q0 + n_q) * d]), up(kw[k0 * d:(k0 + n_kv) * d]), 1e-6, read_slots=read,
                            positions=positions, other_heads=others)
    assert rel(ref, whole[:, q0:q0 + n_q]) < 1e-6  # (the norms' float32 sums, added in another order)


def test_qkv_attention_rejects_bad_input():
    kp = torch.zeros(9, 2, 16)
    qkv, bias, slot = torch.randn(1, 128), torch.zeros(1, 1, 1, 8), torch.tensor([3])
    pool = dict(read_slots=torch.arange(8)[None], positions=torch.tensor([3]))
    with pytest.raises(ValueError, match=r"qkv \[1, 2, 128\]: one token per row"):
        qkv_attention_triton(qkv.view(1, 2, 64).repeat(1, 1, 2), 4, 2, 16, kp, kp.clone(), torch.tensor([[3, 4]]),
                             bias, **pool)
    with pytest.raises(ValueError, match=r"bias \[1, 1, 1, 9\]"):
        qkv_attention_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, torch.zeros(1, 1, 1, 9), **pool)
    with pytest.raises(ValueError, match=r"head_dim 8: expected at least 16"):
        qkv_attention_triton(torch.randn(1, 64), 4, 2, 8, kp[..., :8], kp[..., :8].clone(), slot, bias, **pool)
    with pytest.raises(ValueError, match=r"splits=3: expected a power of two"):
        qkv_attention_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, bias, splits=3, **pool)
    with pytest.raises(ValueError, match=r"qk_norm='layer'"):
        qkv_attention_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, bias, qk_norm="layer", **pool)
    with pytest.raises(ValueError, match=r"other_heads \(2, 1\): other ranks' q and k heads are only read by an "
                                         r"all-heads norm \(qk_norm 'full'\), not qk_norm='head'"):
        qkv_attention_triton(torch.randn(1, 176), 4, 2, 16, kp, kp.clone(), slot, bias, qk_norm="head", **pool,
                             other_heads=(2, 1))
    with pytest.raises(ValueError, match=r"qkv \[1, 128\]: expected \[B, \(Hq \+ 2 Hkv \+ 3 other ranks' heads\) "
                                         r"\* D = 176\]"):
        qkv_attention_triton(qkv, 4, 2, 16, kp, kp.clone(), slot, bias, qk_norm="full", **pool, other_heads=(2, 1))


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


_COMPILE_QKV_ATTENTION = """
import sys
from kernels.attention.qkv_attention_triton import _qkv_attention_kernel as kernel

g, splits, qk_norm, pdl, pre_kv, bool_mask, sinks, others = (int(v) for v in sys.argv[1:])
hkv, d = 4, 128
const = dict(HQ=g * hkv, HKV=hkv, HQ_P=g * hkv, HKV_P=hkv, HQ_O=others * g * hkv, HKV_O=others * hkv,
             HQ_OP=g * hkv, HKV_OP=hkv, G=g, G_P=g, G_M=max(16, g), D=d, R=d // (1 + sinks),
             QK_NORM=qk_norm, CLIP=False, ROPE=True, BLOCK_S=64, P=splits, P_CHUNK=min(splits, 4), PRE_KV=bool(pre_kv),
             UPCAST=False, ADDITIVE=not bool_mask, SINKS=bool(sinks), PDL=pdl)
types = {"slot_ptr": "*i64", "read_ptr": "*i64", "pos_ptr": "*i64", "bias_ptr": "*i8" if bool_mask else "*bf16",
         "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "count_ptr": "*i32", "eps": "fp32", "clip": "fp32",
         "scale": "fp32"}
"""


@pytest.mark.parametrize("g,splits,qk_norm,pdl,pre_kv,bool_mask,sinks,others", [
    (1, 16, 2, 2, 1, 0, 0, 0), (1, 8, 2, 2, 1, 0, 0, 1), (8, 1, 1, 2, 0, 0, 1, 0), (4, 4, 0, 0, 1, 0, 0, 0),
    (8, 4, 1, 2, 0, 1, 1, 0)])
def test_qkv_attention_compiles_for_hopper(g, splits, qk_norm, pdl, pre_kv, bool_mask, sinks, others):
    """The whole Triton compile for sm_90 (tests.hopper), over a paged pool, with an
    additive mask or a bool one (read as bytes), with sinks and half-head rotary or not,
    with the other ranks' heads in an all-heads norm."""
    assert compile_kernel(_COMPILE_QKV_ATTENTION, g, splits, qk_norm, pdl, pre_kv, bool_mask, sinks, others,
                          warps=8) > 0
