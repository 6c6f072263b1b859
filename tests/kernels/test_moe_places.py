"""Experts in host memory (``kernels.fused_moe`` over an offloaded layer's weights): pinned
host weights read in place, and the two places of ``far`` / ``slots`` (every expert in
host memory, some also on the device) against one place, on CPU, under the interpreter
and on a GPU. Tolerances are relative norm errors."""
import pytest
import torch

from kernels.moe import fused_moe
from kernels.moe.reference import fused_moe_ref, quantize_int8
from kernels.moe.triton import fused_moe_triton
from tests.kernels.common import rel, routing
from tests.kernels.test_moe import TOL, gpt_oss_experts, weights


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 512])
@pytest.mark.parametrize("int8", [False, True])
def test_weights_in_pinned_host_memory_are_read_in_place(t, int8):
    """Experts in pinned host memory (offloaded experts at decode sizes): the kernels read
    them over the bus where they lie and give the result of the same weights on the device,
    plain and masked, at sizes where the tables choose the CUDA decode kernels, the Triton
    GEMMs or torch's grouped GEMM (which takes device weights only: the Triton GEMM then)."""
    gen = torch.Generator().manual_seed(t)
    e, h, f, k = 16, 1024, 512, 4
    w13, w2 = weights(e, h, f, "silu", torch.bfloat16, "cpu", gen)
    x = torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16)
    ids, w = routing(t, e, k, "cuda", gen)
    scales = {}
    if int8:
        (w13, s13), (w2, s2) = quantize_int8(w13), quantize_int8(w2)
        scales = {"w13_scale": s13, "w2_scale": s2}
    host = [z.pin_memory() for z in (w13, w2)]
    host_scales = {n: z.pin_memory() for n, z in scales.items()}
    dev_scales = {n: z.cuda() for n, z in scales.items()}
    masked = torch.where(ids % 3 == 0, -1, ids)
    for tid, m in ((ids, False), (masked, True)):
        want = fused_moe(x, w13.cuda(), w2.cuda(), w, tid, masked=m, **dev_scales)
        got = fused_moe(x, *host, w, tid, masked=m, **host_scales)
        assert rel(got.float(), want.float()) < TOL[torch.bfloat16]


def two_places(tensors: dict, cached: list[int], pin: bool) -> tuple[dict, dict, torch.Tensor, dict]:
    """A layer's tensors (w13, w2, scales, biases) in two places: (near: experts ``cached``
    at slots 0, 1, .., their float tensors doubled so that a read from the wrong place
    shows; far: every expert, in pinned host memory where ``pin``; slots [E]; the one
    place of what the pair of places holds, near's values where near has them)."""
    index = torch.tensor(cached, device=tensors["w2"].device)
    near = {k: v[index] * 2 if v.is_floating_point() else v[index] for k, v in tensors.items()}
    slots = torch.full((tensors["w2"].shape[0],), -1, dtype=torch.int64, device=index.device)
    slots[index] = torch.arange(len(cached), device=index.device)
    one = {k: v.index_copy(0, index, near[k]) for k, v in tensors.items()}
    far = {k: v.cpu().pin_memory() if pin else v for k, v in tensors.items()}
    return near, far, slots, one


def experts_of(kind: str, t: int, device, gen):
    """x, ids, weights, the activation and a layer's tensors of 12 experts, k = 4: bf16
    ("bf16"), int8 with scales ("int8"), GPT-OSS's with biases ("gpt_oss")."""
    e, h, f, k = 12, 64, 32, 4
    if kind == "gpt_oss":
        x, w13, w2, b13, b2, ids, w = gpt_oss_experts(t, h, f, e, k, device, torch.bfloat16, t)
        return x, ids, w, "swiglu_oai", dict(w13=w13, w2=w2, b13=b13, b2=b2)
    w13, w2 = weights(e, h, f, "silu", torch.bfloat16, "cpu", gen)
    x = torch.randn(t, h, generator=gen).to(device, torch.bfloat16)
    ids, w = routing(t, e, k, device, gen)
    tensors = dict(w13=w13, w2=w2)
    if kind == "int8":
        (q13, s13), (q2, s2) = quantize_int8(w13), quantize_int8(w2)
        tensors = dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
    return x, ids, w, "silu", {n: z.to(device) for n, z in tensors.items()}


CACHED = [7, 2, 9, 4, 0]  # the near place's experts, in slot order


def id_cases(ids):
    """(ids, masked, first expert): plain; masked, pairs of no expert (-1); from a first
    expert, ids past the layer's."""
    return [(ids, False, 0), (torch.where(ids % 3 == 0, -1, ids), True, 0), (torch.where(ids == 5, 20, ids + 2), True, 2)]


@pytest.mark.parametrize("kind", ["bf16", "int8", "gpt_oss"])
def test_experts_in_two_places_on_cpu_and_bad_places(kind):
    """``far`` / ``slots`` on the CPU: pairs of experts held near read near's weights, the
    others far's, plain, masked and from a first expert; a far place unlike the near one,
    or slots not of far's experts, are named."""
    gen = torch.Generator().manual_seed(3)
    x, ids, w, act, tensors = experts_of(kind, 5, "cpu", gen)
    near, far, slots, one = two_places(tensors, CACHED, pin=False)
    for tid, m, first in id_cases(ids):
        got = fused_moe(x, topk_weights=w, topk_ids=tid, activation=act, masked=m, first_expert=first, far=far,
                        slots=slots, **near)
        want = fused_moe(x, topk_weights=w, topk_ids=tid, activation=act, masked=m, first_expert=first, **one)
        assert rel(got.float(), want.float()) < TOL[torch.bfloat16], (m, first)
    with pytest.raises(ValueError, match="far w2 .*expected"):
        fused_moe(x, topk_weights=w, topk_ids=ids, activation=act, far={**far, "w2": far["w2"][:, :8]}, slots=slots,
                  **near)
    with pytest.raises(ValueError, match="far .*expected the tensors given for the near experts"):
        fused_moe(x, topk_weights=w, topk_ids=ids, activation=act, far={"w13": far["w13"]}, slots=slots, **near)
    with pytest.raises(ValueError, match=r"slots .*expected int64 \[12\]"):
        fused_moe(x, topk_weights=w, topk_ids=ids, activation=act, far=far, slots=slots[:5], **near)


@pytest.mark.interp
@pytest.mark.parametrize("t", [1, 5])
def test_experts_in_two_places_interpreted(t):
    """``far`` / ``slots`` through the GPU path's choice under the interpreter (the CUDA
    decode kernels cannot run there: a masked call a place), against the float64
    reference of the one place they make."""
    gen = torch.Generator().manual_seed(t)
    x, ids, w, act, tensors = experts_of("bf16", t, "cpu", gen)
    x, tensors = x.float(), {k: v.float() for k, v in tensors.items()}
    near, far, slots, one = two_places(tensors, CACHED, pin=False)
    ref = fused_moe_ref(x.double(), one["w13"].double(), one["w2"].double(), w.double(), ids, act)
    got = fused_moe_triton(x, near["w13"], near["w2"], w, ids, act, far=far, slots=slots)
    assert rel(got, ref) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 8, 64])
@pytest.mark.parametrize("kind", ["bf16", "int8", "gpt_oss"])
def test_experts_in_two_places_read_in_one_call(t, kind, monkeypatch):
    """``far`` / ``slots``: a layer's experts in pinned host memory read in place, some
    also on the device (read there), pairs of both places side by side, plain, masked and
    from a first expert: the result of the one place they make, on the device. Where the
    CUDA decode kernels run (T <= 2 here) one launch each takes both places; elsewhere a
    call a place."""
    from kernels.moe import cuda as moe_cuda

    gen = torch.Generator().manual_seed(t)
    x, ids, w, act, tensors = experts_of(kind, t, "cuda", gen)
    near, far, slots, one = two_places(tensors, CACHED, pin=True)
    calls = []
    run = moe_cuda.run
    monkeypatch.setattr(moe_cuda, "run", lambda *a, **kw: calls.append(kw.get("far") is not None) or run(*a, **kw))
    for tid, m, first in id_cases(ids):
        want = fused_moe(x, topk_weights=w, topk_ids=tid, activation=act, masked=m, first_expert=first, **one)
        calls.clear()
        got = fused_moe(x, topk_weights=w, topk_ids=tid, activation=act, masked=m, first_expert=first, far=far,
                        slots=slots, **near)
        assert rel(got.float(), want.float()) < TOL[torch.bfloat16], (m, first)
        assert calls == ([True] if t <= 2 else []), calls
