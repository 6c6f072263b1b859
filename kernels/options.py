"""The kernel options a user may set, as one object that layers take at construction.

The engine fills a ``KernelOptions`` from its config (``engine: {pdl, fused_decode_attention,
fold_shared_experts, overlap_shared_experts, cudnn_prefill_graphs}``) and the model hands it to
every layer that launches kernels; a layer passes ``pdl`` on to each kernel call. Nothing in
``kernels/`` or ``dense/`` reads the environment for these: an A/B comparison builds two option
objects (two engine configs).
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KernelOptions:
    # Decode-path kernels launch with programmatic dependent launch where the GPU has it
    # (compute capability 9.0 or later; see kernels/pdl.py). False: plain launches.
    pdl: bool = True
    # A static-shape decode step runs its attention (QKV epilogue, cache append, attention)
    # in one launch where it fits (kernels.qkv_attention). False: the epilogue launch, then SDPA.
    fused_decode_attention: bool = True
    # An MoE layer's shared experts run as more experts of its fused MoE call, which every
    # token takes (moe_infer.moe_layer.MoELayer.fold_shared). False: a separate MLP and an add.
    fold_shared_experts: bool = True
    # Where the routed experts' outputs cross ranks (expert parallelism: an all-to-all, or
    # an all-reduce over replicas) and a layer's shared MLP is whole on each rank, the shared
    # MLP runs on a second stream while the routed experts and their collectives run
    # (MoELayer.forward). False: after them.
    overlap_shared_experts: bool = True
    # A prefill replayed from a CUDA graph runs its attention on cuDNN's SDPA kernels where
    # they take the shapes (dense.attention.GRAPH_SDPA_BACKENDS): its shapes never change, so
    # cuDNN's execution plan is built once, at capture. False: the kernels eager forwards
    # take (dense.attention.SDPA_BACKENDS).
    cudnn_prefill_graphs: bool = True

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"KernelOptions.{f.name}={value!r}: expected True or False")
