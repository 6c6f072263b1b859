"""RMSNorm (``kernels.norm``) against its torch reference: alone, with the residual add in
front, and as the MoE layer's entry (the add, the norm and the router GEMM, with or without
the top-k table from the same launch); on CPU under the interpreter and on a GPU; and the
norm + router kernel's Triton compile for sm_90 (tests.hopper); ``dense.norm``'s modules
return one type per method."""
import pytest
import torch

from kernels.norm.reference import qk_norm_apply_ref, qk_sum_squares_ref, rms_norm_ref, rms_norm_router_ref
from kernels.norm.triton import qk_norm_apply_triton, qk_sum_squares_triton, rms_norm_router_triton, rms_norm_triton
from kernels.routing.gating import topk_gating_triton
from tests.kernels.common import BACKENDS, rel

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 64), (3, 1, 200), (5, 4096), (2, 3, 33)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, shape, with_residual):
    gen = torch.Generator().manual_seed(sum(shape) + with_residual)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(device, dtype)
    r = torch.randn(shape, generator=gen).to(device, dtype) if with_residual else None
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(device, dtype)
    out = rms_norm_triton(x, w, 1e-5, r)
    ref = rms_norm_ref(x.double(), w.double(), 1e-5, None if r is None else r.double())
    if with_residual:
        (out, summed), (ref, ref_sum) = out, ref
        assert summed.dtype == dtype and rel(summed, ref_sum) < TOL[dtype]
    assert out.shape == x.shape and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("lead,widths", [((1, 1), (1024, 1024, 1024)), ((3,), (64, 32, 32)), ((2, 5), (2048, 128, 128)),
                                         ((4,), (1100, 300, 300))])
def test_sharded_qk_norm_matches_reference_and_a_whole_norm(device, dtype, lead, widths):
    """The q / k norm over heads split across ranks: the sums of squares of q and k, then
    both scaled in place, match the references; with two halves' sums added (what the
    all-reduce does) each half equals its slice of one RMSNorm over the whole width."""
    qw, kw, vw = widths
    gen = torch.Generator().manual_seed(qw + kw + len(lead))
    qkv = (torch.randn(*lead, qw + kw + vw, generator=gen) * 2).to(device, dtype)
    wq, wk = ((torch.rand(n, generator=gen) + 0.5).to(device, dtype) for n in (qw, kw))
    sq = qk_sum_squares_triton(qkv, qw, kw)
    ref_sq = qk_sum_squares_ref(qkv.double(), qw, kw)
    assert sq.shape == (*lead, 2) and sq.dtype == torch.float32 and rel(sq, ref_sq) < 1e-5
    out = qk_norm_apply_triton(qkv.clone(), sq, wq, wk, qw, kw, 1e-6)
    ref = qk_norm_apply_ref(qkv.double(), ref_sq, wq.double(), wk.double(), qw, kw, 1e-6)
    assert out.dtype == dtype and rel(out, ref) < TOL[dtype]
    torch.testing.assert_close(out[..., qw + kw:], qkv[..., qw + kw:], rtol=0, atol=0)  # v untouched
    # Two ranks, each with half of q's and k's columns: their summed squares give each half
    # the whole norm's values.
    hq, hk = qw // 2, kw // 2
    halves = [torch.cat((qkv[..., a:a + hq], qkv[..., qw + b:qw + b + hk]), -1).contiguous()
              for a, b in ((0, 0), (hq, hk))]
    total = sum(qk_sum_squares_triton(h, hq, hk) for h in halves)
    whole_q = rms_norm_ref(qkv[..., :qw].double(), wq.double(), 1e-6)
    normed = qk_norm_apply_triton(halves[1], total, wq[hq:2 * hq], wk[hk:2 * hk], qw, kw, 1e-6)
    assert rel(normed[..., :hq], whole_q[..., hq:2 * hq]) < TOL[dtype]


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_norm_modules_return_one_type_per_method(kind):
    # dense.norm: norm(x) is a tensor, norm.add_and_norm(x, r) the pair (norm(x + r), x + r);
    # no flag changes what one method returns.
    from dense.norm import make_norm

    gen = torch.Generator().manual_seed(5)
    x, r = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    norm = make_norm(kind, 40, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
        y = norm(x)
        pair = norm.add_and_norm(x, r)
    assert isinstance(y, torch.Tensor) and isinstance(pair, tuple) and len(pair) == 2
    torch.testing.assert_close(pair[1], x + r, rtol=0, atol=0)
    torch.testing.assert_close(pair[0], norm(x + r), rtol=0, atol=0)
    if kind == "rmsnorm":
        torch.testing.assert_close(y, rms_norm_ref(x, norm.weight, 1e-6))
    with pytest.raises(TypeError):
        norm(x, residual=r)


def test_rms_norm_rejects_mismatched_shapes():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight \[7\]: expected \[8\]"):
        rms_norm_triton(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match=r"residual \[2, 4\]: expected x's shape \[2, 8\]"):
        rms_norm_triton(x, torch.ones(8), 1e-6, torch.randn(2, 4))


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("t,h,e", [(1, 64, 8), (3, 200, 20), (16, 256, 64), (5, 2000, 40)])
def test_rms_norm_router_matches_reference(device, dtype, t, h, e):
    gen = torch.Generator().manual_seed(t + h + e)
    x = (torch.randn(t, h, generator=gen) * 2).to(device, dtype)
    r = torch.randn(t, h, generator=gen).to(device, dtype)
    nw = (torch.rand(h, generator=gen) + 0.5).to(device, dtype)
    rw = (torch.randn(e, h, generator=gen) / h ** 0.5).to(device, dtype)
    out_h, summed, logits, ids, weights = rms_norm_router_triton(x, r, nw, 1e-5, rw)
    ref_h, ref_sum, ref_logits, *no_table = rms_norm_router_ref(x.double(), r.double(), nw.double(), 1e-5,
                                                                rw.double())
    assert ids is None and weights is None and no_table == [None, None]  # one return type, with or without gating
    assert out_h.dtype == summed.dtype == logits.dtype == dtype and logits.shape == (t, e)
    assert rel(summed, ref_sum) < TOL[dtype] and rel(out_h, ref_h) < TOL[dtype]
    assert rel(logits, ref_logits) < 2 * TOL[dtype]


@pytest.mark.parametrize("device,dtype", BACKENDS)
@pytest.mark.parametrize("t,h,e,k,score,renorm", [(1, 64, 8, 2, "softmax", True), (3, 200, 20, 4, "sigmoid", False),
                                                 (16, 256, 64, 8, "softmax", False), (2, 128, 128, 8, "softmax", True),
                                                 (7, 1024, 40, 6, "softmax", True)])
def test_rms_norm_router_with_gating(device, dtype, t, h, e, k, score, renorm):
    """The top-k table from the norm + router launch (its last program, by ticket) equals
    the gating kernel run on the logits the same launch wrote; twice in a row, so the
    ticket counter is seen to reset. A k over E is refused like the gating refuses it."""
    gen = torch.Generator().manual_seed(t * h + e)
    for _ in range(2):
        x = (torch.randn(t, h, generator=gen) * 2).to(device, dtype)
        r = torch.randn(t, h, generator=gen).to(device, dtype)
        nw = (torch.rand(h, generator=gen) + 0.5).to(device, dtype)
        rw = (torch.randn(e, h, generator=gen) / h ** 0.5).to(device, dtype)
        out_h, summed, logits, ids, w = rms_norm_router_triton(x, r, nw, 1e-5, rw, (k, score, renorm))
        plain = rms_norm_router_triton(x, r, nw, 1e-5, rw)
        for a, b in zip((out_h, summed, logits), plain):
            assert torch.equal(a, b)
        # The gating kernel on the same logits: the same table, ties included (bf16 logits
        # tie often; torch.topk on CPU need not break ties by index).
        ref_ids, ref_w = topk_gating_triton(logits, k, score, renorm)
        assert ids.shape == (t, k) and ids.dtype == torch.int32 and w.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w)
    with pytest.raises(ValueError, match="expected an int with 1 <= k"):
        rms_norm_router_triton(x, r, nw, 1e-5, rw, (e + 1, score, renorm))


def test_rms_norm_router_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"router weight \[4, 7\]: expected \[T, H\], \[T, H\], \[H\], \[E, H\]"):
        rms_norm_router_triton(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(4, 7))


_COMPILE_ROUTER = """
import sys
from kernels.norm.triton import _rms_norm_router_kernel as kernel

bk, k, one, pdl = (int(v) for v in sys.argv[1:])
const = dict(BT=1, BE=4, BK=bk, K=k, SOFTMAX=True, RENORMALIZE=False, E_ALL=64, BLOCK_K=max(k, 1), ONE=bool(one),
             BT_ALL=8, PDL=pdl)
types = {"ids_ptr": "*i32", "weights_ptr": "*fp32", "count_ptr": "*i32", "T": "i32", "H": "i32", "E": "i32",
         "eps": "fp32"}
"""


@pytest.mark.parametrize("bk,k,one,pdl", [(2048, 8, 1, 2), (512, 0, 0, 2)])
def test_rms_norm_router_compiles_for_hopper(bk, k, one, pdl):
    """The norm + router kernel's whole Triton compile for sm_90 (tests.hopper): one step
    over H with the weights loaded before the wait (ONE), and the loop over H in steps."""
    from tests.hopper import compile_kernel

    assert compile_kernel(_COMPILE_ROUTER, bk, k, one, pdl) > 0
