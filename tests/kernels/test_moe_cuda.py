"""The MoE decode kernels in CUDA C++ (``kernels.moe.cuda``): the source compiles for
Hopper with no GPU (CI); unsupported operands are named, and a table entry naming them
falls back to Triton there; on a GPU, every configuration, dtype and activation against
the float64 reference, and the same numbers replayed from a CUDA graph."""
import itertools
from dataclasses import replace

import pytest
import torch

from kernels import tuning
from kernels.moe import cuda as moe_cuda
from kernels.moe import triton as moe_triton
from kernels.moe.reference import fused_moe_ref, quantize_int8
from kernels.moe.triton import fused_moe_triton
from kernels.tuning import MoeCuda
from tests.kernels.common import rel

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def problem(device, dtype, t, h, f, e, k, activation, seed, ids_dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=gen) + 0.3).to(device, dtype)
    rows = f if activation == "gelu" else 2 * f
    w13 = (torch.randn(e, rows, h, generator=gen) / h ** 0.5).to(device, dtype)
    w2 = (torch.randn(e, h, f, generator=gen) / f ** 0.5).to(device, dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device, ids_dtype)
    weights = torch.rand(t, k, generator=gen).to(device)
    return x, w13, w2, ids, weights


def checked_problem(dtype, t, h, f, e, k, activation, seed, int8, ids_dtype=torch.int32):
    """``problem`` on the GPU, its weights int8 with their scales where ``int8`` says so, and
    the float64 reference: (x, w13, w2, ids, weights, w13 scale, w2 scale, reference)."""
    x, w13, w2, ids, w = problem("cuda", dtype, t, h, f, e, k, activation, seed, ids_dtype)
    s13 = s2 = None
    if int8:
        w13, s13 = quantize_int8(w13)
        w2, s2 = quantize_int8(w2)
    ref = fused_moe_ref(x.double(), w13 if int8 else w13.double(), w2 if int8 else w2.double(), w.double(), ids,
                        activation, s13, s2)
    return x, w13, w2, ids, w, s13, s2, ref


def test_source_compiles_for_hopper():
    # NVRTC runs ptxas too, so inline PTX, the lambdas and register allocation are checked.
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the test extras install cupy and NVRTC")
    assert moe_cuda.compile_all("sm_90") == 16


def test_check_names_what_the_kernels_cannot_take():
    x, w13, w2, ids, w = problem("cpu", torch.bfloat16, 1, 64, 32, 4, 2, "silu", 0)
    assert "CUDA device" in moe_cuda.check(x, w13, w2, 2)
    big = torch.empty(2, 2 ** 16, 2 ** 15, dtype=torch.bfloat16, device="meta")  # 4 GiB an expert
    x16 = torch.empty(1, 2 ** 15, dtype=torch.bfloat16, device="meta")
    w2_16 = torch.empty(2, 2 ** 15, 2 ** 15, dtype=torch.bfloat16, device="meta")
    assert "w13 [2, 65536, 32768]: expected under 4 GiB an expert" in moe_cuda.check(x16, big, w2_16, 1)
    with pytest.raises(ValueError, match=r"fused_moe_cuda: .*CUDA device"):
        moe_cuda.fused_moe_cuda(x, w13, w2, w, ids, "silu")
    assert "row_groups = 3: expected a positive int dividing warps = 8 and the block's 8 rows" in \
        moe_cuda.row_groups_check("up", MoeCuda(bn=4, warps=8, unroll=1, row_groups=3))
    assert "dividing warps = 4 and the block's 2 rows" in moe_cuda.row_groups_check(
        "down", MoeCuda(bn=2, warps=4, unroll=1, row_groups=4))
    assert moe_cuda.row_groups_check("up", MoeCuda(bn=4, warps=8, unroll=1, row_groups=2), gated=False) is None


@pytest.mark.interp
def test_table_entry_falls_back_to_triton_where_cuda_cannot_run():
    # A "cuda" entry on operands the kernels cannot take (here: the CPU interpreter) runs
    # the Triton kernels with their default configuration instead; so does a CUDA down
    # entry beside a Triton up entry (the CUDA kernels come as a pair).
    x, w13, w2, ids, w = problem("cpu", torch.float32, 1, 64, 48, 6, 2, "silu", 1)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w.double(), ids, "silu")
    triton_up = moe_triton.default_config("up", 1, 6, 96, 64, 2, tuning.sm_count(x.device))
    for configs in [(moe_cuda.UP_CANDIDATES[0], moe_cuda.DOWN_CANDIDATES[0]), (triton_up, moe_cuda.DOWN_CANDIDATES[0])]:
        out = fused_moe_triton(x, w13, w2, w, ids, "silu", configs=configs)
        assert rel(out, ref) < TOL[torch.float32], configs


def test_supports_and_layout_name_the_reason():
    # Shapes, dtypes, devices and the configurations' row groups are ``supports``' (kept per
    # key by the selection); addresses and strides ``layout``'s (every call).
    x, w13, w2, ids, w = problem("cpu", torch.bfloat16, 2, 64, 32, 4, 2, "silu", 0)
    assert "CUDA device" in moe_cuda.supports(x, w13, w2, 2)
    assert moe_cuda.layout(x, w13, w2) is None
    wide = torch.randn(2, 72, dtype=torch.bfloat16)
    assert "x: expected unit stride along H and rows on 16-byte boundaries" in moe_cuda.layout(wide[:, 1:65], w13, w2)
    assert "w13 / w2: expected contiguous" in moe_cuda.layout(x, w13.transpose(1, 2), w2)
    (q13, s13), (q2, s2) = quantize_int8(w13), quantize_int8(w2)
    assert "w13_scale / w2_scale: expected contiguous" in moe_cuda.layout(x, q13, q2, s13.t().contiguous().t(), s2)


@pytest.mark.interp
def test_selection_asks_the_kernels_once_per_key(monkeypatch):
    # A CUDA entry the kernels cannot take (here: the CPU) runs the Triton kernels without
    # an exception raised on the way; the support is decided once per key, then looked up.
    x, w13, w2, ids, w = problem("cpu", torch.float32, 1, 64, 48, 6, 2, "silu", 2)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w.double(), ids, "silu")
    reasons = []
    real = moe_cuda.supports
    monkeypatch.setattr(moe_cuda, "supports", lambda *args: reasons.append(real(*args)) or reasons[-1])
    monkeypatch.setattr(moe_triton, "_CUDA_SUPPORT", {})

    def never(*args):
        raise AssertionError("the CUDA kernels ran on operands they cannot take")
    monkeypatch.setattr(moe_cuda, "run", never)
    configs = (moe_cuda.UP_CANDIDATES[0], moe_cuda.DOWN_CANDIDATES[0])
    for _ in range(3):
        out = fused_moe_triton(x, w13, w2, w, ids, "silu", configs=configs)
        assert rel(out, ref) < TOL[torch.float32]
    assert len(reasons) == 1 and "CUDA device" in reasons[0]
    assert moe_triton.cuda_reason(x, w13, w2, 2, "silu", None, None, configs) == reasons[0]
    moe_triton.cuda_reason(x, w13, w2, 2, "silu", None, None, (configs[0], None))  # other configurations
    assert len(reasons) == 2


GPU_CASES = [  # t, h, f, e, k, activation
    (1, 4096, 1408, 8, 2, "silu"), (1, 2048, 768, 128, 8, "silu"), (1, 528, 1008, 16, 1, "gelu"),
    (2, 272, 144, 60, 4, "silu"), (3, 2048, 1024, 64, 8, "silu"), (16, 256, 96, 7, 1, "gelu"),
    (8, 512, 256, 8, 2, "silu"), (16, 512, 128, 4, 2, "gelu"),  # several pairs an expert
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("t,h,f,e,k,activation", GPU_CASES)
@pytest.mark.parametrize("int8", [False, True])
def test_matches_reference(dtype, t, h, f, e, k, activation, int8):
    x, w13, w2, ids, w, s13, s2, ref = checked_problem(dtype, t, h, f, e, k, activation, t * 13 + e, int8,
                                                       torch.int64 if t % 2 else torch.int32)
    # Every tuning candidate that the problem's size keeps apart (up i with down i), some
    # with their registers capped, some widening int8 by one permute; past T = 1 also the
    # pair-major grid, in both kernels and in each one alone.
    pairs = list(zip(moe_cuda.UP_CANDIDATES, moe_cuda.DOWN_CANDIDATES))
    pairs += [(replace(up, min_blocks=m), replace(down, min_blocks=m)) for m, (up, down) in zip(moe_cuda.MIN_BLOCKS,
                                                                                            pairs[2:])]
    pairs += [(replace(up, unit=True), replace(down, unit=True)) for up, down in pairs[1:4]]  # int8: one permute
    if t > 1:
        major = [(replace(up, pair_major=True), replace(down, pair_major=True)) for up, down in pairs[::2]]
        pairs += major + [(major[0][0], pairs[1][1]), (pairs[2][0], major[1][1])]
    pairs += list(zip(moe_cuda.UP_CANDIDATES, moe_cuda.PIPE_DOWN_CANDIDATES))  # two weight buffers in the down kernel
    for up, down in pairs:
        out = moe_cuda.fused_moe_cuda(x, w13, w2, w, ids, activation, s13, s2, (up, down))
        assert out.shape == (t, h) and out.dtype == dtype
        assert rel(out, ref) < TOL[dtype], (up, down)
    out = moe_cuda.fused_moe_cuda(x, w13, w2, w, ids, activation, s13, s2)  # default configurations
    assert rel(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,f,e,k,activation", GPU_CASES[1:6])
@pytest.mark.parametrize("int8", [False, True])
def test_row_groups_match_reference(t, h, f, e, k, activation, int8):
    # The block's warps split its rows into groups, each group over all of K: 2 groups of
    # 4 warps (with and without two weight buffers, the down kernel split or not), 4 of 2
    # (one row a thread in the down kernel), 3 of 2 (6 warps).
    x, w13, w2, ids, w, s13, s2, ref = checked_problem(torch.bfloat16, t, h, f, e, k, activation, t * 7 + e, int8)
    up = MoeCuda(bn=4, warps=8, unroll=1, row_groups=2, unit=int8)
    down = MoeCuda(bn=4, warps=8, unroll=1, split_k=1, row_groups=2, unit=int8)
    pairs = [(up, down), (replace(up, unroll=2), replace(down, pipe=True)), (up, replace(down, split_k=2, unroll=2)),
             (replace(up, warps=8, row_groups=4), replace(down, warps=8, row_groups=4, pipe=True)),
             (replace(up, bn=6, warps=6, row_groups=3), replace(down, bn=6, warps=6, row_groups=3, min_blocks=4))]
    for cfg in pairs:
        out = moe_cuda.fused_moe_cuda(x, w13, w2, w, ids, activation, s13, s2, cfg)
        assert rel(out, ref) < TOL[torch.bfloat16], cfg


@pytest.mark.gpu
@pytest.mark.parametrize("int8,first", [(False, 0), (True, 0), (False, 3)])
def test_masked_pairs_read_nothing_and_add_nothing(int8, first):
    """``masked``: pairs with a negative expert id (experts on other ranks) add nothing, in
    every candidate configuration, split-K and the pair-major grid included; with
    ``first_expert`` the ids are the model's (those here counted from it), and those past
    the experts here add nothing too."""
    t, h, f, e, k = 3, 1024, 384, 8, 4
    x, w13, w2, ids, w, s13, s2, _ = checked_problem(torch.bfloat16, t, h, f, e, k, "silu", 7, int8)
    elsewhere = ids >= e // 2
    masked = torch.where(elsewhere, -1, ids)
    if first:  # the model's ids: below the first expert here, or past the last
        masked = torch.where(elsewhere, torch.where(ids % 2 == 0, 0, first + e + ids), ids + first)
    ref = fused_moe_ref(x.double(), w13 if int8 else w13.double(), w2 if int8 else w2.double(),
                        torch.where(elsewhere, 0.0, w).double(), ids, "silu", s13, s2)
    pairs = list(zip(moe_cuda.UP_CANDIDATES, moe_cuda.DOWN_CANDIDATES))
    pairs += [(replace(up, pair_major=True), replace(down, pair_major=True)) for up, down in pairs[::2]]
    pairs += list(zip(moe_cuda.UP_CANDIDATES, moe_cuda.PIPE_DOWN_CANDIDATES))
    for up, down in pairs:
        out = moe_cuda.run(x, w13, w2, w, masked, "silu", s13, s2, (up, down), True, masked=True,
                           first_expert=first)
        assert rel(out, ref) < TOL[torch.bfloat16], (up, down)


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("activation,weighted", [("swiglu_oai", False), ("silu", True), ("gelu", False)])
def test_biases_clamped_swiglu_and_weighted_input(activation, weighted, int8, monkeypatch):
    """GPT-OSS's experts (biases, the clamped SwiGLU) and Llama 4's (each pair's weight on
    its expert's input) against the reference: split-K (the down biases added once), the
    pair-major grid, masked pairs, b2 left out (an expert slice other than the first), and
    ``kernels.fused_moe`` choosing these kernels for them."""
    for t, h, f, e, k in [(1, 2880, 2880, 32, 4), (3, 528, 208, 12, 3)]:
        x, w13, w2, ids, w, s13, s2, _ = checked_problem(torch.bfloat16, t, h, f, e, k, activation, t + e, int8)
        gen = torch.Generator().manual_seed(t * e)
        # large enough biases that the clamps at +-7 cut some gate and up values
        b13 = (4 * torch.randn(e, w13.shape[1], generator=gen)).to("cuda", torch.bfloat16)
        b2 = torch.randn(e, h, generator=gen).to("cuda", torch.bfloat16)
        wide = (w13 if int8 else w13.double(), w2 if int8 else w2.double())
        for bias2 in (b2, None):
            ref = fused_moe_ref(x.double(), *wide, w.double(), ids, activation, s13, s2, b13=b13.double(),
                                b2=None if bias2 is None else bias2.double(), weighted_input=weighted)
            configs = [None, (moe_cuda.UP_CANDIDATES[1], MoeCuda(bn=2, warps=4, unroll=1, split_k=3)),
                       (moe_cuda.UP_CANDIDATES[3], moe_cuda.PIPE_DOWN_CANDIDATES[1])]
            if t > 1:
                configs.append((replace(moe_cuda.UP_CANDIDATES[0], pair_major=True),
                                replace(moe_cuda.DOWN_CANDIDATES[2], pair_major=True)))
            for cfg in configs:
                out = moe_cuda.fused_moe_cuda(x, w13, w2, w, ids, activation, s13, s2, cfg, b13=b13, b2=bias2,
                                              weighted_input=weighted)
                assert rel(out, ref) < TOL[torch.bfloat16], (bias2 is None, cfg)
        masked = torch.where(ids % 2 == 1, -1, ids)  # these pairs' experts are on other ranks: they add nothing
        ref = fused_moe_ref(x.double(), *wide, w.double(), masked, activation, s13, s2, masked=True,
                            b13=b13.double(), b2=b2.double(), weighted_input=weighted)
        out = moe_cuda.run(x, w13, w2, w, masked, activation, s13, s2, None, True, masked=True, b13=b13, b2=b2,
                           weighted_input=weighted)
        assert rel(out, ref) < TOL[torch.bfloat16], "masked"
        if t <= moe_triton.CUDA_HEURISTIC_T:  # a shape no table holds: these kernels, as for the plain experts
            calls = []
            real = moe_cuda.run
            monkeypatch.setattr(moe_cuda, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
            out = fused_moe_triton(x, w13, w2, w, ids, activation, s13, s2, b13=b13, b2=b2, weighted_input=weighted)
            monkeypatch.undo()
            ref = fused_moe_ref(x.double(), *wide, w.double(), ids, activation, s13, s2, b13=b13.double(),
                                b2=b2.double(), weighted_input=weighted)
            assert calls and rel(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_split_k_and_odd_widths():
    # The k * F reduction split where a split ends inside a slot's F columns; F not a
    # multiple of the block's step.
    x, w13, w2, ids, w = problem("cuda", torch.bfloat16, 1, 1040, 200, 12, 3, "silu", 5)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w.double(), ids, "silu")
    for split, pipe in itertools.product((1, 2, 3, 5), (False, True)):
        down = MoeCuda(bn=2, warps=4, unroll=1, split_k=split, pipe=pipe)
        out = moe_cuda.fused_moe_cuda(x, w13, w2, w, ids, "silu", configs=(None, down))
        assert rel(out, ref) < TOL[torch.bfloat16], (split, pipe)


@pytest.mark.gpu
def test_unsupported_operands_fall_back_in_fused_moe():
    # fp32 activations: the table's CUDA entry falls back to the Triton kernels.
    x, w13, w2, ids, w = problem("cuda", torch.float32, 1, 256, 96, 8, 2, "silu", 6)
    assert "bf16 or fp16" in moe_cuda.check(x, w13, w2, 2)
    configs = (moe_cuda.UP_CANDIDATES[1], moe_cuda.DOWN_CANDIDATES[1])
    # A configuration the kernels cannot run is a reason too (row groups dividing the block).
    x16 = x.bfloat16()
    odd = (MoeCuda(bn=4, warps=8, unroll=1, row_groups=3), None)
    assert "row_groups = 3" in moe_cuda.supports(x16, w13.bfloat16(), w2.bfloat16(), 2, configs=odd)
    assert moe_cuda.supports(x16, w13.bfloat16(), w2.bfloat16(), 2, configs=configs) is None
    out = fused_moe_triton(x, w13, w2, w, ids, "silu", configs=configs)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w.double(), ids, "silu")
    assert rel(out, ref) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_graph_replay_and_table_routing(int8, monkeypatch, tmp_path):
    # Captured in a CUDA graph (as in the decode step) the two launches replay to the eager
    # result for new inputs; a table entry naming the CUDA backend routes fused_moe there.
    x, w13, w2, ids, w = problem("cuda", torch.bfloat16, 1, 2048, 1024, 64, 8, "silu", 7)
    scales = {}
    if int8:
        w13, s13 = quantize_int8(w13)
        w2, s2 = quantize_int8(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    configs = (moe_cuda.UP_CANDIDATES[2], moe_cuda.DOWN_CANDIDATES[3])
    run = lambda: moe_cuda.fused_moe_cuda(x, w13, w2, w, ids, "silu", configs=configs, **scales)  # noqa: E731
    eager = run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    gen = torch.Generator().manual_seed(8)
    x.copy_(torch.randn(1, 2048, generator=gen).to("cuda", torch.bfloat16))
    ids.copy_(torch.randperm(64, generator=gen)[:8].to("cuda", torch.int32)[None])
    graph.replay()
    torch.testing.assert_close(out, run(), rtol=0, atol=0)
    assert not torch.equal(out, eager)
    tuning.write_table(tmp_path, tuning.Table("moe", tuning.device_name(x.device), tuning.dtype_name(w13.dtype), {
        tuning.moe_shape("up", 64, 2048, 2048, 8): {1: configs[0]},
        tuning.moe_shape("down", 64, 2048, 1024, 8): {1: configs[1]}}))
    monkeypatch.setattr(tuning, "TABLES", tuning.Tables(tmp_path))
    moe_triton.launch_config.cache_clear()
    try:
        routed = fused_moe_triton(x, w13, w2, w, ids, "silu", **scales)
    finally:
        moe_triton.launch_config.cache_clear()
    torch.testing.assert_close(routed, run(), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 16, 17])
@pytest.mark.parametrize("int8", [False, True])
def test_gated_mlp_matches_reference(t, int8):
    """A dense SwiGLU MLP (a shared expert, a dense layer) as the one expert of every row:
    at decode sizes the CUDA decode kernels, past them (17 rows) the two GEMMs; against the
    float64 reference, bf16 and int8 weights, DeepSeek-V2-Lite's shared-expert widths."""
    from kernels import gated_mlp

    x, w13, w2, _, _ = problem("cuda", torch.bfloat16, t, 2048, 2816, 1, 1, "silu", t)
    s13 = s2 = None
    if int8:
        (w13, s13), (w2, s2) = quantize_int8(w13), quantize_int8(w2)
    ref = fused_moe_ref(x.double(), w13 if int8 else w13.double(), w2 if int8 else w2.double(),
                        torch.ones(t, 1, dtype=torch.float64, device="cuda"),
                        torch.zeros(t, 1, dtype=torch.int64, device="cuda"), "silu", s13, s2)
    out = gated_mlp(x, w13[0], w2[0], None if s13 is None else s13[0], None if s2 is None else s2[0])
    assert out.shape == (t, 2048) and out.dtype == torch.bfloat16
    assert rel(out, ref) < TOL[torch.bfloat16]
