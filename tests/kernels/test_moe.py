"""The MoE experts (``kernels.moe``): the Triton path against its references, on CPU under the
interpreter (small shapes) and on a GPU (the sizes the issue names), and the references
against a per-token loop. Tolerances are relative norm errors."""
from dataclasses import asdict, replace

import pytest
import torch

from kernels.layout.maps import token_maps_triton
from kernels.moe import fused_moe, grouped_gemm
from kernels.moe import triton as moe_triton
from kernels.moe.reference import dequantize_ref, expert_ffn_ref, fused_moe_ref, grouped_ffn_ref, quantize_int8
from kernels.moe.triton import fused_moe_triton
from kernels.routing.reference import topk_gating_ref
from kernels.tuning import MoeCuda, MoeDequant, MoeGroupedMm, MoeTriton
from tests.kernels.common import CPU, GPU, rel, routing

# fp32 multiplies exactly (ieee dot); half types round the FFN's hidden activations.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def weights(e, h, f, activation, dtype, device, gen):
    rows = 2 * f if activation == "silu" else f
    w13 = torch.randn(e, rows, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, f, generator=gen) / f ** 0.5
    return w13.to(device, dtype), w2.to(device, dtype)


INTERP_CASES = [(1, 40, 24, 4, 2, "silu"), (3, 33, 20, 5, 2, "silu"), (33, 48, 16, 7, 3, "gelu"),
                (40, 31, 12, 6, 1, "silu")]


@pytest.mark.interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,h,f,e,k,activation", INTERP_CASES)
def test_fused_moe_interpreted(dtype, t, h, f, e, k, activation):
    check_fused_moe("cpu", dtype, t, h, f, e, k, activation)


GPU_SHAPES = [(4096 + 8, 1408, 8, 2, "silu"), (257, 96, 60, 4, "silu"), (2048, 768, 128, 8, "silu"),
              (520, 1000, 16, 1, "gelu")]
# bf16 (the serving dtype) on every shape and T; fp16 / fp32 on a subset (each new shape
# and dtype is a compile).
GPU_CASES = ([(torch.bfloat16, t, *s) for t in (1, 3, 33, 511, 4097) for s in GPU_SHAPES]
             + [(d, t, *s) for d in (torch.float16, torch.float32) for t in (3, 511) for s in GPU_SHAPES[1:3]])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,t,h,f,e,k,activation", GPU_CASES)
def test_fused_moe_gpu(dtype, t, h, f, e, k, activation):
    check_fused_moe("cuda", dtype, t, h, f, e, k, activation)


def check_fused_moe(device, dtype, t, h, f, e, k, activation):
    gen = torch.Generator().manual_seed(t * 7 + e)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w13, w2 = weights(e, h, f, activation, dtype, device, gen)
    ids, w = routing(t, e, k, device, gen)
    out = fused_moe_triton(x, w13, w2, w, ids, activation)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w.double(), ids, activation)
    assert out.dtype == dtype and out.shape == (t, h)
    assert rel(out, ref) < TOL[dtype]
    # Up to FROM_IDS_PAIRS pairs the GEMMs group pairs from the ids (no maps); with maps
    # given (as the router hands them over) they take the expert-major path: both agree.
    out_maps = fused_moe_triton(x, w13, w2, w, ids, activation, maps=token_maps_triton(ids, e))
    assert rel(out_maps, ref) < TOL[dtype]
    # int8 weights: the kernel matches the dequantised reference to the activation dtype's
    # rounding; the quantisation error itself is reported by the benchmark.
    q13, s13 = quantize_int8(w13)
    q2, s2 = quantize_int8(w2)
    out8 = fused_moe_triton(x, q13, q2, w, ids, activation, s13, s2)
    ref8 = fused_moe_ref(x.double(), q13, q2, w.double(), ids, activation, s13, s2)
    assert rel(out8, ref8) < TOL[dtype]
    assert rel(out8, ref) < 3e-2


def small_problem(device, seed, t, h, f, e, k, dtype=None):
    """(dtype, x, w13, w2, ids, weights) of a small SiLU MoE problem: in ``dtype``, by default
    bf16 on a GPU and float32 under the interpreter."""
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w13, w2 = weights(e, h, f, "silu", dtype, device, gen)
    return (dtype, x, w13, w2, *routing(t, e, k, device, gen))


@pytest.mark.parametrize("device", [CPU, GPU])
def test_tile_order_does_not_change_results(device):
    # Several row tiles per expert and several column tiles: row-major order and groups
    # of 1 or 3 row tiles (a last group cut short) compute the same tiles, bit for bit.
    e = 3
    _, x, w13, w2, ids, w = small_problem(device, 9, t=40, h=48, f=40, e=e, k=2, dtype=torch.float32)
    ref = fused_moe_ref(x.cpu().double(), w13.cpu().double(), w2.cpu().double(), w.cpu().double(), ids.cpu())
    outs = []
    for group_m in (0, 1, 3):
        cfg = MoeTriton(bm=16, bn=16, bk=16, num_warps=4, num_stages=2, split_k=1, group_m=group_m)
        outs.append(fused_moe_triton(x, w13, w2, w, ids, configs=(cfg, cfg), maps=token_maps_triton(ids, e)))
        assert rel(outs[-1].cpu(), ref) < 1e-5
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("activation,wdtype", [("silu", "float"), ("gelu", "float"), ("silu", "int8")])
def test_short_last_tiles(device, activation, wdtype):
    # sub_m: an expert's last row tile runs at bm / 2 or bm / 4 rows where its rows fit.
    # With bm = 64 the three experts end in tiles of 5 rows (quarter height), 20 (half) and
    # 40 (full): every path runs, up GEMM (gathered rows) and down GEMM alike.
    gen = torch.Generator().manual_seed(17)
    counts = [64 + 5, 64 + 20, 40]
    ids = torch.cat([torch.full((c,), i, dtype=torch.int32) for i, c in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=gen)][:, None].to(device)  # k = 1
    w = torch.rand(len(ids), 1, generator=gen).to(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(len(ids), 48, generator=gen).to(device, dtype)
    w13, w2 = weights(len(counts), 48, 40, activation, dtype, device, gen)
    scales = {}
    if wdtype == "int8":
        (w13, s13), (w2, s2) = quantize_int8(w13), quantize_int8(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    ref = fused_moe_ref(x.cpu().double(), w13.cpu().double() if wdtype == "float" else w13.cpu(),
                        w2.cpu().double() if wdtype == "float" else w2.cpu(), w.cpu().double(), ids.cpu(),
                        activation=activation, **{n: v.cpu() for n, v in scales.items()})
    maps = token_maps_triton(ids, len(counts))
    outs = []
    for sub_m in (1, 2, 4):
        cfg = MoeTriton(bm=64, bn=16, bk=16, num_warps=4, num_stages=2, split_k=1, group_m=2, sub_m=sub_m)
        outs.append(fused_moe_triton(x, w13, w2, w, ids, activation, configs=(cfg, cfg), maps=maps, **scales))
        assert rel(outs[-1].cpu(), ref) < (TOL[dtype] if device == "cuda" else 1e-5)
    # Same products, same order along K: only the tile height changed.
    assert all(rel(o.cpu(), outs[0].cpu()) < (1e-2 if device == "cuda" else 1e-6) for o in outs[1:])
    with pytest.raises(ValueError, match="sub_m"):
        fused_moe_triton(x, w13, w2, w, ids, activation, configs=(replace(cfg, bm=32), cfg), maps=maps, **scales)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("wdtype", ["float", "int8"])
def test_weight_tiles_by_tma(device, wdtype):
    # Weight tiles by TMA descriptor against pointer loads: up GEMM over H = 48 (K a
    # multiple of BK: no K mask) with F = 40 (the last column tile reads past the gate rows),
    # down GEMM over K = F = 40 (a K tail TMA fills with zeros).
    e = 3
    dtype, x, w13, w2, ids, w = small_problem(device, 13, t=37, h=48, f=40, e=e, k=2)
    scales = {}
    if wdtype == "int8":
        (w13, s13), (w2, s2) = quantize_int8(w13), quantize_int8(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    ptr = MoeTriton(bm=16, bn=16, bk=16, num_warps=4, num_stages=2, split_k=1, group_m=2)
    tma = replace(ptr, tma=True)
    tma_ok = grouped_gemm.tma_ok
    assert tma_ok(w13, tma.kernel_args()) and not tma_ok(w13, ptr.kernel_args())
    assert grouped_gemm.tma_ok(w2, tma.kernel_args()) == (w2.shape[-1] * w2.element_size() % 16 == 0)
    maps = token_maps_triton(ids, e)
    out_ptr = fused_moe_triton(x, w13, w2, w, ids, configs=(ptr, ptr), maps=maps, **scales)
    out_tma = fused_moe_triton(x, w13, w2, w, ids, configs=(tma, tma), maps=maps, **scales)
    ref = fused_moe_ref(x.cpu().double(), w13.cpu().double() if wdtype == "float" else w13.cpu(),
                        w2.cpu().double() if wdtype == "float" else w2.cpu(), w.cpu().double(), ids.cpu(),
                        **{n: v.cpu() for n, v in scales.items()})
    tol = TOL[dtype] if device == "cuda" else 1e-5
    assert rel(out_tma.cpu(), ref) < tol and rel(out_ptr.cpu(), ref) < tol
    assert rel(out_tma.cpu(), out_ptr.cpu().double()) < tol


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("capacity", [None, 9])
def test_down_gemm_by_grouped_mm(device, capacity):
    # A table entry may send the large-T down GEMM to torch._grouped_mm; the combine then
    # applies the weights. Same result as the reference, dropped pairs included.
    dtype, x, w13, w2, ids, w = small_problem(device, 11, t=30, h=32, f=24, e=5, k=2)
    up = MoeTriton(bm=16, bn=16, bk=16, num_warps=4, num_stages=2, split_k=1)
    down = MoeGroupedMm(**asdict(up))
    assert moe_triton.grouped_mm_ok(down, x, w2)
    out = fused_moe_triton(x, w13, w2, w, ids, capacity=capacity, configs=(up, down))
    ref = fused_moe_ref(x.cpu().double(), w13.cpu().double(), w2.cpu().double(), w.cpu().double(), ids.cpu(),
                        capacity=capacity)
    assert rel(out.cpu(), ref) < (TOL[dtype] if device == "cuda" else 1e-5)
    # int8 weights cannot take it: the Triton kernel runs with the entry's tile sizes.
    q13, s13 = quantize_int8(w13)
    q2, s2 = quantize_int8(w2)
    assert not moe_triton.grouped_mm_ok(down, x, q2)
    out8 = fused_moe_triton(x, q13, q2, w, ids, "silu", s13, s2, capacity=capacity, configs=(up, down))
    ref8 = fused_moe_ref(x.cpu().double(), q13.cpu(), q2.cpu(), w.cpu().double(), ids.cpu(), "silu", s13.cpu(),
                         s2.cpu(), capacity=capacity)
    assert rel(out8.cpu(), ref8) < (TOL[dtype] if device == "cuda" else 1e-5)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_masked_pairs_by_the_models_expert_ids(device, t):
    """``first_expert``: the ids are the model's, w13 / w2 hold experts first .. first + E - 1
    (one rank's under expert parallelism). Pairs of experts before or after them add
    nothing; the others are those experts' (the CUDA decode kernels at small T on a GPU, the
    Triton GEMMs after the maps), bf16 and int8."""
    dtype, x, w13, w2, ids, w = small_problem(device, 31 + t, t=t, h=32, f=24, e=12, k=3)
    first, n = 4, 5
    here = (ids >= first) & (ids < first + n)
    mine = [z[first:first + n].contiguous() for z in (w13, w2)]
    kept_w, kept_ids = torch.where(here, w, 0.0), torch.where(here, ids - first, 0)
    up = lambda z: z.cpu().double()  # noqa: E731
    kept = fused_moe_ref(up(x), *map(up, mine), up(kept_w), kept_ids.cpu())
    assert rel(fused_moe_ref(up(x), *map(up, mine), up(w), ids.cpu(), masked=True, first_expert=first), kept) < 1e-12
    out = fused_moe(x, *mine, w, ids, masked=True, first_expert=first)
    assert rel(out.cpu(), kept) < (TOL[dtype] if device == "cuda" else 1e-5)
    out = fused_moe_triton(x, *mine, w, ids, masked=True, first_expert=first)  # the maps take the ids as they are
    assert rel(out.cpu(), kept) < (TOL[dtype] if device == "cuda" else 1e-5)
    (q13, s13), (q2, s2) = quantize_int8(mine[0]), quantize_int8(mine[1])
    out8 = fused_moe(x, q13, q2, w, ids, "silu", s13, s2, masked=True, first_expert=first)
    ref8 = fused_moe_ref(up(x), q13.cpu(), q2.cpu(), up(kept_w), kept_ids.cpu(), "silu", s13.cpu(), s2.cpu())
    assert rel(out8.cpu(), ref8) < (TOL[dtype] if device == "cuda" else 1e-5)


@pytest.mark.parametrize("device", [CPU, GPU])
def test_capacity_drops_pairs_as_the_reference(device):
    e = 4
    _, x, w13, w2, ids, w = small_problem(device, 5, t=24, h=20, f=12, e=e, k=2, dtype=torch.float32)
    out = fused_moe_triton(x, w13, w2, w, ids, capacity=5)
    ref = fused_moe_ref(x.cpu().double(), w13.cpu().double(), w2.cpu().double(), w.cpu().double(), ids.cpu(),
                        capacity=5)
    assert rel(out.cpu(), ref) < 1e-5


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_masked_pairs_add_nothing(device, t):
    """Pairs with a negative expert id (experts on other ranks) add nothing: the same as
    the pairs kept alone, with the masked ones' weights zero, whatever path the size takes
    (the CUDA decode kernels on a GPU at small T, the Triton GEMMs after the maps)."""
    dtype, x, w13, w2, ids, w = small_problem(device, 21 + t, t=t, h=32, f=24, e=6, k=3)
    # Odd experts elsewhere; past T = 1 the first token has no expert here at all.
    elsewhere = (ids % 2 == 1) | ((torch.arange(t, device=device)[:, None] == 0) & (t > 1))
    masked = torch.where(elsewhere, -1, ids)
    kept = fused_moe_ref(x.cpu().double(), w13.cpu().double(), w2.cpu().double(),
                         torch.where(elsewhere, 0.0, w).cpu().double(), ids.cpu())
    ref = fused_moe_ref(x.cpu().double(), w13.cpu().double(), w2.cpu().double(), w.cpu().double(), masked.cpu(),
                        masked=True)
    assert rel(ref, kept) < 1e-12
    out = fused_moe(x, w13, w2, w, masked, masked=True)
    assert rel(out.cpu(), kept) < (TOL[dtype] if device == "cuda" else 1e-5)
    out = fused_moe_triton(x, w13, w2, w, masked, masked=True)
    assert rel(out.cpu(), kept) < (TOL[dtype] if device == "cuda" else 1e-5)
    assert t == 1 or out[0].abs().max() == 0
    q13, s13 = quantize_int8(w13)
    q2, s2 = quantize_int8(w2)
    out8 = fused_moe(x, q13, q2, w, masked, "silu", s13, s2, masked=True)
    ref8 = fused_moe_ref(x.cpu().double(), q13.cpu(), q2.cpu(), torch.where(elsewhere, 0.0, w).cpu().double(),
                         ids.cpu(), "silu", s13.cpu(), s2.cpu())
    assert rel(out8.cpu(), ref8) < (TOL[dtype] if device == "cuda" else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 16, 40])
def test_moe_layer_routes_without_maps_where_experts_take_ids(t):
    """Where the experts run from the routing ids (kernels.moe.triton.pairs_from_ids) the
    layer's router launches the gating alone; the output equals the layer routed with maps
    (the router forced to build them), and both equal the float64 reference."""
    from moe_infer.config import MoEConfig, ModelConfig
    from moe_infer.moe_layer import MoELayer

    m = ModelConfig(vocab_size=32, hidden_size=2048, num_layers=1, num_heads=16, ffn_hidden=64)
    layer = MoELayer(m, MoEConfig(num_experts=64, top_k=8, expert_hidden=1024)).cuda().bfloat16()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.03)
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        out = layer(x)
        no_maps = not layer._maps_needed(x)
        assert no_maps == layer.experts.pairs_from_ids(x, 8)
        if t == 1:
            assert no_maps  # 8 pairs: at most FROM_IDS_PAIRS, whatever the table holds
        layer._maps_at = {key: True for key in layer._maps_at}
        with_maps = layer(x)
        assert torch.equal(out, with_maps), t
        ids, w = topk_gating_ref((x @ layer.router.weight.t()).float(), 8)  # the router's logits
        ref = fused_moe_ref(x.double(), layer.experts.w13.double(), layer.experts.w2.double(), w.double(), ids,
                            "silu")
        assert rel(out, ref) < 2e-2


@pytest.mark.gpu
def test_moe_layer_in_cuda_graph_matches_eager():
    """The whole MoE layer (router, gating, maps, expert GEMMs, combine) captured once per
    T = 1..16 and replayed on fresh inputs gives eager's result."""
    from moe_infer.config import MoEConfig, ModelConfig
    from moe_infer.moe_layer import MoELayer

    m = ModelConfig(vocab_size=32, hidden_size=1024, num_layers=1, num_heads=8, ffn_hidden=64)
    layer = MoELayer(m, MoEConfig(num_experts=8, top_k=2, expert_hidden=768, shared_experts=1,
                                  shared_expert_hidden=256, shared_expert_gate=True)).cuda().bfloat16()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.03)
        for t in range(1, 17):
            static = torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):  # warm-up compiles the kernels outside the capture
                layer(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = layer(static)
            for _ in range(3):
                fresh = torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16)
                static.copy_(fresh)
                graph.replay()
                eager = layer(fresh)
                assert torch.equal(static_out, eager), t


@pytest.mark.parametrize("device", [CPU, GPU])
def test_dequant_entry_widens_int8_experts_first(device):
    """A "dequant" table entry (int8 at large T) widens the experts to x's dtype in one
    pass and runs x's own GEMMs: the result equals the reference on the dequantized
    weights."""
    e = 4
    dtype, x, w13, w2, ids, w = small_problem(device, 11, t=24, h=32, f=16, e=e, k=2)
    (q13, s13), (q2, s2) = quantize_int8(w13), quantize_int8(w2)
    assert torch.equal(moe_triton.dequantize_int8(q13, s13, dtype), dequantize_ref(q13, s13, dtype))
    dequant = MoeDequant()
    out = fused_moe_triton(x, q13, q2, w, ids, "silu", s13, s2, configs=(dequant, dequant))
    ref = fused_moe_ref(x.cpu().double(), q13.cpu(), q2.cpu(), w.cpu().double(), ids.cpu(), "silu", s13.cpu(),
                        s2.cpu())
    assert rel(out.cpu(), ref) < TOL[dtype]


def test_launch_config_takes_a_same_chip_entry_before_the_heuristic(monkeypatch, tmp_path):
    """The smallest bucket >= T among the device's own entries and those of a device of the
    same chip (kernels.tuning.SAME_CHIP), the own one at a tie; past them all, the heuristic."""
    from kernels import tuning

    own, lent = MoeCuda(bn=2, warps=4, unroll=1), MoeCuda(bn=8, warps=4, unroll=1)
    key = tuning.moe_shape("up", 8, 64, 32, 2)
    for device, entries in (("cpu", {1: own, 16: own}), ("b", {1: lent, 8: lent}), ("c", {64: own})):
        tuning.write_table(tmp_path, tuning.Table("moe", device, "bfloat16", {key: entries}))
    monkeypatch.setattr(tuning, "TABLES", tuning.Tables(tmp_path, chips=(("cpu", "b"),)))
    moe_triton.launch_config.cache_clear()
    try:
        pick = lambda t: moe_triton.launch_config("up", torch.device("cpu"), t, 8, 64, 32, torch.bfloat16, 2)  # noqa: E731
        assert pick(1) == own and pick(2) == lent and pick(8) == lent and pick(9) == own
        assert pick(17) == moe_triton.default_config("up", 17, 8, 64, 32, 2, tuning.sm_count(torch.device("cpu")))
    finally:
        moe_triton.launch_config.cache_clear()


def loop_moe(x, w13, w2, weights, ids, activation):
    """Hugging Face eager style: every token, every slot, one expert at a time, float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            y = expert_ffn_ref(x[t:t + 1].double(), w13[e].double(), w2[e].double(), activation)
            out[t] += weights[t, j].double() * y[0]
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("t,h,f,e,k", [(1, 31, 12, 4, 2), (3, 48, 20, 5, 1), (33, 24, 16, 9, 3)])
def test_fused_moe_ref_matches_per_token_loop(activation, t, h, f, e, k):
    torch.manual_seed(t * h)
    rows13 = 2 * f if activation == "silu" else f
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, rows13, h) / h ** 0.5, torch.randn(e, h, f) / f ** 0.5
    ids, weights = topk_gating_ref(torch.randn(t, e), k)
    out = fused_moe(x, w13, w2, weights, ids, activation)
    torch.testing.assert_close(out.double(), loop_moe(x, w13, w2, weights, ids, activation),
                               rtol=1e-5, atol=1e-5)


def test_grouped_ffn_skips_experts_without_rows():
    torch.manual_seed(1)
    xs = torch.randn(4, 8)
    offsets = torch.tensor([0, 0, 4, 4], dtype=torch.int32)  # only expert 1 has rows
    w13, w2 = torch.randn(3, 10, 8), torch.randn(3, 8, 5)
    w13[0] = float("nan")  # would poison the result if expert 0 ran
    ys = grouped_ffn_ref(xs, offsets, w13, w2)
    torch.testing.assert_close(ys, expert_ffn_ref(xs, w13[1], w2[1]))


@pytest.mark.parametrize("bad,match", [
    (dict(activation="relu"), "activation"),
    (dict(x=torch.randn(2, 3, 8)), "x: expected"),
    (dict(w2=torch.randn(4, 9, 6)), "w13"),
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int32)), "topk_ids"),
    (dict(topk_ids=torch.zeros(2, 2)), "int32 or int64"),
])
def test_fused_moe_rejects_bad_arguments(bad, match):
    args = dict(x=torch.randn(2, 8), w13=torch.randn(4, 12, 8), w2=torch.randn(4, 8, 6),
                topk_weights=torch.rand(2, 2), topk_ids=torch.zeros(2, 2, dtype=torch.int32),
                activation="silu")
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


def gpt_oss_experts(t, h, f, e, k, device, dtype, seed):
    """x, w13, w2, b13, b2, ids, weights of GPT-OSS-style experts, biases large enough that
    the clamps at +-7 bind for some rows."""
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(t, h, generator=gen)).to(device, dtype)
    w13 = (torch.randn(e, 2 * f, h, generator=gen) / h ** 0.5 * 2).to(device, dtype)
    w2 = (torch.randn(e, h, f, generator=gen) / f ** 0.5).to(device, dtype)
    b13 = (3 * torch.randn(e, 2 * f, generator=gen)).to(device, dtype)
    b2 = torch.randn(e, h, generator=gen).to(device, dtype)
    ids, w = routing(t, e, k, device, gen)
    return x, w13, w2, b13, b2, ids, w


def test_gpt_oss_experts_reference_matches_transformers_formula():
    """fused_moe's biases and swiglu_oai against GPT-OSS's own expert math, written as
    transformers does: gate and up interleaved in one [H, 2F] matrix, biases added, the
    clamped SwiGLU with (up + 1), the down bias before the routing weight."""
    x, w13, w2, b13, b2, ids, w = gpt_oss_experts(9, 24, 10, 5, 2, "cpu", torch.float64, 3)
    w = w.double()
    out = fused_moe(x, w13, w2, w, ids, "swiglu_oai", b13=b13, b2=b2)
    e, f = w13.shape[0], w2.shape[2]
    gate_up = torch.empty(e, x.shape[1], 2 * f, dtype=x.dtype)  # the checkpoint's layout
    gate_up[:, :, ::2], gate_up[:, :, 1::2] = w13[:, :f].transpose(1, 2), w13[:, f:].transpose(1, 2)
    bias = torch.empty(e, 2 * f, dtype=x.dtype)
    bias[:, ::2], bias[:, 1::2] = b13[:, :f], b13[:, f:]
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ex = int(ids[t, j])
            gu = x[t] @ gate_up[ex] + bias[ex]
            gate, up = gu[::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
            glu = gate * torch.sigmoid(gate * 1.702) * (up + 1)
            want[t] += w[t, j] * (glu @ w2[ex].t() + b2[ex])
    assert (gu.abs() > 7).any()  # the clamps bind somewhere
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # (the combine sums in float32)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_gpt_oss_experts_kernels_match_the_reference(device, t):
    """The grouped GEMMs' bias and swiglu_oai epilogues (decode ids, maps, a split-K down
    GEMM whose bias is added once) against the float64 reference."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, w13, w2, b13, b2, ids, w = gpt_oss_experts(t, 48, 20, 6, 2, device, dtype, t)
    ref = fused_moe_ref(*(z.double() for z in (x, w13, w2, w)), ids, "swiglu_oai",
                        b13=b13.double(), b2=b2.double())
    up, down = moe_triton._table_configs(x, w13, w2, 2)
    up = moe_triton.triton_entry(up, "up", x.device, t, 6, 40, 48, 2, x.element_size())
    down = moe_triton.triton_entry(down, "down", x.device, t, 6, 48, 20, 2, x.element_size())
    for configs in (None, (up, replace(down, split_k=2))):
        out = fused_moe_triton(x, w13, w2, w, ids, "swiglu_oai", configs=configs, b13=b13, b2=b2)
        assert rel(out.double(), ref) < TOL[dtype], configs


def test_weighted_input_scales_each_experts_input():
    """Llama 4's experts: the routing weight scales the expert's input, not its output."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 24, generator=gen, dtype=torch.float64)
    w13, w2 = weights(5, 24, 10, "silu", torch.float64, "cpu", gen)
    ids, w = routing(7, 5, 2, "cpu", gen)
    w = w.double()
    out = fused_moe(x, w13, w2, w, ids, "silu", weighted_input=True)
    want = torch.zeros_like(x)
    for t in range(7):
        for j in range(2):
            want[t] += expert_ffn_ref(w[t, j] * x[t:t + 1], w13[int(ids[t, j])], w2[int(ids[t, j])])[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # (the combine sums in float32)
    assert rel(fused_moe(x, w13, w2, w, ids, "silu"), want) > 1e-2  # not what the output weighting gives


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("t", [1, 40])
def test_weighted_input_kernels_match_the_reference(device, t):
    """The up GEMM's weight-first epilogue (decode ids and maps; a split-K down GEMM then
    adds unweighted partials), against the float64 reference."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, 48, generator=gen).to(device, dtype)
    w13, w2 = weights(6, 48, 20, "silu", dtype, device, gen)
    ids, w = routing(t, 6, 1, device, gen)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w.double(), ids, weighted_input=True)
    up, down = moe_triton._table_configs(x, w13, w2, 1)
    up = moe_triton.triton_entry(up, "up", x.device, t, 6, 40, 48, 1, x.element_size())
    down = moe_triton.triton_entry(down, "down", x.device, t, 6, 48, 20, 1, x.element_size())
    for configs in (None, (up, replace(down, split_k=2))):
        out = fused_moe_triton(x, w13, w2, w, ids, configs=configs, weighted_input=True)
        assert rel(out.double(), ref) < TOL[dtype], configs


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("t,activation", [(1, "swiglu_oai"), (5, "silu"), (40, "swiglu_oai"), (9, "gelu")])
def test_mxfp4_experts_kernels_match_their_dequantized_weights(device, t, activation):
    """MXFP4 experts (two codes a byte, a power-of-two scale per 32 along K) through the
    grouped GEMMs -- decode ids, maps, split-K, a K past the last whole tile (96 = 64 + 32),
    biases -- equal the same GEMMs on the dequantized weights, which are exact."""
    from kernels.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    gen = torch.Generator().manual_seed(t)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    e, h, f, k = 6, 96, 64, 2
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w13, w2 = weights(e, h, f, "silu" if activation != "gelu" else "gelu", torch.float32, "cpu", gen)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    d13, d2 = (dequantize_mxfp4(q, s, dtype).to(device) for q, s in ((q13, s13), (q2, s2)))
    q13, s13, q2, s2 = (z.to(device) for z in (q13, s13, q2, s2))
    b13 = (torch.randn(e, w13.shape[1], generator=gen) * 0.1).to(device, dtype)
    b2 = (torch.randn(e, h, generator=gen) * 0.1).to(device, dtype)
    ids, w = routing(t, e, k, device, gen)
    want = fused_moe_ref(*(z.double() for z in (x, d13, d2, w)), ids, activation, b13=b13.double(),
                         b2=b2.double())
    ref = fused_moe(x, q13, q2, w, ids, activation, w13_scale=s13, w2_scale=s2, b13=b13, b2=b2)  # the reference path
    assert rel(ref.double(), want) < TOL[dtype]
    up, down = moe_triton._table_configs(x, q13, q2, k)
    up = moe_triton.triton_entry(up, "up", x.device, t, e, q13.shape[1], h, k, x.element_size())
    down = moe_triton.triton_entry(down, "down", x.device, t, e, h, f, k, x.element_size())
    for configs in (None, (replace(up, bk=64), replace(down, bk=32, split_k=2))):
        out = fused_moe_triton(x, q13, q2, w, ids, activation, s13, s2, configs=configs, b13=b13, b2=b2)
        assert rel(out.double(), want) < TOL[dtype], configs


def test_mxfp4_quantizer_rounds_to_the_nearest_code_and_keeps_mxfp4_weights():
    from kernels.moe.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 64, generator=gen) * torch.logspace(-3, 3, 4)[:, None, None]
    w[0, 0, :32] = 0  # an all-zero group
    q, s = quantize_mxfp4(w)
    assert q.shape == (4, 3, 32) and s.shape == (4, 3, 2) and q.dtype == s.dtype == torch.uint8
    d = dequantize_mxfp4(q, s, torch.float32)
    scale = torch.ldexp(torch.ones(s.shape), (s.int() - 127).float())[..., None]  # [4, 3, 2, 1]
    grid = torch.tensor(FP4_VALUES) * scale[..., None]  # every code's value in each group
    best = (w.unflatten(-1, (2, 32))[..., None] - grid).abs().amin(-1)
    torch.testing.assert_close((d - w).abs().unflatten(-1, (2, 32)), best, rtol=0, atol=1e-6 * w.abs().max())
    assert not d[0, 0, :32].any()
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4(d), (q, s)))  # MXFP4 weights keep their codes
