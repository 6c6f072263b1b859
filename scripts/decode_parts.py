"""Where a decode step's time goes, for ``bench_decode.py``: the bytes a step must read (its
floor: the weights, the experts a batch is expected to hit, the KV cache) and each kernel's
share of the device's timeline over a generate() call, grouped into the step's parts
(routing, experts, norms, attention, dense GEMMs) with the share of the copy bandwidth a
part reaches on its bytes.
"""
from __future__ import annotations

import torch

import bench_common as bc


def floor_bytes(engine, batch: int, context: int) -> int:
    """Bytes one decode step of ``batch`` rows must read, ``context`` cached tokens each."""
    cfg, model = engine.config, engine.model
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        if name == "embed.weight" and model.lm_head is not None:
            total += batch * p.shape[1] * p.element_size()  # only the rows looked up
            continue
        total += p.numel() * p.element_size()
    for layer in model.layers:
        experts = getattr(layer.ffn, "experts", None)
        if experts is None:
            continue
        e, k = cfg.moe.num_experts, cfg.moe.top_k
        hit = e * (1 - (1 - k / e) ** batch)
        held = experts.w13.shape[0]  # past E: shared experts folded in, which every token takes
        per_expert = sum(t.numel() * t.element_size() for t in experts.state_dict().values()) / held
        total += (hit + held - e) * per_expert
    return int(total + batch * context * kv_token_bytes(engine))


def kv_token_bytes(engine) -> int:
    """Bytes of KV cache a token takes over every layer (latent attention: one compressed row)."""
    m = engine.config.model
    return m.num_layers * engine.model.num_kv_heads * sum(m.kv_widths) * engine.dtype.itemsize


# Kernel name patterns -> the part of the step they belong to (first match wins; the
# fused norm + router launch counts as routing).
PARTS = [
    ("MoE routing", ("_topk_gating_kernel", "_grouped_topk_kernel", "_route_kernel", "_maps_",
                     "_rms_norm_router_kernel")),
    ("MoE experts", ("_grouped_gemm_kernel", "_gather_kernel", "_scatter_kernel", "moe_up", "moe_down")),
    ("norms", ("_rms_norm_kernel", "layer_norm", "LayerNorm")),
    ("qkv epilogue", ("_qkv_decode_kernel",)),
    ("attention", ("fmha", "flash", "attention", "_paged_split_kernel", "_combine_kernel", "softmax", "_latent_")),
    ("dense GEMM", ("gemm", "nvjet", "sm90", "cutlass", "_sbi_kernel", "_reduce_kernel", "gemv", "splitK")),
]


def _part(name: str) -> str:
    low = name.lower()
    for part, keys in PARTS:
        if any(k.lower() in low for k in keys):
            return part
    return "other (elementwise, copies, sampling)"


def kernel_times(engine, prompts, new_tokens, timeline: dict | None = None) -> dict:
    """Device time and launches of each kernel over one generate() call: name -> [µs, calls],
    the µs being what its launches add to the device's timeline (``bench_common.timeline_shares``:
    a kernel launched early waits inside its span for the one before, which its span would
    count again). With ``timeline`` (a dict to fill): the span from the first kernel's start
    to the last one's end, the idle time inside it, and its longest gaps with the kernels on
    each side."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, max_new_tokens=new_tokens)
        torch.cuda.synchronize(engine.device)
    out, spans = {}, []
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA and ev.device_time > 0:
            spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    for (_, _, name), share in zip(spans, bc.timeline_shares([(lo, hi) for lo, hi, _ in spans])):
        slot = out.setdefault(name, [0.0, 0])
        slot[0] += share
        slot[1] += 1
    if timeline is not None and spans:
        spans.sort()
        gaps, end, before = [], spans[0][1], spans[0][2]
        for lo, hi, name in spans[1:]:
            if lo > end:
                gaps.append((lo - end, before, name))
            if hi > end:
                end, before = hi, name
        timeline.update(span_ms=(end - spans[0][0]) / 1e3, idle_ms=sum(g for g, _, _ in gaps) / 1e3,
                        gaps=[{"us": g, "after": a[:60], "before": b[:60]} for g, a, b in sorted(gaps)[::-1][:8]])
    return out


def profile_step(engine, prompts, n: int, step_ms: float, floor: dict) -> dict:
    """Per decode step (the run with n + 1 new tokens minus the run with 1): each kernel's
    device time and launches, grouped into parts; a part that reads weights or the cache
    also gets the share of the copy bandwidth it reaches on those bytes."""
    engine.generate(prompts, max_new_tokens=n + 1)  # warm-up, graphs captured
    one, full = kernel_times(engine, prompts, 1), kernel_times(engine, prompts, n + 1)
    per = {}
    for name, (us, calls) in full.items():
        us0, calls0 = one.get(name, (0.0, 0))
        if calls > calls0:
            per[name] = ((us - us0) / n, (calls - calls0) / n)
    parts = {}
    for name, (us, calls) in per.items():
        agg = parts.setdefault(_part(name), [0.0, 0.0])
        agg[0] += us
        agg[1] += calls
    busy = sum(us for us, _ in per.values())
    rows = []
    for part, (us, calls) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        nbytes = floor.get(part)
        rows.append({"part": part, "us_per_step": us, "launches_per_step": calls, "floor_bytes": nbytes,
                     "pct_copy": (100 * nbytes / (us * 1e-6) / (floor["copy_gbs"] * 1e9)) if nbytes and us else None})
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:20]
    return {"step_ms": step_ms, "kernel_busy_ms": busy / 1e3, "parts": rows,
            "kernels": [{"name": k[:90], "us_per_step": us, "launches_per_step": c} for k, (us, c) in top]}


def floor_parts(engine, batch: int, context: int, copy_gbs: float) -> dict:
    """Bytes each part of a step must read: the dense GEMMs' weights, the experts hit, the KV cache."""
    model, cfg = engine.model, engine.config
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if ".experts." not in n and n != "embed.weight" and p.dim() == 2)
    if model.lm_head is None:
        dense += model.embed.weight.numel() * model.embed.weight.element_size()
    experts = floor_bytes(engine, batch, 0) - dense - batch * cfg.model.hidden_size * engine.dtype.itemsize
    return {"dense GEMM": dense, "MoE experts": max(experts, 0) if cfg.moe else None,
            "attention": batch * context * kv_token_bytes(engine), "copy_gbs": copy_gbs}
