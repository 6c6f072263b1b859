"""Kernel options (``engine: {pdl, fused_decode_attention}``): the engine config fills one
``KernelOptions``, every layer that launches kernels holds it, each kernel call gets its
``pdl``, and the launch decision is a function of (device, options) alone."""
import pytest
import torch

import dense.parallel_linear
import kernels
import kernels.pdl
from dense import Attention, RMSNorm
from dense.parallel_linear import ColumnParallelLinear, Linear, RowParallelLinear
from dense.quant import Int8Linear
from kernels.options import KernelOptions
from moe_infer.config_files import config_from_dict
from moe_infer.engine import Engine
from moe_infer.experts import Experts, Int8Experts, quantize_model
from moe_infer.loader import _materialize
from moe_infer.model import Block, Transformer
from moe_infer.runner import PagedRunner, Row

MOE = {  # RMSNorm, per-head q/k norm, a dense first layer, shared experts, an untied LM head
    "model": dict(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden=40,
                  max_position=64, qk_norm="head"),
    "moe": dict(num_experts=4, top_k=2, expert_hidden=16, first_dense=1, shared_experts=1,
                shared_expert_hidden=16),
}
# Every module type that launches kernels itself and so must hold the options.
HOLDERS = (Block, Attention, RMSNorm, Linear, ColumnParallelLinear, RowParallelLinear, Experts)


def _model(engine: dict) -> Transformer:
    cfg = config_from_dict({**MOE, "engine": engine})
    with torch.device("meta"):
        model = Transformer(cfg)
    _materialize(model, torch.device("cpu"), torch.float32)
    model.init_random(0)
    return model.eval()


def _prefill_and_decode(model: Transformer, graph: bool):
    """A prefill of two rows through the runner, then one fixed-shape decode step (captured
    where ``graph``, else run eagerly)."""
    engine = Engine(model, model.cfg)
    engine.decode_mode = "graph" if graph else "static"
    runner = PagedRunner(engine, num_blocks=8, block_size=8, max_batch=2)
    rows = [Row([3, 14, 15, 9], 0, [0]), Row([2, 6, 5, 3], 0, [1])]
    runner.forward(rows)
    runner.forward([Row([7], 4, [0]), Row([1], 4, [1])])


def test_kernel_options_validate_their_fields():
    assert KernelOptions() == KernelOptions(pdl=True, fused_decode_attention=True)
    with pytest.raises(ValueError, match=r"KernelOptions\.pdl='yes': expected True or False"):
        KernelOptions(pdl="yes")
    with pytest.raises(ValueError, match=r"KernelOptions\.fused_decode_attention=0: expected True or False"):
        KernelOptions(fused_decode_attention=0)


def test_pdl_launch_is_a_function_of_device_and_option(monkeypatch):
    """On a PDL-capable GPU the option alone decides, call after call in either order (no
    per-device decision is kept); the environment plays no part; a CPU tensor or an older
    GPU never gets the launch option."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(kernels.pdl, "_hopper_or_later", lambda index: True)
    monkeypatch.setenv("MOE_INFER_PDL", "0")
    for pdl in (True, False, True):
        assert kernels.pdl.pdl_on(gpu, pdl) is pdl
        assert kernels.pdl.pdl_launch(gpu, pdl) == ({"PDL": 2, "launch_pdl": True} if pdl else {"PDL": 0})
    assert kernels.pdl.pdl_launch(torch.device("cpu"), True) == {"PDL": 0}
    monkeypatch.setattr(kernels.pdl, "_hopper_or_later", lambda index: False)
    assert kernels.pdl.pdl_launch(gpu, True) == {"PDL": 0}


@pytest.mark.parametrize("engine", [{}, {"pdl": False}, {"fused_decode_attention": False},
                                    {"pdl": False, "fused_decode_attention": False}])
def test_engine_options_reach_every_layer(engine):
    """The model's options are the engine section's, and every layer that launches kernels
    holds them, before and after the int8 swap."""
    expected = KernelOptions(**engine)
    model = _model(engine)
    assert model.options == expected
    holders = [m for m in model.modules() if isinstance(m, HOLDERS)]
    assert {type(m) for m in holders} >= set(HOLDERS)
    assert all(m.options == expected for m in holders), [type(m) for m in holders if m.options != expected]
    quantize_model(model)
    swapped = [m for m in model.modules() if isinstance(m, (Int8Linear, Int8Experts))]
    assert {type(m) for m in swapped} == {Int8Linear, Int8Experts}
    assert all(m.options == expected for m in swapped)


@pytest.mark.parametrize("pdl", [False, True])
def test_kernel_calls_get_the_configured_pdl(monkeypatch, pdl):
    """A prefill and a fixed-shape decode step (the graph path's step, run eagerly), in full
    precision and int8: every call of a kernel entry point from the layers carries the
    engine's ``pdl``."""
    seen: dict[str, list] = {}

    def record(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            seen.setdefault(f"{module.__name__}.{name}", []).append(kwargs.get("pdl", "missing"))
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for module, name in ((kernels, "rms_norm"), (kernels, "fused_moe"), (kernels, "argmax"), (kernels, "route"),
                         (kernels, "topk_gating"),
                         (kernels, "dense_linear"), (kernels, "norm_linear"),
                         (dense.parallel_linear, "dense_linear"), (dense.parallel_linear, "norm_linear")):
        record(module, name)
    model = _model({"pdl": pdl})
    with torch.no_grad():
        for _ in range(2):  # full precision, then int8
            _prefill_and_decode(model, graph=False)
            quantize_model(model)
    assert set(seen) - {"kernels.topk_gating"} == {
        "kernels.rms_norm", "kernels.fused_moe", "kernels.argmax", "kernels.route", "kernels.dense_linear",
        "kernels.norm_linear", "dense.parallel_linear.dense_linear", "dense.parallel_linear.norm_linear"}
    assert {name: set(values) for name, values in seen.items()} == {name: {pdl} for name in seen}


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_every_launch_of_a_dense_step_asks_with_the_configured_pdl(monkeypatch, pdl):
    """On a GPU, a dense model's prefill and captured decode step: every launch of
    our kernels (Triton and CUDA C++) decides PDL from the engine's option."""
    import kernels.cuda_common

    asked, real = [], kernels.pdl.pdl_on

    def spy(device, flag):
        asked.append(flag)
        return real(device, flag)
    monkeypatch.setattr(kernels.pdl, "pdl_on", spy)
    monkeypatch.setattr(kernels.cuda_common, "pdl_on", spy)
    cfg = config_from_dict({"model": dict(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                          ffn_hidden=512, max_position=128, qk_norm="head"),
                            "engine": {"pdl": pdl}})
    with torch.device("meta"):
        model = Transformer(cfg)
    _materialize(model, torch.device("cuda"), torch.bfloat16)
    model.init_random(0)
    with torch.no_grad():
        _prefill_and_decode(model.eval(), graph=True)
    torch.cuda.synchronize()
    assert asked and set(asked) == {pdl}
