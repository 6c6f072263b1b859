"""The single-device MoE expert computation in Triton: maps, up GEMM (tokens read in place,
activation fused), down GEMM (combine weights fused), combine.

Shape letters: T tokens, H hidden, E experts, k slots, F expert width, N = T * k rows.
Launch configurations come from the moe tables (``kernels.tuning``, written by
``scripts/tune_moe.py``), looked up per device, weight dtype, shape and T; nothing is tuned
while serving. An entry is a Triton tile configuration (``MoeTriton``), or another path:
``MoeCuda`` (the CUDA decode kernels, small T), ``MoeGroupedMm`` (the down GEMM by
``torch._grouped_mm``, bf16 at large T) or ``MoeDequant`` (int8 experts widened to the
activations' dtype first, then that dtype's entries; large T).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton

from kernels import tuning
from kernels.layout.maps import token_maps_triton
from kernels.layout.rows import combine_rows_triton
from kernels.moe import cuda as moe_cuda
from kernels.moe.grouped_gemm import grouped_gemm
from kernels.moe.reference import placed_ids
from kernels.tuning import MoeCuda, MoeDequant, MoeEntry, MoeGroupedMm, MoeTriton

# Up to this many (token, slot) pairs the GEMMs group pairs themselves (no maps kernel).
# At 32, the 32-row int8 tiles measured slower.
FROM_IDS_PAIRS = 16
# Up to this many tokens a shape without table entries runs the CUDA decode kernels, which
# every tuned shape's table chooses there.
CUDA_HEURISTIC_T = 2


def default_config(phase: str, t: int, e: int, n: int, k: int, topk: int, sms: int,
                   elem_bytes: int = 2) -> MoeTriton:
    """A reasonable launch configuration when the tuning tables have no entry (``sms``:
    the device's SM count, ``tuning.sm_count``)."""
    rows_per_expert = max(1, t * topk // e) if t * topk >= e else 1
    bm = min(128, max(16, triton.next_power_of_2(min(rows_per_expert, t))))
    if bm <= 32:  # bandwidth-bound: wide K steps, many loads in flight
        cfg = dict(bm=bm, bn=64, bk=128, num_warps=4, num_stages=4)
    else:  # tensor-core bound; groups of 8 row tiles keep their A rows in L2
        cfg = dict(bm=bm, bn=128 if phase == "down" else 64, bk=64, num_warps=8, num_stages=3, group_m=8)
    if elem_bytes > 2:  # fp32 tiles take twice the shared memory per stage
        cfg.update(bk=min(cfg["bk"], 64), num_stages=2)
    split = 1
    if phase == "down":
        tiles = min(e, t * topk) * triton.cdiv(n, cfg["bn"])
        while tiles * split < 2 * sms and k // (split * 2) >= 512 and split < 8:
            split *= 2
    return MoeTriton(split_k=split, **cfg)


@functools.lru_cache(maxsize=4096)  # per call this is on the decode path: keep it a lookup
def launch_config(phase: str, device: torch.device, t: int, e: int, n: int, k: int,
                  wdtype: torch.dtype, topk: int, elem_bytes: int = 2, experts: bool = False) -> MoeEntry:
    """The moe table's entry for this GEMM at T = t (``tuning.Tables.lookup``: the smallest
    bucket >= t of the device's own entries and its chip's), else ``default_config`` (for
    the ``experts`` of ``fused_moe`` at T <= CUDA_HEURISTIC_T: the CUDA decode kernels)."""
    def heuristic() -> MoeEntry:
        if experts and t <= CUDA_HEURISTIC_T:
            # Every tuned shape takes the CUDA decode kernels here: so do the shapes no table
            # holds, such as a rank's share of the experts (E / ep, or F / expert_slicing).
            return moe_cuda.default_configs(t, k if phase == "up" else n, tuning.sm_count(device))[phase == "down"]
        return default_config(phase, t, e, n, k, topk, tuning.sm_count(device), elem_bytes)

    return tuning.TABLES.lookup(
        "moe", tuning.device_name(device), tuning.dtype_name(wdtype), tuning.moe_shape(phase, e, n, k, topk), t,
        heuristic)


def triton_entry(cfg: MoeEntry, phase: str, device: torch.device, t: int, e: int, n: int, k: int, topk: int,
                 elem_bytes: int = 2) -> MoeTriton:
    """``cfg`` where the Triton grouped GEMM can run it; an entry naming another path (the
    CUDA decode kernels, the int8 dequantizing path) gives way to the heuristic."""
    if isinstance(cfg, MoeTriton):
        return cfg
    return default_config(phase, t, e, n, k, topk, tuning.sm_count(device), elem_bytes)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 weights [E, N, K] and their per-channel scales [E, N] -> ``dtype``, in one pass
    (each weight read as one byte and written once; ``dequantize_ref``'s values)."""
    return torch.mul(q, scale[..., None], out=torch.empty(q.shape, dtype=dtype, device=q.device))


def grouped_mm_ok(cfg: MoeEntry, a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a GEMM whose launch configuration is a ``MoeGroupedMm`` can take
    ``torch._grouped_mm``: weights in the activations' dtype (not int8) on their device (not
    read in place from host memory), 16-byte aligned rows, and on CUDA a Hopper or later
    GPU with bf16 (the CPU takes any float dtype: the interpreter tests run this path).
    Otherwise the Triton kernel runs with the table's tile sizes."""
    if not isinstance(cfg, MoeGroupedMm) or a.dtype != w.dtype or not a.is_floating_point() or w.device != a.device:
        return False
    if a.is_cuda and (a.dtype != torch.bfloat16 or torch.cuda.get_device_capability(a.device)[0] < 9):
        return False
    return a.shape[1] * a.element_size() % 16 == 0 and w.shape[1] * w.element_size() % 16 == 0 \
        and a.stride(1) == 1 and w.is_contiguous()


def _table_configs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk: int,
                   experts: int | None = None) -> tuple[MoeEntry, MoeEntry]:
    """The (up, down) launch configurations of the table (or the heuristic) for x [T, H]
    (for ``experts`` experts; None: w2's)."""
    (t, h), (e, _, f) = x.shape, w2.shape
    e = experts or e
    f *= 2 if w2.dtype == torch.uint8 else 1  # MXFP4: two weights a byte
    return (launch_config("up", x.device, t, e, w13.shape[1], h, w13.dtype, topk, x.element_size(), True),
            launch_config("down", x.device, t, e, h, f, w2.dtype, topk, x.element_size(), True))


def _cuda_pair(up_cfg: MoeCuda, down_cfg: MoeEntry) -> tuple[MoeCuda, MoeCuda | None]:
    """The CUDA kernels' configurations: the down entry only if the table chose CUDA there
    too (else the CUDA default, as the two kernels come as a pair)."""
    return up_cfg, down_cfg if isinstance(down_cfg, MoeCuda) else None


_MISSING = object()
_CUDA_SUPPORT: dict = {}  # what moe_cuda.supports reads (see cuda_reason) -> its answer


def _sig(z: torch.Tensor | None) -> tuple | None:
    return None if z is None else (z.dtype, tuple(z.shape), z.device)


def cuda_reason(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk: int, activation: str,
                w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                configs: tuple[MoeCuda, MoeCuda | None], b13: torch.Tensor | None = None,
                b2: torch.Tensor | None = None) -> str | None:
    """Why the CUDA decode kernels cannot run these operands with these (up, down)
    ``configs`` (None: they can). ``moe_cuda.supports`` runs once per key of what it reads
    (device, dtypes, shapes, k, activation, configs: one layer at one T), so a decode step
    only looks its answer up; ``moe_cuda.layout`` (addresses and strides) runs every call."""
    key = (_sig(x), _sig(w13), _sig(w2), topk, activation, None if w13_scale is None else w13_scale.dtype,
           None if w2_scale is None else w2_scale.dtype, configs, _sig(b13), _sig(b2))
    why = _CUDA_SUPPORT.get(key, _MISSING)
    if why is _MISSING:
        if len(_CUDA_SUPPORT) > 4096:  # bounded: the keys are a model's layer shapes times T <= MAX_T
            _CUDA_SUPPORT.clear()
        why = _CUDA_SUPPORT[key] = moe_cuda.supports(x, w13, w2, topk, w13_scale, w2_scale, configs, activation,
                                                     b13, b2)
    return why or moe_cuda.layout(x, w13, w2, w13_scale, w2_scale, b13, b2)


def pairs_from_ids(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk: int,
                   w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                   b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> bool:
    """Whether ``fused_moe_triton`` (dropless, no maps given) runs the experts from the
    routing ids alone: the CUDA decode kernels where the table chose them and they take the
    operands, or the Triton GEMMs at n <= FROM_IDS_PAIRS pairs. The layer then needs no
    maps, no scatter and no gather: x is read by pair inside the up GEMM and the slots are
    summed inside the down GEMM (the benchmark times routing accordingly)."""
    up_cfg = _table_configs(x, w13, w2, topk)[0]
    if isinstance(up_cfg, MoeCuda) and x.is_cuda:
        if moe_cuda.check(x, w13, w2, topk, w13_scale, w2_scale, b13=b13, b2=b2) is None:
            return True
    return x.shape[0] * topk <= FROM_IDS_PAIRS


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
                     w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     capacity: int | None = None, configs: tuple[MoeEntry, MoeEntry] | None = None,
                     maps: tuple | None = None, pdl: bool = True, masked: bool = False,
                     b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                     weighted_input: bool = False, first_expert: int = 0,
                     far: dict[str, torch.Tensor] | None = None, slots: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Same contract as ``kernels.fused_moe``; ``configs`` overrides the (up, down) launch
    configurations (``kernels.tuning`` entries; the tuning script uses it); ``maps`` are
    (offsets, rows, row_pair) already built from ``topk_ids`` (``kernels.route``)."""
    if far is not None:
        return _two_places(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, configs, pdl,
                           masked, b13, b2, weighted_input, first_expert, far, slots)
    t, h = x.shape
    e, topk = w2.shape[0], topk_ids.shape[1]
    mxfp4 = w2.dtype == torch.uint8
    f = w2.shape[2] * (2 if mxfp4 else 1)
    n = t * topk
    size = x.element_size()
    up_cfg, down_cfg = configs if configs is not None else _table_configs(x, w13, w2, topk)
    if isinstance(up_cfg, MoeDequant) and w13.dtype == torch.int8 and w13.device == x.device:
        # Large T, where the table says so: the int8 experts widened to x's dtype in one pass,
        # then x's own GEMMs and table entries. Widening every tile inside the tensor-core
        # GEMM costs more there than the bytes it saves. Holds one layer's experts in x's
        # dtype for the call (weights on the device: host ones are read in place as they are).
        return fused_moe_triton(x, dequantize_int8(w13, w13_scale, x.dtype), dequantize_int8(w2, w2_scale, x.dtype),
                                topk_weights, topk_ids, activation, capacity=capacity, maps=maps, pdl=pdl,
                                masked=masked, b13=b13, b2=b2, weighted_input=weighted_input,
                                first_expert=first_expert)
    if not mxfp4 and isinstance(up_cfg, MoeCuda) and (capacity is None or capacity >= t):
        # Where the table chose the CUDA decode kernels (small T, measured faster) and they
        # can take the operands (not fp32, odd widths, MXFP4: then Triton). No pair is
        # dropped when each expert can keep T pairs: an expert appears once per token.
        pair = _cuda_pair(up_cfg, down_cfg)
        if cuda_reason(x, w13, w2, topk, activation, w13_scale, w2_scale, pair, b13, b2) is None:
            return moe_cuda.run(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, pair, pdl,
                                masked, b13=b13, b2=b2, weighted_input=weighted_input, first_expert=first_expert)
    # The CUDA kernels come as a pair behind the CUDA up kernel: a CUDA entry left over
    # here (not taken, or a CUDA down beside a Triton up) gives way to the Triton default.
    up_cfg = triton_entry(up_cfg, "up", x.device, t, e, w13.shape[1], h, topk, size)
    down_cfg = triton_entry(down_cfg, "down", x.device, t, e, h, f, topk, size)
    # Decode sizes: with no maps given, the GEMMs find each expert's pairs from the ids
    # themselves (all pairs in one row tile), saving the maps kernel; buffer rows are pairs.
    pair_ids = None
    if masked:
        # Pairs of experts elsewhere go to a bin past the experts (rows no GEMM tile runs),
        # then are dropped from the combine as capacity drops pairs.
        offsets, rows, row_pair = token_maps_triton(topk_ids, e, capacity, pdl, first=first_expert)
    elif maps is None and capacity is None and n <= FROM_IDS_PAIRS:
        pair_ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        bm = max(16, triton.next_power_of_2(n))
        up_cfg, down_cfg = replace(up_cfg, bm=max(bm, up_cfg.bm)), replace(down_cfg, bm=max(bm, down_cfg.bm))
        offsets = rows = row_pair = None
    else:
        offsets, rows, row_pair = maps if maps is not None else token_maps_triton(topk_ids, e, capacity, pdl)
    x = x if x.stride(-1) == 1 else x.contiguous()  # rows may be strided (padded all-to-all rows)
    pair_w = topk_weights.reshape(-1).float().contiguous()
    hidden = grouped_gemm(x, w13, offsets, row_pair, up_cfg.kernel_args(), num_rows=n, topk=topk,
                          a_from_tokens=True, gated=activation in ("silu", "swiglu_oai"),
                          act=activation if activation in ("gelu", "swiglu_oai") else "none", scale=w13_scale, bias=b13,
                          pair_weights=pair_w if weighted_input else None, weight_first=weighted_input,
                          pair_ids=pair_ids, pdl=pdl)[0]  # [N, F]
    if pair_ids is None and b2 is None and grouped_mm_ok(down_cfg, hidden, w2):
        # Large T, where the table says so: the down GEMM by torch's grouped GEMM (CUTLASS)
        # over the expert-major rows; the combine weights move into the combine.
        ys = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offsets[1:])  # [N, H], buffer rows
        return combine_rows_triton(ys[None], rows, None if weighted_input else topk_weights, x.dtype, topk, pdl=pdl)
    # Without split-K each weighted pair row is stored in x's dtype (half the bytes written
    # and read again at large T; the sum over slots is still float32); split-K partials
    # stay float32.
    partial = grouped_gemm(hidden, w2, offsets, row_pair, down_cfg.kernel_args(), num_rows=n, topk=topk,
                           a_from_tokens=False, gated=False, scale=w2_scale, bias=b2,
                           pair_weights=None if weighted_input else pair_w,
                           out_dtype=x.dtype, pair_ids=pair_ids, pdl=pdl)  # [S, N, H], already weighted
    return combine_rows_triton(partial, rows, None, x.dtype, topk, pdl=pdl)


def _two_places(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, configs, pdl, masked, b13, b2,
                weighted_input, first_expert, far, slots) -> torch.Tensor:
    """``fused_moe_triton`` over the experts of ``far`` that the ids name, those at a
    ``slots`` entry read from w13 / w2: where the table chooses the CUDA decode kernels for
    the layer's E' experts and they take both places, one launch each reads either place
    by pair; otherwise a masked call a place over ``placed_ids``, summed."""
    cfg = configs if configs is not None else _table_configs(x, w13, w2, topk_weights.shape[1], far["w2"].shape[0])
    run = dict(activation=activation, pdl=pdl, weighted_input=weighted_input)
    if isinstance(cfg[0], MoeCuda):
        pair, topk = _cuda_pair(*cfg), topk_ids.shape[1]
        near = dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, b13=b13, b2=b2)
        if all(cuda_reason(x, place["w13"], place["w2"], topk, activation, place.get("w13_scale"),
                           place.get("w2_scale"), pair, place.get("b13"), place.get("b2")) is None
               for place in (near, far)):
            return moe_cuda.run(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, pair, pdl,
                                masked, b13=b13, b2=b2, weighted_input=weighted_input, first_expert=first_expert,
                                far=far, slots=slots)
    e = w2.shape[0]
    ids = placed_ids(topk_ids, first_expert, slots, e)  # the near experts, then far's
    out = fused_moe_triton(x, w13, w2, topk_weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, masked=True,
                           b13=b13, b2=b2, **run)
    return out + fused_moe_triton(x, far["w13"], far["w2"], topk_weights, ids, w13_scale=far.get("w13_scale"),
                                  w2_scale=far.get("w2_scale"), masked=True, first_expert=e, b13=far.get("b13"),
                                  b2=far.get("b2"), **run)  # (summed in float32, rounded once, as slots are)


_ROW_TABLES: dict = {}  # (rows, device) -> the pair ids / segment offsets of one dense GEMM


def linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None = None,
                  pdl: bool = True) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W = q [N, K] (bf16 / fp16 / fp32, or int8
    dequantised with per-row ``scale`` [N]): the grouped GEMM with one group, int8 widened
    in registers and the scale applied in the epilogue; split-K (deterministic) when the
    output is too narrow to fill the GPU. The small-batch GEMM of the decode path."""
    k = x.shape[-1]
    a = x.reshape(-1, k)
    a = a if a.stride(-1) == 1 else a.contiguous()
    t, n = a.shape[0], q.shape[0]
    # (an E = 1 entry may name the CUDA decode kernels: a shared MLP's, kernels.gated_mlp)
    cfg = triton_entry(launch_config("down", a.device, t, 1, n, k, q.dtype, 1, a.element_size()), "down", a.device,
                       t, 1, n, k, 1, a.element_size())
    key = (t, a.device)
    if key not in _ROW_TABLES:  # small constant tables, made once per size (graph-safe after)
        if len(_ROW_TABLES) > 256:
            _ROW_TABLES.clear()
        ids = torch.zeros(t, dtype=torch.int32, device=a.device) if t <= FROM_IDS_PAIRS else None
        offsets = torch.tensor([0, t], dtype=torch.int32, device=a.device)
        _ROW_TABLES[key] = ids, offsets
    ids, offsets = _ROW_TABLES[key]
    if ids is not None:
        cfg = replace(cfg, bm=max(cfg.bm, 16, triton.next_power_of_2(t)))
    out = grouped_gemm(a, q[None], offsets, None, cfg.kernel_args(), num_rows=t, topk=1, a_from_tokens=False,
                       gated=False, scale=None if scale is None else scale[None], out_dtype=a.dtype, pair_ids=ids,
                       pdl=pdl)  # [S, T, N]
    out = out[0] if out.shape[0] == 1 else out.sum(0).to(a.dtype)
    return out.view(*x.shape[:-1], n)
