"""The norm + router + top-k cluster kernel (``kernels.router_cuda``): it compiles for Hopper
with no GPU (CI) and names what it cannot take; on a GPU, against the float64 reference and
the gating kernel, and through ``kernels.rms_norm_router``."""
import pytest
import torch

import kernels
from kernels import router_cuda

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_source_compiles_for_hopper():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the test extras install cupy and NVRTC")
    assert router_cuda.compile_all("sm_90") == 4


def test_check_names_what_the_kernel_cannot_take():
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    g, w = torch.ones(64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    assert "Hopper" in router_cuda.check(x, x, g, w, 2, "softmax")
    assert "1 to 4 rows" in router_cuda.check(torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64,
                                              dtype=torch.bfloat16), g, w, 2, "softmax")
    assert "k <= 16" in router_cuda.check(x, x, g, w, 9, "softmax")
    assert "bf16 or fp16" in router_cuda.check(x.float(), x.float(), g.float(), w.float(), 2, "softmax")
    assert "[E, H]" in router_cuda.check(x, x, g, w[:, :32], 2, "softmax")
    wide = torch.randn(256, 4096, dtype=torch.bfloat16)  # 32 experts a block, two vectors of each
    assert "64 router vectors, at most 16" in router_cuda.check(torch.randn(1, 4096, dtype=torch.bfloat16),
                                                                 torch.randn(1, 4096, dtype=torch.bfloat16),
                                                                 torch.ones(4096, dtype=torch.bfloat16), wide, 8,
                                                                 "softmax")
    with pytest.raises(ValueError, match=r"norm_router_topk_cuda: .*Hopper"):
        router_cuda.norm_router_topk_cuda(x, x, g, 1e-6, w, 2)


def _operands(t, h, e, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=gen) * 2).to("cuda", dtype)
    r = torch.randn(t, h, generator=gen).to("cuda", dtype)
    nw = (torch.rand(h, generator=gen) + 0.5).to("cuda", dtype)
    rw = (torch.randn(e, h, generator=gen) / h ** 0.5).to("cuda", dtype)
    return x, r, nw, rw


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,h,e,k,score,renorm", [
    (1, 2048, 64, 8, "softmax", False),  # OLMoE
    (1, 2048, 128, 8, "softmax", True),  # Qwen3-30B-A3B
    (1, 4096, 8, 2, "softmax", True),  # Mixtral: one expert a block
    (3, 1000, 60, 4, "sigmoid", False),  # H not a multiple of a block's 2048, E not of 8
    (4, 4104, 40, 16, "softmax", True),  # three vectors a thread, five experts a block
    (2, 64, 5, 5, "softmax", False)])  # fewer experts than blocks, k = E
def test_matches_reference_and_gating(dtype, t, h, e, k, score, renorm):
    # The sum comes back bit for bit; h and the logits match the float64 reference; the
    # table equals the gating kernel's on the logits the launch wrote (bf16 logits tie
    # often, and both break ties to the lower index). Twice, with fresh inputs.
    for seed in (t * h + e, t + h + e):
        x, r, nw, rw = _operands(t, h, e, dtype, seed)
        out_h, summed, logits, ids, w = router_cuda.norm_router_topk_cuda(x, r, nw, 1e-5, rw, k, score, renorm)
        ref_h, ref_sum, ref_logits = kernels.norm.rms_norm_router_ref(x.double(), r.double(), nw.double(), 1e-5,
                                                                      rw.double())
        torch.testing.assert_close(summed, x + r, rtol=0, atol=0)
        assert out_h.dtype == logits.dtype == dtype and logits.shape == (t, e)
        assert rel(out_h, ref_h) < TOL[dtype] and rel(logits, ref_logits) < 2 * TOL[dtype]
        triton_h = kernels.norm.rms_norm_router_triton(x, r, nw, 1e-5, rw)[0]
        assert (out_h.float() - triton_h.float()).abs().max() <= 2 * (triton_h.float().abs().max() * 2 ** -7)
        ref_ids, ref_w = kernels.topk_gating_triton(logits, k, score, renorm)
        assert ids.shape == (t, k) and ids.dtype == torch.int32 and w.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_rms_norm_router_takes_the_cluster_kernel_with_gating():
    # With a top-k table asked for, up to MAX_T rows: the cluster kernel's outputs; past
    # them, or with the kernel switched off, the Triton launch's.
    x, r, nw, rw = _operands(router_cuda.MAX_T + 1, 2048, 64, torch.bfloat16, 3)
    for rows in (1, router_cuda.MAX_T, router_cuda.MAX_T + 1):
        got = kernels.rms_norm_router(x[:rows], r[:rows], nw, 1e-6, rw, (8, "softmax", False))
        if rows <= router_cuda.MAX_T:
            want = router_cuda.norm_router_topk_cuda(x[:rows], r[:rows], nw, 1e-6, rw, 8, "softmax", False)
        else:
            want = kernels.norm.rms_norm_router_triton(x[:rows], r[:rows], nw, 1e-6, rw, (8, "softmax", False))
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    router_cuda.ENABLED = False
    try:
        got = kernels.rms_norm_router(x[:1], r[:1], nw, 1e-6, rw, (8, "softmax", False))
    finally:
        router_cuda.ENABLED = True
    want = kernels.norm.rms_norm_router_triton(x[:1], r[:1], nw, 1e-6, rw, (8, "softmax", False))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_graph_replay_gives_eager_results():
    x, r, nw, rw = _operands(1, 2048, 128, torch.bfloat16, 5)
    eager = router_cuda.norm_router_topk_cuda(x, r, nw, 1e-6, rw, 8, "softmax", True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_cuda.norm_router_topk_cuda(x, r, nw, 1e-6, rw, 8, "softmax", True)
    x.copy_(torch.randn(1, 2048).to("cuda", torch.bfloat16))
    graph.replay()
    fresh = router_cuda.norm_router_topk_cuda(x, r, nw, 1e-6, rw, 8, "softmax", True)
    for a, b in zip(out, fresh):
        assert torch.equal(a, b)
    assert not torch.equal(out[0], eager[0])
