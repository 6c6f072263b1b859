"""The MoE experts at decode sizes in CUDA C++ (``kernels/moe/moe.cu``, compiled through
CuPy): two kernels, no maps, no combine launch. Same contract as ``kernels.fused_moe`` for
T <= MAX_T tokens.

Shape letters: T tokens, H hidden, E experts, k slots, F expert width, P = T * k pairs
(pair p is slot p % k of token p // k).

- ``moe_up``: block (column tile, pair p) computes BN columns of
  h[p] = act(x[p // k] @ w1[e_p].T) (* x @ w3[e_p].T) times the pair's combine weight. The
  weight moves here from the down GEMM because the sum over slots is linear; h is [P, F].
- ``moe_down``: block (column tile, K split, token t) computes
  out[t] = sum over the token's k slots of w2[e_p] @ h[p]: one reduction over the k slots'
  F columns back to back (k * F long), so the combine is the GEMM's own sum. int8 scales
  differ per expert, so each 16-byte vector's dot product is scaled before it is added.

Both stream weights as SBI-GeMM does (``kernels.linear.sbi_cuda``: 16-byte loads along the
reduction, U loads per row in flight, warp-shuffle then one shared-memory reduction).
Weights are read once per pair, not once per expert: at T = 1 the k experts are
distinct, so that is each active byte once. Past T = 1 pairs share experts; the
pair-major grid (``pair_major``: the blocks of all pairs for one column tile launch next
to each other) has the pairs that share an expert read the same rows at about the same
time, so the second read tends to come from L2. The Triton grouped GEMM, which groups
pairs by expert, is used unless the tuning table chose this for that T.

The down kernel loads the ids and its first weights before waiting for the up kernel
(PDL): the ids come from a kernel before the up GEMM, which has completed once every up
block has passed its own wait, the condition for the down grid to start (the up kernel
never takes the early trigger, see ``kernels/pdl.py``).

Compile-time parameters: BN, WARPS, U, INT8, DT (0 bf16, 1 fp16), GATED (SiLU gate * up,
else GeLU), OAI (GATED: GPT-OSS's clamped SwiGLU instead of SiLU), B13 / B2 (per-expert
biases, added before the activation / before the combine weight: the down kernel adds each
slot's bias times its weight once, in the first split), SLOTS (the ids name the experts of a
far place, the weights, scales and biases after the usual arguments, and ``slots[e]`` >= 0
reads expert e from w13 / w2 at that slot instead: an offloaded layer's device experts and
pinned host ones in one launch each), WIN (Llama 4: the pair's weight scales the up GEMM's
output before the activation, and not h), IDS64 (int64 ids, else int32), PARTIAL (down:
float32 split-K partials), PAIR_MAJOR (grid: pairs / tokens fastest, else column tiles
fastest), MINB (the registers are capped so that MINB blocks fit on an SM), UNIT (int8
widened by one byte permute a weight, its offset cancelled once per 16 activations: about a
third fewer instructions, relative error about 1e-4 against 1e-7; the tuner picks it for the
small experts at T = 1), PIPE (``moe_down``, a down entry's ``pipe``: two weight buffers,
each step's loads issued before the arithmetic of the step before it, the second step's
right after the wait), RG (``row_groups``: the block's warps split its rows into RG groups,
each group over all of K, so a thread's arithmetic after the wait is shorter; chosen for
DS-MoE's int8 down kernel at T = 1). int8 kernels on the tensor cores (mma m16n8k16) halve
the instructions a weight again, but at T = 1 they measured slower than ``unit`` for the
small shapes and for Mixtral's decode step, and were removed.

At decode sizes a block is one short chain of dependent memory round trips (expert id,
weights, reduction) in a grid of one or two waves, so the kernels are latency-bound
(Nsight Compute: the wait on global loads is the top stall). Anything a block loads that
no kernel writes (the int8 scales) is therefore loaded beside its first weights, never
after them (docs/performance.md). For the same reason what a block can
compute before its PDL wait (the up kernel's row offsets, 32-bit, and its token row; the
down kernel's second step of rows) is computed there and pinned, so that after the wait
only what depends on the kernel before stands between it and the weight loads; and the
down kernel finds a position's slot by a float reciprocal, not an integer division.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import torch

from kernels.cuda_common import DTYPES, addressable, compile_check, cuda_source, launch, ptr
from kernels.tuning import MoeCuda

SOURCE = cuda_source("moe/moe.cu")  # kernels moe_up and moe_down, and common.cuh's splitk_reduce

MAX_T = 16
MAX_K = 16


# Launch configurations tried by the tuning script (the table stores the winner per shape
# and T): bn outputs per block, warps, unroll (loads per row in flight), split_k (down),
# pair_major (the grid order; absent: column tiles fastest). The pair-major ones are tried
# only past T = 1 (``candidates``), where pairs can share an expert.
UP_CANDIDATES = [MoeCuda(bn=bn, warps=w, unroll=u)
                 for bn, w, u in ((2, 4, 2), (4, 4, 1), (4, 4, 2), (8, 4, 1), (2, 8, 2), (4, 8, 1))]
DOWN_CANDIDATES = [MoeCuda(bn=bn, warps=w, unroll=u, split_k=s)
                   for (bn, w, u), s in itertools.product(((2, 4, 4), (4, 4, 2), (4, 4, 4), (8, 4, 2), (4, 8, 2)),
                                                          (1, 2))]

# The down kernel with two weight buffers (``pipe``): register room for two steps, so
# unroll 1 or 2.
PIPE_DOWN_CANDIDATES = [MoeCuda(bn=bn, warps=w, unroll=u, split_k=s, pipe=True)
                        for (bn, w, u), s in itertools.product(((4, 4, 1), (8, 4, 1), (4, 8, 1), (2, 4, 2)), (1, 2))]

# The down kernel with row groups (``row_groups``: the block's warps split its rows, each
# group over all of K), two weight buffers.
ROW_GROUP_DOWN_CANDIDATES = [MoeCuda(bn=bn, warps=w, unroll=1, split_k=1, pipe=True, row_groups=g)
                             for bn, w, g in ((4, 8, 2), (8, 16, 4))]

MIN_BLOCKS = (4, 5, 6, 8)  # register caps tried (``min_blocks``): more blocks, more loads in flight an SM


def candidates(phase: str, t: int, int8: bool = False) -> list[MoeCuda]:
    """The CUDA launch configurations the tuning script times for ``phase`` at T = t: the
    base ones, each also with its registers capped for ``min_blocks`` blocks an SM (the
    int8 kernels use 100-180 registers uncapped, so two or three blocks an SM hold all
    the loads in flight), for int8 each also widening with one byte permute a weight
    (``unit``); the down kernel also with two weight buffers (``pipe``), some of them with
    row groups (``row_groups``); and past T = 1 each in the pair-major grid."""
    base = UP_CANDIDATES if phase == "up" else DOWN_CANDIDATES + PIPE_DOWN_CANDIDATES + ROW_GROUP_DOWN_CANDIDATES
    base = base + ([replace(c, unit=True) for c in base] if int8 else [])
    base = base + [replace(c, min_blocks=m) for c in base for m in MIN_BLOCKS]
    return base + ([replace(c, pair_major=True) for c in base] if t > 1 else [])


def default_configs(t: int, h: int, sms: int) -> tuple[MoeCuda, MoeCuda]:
    """(up, down) launch configurations when the table has none for this shape."""
    bn = 4
    split = 2 if -(-h // bn) * t < 2 * sms else 1  # too few blocks: split the k * F reduction
    return MoeCuda(bn=bn, warps=4, unroll=2), MoeCuda(bn=bn, warps=4, unroll=4, split_k=split)


def supports(x, w13, w2, topk, w13_scale=None, w2_scale=None, configs=None, activation="silu",
             b13=None, b2=None) -> str | None:
    """Why these kernels cannot take operands of these shapes, dtypes and devices, or run the
    (up, down) ``configs`` (None: they can). It reads nothing else, so a caller may keep its
    answer per key (``kernels.moe.triton.cuda_reason``); ``layout`` checks the addresses and
    strides. The shapes themselves were checked by ``kernels.fused_moe``."""
    t, h = x.shape
    f = w2.shape[2]
    if w13[0].numel() * w13.element_size() >= 2 ** 32:  # moe_up's row offsets are 32-bit
        return f"w13 {list(w13.shape)}: expected under 4 GiB an expert"
    if not (x.is_cuda and addressable(w13, x.device) and addressable(w2, x.device)):
        return (f"x / w13 / w2 on {x.device} / {w13.device} / {w2.device}: expected one CUDA device "
                f"(the weights may be in pinned host memory)")
    if x.dtype not in DTYPES:
        return f"x: bf16 or fp16, got {x.dtype}"
    if not 1 <= t <= MAX_T or topk > MAX_K:
        return f"x {list(x.shape)}, k = {topk}: 1 to {MAX_T} tokens and k <= {MAX_K}"
    int8 = w13.dtype == torch.int8
    if w13.dtype != w2.dtype or w13.dtype not in (x.dtype, torch.int8):
        return f"w13 / w2 {w13.dtype} / {w2.dtype}: expected both {x.dtype}, or both int8"
    vec = 16 if int8 else 8  # elements of one 16-byte weight load
    if h % vec or f % vec:
        return f"H = {h}, F = {f}: expected multiples of {vec}"
    if int8 and not w13_scale.dtype == w2_scale.dtype == torch.float32:
        return f"w13_scale / w2_scale {w13_scale.dtype} / {w2_scale.dtype}: expected float32"
    for name, b in (("b13", b13), ("b2", b2)):
        if b is not None and (b.dtype != x.dtype or not addressable(b, x.device)):
            return f"{name} {b.dtype} on {b.device}: expected {x.dtype} where the weights are"
    for phase, cfg in zip(("up", "down"), configs or (None, None)):
        why = row_groups_check(phase, cfg, activation != "gelu") if cfg is not None else None
        if why:
            return why
    return None


def layout(x, w13, w2, w13_scale=None, w2_scale=None, b13=None, b2=None) -> str | None:
    """Why the kernels cannot read these operands where they lie (None: they can):
    contiguous 16-byte aligned weights, x's rows on 16-byte boundaries. A view can change
    these from call to call, so they are checked at each call; ``supports`` must have passed."""
    if not (w13.is_contiguous() and w2.is_contiguous()) or w13.data_ptr() % 16 or w2.data_ptr() % 16:
        return "w13 / w2: expected contiguous weights on 16-byte boundaries"
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16:
        return "x: expected unit stride along H and rows on 16-byte boundaries"
    if w13.dtype == torch.int8 and not (w13_scale.is_contiguous() and w2_scale.is_contiguous()):
        return "w13_scale / w2_scale: expected contiguous"
    if not all(b is None or b.is_contiguous() for b in (b13, b2)):
        return "b13 / b2: expected contiguous"
    return None


def check(x, w13, w2, topk, w13_scale=None, w2_scale=None, configs=None, activation="silu",
          b13=None, b2=None) -> str | None:
    """Why these kernels cannot take the operands or run ``configs`` (None: they can):
    ``supports``, then ``layout``."""
    return (supports(x, w13, w2, topk, w13_scale, w2_scale, configs, activation, b13, b2)
            or layout(x, w13, w2, w13_scale, w2_scale, b13, b2))


def options(bn: int, warps: int, unroll: int, int8: bool, dt: int, gated: bool, partial: bool,
            ids64: bool = False, pair_major: bool = False, min_blocks: int = 1, unit: bool = False,
            pipe: bool = False, row_groups: int = 1, masked: bool = False, oai: bool = False,
            b13: bool = False, b2: bool = False, weighted_input: bool = False,
            here: tuple[int, int] = (0, 0), slots: bool = False) -> tuple:
    """The compile flags; ``here`` (masked): (first expert id, experts) the ids name;
    ``slots``: the ids name a far place's experts, some also at near slots."""
    return ("-std=c++17", f"-DMASKED={int(masked)}", f"-DFIRST={here[0]}", f"-DE_HERE={here[1]}",
            f"-DSLOTS={int(slots)}", f"-DOAI={int(oai)}",
            f"-DB13={int(b13)}", f"-DB2={int(b2)}", f"-DWIN={int(weighted_input)}", f"-DBN={bn}",
            f"-DWARPS={warps}", f"-DU={unroll}", f"-DINT8={int(int8)}",
            f"-DUNIT={int(unit)}", f"-DDT={dt}", f"-DGATED={int(gated)}", f"-DIDS64={int(ids64)}",
            f"-DPARTIAL={int(partial)}", f"-DPAIR_MAJOR={int(pair_major)}", f"-DMINB={max(1, min_blocks)}",
            f"-DPIPE={int(pipe)}", f"-DRG={row_groups}")


def row_groups_check(phase: str, cfg: MoeCuda, gated: bool = True) -> str | None:
    """Why configuration ``cfg`` of ``phase`` cannot split its block into ``row_groups``
    (None: it can): whole warps and whole rows a group."""
    g = cfg.row_groups
    rows = cfg.bn * (2 if phase == "up" and gated else 1)
    if cfg.warps % g or rows % g:
        return (f"{phase} row_groups = {g!r}: expected a positive int dividing warps = {cfg.warps} and the "
                f"block's {rows} rows")
    return None


def fused_moe_cuda(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, activation: str = "silu", w13_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None,
                   configs: tuple[MoeCuda | None, MoeCuda | None] | None = None, pdl: bool = True, *,
                   b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                   weighted_input: bool = False) -> torch.Tensor:
    """``kernels.fused_moe`` for T <= MAX_T tokens (dropless); ``configs`` are the (up, down)
    launch configurations (``kernels.tuning.MoeCuda``; None: ``default_configs``). Raises ValueError naming the
    operand or configuration the kernels cannot take (``check``)."""
    why = check(x, w13, w2, topk_ids.shape[1], w13_scale, w2_scale, configs, activation, b13, b2)
    if why is not None:
        raise ValueError(f"fused_moe_cuda: {why}")
    return run(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, configs, pdl, b13=b13, b2=b2,
               weighted_input=weighted_input)


def run(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        activation: str, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
        configs: tuple[MoeCuda | None, MoeCuda | None] | None, pdl: bool, masked: bool = False, *,
        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, weighted_input: bool = False,
        first_expert: int = 0, far: dict[str, torch.Tensor] | None = None,
        slots: torch.Tensor | None = None) -> torch.Tensor:
    """``fused_moe_cuda`` without its checks, for callers that made them (``check``, or
    ``supports`` once per key and then ``layout``: ``kernels.moe.triton``; for ``far``'s
    tensors too). ``masked``: the ids count from ``first_expert``, pairs of no expert here
    add nothing and read no weights; ``b13`` / ``b2``, ``weighted_input``, ``far`` and
    ``slots``: as ``kernels.fused_moe`` takes them."""
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    pair_w = topk_weights.reshape(-1).float().contiguous()  # [P]
    return _experts(x, w13, w2, ids, pair_w, topk_ids.shape[1], activation, w13_scale, w2_scale, configs, pdl,
                    masked, b13, b2, weighted_input, first_expert, far, slots)


def _experts(x, w13, w2, ids, pair_w, topk, activation, w13_scale, w2_scale, configs, pdl: bool,
             masked: bool = False, b13=None, b2=None, weighted_input: bool = False,
             first_expert: int = 0, far: dict | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """The two launches (and the split-K sum); ``ids`` [P] are the pairs' experts, ``pair_w``
    [P] their combine weights; ``far`` / ``slots``: every expert in a second place, and
    which of them w13 / w2 hold (None: one place)."""
    far = far or {}
    t, h = x.shape
    f = w2.shape[2]
    up, down = configs if configs is not None else (None, None)
    if up is None or down is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        default_up, default_down = default_configs(t, h, sms)
        up, down = up or default_up, down or default_down
    int8, gated, dt, ids64 = w13.dtype == torch.int8, activation != "gelu", DTYPES[x.dtype], ids.dtype == torch.int64
    named = (far or {"w2": w2})["w2"].shape[0]  # the experts the ids name
    extras = dict(masked=masked, oai=activation == "swiglu_oai", b13=b13 is not None, b2=b2 is not None,
                  weighted_input=weighted_input, slots=bool(far), here=(first_expert, named) if masked else (0, 0))
    hidden = torch.empty(t * topk, f, dtype=x.dtype, device=x.device)  # [P, F]
    # The up kernel lets the down kernel launch only after its own wait (never early): the
    # down kernel reads the ids before its wait, and they are from the kernel before this one.
    up_major = up.pair_major
    up_opts = options(up.bn, up.warps, up.unroll, int8, dt, gated, False, ids64=ids64, pair_major=up_major,
                      min_blocks=up.min_blocks, unit=up.unit, row_groups=up.row_groups, **extras) + ("-DPDL_EARLY=0",)
    up_grid = (-(-f // up.bn), t * topk)
    launch(x.device, SOURCE, "moe_up", up_opts, up_grid[::-1] if up_major else up_grid,
           up.warps * 32, (ptr(x), ptr(w13), ptr(w13_scale), ptr(b13), ptr(ids), ptr(pair_w), ptr(hidden), np.int32(h),
                              np.int32(f), np.int32(topk), np.int64(x.stride(0)), ptr(slots), ptr(far.get("w13")),
                              ptr(far.get("w13_scale")), ptr(far.get("b13"))), pdl=pdl)
    step = down.warps * 32 * (16 if int8 else 8)
    length = topk * f
    k_span = -(-length // (down.split_k * step)) * step
    split = -(-length // k_span)  # no empty splits
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    target = out if split == 1 else torch.empty(split, t, h, dtype=torch.float32, device=x.device)
    down_major = down.pair_major
    opts = options(down.bn, down.warps, down.unroll, int8, dt, gated, split > 1, ids64=ids64,
                   pair_major=down_major, min_blocks=down.min_blocks, unit=down.unit, pipe=down.pipe,
                   row_groups=down.row_groups, **extras)
    down_grid = (-(-h // down.bn), split, t)
    launch(x.device, SOURCE, "moe_down", opts, down_grid[::-1] if down_major else down_grid, down.warps * 32,
           (ptr(hidden), ptr(w2), ptr(w2_scale), ptr(b2), ptr(ids), ptr(pair_w), ptr(target), np.int32(h),
            np.int32(f), np.int32(topk), np.int32(k_span), np.int64(out.stride(0)), ptr(slots), ptr(far.get("w2")),
            ptr(far.get("w2_scale")), ptr(far.get("b2"))), pdl=pdl)
    if split > 1:
        launch(x.device, SOURCE, "splitk_reduce", opts, (-(-h // 256), t), 256,
               (ptr(target), ptr(None), ptr(None), ptr(out), np.int32(split), np.int32(t), np.int32(h),
                np.int64(0), np.int64(out.stride(0))), pdl=pdl)
    return out


def compile_all(arch: str = "sm_90") -> int:
    """Compiles the kernels for ``arch`` through NVRTC (no GPU needed) over combinations
    that take every value of every compile-time parameter; returns how many."""
    count = 0
    for i, (int8, dt, gated) in enumerate(itertools.product((False, True), DTYPES.values(), (False, True))):
        up, down = UP_CANDIDATES[i % len(UP_CANDIDATES)], DOWN_CANDIDATES[i % len(DOWN_CANDIDATES)]
        launch_flags = (f"-DPDL_EARLY={i // 2 % 2}",)  # what ``launch`` adds, or a kernel pins
        min_blocks = MIN_BLOCKS[i % len(MIN_BLOCKS)] if i % 2 else 1
        groups = 2 if i % 3 == 2 else 1  # every candidate has 4 or 8 warps and an even number of rows
        # GPT-OSS's activation and biases, Llama 4's weighted input (gated i: odd)
        extras = dict(oai=i in (3, 7), b13=i % 4 >= 2, b2=i % 4 >= 2, weighted_input=i in (1, 4))
        compile_check(SOURCE, options(up.bn, up.warps, up.unroll, int8, dt, gated, False, ids64=i % 2 == 0,
                                      pair_major=i % 2 == 1, min_blocks=min_blocks, unit=i % 4 == 1,
                                      row_groups=groups, masked=i % 3 == 0, **extras,
                                      here=(8, 8) if i % 3 == 0 else (0, 0), slots=i % 4 == 0)
                      + launch_flags, arch, "moe_cuda.cu")
        compile_check(SOURCE, options(down.bn, down.warps, down.unroll, int8, dt, gated, i % 4 < 2,
                                      ids64=i % 2 == 1, pair_major=i % 4 >= 2, min_blocks=min_blocks,
                                      unit=i % 4 == 3, pipe=i % 3 != 1, row_groups=groups, masked=i % 3 == 0,
                                      **extras, slots=i % 4 >= 2)
                      + launch_flags, arch, "moe_cuda.cu")
        count += 2
    return count
