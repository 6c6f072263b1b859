"""Weight-only int8 for every linear layer: the kernel against its reference, the module
types, and the converter applied at load on the embedded model."""
import pytest
import torch
from torch import nn

import kernels
import moe_infer
from comm import Group
from dense.parallel_linear import ColumnParallelLinear, RowParallelLinear
from dense.quant import Int8Linear, quantize_linears
from kernels.linear.reference import sbi_linear_ref
from moe_infer.config import ConfigError, EngineConfig
from moe_infer.experts import Int8Experts

CPU = pytest.param("cpu", id="interp", marks=pytest.mark.interp)
GPU = pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
PROMPTS = ["Shall I compare thee to a summer's day?", "Let me not to the marriage of true minds",
           "That time of year thou mayst in me behold"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,n", [(1, 40, 24), (5, 33, 70), (33, 48, 20)])
def test_linear_int8_kernel_matches_its_reference(device, dtype, t, k, n):
    """Small T takes the maps-free path (one row tile), larger T the segment path; narrow
    outputs split K. Compared with the dequantised reference in float64."""
    from kernels.moe.triton import linear_triton

    gen = torch.Generator().manual_seed(t + k + n)
    x = torch.randn(2, t, k, generator=gen).to(device, dtype)  # leading dims are kept
    w = torch.randn(n, k, generator=gen)
    q, s = kernels.quantize_int8(w[None])
    q, s = q[0].to(device), s[0].to(device)
    out = linear_triton(x, q, s)
    ref = x.double() @ (q.double() * s.double()[:, None]).t()
    assert out.shape == (2, t, n) and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]
    wd = w.to(device, dtype)  # the same GEMM on full-precision weights
    assert rel(linear_triton(x, wd), x.double() @ wd.double().t()) < TOL[dtype]
    assert rel(sbi_linear_ref(x.cpu(), q.cpu(), s.cpu()), ref.cpu()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_int8_in_blocks_leaves_its_input_alone(dtype):
    """Blocks of rows give the same int8 weights and scales as one pass, and the float32
    work done in place never touches the caller's weights (a float32 input included)."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(3, 37, 50, generator=gen) * torch.rand(3, 37, 1, generator=gen)).to(dtype)
    before = w.clone()
    q, s = kernels.quantize_int8(w, max_elements=200)  # 4 rows per block, the last one short
    assert torch.equal(w, before)
    wf = w.double()
    expected = wf.abs().amax(-1).clamp(min=1e-12) / 127
    torch.testing.assert_close(s.double(), expected, rtol=1e-6, atol=0)
    assert torch.equal(q, kernels.quantize_int8(w)[0]) and q.dtype == torch.int8
    assert (q.abs().amax(-1) == 127).all()
    assert ((q.double() * s.double()[..., None] - wf).abs() <= s.double()[..., None] / 2 + 1e-6).all()


def test_dense_linear_routes_by_the_table(monkeypatch, tmp_path):
    """Without a table entry: cuBLAS for full-precision weights, SBI-GeMM for int8; an
    entry picks SBI-GeMM (Triton, or CUDA with a launch configuration) or linear_triton per
    shape and row bucket; every pick gives the
    same numbers (CPU tensors here take the reference, so the choice is checked directly)."""
    from kernels.linear import select as dl
    from kernels import tuning
    from kernels.tuning import LinearCublas, LinearCuda, LinearSbi, LinearTriton

    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"int8 needs its per-output-channel scale"):
        kernels.dense_linear(torch.randn(2, 8), q)
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(tuning, "device_name", lambda d: "h")
    cuda = LinearCuda(bn=4, warps=4, unroll=2, split_k=2)
    tuning.write_table(tmp_path, tuning.Table("linear", "h", "bfloat16", {
        "N30:K40": {1: LinearSbi(), 4: LinearTriton(), 8: cuda}}))
    tuning.write_table(tmp_path, tuning.Table("linear", "h", "int8", {"N30:K40": {8: LinearTriton()}}))
    monkeypatch.setattr(tuning, "TABLES", tuning.Tables(tmp_path))
    dl.choice.cache_clear()
    assert dl.choice(dev, 30, 40, torch.bfloat16, 1) == LinearSbi()
    assert dl.choice(dev, 30, 40, torch.bfloat16, 3) == LinearTriton()  # bucket 4
    assert dl.choice(dev, 30, 40, torch.bfloat16, 16) == LinearCublas()  # no entry
    assert dl.choice(dev, 30, 40, torch.int8, 9) == LinearSbi()  # past the largest bucket: the heuristic
    assert dl.choice(dev, 31, 40, torch.int8, 1) == LinearSbi()  # no entry
    assert dl.choice(dev, 30, 40, torch.bfloat16, 5) == cuda  # the CUDA kernel with its launch configuration
    # A device of the same chip lends an entry for a shape and bucket this one lacks.
    root = tmp_path / "chip"
    tuning.write_table(root, tuning.Table("linear", "h", "bfloat16", {"N30:K40": {1: LinearSbi()}}))
    tuning.write_table(root, tuning.Table("linear", "h2", "bfloat16", {"N30:K40": {1: LinearTriton(), 8: cuda}}))
    tuning.write_table(root, tuning.Table("linear", "h2", "int8", {"N64:K40": {2: LinearTriton()}}))
    monkeypatch.setattr(tuning, "TABLES", tuning.Tables(root, chips=(("h", "h2"),)))
    dl.choice.cache_clear()
    assert dl.choice(dev, 30, 40, torch.bfloat16, 1) == LinearSbi()  # its own first
    assert dl.choice(dev, 30, 40, torch.bfloat16, 8) == cuda
    assert dl.choice(dev, 64, 40, torch.int8, 2) == LinearTriton()
    assert dl.choice(dev, 64, 40, torch.int8, 16) == LinearSbi()  # no one's entry
    dl.choice.cache_clear()
    x, w, b = torch.randn(2, 3, 40), torch.randn(30, 40), torch.randn(30)
    torch.testing.assert_close(kernels.dense_linear(x, w, b), x @ w.t() + b)


@pytest.mark.parametrize("kind", [nn.Linear, ColumnParallelLinear, RowParallelLinear])
def test_int8_linear_equals_the_dequantised_layer(kind):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=True) if kind is nn.Linear else kind(24, 40, True, Group.alone())
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    q = Int8Linear(layer)
    x = torch.randn(3, 5, 24)
    deq = q.weight.float() * q.scale[:, None]
    torch.testing.assert_close(q(x), x @ deq.t() + layer.bias, rtol=1e-5, atol=1e-5)
    assert q.weight.dtype == torch.int8 and (q.reduce is not None) == (kind is RowParallelLinear)
    # Per-channel scales: each row's largest weight maps to +-127.
    assert (q.weight.abs().amax(1) == 127).all()
    assert rel(q(x), layer(x).detach()) < 1e-2


def test_converter_at_load_keeps_the_greedy_text_of_the_embedded_model(device_dtype):
    """engine.quantize = int8: experts and every linear layer but the router become int8;
    greedy continuations equal the full-precision model's; the logit error is bounded
    (measured: fp32 on CPU 2026-11-22; bf16 on the H100 0.039 against the bf16 model,
    2026-11-25: see docs/performance.md)."""
    device, dtype = device_dtype
    full = moe_infer.load(device=device, dtype=dtype, progress=False)
    q = moe_infer.load(device=device, dtype=dtype, progress=False, quantize="int8")
    linears = [m for m in q.model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 3 * 2 + 1  # per layer qkv_proj and o_proj; the untied LM head
    assert sum(isinstance(m, Int8Experts) for m in q.model.modules()) == 3
    assert not any(isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) for m in q.model.modules())
    assert [o.text for o in q.generate(PROMPTS, max_new_tokens=40)] == \
        [o.text for o in full.generate(PROMPTS, max_new_tokens=40)]
    ids = [full.tokenizer.encode(p) for p in PROMPTS]
    err = rel(q.logits(ids), full.logits(ids))
    assert err < (3e-2 if dtype == torch.float32 else 5e-2), err


def test_quantize_config_is_checked_and_routers_stay_full_precision():
    with pytest.raises(ConfigError, match=r"engine\.quantize.*one of int8"):
        EngineConfig(quantize="int4")
    model = nn.ModuleDict({"router": nn.Linear(32, 32), "proj": nn.Linear(32, 32), "tiny": nn.Linear(32, 4)})
    assert quantize_linears(model) == 1
    assert isinstance(model["proj"], Int8Linear) and isinstance(model["router"], nn.Linear)
    assert isinstance(model["tiny"], nn.Linear)  # narrower than min_out


def test_converter_frees_each_full_precision_module_as_it_goes():
    """Each bf16 Experts / linear module is freed by reference counting the moment its int8
    version replaces it (a reference cycle would keep every one alive until a garbage
    collection: a model filling the GPU then runs out of memory while converting)."""
    import gc
    import weakref

    from dense.quant import LINEAR_TYPES
    from moe_infer.experts import Experts, quantize_model

    engine = moe_infer.load(progress=False)
    refs = [weakref.ref(m) for name, m in engine.model.named_modules()
            if type(m) is Experts or (isinstance(m, LINEAR_TYPES) and "router" not in name)]
    assert len(refs) == 3 + 3 * 2 + 1  # per layer the experts, qkv_proj and o_proj; the LM head
    gc.disable()
    try:
        quantize_model(engine.model)
        alive = [r() for r in refs if r() is not None]
    finally:
        gc.enable()
    assert not alive, [type(m).__name__ for m in alive]


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text", "deepseek_v3"])
def test_int8_keeps_the_new_families_close(family, tmp_path):
    """int8 weights for GPT-OSS (experts with biases, the biases kept in full precision),
    Llama 4 (weights on the experts' inputs) and DeepSeek-V3 (latent attention: kv_b_proj,
    read as per-head matrices, stays in full precision; its merged input projection is int8):
    logits near the fp32 model's."""
    from hf_models import save_hf_model

    save_hf_model(family, tmp_path)
    full = moe_infer.load(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    q = moe_infer.load(tmp_path, device="cpu", dtype=torch.float32, progress=False, quantize="int8")
    experts = [m for m in q.model.modules() if isinstance(m, Int8Experts)]
    assert experts and all(e.w13.dtype == torch.int8 for e in experts)
    if family == "gpt_oss":
        assert all(e.b13.dtype == torch.float32 and e.b2 is not None for e in experts)
    if family == "llama4_text":
        assert all(e.weighted_input for e in experts)
    if family == "deepseek_v3":
        assert all(layer.attn.kv_b.dtype == torch.float32 and isinstance(layer.attn.in_proj, Int8Linear)
                   for layer in q.model.layers)
    ids = [[5, 17, 3, 44, 12, 9, 31], [8, 2, 60]]
    assert rel(q.logits(ids), full.logits(ids)) < 5e-2


def test_mxfp4_experts_run_the_models_experts_at_their_4_bit_values():
    """engine.quantize: mxfp4 keeps the routed experts 4-bit (half a byte a weight and a scale
    byte per 32; random codes drawn as they are, never in full precision) and the rest in
    full precision: its logits are those of the same model with the experts' weights
    replaced by their MXFP4 values."""
    from kernels.moe.mxfp4 import dequantize_mxfp4
    from moe_infer.experts import Experts, Mxfp4Experts
    from moe_infer.memory import memory_need

    full = moe_infer.load("tiny-moe", device="cpu", progress=False)
    four = moe_infer.load("tiny-moe", device="cpu", progress=False, quantize="mxfp4")
    mx = [m for m in four.model.modules() if isinstance(m, Mxfp4Experts)]
    plain = [m for m in full.model.modules() if type(m) is Experts]
    assert len(mx) == len(plain) > 0 and not any(isinstance(m, Int8Linear) for m in four.model.modules())
    with torch.no_grad():  # the same dense weights (random draws differ once codes are drawn), the 4-bit experts'
        params = dict(full.model.named_parameters())
        for name, p in four.model.named_parameters():
            if p.is_floating_point():
                params[name].copy_(p)
        for a, b in zip(plain, mx):
            a.w13.copy_(dequantize_mxfp4(b.w13, b.w13_scale, a.w13.dtype))
            a.w2.copy_(dequantize_mxfp4(b.w2, b.w2_scale, a.w2.dtype))
    prompts = [[5, 17, 3, 44], [8, 2]]
    torch.testing.assert_close(four.logits(prompts), full.logits(prompts), rtol=1e-6, atol=1e-6)
    assert [o.token_ids for o in four.generate(prompts, max_new_tokens=5)] == \
        [o.token_ids for o in full.generate(prompts, max_new_tokens=5)]
    need, plain_need = memory_need(four.config, torch.float32), memory_need(full.config, torch.float32)
    expert_weights = sum(m.w13.numel() + m.w2.numel() for m in mx) * 2  # (packed two a byte)
    assert plain_need.weights - need.weights == expert_weights * 4 - expert_weights * (1 / 2 + 1 / 32)


def test_mxfp4_needs_experts_in_groups_of_32():
    import dataclasses

    from moe_infer.loader import resolve_config

    cfg = resolve_config("tiny-moe")
    odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_hidden=100))
    with pytest.raises(ConfigError, match=r"engine\.quantize='mxfp4': expected int8 or null: MXFP4 takes a MoE"):
        moe_infer.load(odd, device="cpu", progress=False, quantize="mxfp4")


@pytest.mark.parametrize("ep_rank,ep,slice_rank,slices", [(1, 2, 0, 1), (0, 1, 1, 2), (1, 2, 1, 2)])
def test_packed_mxfp4_experts_cut_a_checkpoint_as_the_unpacked_ones_do(ep_rank, ep, slice_rank, slices):
    """An expert-parallel or expert-sliced rank's empty MXFP4 experts take their share of the
    whole packed tensors: the codes and scales of their share of the whole float weights."""
    from moe_infer.experts import Experts, Mxfp4Experts

    e, h, f = 4, 64, 128
    with torch.device("meta"):
        plain = Experts(e, h, f, "swiglu_oai", ep_rank, ep, slice_rank, slices, bias=True)
    packed = Mxfp4Experts.packed_like(plain)
    gen = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(e, 2 * f, h, generator=gen), torch.randn(e, h, f, generator=gen)
    (q13, s13), (q2, s2) = kernels.quantize_mxfp4(w13), kernels.quantize_mxfp4(w2)
    for name, full, want in (("w13", q13, plain.shard_fns["w13"](w13)), ("w13_scale", s13, plain.shard_fns["w13"](w13)),
                             ("w2", q2, plain.shard_fns["w2"](w2)), ("w2_scale", s2, plain.shard_fns["w2"](w2))):
        got = packed.shard_fns[name](full)
        assert got.shape == getattr(packed, name).shape, name
        assert torch.equal(got, kernels.quantize_mxfp4(want)[name.endswith("_scale")]), name
