"""The dense transformer backbone: norms, rotary positions, attention with a paged KV cache, MLP.

Modules take a ``moe_infer.config.ModelConfig``-shaped object (duck-typed: this package
imports nothing from ``moe_infer``), the user's ``kernels.options.KernelOptions`` at
construction, and a per-step ``StepContext``.
"""
from dense.attention import Attention, PagedKVCache, StepContext
from dense.mlp import MLP
from dense.norm import LayerNorm, RMSNorm, make_norm
from dense.rotary import Rotary, apply_rotary

__all__ = ["Attention", "PagedKVCache", "StepContext", "MLP", "LayerNorm", "RMSNorm", "make_norm", "Rotary",
           "apply_rotary"]
