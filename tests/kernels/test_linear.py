"""The dense linear layers (``kernels.linear``). SBI-GeMM in Triton against the torch
reference: RMSNorm and LayerNorm prologues, bias and residual epilogues, int8 weights, one
split or several; on CPU under the interpreter and on a GPU. SBI-GeMM in CUDA C++ (CuPy /
NVRTC): the source compiles for Hopper with no GPU (CI); unsupported operands are named; on
a GPU, every prologue / epilogue / split against the torch reference, and the same numbers
replayed from a CUDA graph. ``dense_linear`` and ``norm_linear`` follow the linear tables."""
import re

import pytest
import torch

import kernels
from kernels.linear import sbi_cuda
from kernels.linear.reference import sbi_linear_ref
from kernels.linear.sbi_triton import sbi_config, sbi_linear_triton
from tests.kernels.common import rel

TRITON_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # the CUDA kernels (GPU only)


def maybe_int8(w, int8):
    """(w, None), or w [N, K] quantized: (int8 weight, per-row scale [N])."""
    if not int8:
        return w, None
    q, s = kernels.quantize_int8(w[None])
    return q[0], s[0]


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
    assert rel(out, ref) < TRITON_TOL[dtype]


def test_sbi_linear_defaults_and_limits():
    x, w = torch.randn(2, 40), torch.randn(30, 40)
    torch.testing.assert_close(sbi_linear_triton(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"at most 64 rows"):
        sbi_linear_triton(torch.randn(65, 40), w)
    cfg = sbi_config(1, 4096, 14336, 132)  # a narrow output and a long K: split until SMs are busy
    assert cfg["split_k"] > 1 and cfg["bt"] == 16


def test_source_compiles_for_hopper():
    # NVRTC runs ptxas too, so inline PTX and register allocation are checked here.
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the test extras install cupy and NVRTC")
    assert sbi_cuda.compile_all("sm_90") == 24


def test_sources_reach_nvrtc_as_one_text():
    # kernels/moe/moe.cu and kernels/linear/sbi.cu include kernels/cuda/common.cuh; cuda_source pastes it in, so the text handed to
    # NVRTC (and hashed by CuPy's compile cache) holds every helper and no #include.
    from kernels import cuda_common
    from kernels.moe import cuda as moe_cuda

    common = (cuda_common.CUDA_DIR / "common.cuh").read_text()
    for name, source in (("linear/sbi.cu", sbi_cuda.SOURCE), ("moe/moe.cu", moe_cuda.SOURCE)):
        assert source == cuda_common.cuda_source(name)
        assert common in source and "splitk_reduce" in source
        assert not re.search(r"^\s*#\s*include", source, re.M), name


def test_check_names_what_the_kernel_cannot_take():
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(30, 64, dtype=torch.bfloat16)
    assert "CUDA device" in sbi_cuda.check(x, w)
    assert "[T, K] and [N, K]" in sbi_cuda.check(x, w[:, :32])
    assert "bf16 or fp16" in sbi_cuda.check(x.float(), w.float())
    assert "1 to 16 rows" in sbi_cuda.check(torch.randn(17, 64, dtype=torch.bfloat16), w)
    assert "multiple of 8" in sbi_cuda.check(x[:, :60], w[:, :60])
    q = torch.zeros(30, 64, dtype=torch.int8)
    assert "int8 with its per-row scale" in sbi_cuda.check(x, q)
    assert "multiple of 16" in sbi_cuda.check(x[:, :56], q[:, :56], torch.ones(30))
    # Addresses and strides are ``layout``'s (``check`` runs ``supports`` first, whose last
    # test is the device: on the CPU that is the reason it gives).
    assert "16-byte boundaries" in sbi_cuda.layout(torch.randn(2, 72, dtype=torch.bfloat16)[:, 1:65], w)
    assert "residual [2, 31]" in sbi_cuda.check(x, w, residual=torch.randn(2, 31, dtype=torch.bfloat16))
    assert "scale [29]" in sbi_cuda.check(x, q, torch.ones(29))
    with pytest.raises(ValueError, match=r"sbi_linear_cuda: .*CUDA device"):
        sbi_cuda.sbi_linear_cuda(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,n", [(1, 200, 24), (3, 4104, 70), (8, 64, 130), (16, 1040, 33)])
@pytest.mark.parametrize("norm", [None, "rmsnorm", "layernorm"])
@pytest.mark.parametrize("int8,cfg", [(False, None), (True, None), (False, dict(bn=1, warps=8, unroll=1, split_k=3)),
                                      (True, dict(bn=8, warps=4, unroll=2, split_k=2)),
                                      (True, dict(bn=4, warps=4, unroll=2, split_k=1, unit=True)),
                                      (False, dict(bn=2, warps=4, unroll=1, split_k=1, pipe=True)),
                                      (True, dict(bn=4, warps=4, unroll=1, split_k=2, unit=True, pipe=True))])
def test_matches_reference(dtype, t, k, n, norm, int8, cfg):
    if int8 and k % 16:
        k += 8
    gen = torch.Generator().manual_seed(t * 31 + k + n)
    x = (torch.randn(t, k, generator=gen) * 2 + 0.5).to("cuda", dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to("cuda", dtype)
    w, scale = maybe_int8(w, int8)
    bias = torch.randn(n, generator=gen).to("cuda", dtype)
    residual = torch.randn(t, n, generator=gen).to("cuda", dtype)
    nrm, g, gb = None, None, None
    if norm:
        g = (torch.rand(k, generator=gen) + 0.5).to("cuda", dtype)
        gb = torch.randn(k, generator=gen).to("cuda", dtype) if norm == "layernorm" else None
        nrm = (norm, g, gb, 1e-5)
    d = lambda z: None if z is None else z.double()  # noqa: E731
    for b, r in ((bias, residual), (None, None)):
        out = sbi_cuda.sbi_linear_cuda(x, w, scale, b, r, nrm, config=cfg)
        ref = sbi_linear_ref(x.double(), w if int8 else w.double(), d(scale), d(b), d(r),
                             None if nrm is None else (norm, g.double(), d(gb), 1e-5))
        assert out.shape == (t, n) and out.dtype == dtype
        assert rel(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_graph_replay_and_dense_linear(int8, monkeypatch, tmp_path):
    # Captured in a CUDA graph (the decode step is) the launches replay to the eager result;
    # a table entry naming the CUDA kernel routes dense_linear there.
    from kernels.linear import select as dl
    from kernels import tuning

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2048, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(3000, 2048, generator=gen) / 45).to("cuda", torch.bfloat16)
    w, scale = maybe_int8(w, int8)
    cfg = dict(bn=4, warps=4, unroll=2, split_k=2)
    eager = sbi_cuda.sbi_linear_cuda(x, w, scale, config=cfg)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sbi_cuda.sbi_linear_cuda(x, w, scale, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sbi_cuda.sbi_linear_cuda(x, w, scale, config=cfg)
    x.copy_(torch.randn(4, 2048, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, sbi_cuda.sbi_linear_cuda(x, w, scale, config=cfg), rtol=0, atol=0)
    assert not torch.equal(out, eager)
    tuning.write_table(tmp_path, tuning.Table("linear", tuning.device_name(x.device), tuning.dtype_name(w.dtype),
                                              {tuning.linear_shape(3000, 2048): {4: tuning.LinearCuda(**cfg)}}))
    monkeypatch.setattr(tuning, "TABLES", tuning.Tables(tmp_path))
    dl.choice.cache_clear()
    try:
        routed = kernels.dense_linear(x, w, scale=scale)
    finally:
        dl.choice.cache_clear()
    torch.testing.assert_close(routed, sbi_cuda.sbi_linear_cuda(x, w, scale, config=cfg), rtol=0, atol=0)


def test_norm_linear_on_cpu_is_the_norm_then_the_layer():
    gen = torch.Generator().manual_seed(4)
    x, r = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    g, w, b = torch.rand(64, generator=gen) + 0.5, torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    y, s = kernels.norm_linear(x, r, g, 1e-6, w, b)
    h, s_ref = kernels.rms_norm(x, g, 1e-6, r)
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(y, kernels.dense_linear(h, w, b))


def test_resident_where_one_step_covers_k():
    # The normed activations stay in registers only for one K split covered by one step of
    # the main loop (warps x 32 x 8 bf16 / 16 int8 values a load slot) and few rows.
    assert sbi_cuda.resident(True, 1, 2048, 8, 1, False, 1)
    assert sbi_cuda.resident(True, 2, 2048, 4, 2, False, 1)
    assert sbi_cuda.resident(True, 1, 4096, 8, 1, True, 1)
    assert not sbi_cuda.resident(False, 1, 2048, 8, 1, False, 1)  # no norm: nothing to keep
    assert not sbi_cuda.resident(True, 1, 2048, 8, 1, False, 2)  # split-K
    assert not sbi_cuda.resident(True, 1, 4096, 8, 1, False, 1)  # two steps of K
    assert not sbi_cuda.resident(True, 8, 2048, 8, 1, False, 1)  # 64 values a thread


def test_norm_linear_cuda_names_what_it_cannot_take():
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(30, 64, dtype=torch.bfloat16)
    g = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA device"):
        sbi_cuda.sbi_norm_linear_cuda(x, x, ("rmsnorm", g, None, 1e-6), w)


def test_supports_and_layout_name_the_reason():
    # What shapes, dtypes and devices decide (``supports``, kept per key by the selection)
    # and what addresses and strides decide (``layout``, every call), each with its reason.
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(30, 64, dtype=torch.bfloat16)
    g = torch.ones(64, dtype=torch.bfloat16)
    assert sbi_cuda.supports(x[:, :60], w[:, :60]) == "K = 60: expected a multiple of 8"
    assert "CUDA device" in sbi_cuda.supports(x, w)
    assert "RMSNorm only" in sbi_cuda.supports(x, w, norm=("layernorm", g, g, 1e-6), x_residual=x)
    assert "x_residual [1, 64]" in sbi_cuda.supports(x, w, norm=("rmsnorm", g, None, 1e-6), x_residual=x[:1])
    assert sbi_cuda.layout(x, w) is None
    assert "unit stride along K" in sbi_cuda.layout(torch.randn(64, 2, dtype=torch.bfloat16).t(), w)
    assert "w: rows must start on 16-byte boundaries" in sbi_cuda.layout(x[:, :56], w[:, 4:60])
    every_other_row = torch.randn(4, 64, dtype=torch.bfloat16)[::2]
    assert "x_residual: expected contiguous" in sbi_cuda.layout(x, w, norm=("rmsnorm", g, None, 1e-6),
                                                                x_residual=every_other_row)


def _cuda_table(monkeypatch, tmp_path, n, k, entry):
    """A linear table for the CPU whose (n, k) entry at T <= 16 is ``entry``; the choice and
    support caches emptied."""
    from kernels import tuning
    from kernels.linear import select

    tuning.write_table(tmp_path, tuning.Table("linear", "cpu", "bfloat16", {tuning.linear_shape(n, k): {16: entry}}))
    monkeypatch.setattr(tuning, "TABLES", tuning.Tables(tmp_path))
    monkeypatch.setattr(select, "_CUDA_SUPPORT", {})
    select.choice.cache_clear()


def test_selection_takes_the_next_backend_where_cuda_says_no(monkeypatch, tmp_path):
    # A CUDA table entry whose kernel cannot take the operands gives way to SBI-GeMM in
    # Triton, asked up front (no exception); where it can, the entry itself runs.
    from kernels.linear import select
    from kernels.tuning import LinearCuda, LinearSbi

    entry = LinearCuda(bn=4, warps=4, unroll=2, split_k=1)
    try:
        _cuda_table(monkeypatch, tmp_path, 30, 60, entry)
        x, w = torch.randn(2, 60, dtype=torch.bfloat16), torch.randn(30, 60, dtype=torch.bfloat16)
        assert select.cuda_reason(x, w, None, None) == "K = 60: expected a multiple of 8"
        assert select.backend(x, w) == LinearSbi()
        _cuda_table(monkeypatch, tmp_path, 30, 64, entry)
        x, w = torch.randn(2, 72, dtype=torch.bfloat16), torch.randn(30, 64, dtype=torch.bfloat16)
        monkeypatch.setattr(sbi_cuda, "supports", lambda *args: None)  # as on a GPU: the shapes fit
        assert select.backend(x[:, :64], w) == entry
        assert select.backend(x[:, 1:65], w) == LinearSbi()  # misaligned rows: layout says no
    finally:
        select.choice.cache_clear()


def test_support_is_decided_once_per_key(monkeypatch):
    # sbi_cuda.supports runs once per (device, dtypes, shapes); layout every call.
    from kernels.linear import select

    calls = []
    real = sbi_cuda.supports
    monkeypatch.setattr(sbi_cuda, "supports", lambda *args: calls.append(args[0].shape) or real(*args))
    monkeypatch.setattr(select, "_CUDA_SUPPORT", {})
    x, w = torch.randn(3, 72, dtype=torch.bfloat16), torch.randn(30, 64, dtype=torch.bfloat16)
    g = torch.ones(64, dtype=torch.bfloat16)
    for _ in range(3):
        assert "CUDA device" in select.cuda_reason(x[:2, :64], w, None, None)
    assert len(calls) == 1
    select.cuda_reason(x[:, :64], w, None, None)  # another T: another key
    select.cuda_reason(x[:2, :64], w, None, None, ("rmsnorm", g, None, 1e-6), x[:2, 8:])  # the fused norm's
    select.cuda_reason(x[:2, :64], w, None, None, ("rmsnorm", g, None, 1e-6), x[:2, 8:])
    assert len(calls) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,n", [(1, 2048, 6144), (3, 1040, 70), (16, 4096, 33)])
@pytest.mark.parametrize("int8", [False, True])
def test_norm_linear_cuda_matches_add_norm_gemm(dtype, t, k, n, int8):
    # The add is rounded as the unfused add stores it, and comes back bit for bit; the
    # GEMM on its RMSNorm matches the float64 reference. Every block reads the sum, block
    # (0, 0) writes it: split-K and several column tiles included.
    gen = torch.Generator().manual_seed(t + k + n)
    x = torch.randn(t, k, generator=gen).to("cuda", dtype)
    r = (torch.randn(t, k, generator=gen) * 3).to("cuda", dtype)
    g = (torch.rand(k, generator=gen) + 0.5).to("cuda", dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to("cuda", dtype)
    w, scale = maybe_int8(w, int8)
    bias = torch.randn(n, generator=gen).to("cuda", dtype)
    # The last three keep the normed activations in registers (RESIDENT) where T and K allow
    # (the last: Qwen3's int8 QKV entry, int8 widened by one byte permute).
    kept = dict(bn=4, warps=8, unroll=1, split_k=1)
    for cfg in (None, dict(bn=2, warps=4, unroll=2, split_k=3), kept, dict(kept, persist=2),
                dict(bn=8, warps=4, unroll=1, split_k=1, unit=int8)):
        y, s = sbi_cuda.sbi_norm_linear_cuda(x, r, ("rmsnorm", g, None, 1e-6), w, scale, bias, cfg)
        torch.testing.assert_close(s, x + r, rtol=0, atol=0)
        ref = sbi_linear_ref(s.double(), w if int8 else w.double(), None if scale is None else scale.double(),
                             bias.double(), None, ("rmsnorm", g.double(), None, 1e-6))
        assert y.shape == (t, n) and rel(y, ref) < TOL[dtype]


@pytest.mark.gpu
def test_norm_linear_follows_the_table(monkeypatch, tmp_path):
    # A CUDA entry with norm set: one launch, equal to the direct call; a CUDA entry without
    # it, or none, the norm launch and dense_linear, equal to the fused result within bf16
    # rounding of the normed input.
    from kernels.linear import select as dl
    from kernels import tuning

    gen = torch.Generator().manual_seed(6)
    x, r = (torch.randn(1, 1, 2048, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    g = (torch.rand(2048, generator=gen) + 0.5).to("cuda", torch.bfloat16)
    w = (torch.randn(3072, 2048, generator=gen) / 45).to("cuda", torch.bfloat16)
    cfg = dict(bn=4, warps=4, unroll=2, split_k=1)
    unfused, s_unfused = kernels.norm_linear(x, r, g, 1e-6, w)
    direct, _ = sbi_cuda.sbi_norm_linear_cuda(x[0], r[0], ("rmsnorm", g, None, 1e-6), w, config=cfg)
    for fuse in (True, False):
        entry = tuning.LinearCuda(**cfg, norm=fuse)
        root = tmp_path / str(fuse)
        tuning.write_table(root, tuning.Table("linear", tuning.device_name(x.device), tuning.dtype_name(w.dtype),
                                              {tuning.linear_shape(3072, 2048): {1: entry}}))
        monkeypatch.setattr(tuning, "TABLES", tuning.Tables(root))
        dl.choice.cache_clear()
        try:
            fused, s = kernels.norm_linear(x, r, g, 1e-6, w)
            two = kernels.dense_linear(kernels.rms_norm(x, g, 1e-6, r)[0], w)
        finally:
            dl.choice.cache_clear()
        torch.testing.assert_close(fused[0] if fuse else fused, direct if fuse else two, rtol=0, atol=0)
        torch.testing.assert_close(s, s_unfused, rtol=0, atol=0)
        assert rel(fused, unfused) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,n", [(1, 4096, 4096 + 6), (3, 1040, 1000), (16, 2048, 1536)])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("norm,split", [(None, 1), ("rmsnorm", 1), (None, 2)])
def test_persistent_grid_gives_the_one_tile_a_block_result(t, k, n, int8, norm, split):
    """Fewer blocks than column tiles (``persist`` blocks per SM, each walking tiles with
    the next one's weights loaded during this one's reduction), and two weight buffers
    (``pipe``): the same outputs, bit for bit, as one tile a block (each tile's sums are
    formed in the same order), with the norm, split-K, int8, a bias and a residual; and
    close to the float64 reference."""
    gen = torch.Generator().manual_seed(t + k + n)
    x = (torch.randn(t, k, generator=gen) * 2).to("cuda", torch.bfloat16)
    w, scale = maybe_int8((torch.randn(n, k, generator=gen) / k ** 0.5).to("cuda", torch.bfloat16), int8)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    residual = torch.randn(t, n, generator=gen).to("cuda", torch.bfloat16)
    g = (torch.rand(k, generator=gen) + 0.5).to("cuda", torch.bfloat16)
    nrm = ("rmsnorm", g, None, 1e-5) if norm else None
    cfg = dict(bn=2, warps=4, unroll=2, split_k=split)
    plain = sbi_cuda.sbi_linear_cuda(x, w, scale, bias, residual, nrm, config=cfg)
    for more in (dict(persist=1), dict(persist=2), dict(pipe=True), dict(persist=2, pipe=True)):
        out = sbi_cuda.sbi_linear_cuda(x, w, scale, bias, residual, nrm, config=dict(cfg, **more))
        assert torch.equal(out, plain), more
    ref = sbi_linear_ref(x.double(), w if int8 else w.double(), None if scale is None else scale.double(),
                         bias.double(), residual.double(), None if nrm is None else ("rmsnorm", g.double(), None, 1e-5))
    assert rel(plain, ref) < TOL[torch.bfloat16]
