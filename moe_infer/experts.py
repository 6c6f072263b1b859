"""Step 4: the experts' weights, run by the fused MoE kernels (``Experts.fused``).

Shape letters: E experts, H hidden, F expert width, T tokens, k slots.
``Int8Experts`` (weight-only int8) and ``Mxfp4Experts`` (4-bit, groups of 32) are swapped in
by ``quantize_experts``.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels.options import KernelOptions
from moe_infer.config import ConfigError

_KERNEL_ACTIVATION = {"swiglu": "silu", "gelu": "gelu", "swiglu_oai": "swiglu_oai"}


class Experts(nn.Module):
    """w13 [E, 2F, H] (gate rows, then up rows; [E, F, H] for GeLU), w2 [E, H, F]; with
    ``bias`` (GPT-OSS) b13 [E, 2F] and b2 [E, H].

    With expert parallelism this rank holds experts ``expert_range`` (E / ep of them); with
    expert-slicing, F / expert_slicing of each one's width (its gate and up rows, and the
    matching columns of w2), so its outputs are partial sums."""

    def __init__(self, num_experts: int, hidden: int, width: int, activation: str,
                 ep_rank: int = 0, ep: int = 1, slice_rank: int = 0, slices: int = 1,
                 options: KernelOptions = KernelOptions(), bias: bool = False, weighted_input: bool = False):
        super().__init__()
        self.options, self.weighted_input = options, weighted_input
        e, f = num_experts // ep, width // slices
        gated = activation in ("swiglu", "swiglu_oai")
        self.w13 = nn.Parameter(torch.empty(e, 2 * f if gated else f, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, f))
        self.b13 = nn.Parameter(torch.empty(e, 2 * f if gated else f)) if bias else None
        self.b2 = nn.Parameter(torch.empty(e, hidden)) if bias else None
        self.activation = _KERNEL_ACTIVATION[activation]
        first, end = self.expert_range = (ep_rank * e, (ep_rank + 1) * e)
        lo = slice_rank * f

        # These closures must not hold self: a cycle would keep the module (and its weights)
        # alive after the int8 converter swaps it out, until the garbage collector runs.
        def experts_of(full):  # the loader may already have read only this rank's experts
            return full if full.shape[0] == e else full[first:end]

        def w13(full):  # (and b13: the same rows)
            full = experts_of(full)
            if not gated:
                return full[:, lo:lo + f]
            return torch.cat([full[:, lo:lo + f], full[:, width + lo:width + lo + f]], dim=1)

        self.shard_fns = {"w13": w13, "w2": lambda full: experts_of(full)[:, :, lo:lo + f]}
        if bias:
            self.shard_fns.update(b13=w13, b2=experts_of)
        self.adds_b2 = slice_rank == 0  # the slices' outputs are partial sums: one of them adds b2
        self.width_range = (lo, lo + f)  # this rank's columns of each expert's width F

    def scales(self) -> dict:
        return {}

    def biases(self) -> dict:
        return {} if self.b13 is None else {"b13": self.b13, "b2": self.b2 if self.adds_b2 else None}

    def fused(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
              capacity: int | None = None, maps: tuple | None = None, masked: bool = False,
              first_expert: int = 0) -> torch.Tensor:
        """Tokens x [T, H] -> weighted sum of their experts' outputs [T, H], in one pass
        (``masked``: the ids count from ``first_expert``; experts not here, on other ranks,
        add nothing)."""
        return kernels.fused_moe(x, self.w13, self.w2, weights, expert_ids, self.activation,
                                 capacity=capacity, maps=maps, pdl=self.options.pdl, masked=masked,
                                 first_expert=first_expert, **self.scales(),
                                 **self.biases(), weighted_input=self.weighted_input)

    @staticmethod
    def waits_for_host(num_tokens: int) -> bool:
        """Whether a call over ``num_tokens`` tokens waits for the host: never, every expert
        is on the device (offloaded ones may: ``moe_infer.offload``)."""
        return False

    def pairs_from_ids(self, x: torch.Tensor, top_k: int) -> bool:
        """Whether ``fused`` (dropless, no maps) runs on x from the routing ids alone, so the
        router need not build the maps (``kernels.moe.triton.pairs_from_ids``; GPU only)."""
        if not x.is_cuda:
            return False
        from kernels.moe.triton import pairs_from_ids  # the GPU backend: Triton, imported at first use

        return pairs_from_ids(x, self.w13, self.w2, top_k, **self.scales(), **self.biases())


class QuantizedExperts(Experts):
    """Experts whose w13 / w2 are stored quantized by ``quantize`` (w -> (q, scales)); the
    biases stay unquantized."""

    quantize = None  # w [E, N, K] -> (stored weights, their scales)
    scale_parameters = False  # the scales as parameters (a checkpoint fills them), else buffers

    def __init__(self, experts: Experts, stored: tuple | None = None):
        """``stored``: (w13, w13_scale, w2, w2_scale) as they are to be kept (else quantized
        from ``experts``' weights)."""
        nn.Module.__init__(self)
        self.activation, self.expert_range, self.options = experts.activation, experts.expert_range, experts.options
        self.b13, self.b2, self.adds_b2 = experts.b13, experts.b2, experts.adds_b2
        self.weighted_input, self.width_range = experts.weighted_input, experts.width_range
        if stored is None:
            stored = (*type(self).quantize(experts.w13.detach()), *type(self).quantize(experts.w2.detach()))
        q13, s13, q2, s2 = stored
        self.w13 = nn.Parameter(q13, requires_grad=False)
        self.w2 = nn.Parameter(q2, requires_grad=False)
        for name, scale in (("w13_scale", s13), ("w2_scale", s2)):
            if self.scale_parameters:
                setattr(self, name, nn.Parameter(scale, requires_grad=False))
            else:
                self.register_buffer(name, scale)

    def scales(self) -> dict:
        return {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale}


class Int8Experts(QuantizedExperts):
    """Weight-only int8 experts: int8 w13 / w2 with per-output-channel float32 scales."""

    quantize = staticmethod(kernels.quantize_int8)


class Mxfp4Experts(QuantizedExperts):
    """MXFP4 experts (``engine.quantize: mxfp4``; GPT-OSS's release format): w13 / w2 two
    E2M1 codes a byte with a power-of-two scale per 32 weights along K (``kernels.moe.mxfp4``),
    decoded inside the grouped GEMM. Made from full-precision experts (quantized), or
    ``packed_like`` them, empty, for an MXFP4 checkpoint's codes to be read into as they are
    (or random codes drawn): the model's experts then never exist in full precision."""

    quantize = staticmethod(kernels.quantize_mxfp4)
    scale_parameters = True

    def __init__(self, experts: Experts, stored: tuple | None = None):
        for name in ("w13", "w2"):
            k = getattr(experts, name).shape[-1]
            if k % 32:
                raise ConfigError(f"engine.quantize=mxfp4: expected the experts' {name} rows (K = {k}) in groups of "
                                  f"32; this model's (or this rank's share of them) are not")
        super().__init__(experts, stored)

    @classmethod
    def packed_like(cls, experts: Experts) -> "Mxfp4Experts":
        """Empty MXFP4 experts of ``experts``' shapes, on its device, with sharding functions
        that cut a checkpoint's packed tensors as ``experts``' cut the unpacked ones (w13's
        rows alike; w2's columns of F in bytes and in groups)."""
        dev = experts.w13.device
        (e, r13, h), f = experts.w13.shape, experts.w2.shape[2]

        def empty(*shape):
            return torch.empty(shape, dtype=torch.uint8, device=dev)

        out = cls(experts, (empty(e, r13, h // 2), empty(e, r13, h // 32), empty(e, h, f // 2), empty(e, h, f // 32)))
        (first, end), (lo, hi) = experts.expert_range, experts.width_range

        def w2_columns(per: int):  # this rank's experts and columns, ``per`` weights an element
            def cut(full):
                full = full if full.shape[0] == e else full[first:end]
                return full[:, :, lo // per:hi // per]
            return cut

        w13 = experts.shard_fns["w13"]
        out.shard_fns = {"w13": w13, "w13_scale": w13, "w2": w2_columns(2), "w2_scale": w2_columns(32)}
        out.shard_fns.update({k: v for k, v in experts.shard_fns.items() if k in ("b13", "b2")})
        return out


def expert_targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, name) of every full-precision ``Experts`` module of ``model``."""
    # Pairs, not the modules: a list holding every bf16 Experts would keep them all alive
    # until the end, and a model that fills the GPU has no room for that.
    return [(parent, name) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is Experts]


def quantize_experts(model: nn.Module, device: torch.device | None = None, prepare=None,
                     kind: str = "int8") -> nn.Module:
    """Swaps every ``Experts`` module of ``model`` for its ``kind`` ("int8" or "mxfp4")
    version, in place; with ``device``, each module moves there first (weights staged in
    host memory), and ``prepare(module)`` runs before it is quantized."""
    quantized = {"int8": Int8Experts, "mxfp4": Mxfp4Experts}[kind]
    for parent, name in expert_targets(model):
        experts = getattr(parent, name)
        if device is not None:
            experts.to(device)
        if prepare is not None:
            prepare(experts)
        setattr(parent, name, quantized(experts))  # the full-precision module is freed here
    return model


def pack_experts(model: nn.Module) -> nn.Module:
    """Swaps every ``Experts`` module of ``model`` (on the meta device, before loading) for
    empty ``Mxfp4Experts`` of its shapes, in place: an MXFP4 checkpoint's codes load into them
    as they are, or random codes are drawn (``moe_infer.model.init_random``)."""
    for parent, name in expert_targets(model):
        setattr(parent, name, Mxfp4Experts.packed_like(getattr(parent, name)))
    return model


def quantize_model(model: nn.Module, device: torch.device | None = None, prepare=None) -> nn.Module:
    """Weight-only int8 for the whole model, in place: the experts (``Int8Experts``) and
    every dense linear layer but the router and gates (``dense.quant.Int8Linear``).

    With ``device``, a model held in host memory is quantized there module by module and
    then moved whole, so the device never holds more than one full-precision module;
    ``prepare(module)`` runs on each module about to be quantized, once it is there."""
    from dense.quant import quantize_linears

    quantize_experts(model, device, prepare)
    quantize_linears(model, device=device, prepare=prepare)
    if device is not None:
        model.to(device)
    return model
