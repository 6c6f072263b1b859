"""Causal self-attention (MHA / GQA / MQA) with a preallocated KV cache.

Shape letters: B batch, T tokens this step, S key slots visible this step, H hidden,
D head dim. Ragged batches are handled by masks, never by per-row loops: ``key_valid``
marks real tokens (left or right padding both work) and positions are per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dense.norm import RMSNorm
from dense.rotary import Rotary, apply_rotary


@dataclass
class StepContext:
    """What every layer of one forward step shares, computed once per step."""

    positions: torch.Tensor  # [B, T] int64 position of each query token
    attn_mask: torch.Tensor  # [B, 1, T, S] bool, True where a query may attend
    cos: torch.Tensor | None  # [B, T, D] rotary tables, None for learned positions
    sin: torch.Tensor | None
    start: int  # cache slot of the first query token (0 without a cache)

    @classmethod
    def build(cls, positions: torch.Tensor, key_valid: torch.Tensor,
              key_positions: torch.Tensor, start: int, rotary: Rotary | None,
              dtype: torch.dtype, sliding_window: int | None = None) -> "StepContext":
        """positions [B, T]; key_valid, key_positions [B, S] with S = start + T."""
        t, s = positions.shape[1], key_valid.shape[1]
        device = positions.device
        q_slot = torch.arange(start, start + t, device=device)  # [T]
        k_slot = torch.arange(s, device=device)  # [S]
        causal = k_slot[None, :] <= q_slot[:, None]  # [T, S]
        mask = key_valid[:, None, :] & causal  # [B, T, S]
        if sliding_window is not None:
            dist = positions[:, :, None] - key_positions[:, None, :]
            mask &= dist < sliding_window
        # A padding query may have no valid key; let it see itself so softmax stays finite.
        mask |= k_slot[None, :] == q_slot[:, None]
        cos = sin = None
        if rotary is not None:
            cos, sin = rotary(positions, dtype)
        return cls(positions, mask.unsqueeze(1), cos, sin, start)


class KVCache:
    """Keys and values of every layer, allocated once: [layers, B, KV heads, S_max, D]."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Writes k, v [B, KV heads, T, D] at slots start.. and returns the keys and
        values of slots 0 .. start + T."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_width, kv_width, kv_width)
        # One fused projection for q, k and v: one weight read per step.
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_width + 2 * kv_width, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_width, cfg.hidden_size, bias=cfg.out_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":  # Qwen3: over each head's D values
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps), RMSNorm(self.head_dim, cfg.norm_eps)
        elif cfg.qk_norm == "full":  # OLMoE: over all heads together
            self.q_norm, self.k_norm = RMSNorm(q_width, cfg.norm_eps), RMSNorm(kv_width, cfg.norm_eps)
        self.clip_qkv = cfg.clip_qkv

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: KVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)  # [B, T, heads * D] each
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, D]
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if ctx.cos is not None:
            q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        if cache is not None:
            k, v = cache.append(layer, ctx.start, k, v)  # [B, KV heads, S, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.attn_mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
