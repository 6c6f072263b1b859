"""The MoE experts on one device: x [T, H] and a routing table -> the weighted sum of each
token's k experts' outputs [T, H] (DeepSpeed-Inference V-C: maps, scatter, the grouped
expert GEMMs, gather), and the int8 weight quantizer the experts' int8 form uses.

Shape letters: T tokens, H hidden, E experts, k slots per token, F expert width,
N = T * k rows of the expert-major buffer.

Backends: a CPU tensor runs the plain-torch reference (``reference.py``); a CUDA tensor
runs ``triton.py`` (imported at that first call), which picks per device, weight dtype,
shape and T from the moe tables (``kernels.tuning``): the Triton grouped GEMMs
(``grouped_gemm.py``) with the maps and combine of ``kernels.layout``, the CUDA C++ decode
kernels (``cuda.py``, compiled through CuPy, small T), the down GEMM by
``torch._grouped_mm``, or int8 experts widened first.
"""
from __future__ import annotations

import torch

from kernels.moe.mxfp4 import GROUP, quantize_mxfp4
from kernels.moe.reference import ACTIVATIONS, GATED, fused_moe_ref, placed_ids, quantize_int8


def _check_moe_args(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, b13=None, b2=None):
    _check_experts(x, w13, w2, activation, w13_scale, w2_scale)
    for name, b, w in (("b13", b13, w13), ("b2", b2, w2)):
        if b is not None and tuple(b.shape) != tuple(w.shape[:2]):
            raise ValueError(f"{name} {list(b.shape)}: expected [E, rows of {name.replace('b', 'w')}] = "
                             f"{list(w.shape[:2])}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} / topk_weights "
                         f"{list(topk_weights.shape)}: expected both [T={x.shape[0]}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected int32 or int64, got {topk_ids.dtype}")


FAR_KEYS = ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2")


def _check_far(far: dict, slots, near: dict) -> None:
    """``far``'s experts as the near ones (``near``: fused_moe's w13, w2, scales, biases):
    the same tensors but for the number of experts, the same dtypes; ``slots`` int64 [E'];
    ValueError naming them."""
    if set(far) - set(FAR_KEYS) or {k for k, v in near.items() if v is not None} != set(far):
        raise ValueError(f"far {sorted(far)}: expected the tensors given for the near experts, "
                         f"{sorted(k for k, v in near.items() if v is not None)}")
    e = far["w2"].shape[0]
    for k, v in far.items():
        want = (e, *near[k].shape[1:])
        if tuple(v.shape) != want or v.dtype != near[k].dtype:
            raise ValueError(f"far {k} {list(v.shape)} {v.dtype}: expected {list(want)} {near[k].dtype} (its near "
                             f"one's shape with far {k}'s experts)")
    if slots is None or slots.dtype != torch.int64 or tuple(slots.shape) != (e,) or not slots.is_contiguous():
        raise ValueError(f"slots {None if slots is None else (slots.dtype, list(slots.shape))}: expected int64 "
                         f"[{e}] (far's experts), contiguous, with far")


def _check_experts(x, w13, w2, activation, w13_scale, w2_scale):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, H], got shape {list(x.shape)}")
    h = x.shape[1]
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 / w2: expected [E, 2F, H] / [E, H, F], got "
                         f"{list(w13.shape)} / {list(w2.shape)}")
    if (w13.dtype == torch.uint8) != (w2.dtype == torch.uint8):
        raise ValueError(f"w13 {w13.dtype} / w2 {w2.dtype}: expected both MXFP4 (uint8) or neither")
    packs = 2 if w13.dtype == torch.uint8 else 1  # MXFP4: two weights a byte along K
    e, f = w2.shape[0], w2.shape[2] * packs
    rows13 = 2 * f if activation in GATED else f
    if tuple(w13.shape) != (e, rows13, h // packs) or w2.shape[1] != h or h % packs:
        raise ValueError(f"w13 {list(w13.shape)} / w2 {list(w2.shape)}: expected "
                         f"[E, {'2F' if activation in GATED else 'F'}, H={h}{' / 2' * (packs > 1)}] / "
                         f"[E, H={h}, F{' / 2' * (packs > 1)}]")
    for name, w, s in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if (w.dtype in (torch.int8, torch.uint8)) != (s is not None):
            raise ValueError(f"{name}_scale: expected scales exactly when {name} is int8 or MXFP4 (uint8)")
        if s is None:
            continue
        want = (*w.shape[:2], w.shape[2] * 2 // GROUP) if w.dtype == torch.uint8 else tuple(w.shape[:2])
        if tuple(s.shape) != want or (w.dtype == torch.uint8) != (s.dtype == torch.uint8):
            raise ValueError(f"{name}_scale {list(s.shape)} {s.dtype}: expected {list(want)} "
                             f"{'uint8 (E8M0 group scales)' if w.dtype == torch.uint8 else 'per-channel floats'}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              capacity: int | None = None, maps: tuple | None = None, *, pdl: bool = True,
              masked: bool = False, first_expert: int = 0, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, weighted_input: bool = False,
              far: dict[str, torch.Tensor] | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """MoE expert computation on one device: x [T, H] -> [T, H].

    w13 [E, 2F, H] holds each expert's gate rows then up rows (Hugging Face / vLLM layout;
    [E, F, H] for the plain GeLU experts of GPT-style models), w2 [E, H, F]. int8 weights
    come with per-output-channel scales ``w13_scale [E, 2F]``, ``w2_scale [E, H]``
    (``quantize_int8``); MXFP4 weights (uint8, two a byte: w13 [E, 2F, H / 2], w2 [E, H, F / 2])
    with group scales ``w13_scale [E, 2F, H / 32]``, ``w2_scale [E, H, F / 32]`` uint8
    (``quantize_mxfp4``). ``capacity`` drops pairs past that many per expert (None: dropless).
    ``maps`` (from ``route``) saves recomputing the maps of ``topk_ids`` on a GPU. ``pdl``: the
    GPU kernels launch with programmatic dependent launch where the device has it
    (``kernels.pdl``; every op here takes it). ``masked``: the ids count from
    ``first_expert`` (w13 and w2 hold experts first_expert .. first_expert + E - 1, the ids
    may be a model's global ones); a pair whose expert is not among them (a negative id, or
    one on another rank) adds nothing and reads no weights; ``maps`` are then not taken.
    ``b13`` [E, 2F or F] / ``b2`` [E, H]: per-expert biases (GPT-OSS), added after each GEMM,
    before the activation and before the combine weight. On a GPU the weights, scales and
    biases may lie in pinned host memory: the kernels read them in place over the bus (each
    expert's once per row tile of its pairs: once at decode sizes).
    ``weighted_input`` (Llama 4): each pair's weight scales its expert's input, not its output
    (the same as scaling the up GEMM's output before the activation).
    ``far`` / ``slots``: the experts in two places (an offloaded layer: every expert in
    pinned host memory, read in place, some also on the device): ``far`` {"w13": [E', ...],
    "w2": ..., and the scales and biases the near ones have} holds the E' experts the ids
    name, ``slots`` [E'] int64 where w13 / w2 hold each one (-1: only in far). The CUDA
    decode kernels take both places in one launch each (pairs of either place side by
    side); elsewhere a masked call a place, summed.
    """
    _check_moe_args(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, b13, b2)
    if far is not None or slots is not None:
        _check_far(far or {}, slots, dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, b13=b13, b2=b2))
        if capacity is not None:
            raise ValueError("far: experts in two places run dropless (capacity None)")
    if x.is_cuda:
        from kernels.moe.triton import fused_moe_triton
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale,
                                capacity, maps=None if masked else maps, pdl=pdl, masked=masked,
                                first_expert=first_expert, b13=b13, b2=b2, weighted_input=weighted_input, far=far,
                                slots=slots)
    if far is not None:  # one place: the near experts, then far's, the ids made its
        topk_ids, masked, first_expert = placed_ids(topk_ids, first_expert, slots, w2.shape[0]), True, 0
        cat = {k: torch.cat([v, far[k].to(v.device)]) for k, v in
               dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, b13=b13, b2=b2).items() if k in far}
        w13, w2, w13_scale, w2_scale, b13, b2 = (cat.get(k) for k in FAR_KEYS)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, capacity, masked,
                         b13, b2, weighted_input, first_expert)


_ONE_EXPERT: dict = {}  # (rows, device) -> the pairs of every row with one expert: ids 0, weights 1
GATED_MLP_MAX_T = 16  # rows to which the moe tables hold entries for the shared-expert shapes (tune_moe.py)


def gated_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, *, pdl: bool = True) -> torch.Tensor:
    """A dense SwiGLU MLP: x [T, H], w13 [2F, H] (gate rows, then up rows), w2 [H, F] (int8
    with per-row scales [2F] / [H]) -> silu(x w_gate) * (x w_up) @ w2.T [T, H]. At decode
    sizes on a GPU (T <= ``GATED_MLP_MAX_T``) it runs as ``fused_moe`` with the MLP as the
    one expert of every row (a shared expert, a dense layer), by the moe tables' entries for
    that shape: two launches, the activation inside the first, where two GEMMs and two
    elementwise ops ran. Elsewhere: the two GEMMs (``kernels.dense_linear``) and torch's
    activation."""
    from kernels.linear import dense_linear

    t = x.shape[0]
    if x.is_cuda and x.dim() == 2 and t <= GATED_MLP_MAX_T:
        key = (t, x.device)
        if key not in _ONE_EXPERT:  # made once per size, outside a graph's capture (its warm-up runs)
            _ONE_EXPERT[key] = (torch.zeros(t, 1, dtype=torch.int32, device=x.device),
                                torch.ones(t, 1, dtype=torch.float32, device=x.device))
        ids, weights = _ONE_EXPERT[key]
        return fused_moe(x, w13[None], w2[None], weights, ids, "silu", None if w13_scale is None else w13_scale[None],
                         None if w2_scale is None else w2_scale[None], pdl=pdl)
    gate, up = dense_linear(x, w13, scale=w13_scale, pdl=pdl).chunk(2, dim=-1)
    return dense_linear(torch.nn.functional.silu(gate) * up, w2, scale=w2_scale, pdl=pdl)


__all__ = ["fused_moe", "gated_mlp", "quantize_int8", "quantize_mxfp4"]
