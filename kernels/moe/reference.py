"""Plain-torch references for the single-device MoE expert computation
(DeepSpeed-Inference, section V-C): the four steps after routing, one after another.

Shape letters: T tokens, H hidden, E experts, k slots per token, F expert width,
N = T * k rows of the expert-major buffer.

  maps      expert_ids [T, k]        -> offsets [E + 1] int32, rows [T, k] int32
  scatter   x [T, H], rows           -> xs [N, H]   (grouped by expert)
  experts   xs [N, H], offsets       -> ys [N, H]
  gather    ys [N, H], rows, weights -> out [T, H]  (weighted sum over the k slots)

The maps, scatter and gather references live in ``kernels.layout.reference``; here are the
experts and the whole chain (``fused_moe_ref``), which the fast kernels must match. Beside
them: the int8 weight quantizer, which every device shares.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.layout.reference import gather_rows_ref, scatter_rows_ref, token_maps_ref
from kernels.moe.mxfp4 import dequantize_mxfp4

# silu: SwiGLU, w13 holds gate rows then up rows; gelu: plain; swiglu_oai: GPT-OSS's
# SwiGLU (gate clamped above at 7, up to [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)).
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
GATED = ("silu", "swiglu_oai")  # w13 holds 2F rows


def expert_ffn_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str = "silu",
                   b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """One expert: x [n, H], w13 [2F or F, H], w2 [H, F] (biases b13 [2F or F], b2 [H]) -> [n, H]."""
    h = x @ w13.t()
    if b13 is not None:
        h = h + b13
    if activation == "silu":
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    elif activation == "swiglu_oai":
        gate, up = h.chunk(2, dim=-1)
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        h = gate * torch.sigmoid(1.702 * gate) * (up + 1)
    elif activation == "gelu":
        h = F.gelu(h)
    else:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    h = h @ w2.t()
    return h if b2 is None else h + b2


def grouped_ffn_ref(xs: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    activation: str = "silu", b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped expert FFN over the expert-major buffer; only experts with rows run."""
    ys = torch.zeros_like(xs)  # [N, H]
    bounds = offsets.tolist()  # a host sync: fine for the reference
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            ys[lo:hi] = expert_ffn_ref(xs[lo:hi], w13[e], w2[e], activation, None if b13 is None else b13[e],
                                       None if b2 is None else b2[e])
    return ys


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int8 [E, N, K] with per-channel scales [E, N], or MXFP4 (uint8 [E, N, K / 2] with
    group scales [E, N, K / 32], ``kernels.moe.mxfp4``) -> ``dtype``; other weights pass through."""
    if scale is None:
        return q
    if q.dtype == torch.uint8:
        return dequantize_mxfp4(q, scale, dtype)
    return (q.float() * scale.float()[..., None]).to(dtype)


def quantize_int8(w: torch.Tensor, max_elements: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8 with per-output-channel scales: w [E, N, K] -> (q int8, scale f32 [E, N]).

    Symmetric: scale = max|w| / 127 per row, q = round(w / scale). Done in blocks of rows
    of at most ``max_elements`` weights, in place on one float32 copy of the block, so the
    temporaries stay small beside a large model's weights (one Mixtral expert alone holds
    117M weights in w13)."""
    if w.dim() != 3:
        raise ValueError(f"w: expected expert weights [E, N, K], got shape {list(w.shape)}")
    e, n, k = w.shape
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(e, n, dtype=torch.float32, device=w.device)
    rows_w, rows_q, rows_s = w.contiguous().view(e * n, k), q.view(e * n, k), scale.view(e * n)
    step = max(1, max_elements // max(k, 1))
    for lo in range(0, e * n, step):
        wf = rows_w[lo:lo + step].to(torch.float32, copy=True)  # a copy even from float32: worked in place
        s = torch.linalg.vector_norm(wf, ord=float("inf"), dim=-1).clamp_(min=1e-12).div_(127.0)
        rows_q[lo:lo + step] = wf.div_(s[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        rows_s[lo:lo + step] = s
    return q, scale


def here_or_past(ids: torch.Tensor, first: int, e: int) -> torch.Tensor:
    """Expert ids counted from ``first`` -> their index among the E experts here, or E (a
    bin past them) for an expert elsewhere."""
    local = ids - first
    return torch.where((local >= 0) & (local < e), local, e)


def placed_ids(ids: torch.Tensor, first: int, slots: torch.Tensor, near: int) -> torch.Tensor:
    """Ids of a far place's E' experts (counted from ``first``; other ids: elsewhere) and
    ``slots`` [E'] (each one's near slot, -1: none) -> ids into the ``near`` near experts
    then far's, [T, k] int64, -1 elsewhere (``kernels.fused_moe``'s ``far``)."""
    e = slots.numel()
    local = here_or_past(ids.long(), first, e)
    s = slots[local.clamp(max=e - 1)]
    return torch.where(local < e, torch.where(s >= 0, s, near + local), -1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu", w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, capacity: int | None = None,
                  masked: bool = False, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, weighted_input: bool = False,
                  first_expert: int = 0) -> torch.Tensor:
    """The single-device expert computation: maps, scatter, grouped FFN, gather. ``masked``:
    the ids count from ``first_expert``; pairs of no expert here (ids past the E here, or
    before them) add nothing (their rows, in a bin past the experts, never run). Biases
    b13 [E, 2F or F], b2 [E, H] are added before each activation and before the combine
    weight. ``weighted_input`` (Llama 4): each pair's weight scales the expert's input
    instead of its output."""
    w13, w2 = dequantize_ref(w13, w13_scale, x.dtype), dequantize_ref(w2, w2_scale, x.dtype)
    e = w13.shape[0]
    if masked:
        topk_ids = here_or_past(topk_ids, first_expert, e)
    offsets, rows = token_maps_ref(topk_ids, e + masked, capacity)
    xs = scatter_rows_ref(x, rows)
    if weighted_input:
        flat, w = rows.reshape(-1).long(), topk_weights.reshape(-1)
        row_w = torch.zeros(xs.shape[0], dtype=torch.float32, device=x.device)
        row_w[flat[flat >= 0]] = w[flat >= 0].float()
        xs = (xs.float() * row_w[:, None]).to(xs.dtype)
        topk_weights = torch.ones_like(topk_weights)
    ys = grouped_ffn_ref(xs, offsets, w13, w2, activation, b13, b2)
    return gather_rows_ref(ys, rows, topk_weights)
