#!/usr/bin/env python
"""Decode latency per token: the fixed-shape decode step replayed as a CUDA graph against
eager decode (shapes that grow with the cache), through ``Engine.generate``; beside them
the bandwidth floor (bytes a step must read over the copy bandwidth measured in the same
run) and, with ``--peer``, Hugging Face transformers' ``generate()`` with a static cache on
the same model shape.

    python scripts/bench_decode.py                          # the embedded model on the GPU
    python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 --new-tokens 64
    python scripts/bench_decode.py --device cpu --smoke      # static-shape step, eagerly, on the CPU
    python scripts/bench_decode.py --model mixtral-8x7b --prompt-lens 128,512,2048 --batches 1,8,32,64 \
        --new-tokens 32 --reps 3                            # the issue's table: prefill and decode per cell

Per-token time = (time of generate() with N + 1 new tokens - time with 2) / (N - 1): the
prefill and the first decode step cancel out, what is left is N - 1 decode steps including
sampling and the one host sync per token. Medians of ``--reps`` alternating runs after a
warm-up (which also captures the graphs), the garbage collector off inside each. The
greedy tokens of both modes are compared.
"replay ms": the captured step replayed back to back, timed on the device: the step's
own time, without the host loop and the gaps between replays, at the last slot generate()
wrote; "mid replay ms": the same at the middle of the generated span, the context the
floor counts.

Floor per step: every weight but the experts and the embedding table; the experts a batch
of B is expected to hit (E * (1 - (1 - k/E)^B) per MoE layer, routing taken as uniform);
the KV cache up to the middle of the generated span. Read once, at the measured copy
bandwidth (device-to-device, read + write counted).
Writes bench/results/decode-<model>[-int8|-mxfp4]-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import moe_infer  # noqa: E402
import moe_infer.routing  # noqa: E402
from decode_parts import floor_bytes, floor_parts, kernel_times, profile_step  # noqa: E402
from peer_configs import hf_config  # noqa: E402


def timed_generate(engine, prompts, new_tokens) -> tuple[float, list]:
    """Seconds of one generate() call (``_wall``), and its completions."""
    out = []
    return _wall(lambda: out.append(engine.generate(prompts, max_new_tokens=new_tokens)), engine.device), out[0]


def per_token_ms(engine, prompts, n, reps):
    """ms per decode step: generate() with n + 1 new tokens against 2, alternating, medians
    of ``reps``; both run the same decode path (one new token would skip the decode step's
    set-up), so the difference is n - 1 decode steps."""
    for new in (n + 1, 2):  # warm-up: compiles, captures both graph buckets
        engine.generate(prompts, max_new_tokens=new)
    short_t, long_t = [], []
    for _ in range(reps):
        short_t.append(timed_generate(engine, prompts, 2)[0])
        t, out = timed_generate(engine, prompts, n + 1)
        long_t.append(t)
    short = [len(o.token_ids) for o in out if len(o.token_ids) != n + 1]
    if short:  # the difference of the two times holds n - 1 decode steps only if no row stopped early
        raise RuntimeError(f"per_token_ms: rows generated {short} tokens, expected {n + 1}")
    return 1e3 * (statistics.median(long_t) - statistics.median(short_t)) / (n - 1), [o.token_ids for o in out]


def decode_step_ms(engine, prompts, n: int, reps: int) -> float:
    """ms per decode step of the whole batch from generate()'s own clock
    (``GenerationStats.decode_s`` and the tokens made in it: a batch's first tokens to its
    last, every host sync included; over pipeline stages, the time the pipeline held decode
    steps alone), median of ``reps`` after a warm-up. Steadier than ``per_token_ms``'s
    difference of two runs where the prefill's time varies by more than that difference
    can bear: experts in host memory, several ranks whose collectives meet."""
    engine.generate(prompts, max_new_tokens=n)
    times = []
    for _ in range(reps):
        engine.generate(prompts, max_new_tokens=n)
        s = engine.last_stats
        if s.generated_tokens != n * len(prompts):  # eos is cleared: every row runs its n tokens
            raise RuntimeError(f"decode_step_ms: {s.generated_tokens} tokens, expected {n * len(prompts)}")
        if not s.decoded_tokens:
            raise RuntimeError("decode_step_ms: no decode step ran apart from a prompt; raise the new tokens")
        times.append(s.decode_s * len(prompts) / s.decoded_tokens)
    return 1e3 * statistics.median(times)


def replay_ms(engine, batch: int, slot: int | None = None) -> float | None:
    """Device time of one captured decode step for ``batch`` rows: its graph replayed back
    to back at ``slot`` (default: the last slot generate() used), with no host loop in
    between (the per-token figure also holds the host's share and the gap between
    replays). None without a graph.
    The first two CUDA graphs a process makes replay 2-2.6% slower than later ones (measured
    on OLMoE and Qwen3-30B-A3B); the runner makes two one-kernel graphs before its first
    decode step's, so this capture is the process's third."""
    step = captured_decoder(engine, batch, slot)
    if step is None:
        return None
    if slot is not None:
        step.inputs[:, 1].fill_(slot)  # every row's position; padding rows still write the trash slot
    return bc.time_fn(step.graph.replay, warmup=3, reps=50, device=engine.device) / 1e3


def captured_decoder(engine, batch: int, slot: int | None = None):
    """The captured decode step of the smallest batch bucket holding ``batch`` rows: the
    one of the largest key bucket (the last generate() used), or with ``slot`` the smallest
    one whose keys reach past it; None without one."""
    runner = engine.runner
    steps = [s for s in (runner._steps.values() if runner is not None else ())
             if s.graph is not None and s.batch >= batch and (slot is None or s.keys > slot)]
    if not steps:
        return None
    return min(steps, key=lambda s: (s.batch, s.keys if slot is not None else -s.keys))


def captured_step(engine, batch: int):
    """The replay of the smallest captured decode step holding ``batch`` rows; None without one."""
    decoder = captured_decoder(engine, batch)
    return decoder.graph.replay if decoder is not None else None


def prefill_flops(engine, prompt_len: int, batch: int) -> float:
    """FLOPs a prefill must do: 2 per weight a token uses (each token's top-k experts out of
    the [E, ...] expert tensors; the LM head for the last token of each prompt only, as
    ``last_only`` computes it) plus causal attention (QK^T and PV over the keys at or
    before each query)."""
    m, moe, model = engine.config.model, engine.config.moe, engine.model
    tokens, per_token = batch * prompt_len, 0.0
    for name, w in model.state_dict().items():  # int8 weights are buffers
        if name == "embed.weight" or name.startswith("lm_head.") or w.dim() < 2 or name.endswith("_scale"):
            continue
        if ".experts." in name and moe is not None:  # (MXFP4: two weights a byte; past E: folded shared experts)
            held = w.shape[0]
            per_token += w.numel() * (2 if w.dtype == torch.uint8 else 1) * (moe.top_k + held - moe.num_experts) / held
        elif w.dim() == 2:
            per_token += w.numel()
    attn = 4 * m.num_layers * m.num_heads * m.head_dim * batch * prompt_len * (prompt_len + 1) / 2
    return 2 * per_token * tokens + 2 * m.vocab_size * m.hidden_size * batch + attn


def prefill_rate(engine, prompt_len: int, batch: int, reps: int, gen, profile: bool = False) -> dict:
    """Prefill tokens/s (generate() with one new token: the prefill and one sampled token)
    and its matmul rate: 2 * active parameters * tokens (+ attention) over the time. With
    ``profile``, also the kernels that took the most device time in one such call."""
    vocab = engine.config.model.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    engine.config.engine.max_batch_size = max(engine.config.engine.max_batch_size, batch)
    engine.generate(prompts, max_new_tokens=1)
    t = statistics.median(timed_generate(engine, prompts, 1)[0] for _ in range(reps))
    flops = prefill_flops(engine, prompt_len, batch)
    out = {"prompt_len": prompt_len, "batch": batch, "seconds": t, "tokens_per_s": batch * prompt_len / t,
           "tflops": flops / t / 1e12}
    if profile:
        timeline = {}
        times = kernel_times(engine, prompts, 1, timeline)
        out["kernel_busy_ms"] = sum(us for us, _ in times.values()) / 1e3
        out["timeline"] = timeline
        out["kernels"] = [{"name": k[:90], "ms": us / 1e3, "launches": c}
                          for k, (us, c) in sorted(times.items(), key=lambda kv: -kv[1][0])[:15]]
    return out


def matrix_cell(engine, prompt_len: int, batch: int, new_tokens: int, reps: int, gen, copy_gbs: float | None,
                prompts_for: dict, routing: bool = False) -> dict:
    """One (prompt length, batch) cell of the issue's table, as a user's generate() call
    runs it: prefill = the time to the first token on the host (``Completion.
    time_to_first_token_s``), decode = the mean time between later tokens (host loop, one
    sync a token); medians of ``reps`` calls after a warm-up that compiles and captures.
    Beside them the captured step's device time at the middle of the generated span, and
    the floor there; with ``routing``, each MoE layer's picks per expert over the cell's
    prompts (``moe_infer.routing.measure``: what the prefill's experts saw)."""
    vocab = engine.config.model.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    prompts_for[(prompt_len, batch)] = prompts
    engine.runner = None  # one cell's KV cache on the device at a time
    bc.empty_cache(engine.device)
    engine.config.engine.max_batch_size = max(engine.config.engine.max_batch_size, batch)
    engine.generate(prompts, max_new_tokens=new_tokens)  # warm-up
    ttft, gap = [], []
    for _ in range(reps):
        _, outs = timed_generate(engine, prompts, new_tokens)
        short = [len(o.token_ids) for o in outs if len(o.token_ids) != new_tokens]
        if short:
            raise RuntimeError(f"matrix_cell: rows generated {short} tokens, expected {new_tokens}")
        ttft.append(max(o.time_to_first_token_s for o in outs))
        gap.append(max(o.inter_token_s for o in outs))
    mid = prompt_len + new_tokens // 2
    prefill_s, decode_ms = statistics.median(ttft), 1e3 * statistics.median(gap)
    nbytes = floor_bytes(engine, batch, mid)
    extra = {"routing": moe_infer.routing.measure(engine, prompts)["layers"]} if routing else {}
    return {**extra, "prompt_len": prompt_len, "batch": batch, "prefill_s": prefill_s,
            "prefill_tokens_per_s": batch * prompt_len / prefill_s,
            "prefill_tflops": prefill_flops(engine, prompt_len, batch) / prefill_s / 1e12,
            "decode_ms_per_token": decode_ms, "decode_tokens_per_s": 1e3 * batch / decode_ms,
            "replay_mid_ms_per_step": replay_ms(engine, batch, slot=mid), "floor_bytes": nbytes,
            "floor_ms": nbytes / copy_gbs / 1e6 if copy_gbs else None}


def print_matrix(cells: list[dict], mm_tflops: float | None) -> None:
    def opt(v, fmt):
        return "-" if v is None else format(v, fmt)

    def ratio(a, b):
        return opt(a and b and a / b, ".2f")

    print(bc.format_table(
        ["prompt", "batch", "prefill ms", "prefill tok/s", "TFLOP/s", "%mm", "decode ms/token", "decode tok/s",
         "replay ms", "floor ms", "decode / floor", "replay / floor", "peer decode ms", "peer / ours",
         "peer prefill ms"],
        [[c["prompt_len"], c["batch"], f"{1e3 * c['prefill_s']:.1f}", f"{c['prefill_tokens_per_s']:.0f}",
          f"{c['prefill_tflops']:.1f}", opt(mm_tflops and 100 * c["prefill_tflops"] / mm_tflops, ".0f"),
          f"{c['decode_ms_per_token']:.3f}", f"{c['decode_tokens_per_s']:.0f}", opt(c["replay_mid_ms_per_step"], ".3f"),
          opt(c["floor_ms"], ".3f"), ratio(c["decode_ms_per_token"], c["floor_ms"]),
          ratio(c["replay_mid_ms_per_step"], c["floor_ms"]), opt(c.get("peer_ms_per_token"), ".3f"),
          ratio(c.get("peer_ms_per_token"), c["decode_ms_per_token"]),
          opt(c.get("peer_prefill_s") and 1e3 * c["peer_prefill_s"], ".1f")] for c in cells]))


def model_slug(args) -> str:
    """The model's part of a results file name (``--layers``: its layer count too)."""
    name = Path(args.model).stem if args.model else "default"
    return name if args.layers is None else f"{name}-{args.layers}layers"


def peer_ms(engine, args, prompts_for: dict) -> tuple[dict, dict, str]:
    """transformers generate() per token (static cache, greedy, no early EOS) and its
    prefill (the call with 2 new tokens less one decode step), for each key of
    ``prompts_for`` (a batch, or a (prompt length, batch) cell) -> ({key: ms}, {key: s}, note)."""
    import transformers

    device, dtype = engine.device, engine.dtype
    if args.model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(moe_infer.config_files.DEFAULT_MODEL, dtype=dtype)
        model = model.to(device)
    else:
        cfg = hf_config(engine.config)
        if cfg is None:
            return {}, "no transformers family of this shape"
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    out, prefill, picked = {}, {}, {}
    for key, prompts in prompts_for.items():
        ids = torch.tensor(prompts, device=device)
        # With a static cache generate() compiles the decoding forward itself where the model
        # allows it (torch.compile); timed with and without that, the faster one counts.
        for mode, extra in (("auto-compile", {}), ("no compile", {"disable_compile": True})):
            def run(n, extra=extra):
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, cache_implementation="static", pad_token_id=0, **extra)

            with torch.no_grad():
                run(args.new_tokens + 1)  # warm-up (and the compile, where it happens)
                run(2)
                two = statistics.median(_wall(lambda: run(2), device) for _ in range(args.reps))
                full = statistics.median(_wall(lambda: run(args.new_tokens + 1), device) for _ in range(args.reps))
            ms = 1e3 * (full - two) / (args.new_tokens - 1)  # as per_token_ms
            if key not in out or ms < out[key]:
                out[key], prefill[key], picked[key] = ms, two - ms / 1e3, mode
    del model
    modes = ", ".join(f"{key}: {m}" for key, m in picked.items())
    return out, prefill, (f"transformers generate(), static cache, greedy; faster of auto-compile / no compile "
                          f"({modes})")


def run_matrix(engine, args, lens: list[int], batches: list[int], peer_cells: set | None, gen, copy_gbs) -> None:
    """--prompt-lens: every (prompt length, batch) cell, the peer on ``peer_cells`` (None:
    all), one table."""
    cells, prompts_for = [], {}
    for length in lens:
        for b in batches:
            cells.append(matrix_cell(engine, length, b, args.new_tokens, args.reps, gen, copy_gbs, prompts_for,
                                     args.routing))
            print(f"prompt {length} batch {b}: prefill {1e3 * cells[-1]['prefill_s']:.1f} ms, decode "
                  f"{cells[-1]['decode_ms_per_token']:.3f} ms/token", flush=True)
    mm = bc.measure_matmul_tflops(engine.device) if engine.device.type == "cuda" else None
    peer_note = "not run (--peer)"
    if args.peer:
        engine.runner = None
        engine.model.to("meta")  # a second copy of a large model does not fit beside ours
        bc.empty_cache(engine.device)
        chosen = peer_cells if peer_cells is not None else set(prompts_for)
        peer, prefill, peer_note = peer_ms(engine, args, {k: p for k, p in prompts_for.items() if k in chosen})
        for c in cells:
            key = (c["prompt_len"], c["batch"])
            c["peer_ms_per_token"], c["peer_prefill_s"] = peer.get(key), prefill.get(key)
    run = bc.run_info(engine.device)
    m = engine.config.model
    print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | {engine.dtype}"
          f"{' | ' + args.quantize + ' weights' if args.quantize else ''} | decode mode {engine.decode_mode}")
    print(f"model {args.model or 'default (embedded)'}: H={m.hidden_size} layers={m.num_layers} | "
          f"{args.new_tokens} new tokens, greedy, medians of {args.reps} | prefill: time to the first token, "
          f"{engine.config.engine.prefill_tokens} tokens a forward at most | decode: host loop between tokens")
    print(f"copy bandwidth {copy_gbs and round(copy_gbs)} GB/s; bf16 matmul {mm and round(mm)} TFLOP/s; "
          f"peer: {peer_note}")
    print_matrix(cells, mm)
    if not args.smoke:
        name = f"decode-matrix-{model_slug(args)}{'-' + args.quantize if args.quantize else ''}"
        bc.write_results(name, engine.device, {"run": run, "model": args.model or "default", "args": vars(args),
                                                   "kernel_options": dataclasses.asdict(
                                                       engine.config.engine.kernel_options()),
                                                   "copy_gbs": copy_gbs, "matmul_tflops": mm, "peer": peer_note,
                                                   "cells": cells})


def _wall(fn, device) -> float:
    """Seconds of one call of ``fn``. The garbage collector is kept off during it, so no
    collection lands inside the timed call; its young generations are collected before
    (a full collection with transformers loaded takes a good part of a second)."""
    gc.collect(1)
    gc.disable()
    try:
        bc.synchronize(device)
        start = time.perf_counter()
        fn()
        bc.synchronize(device)
        return time.perf_counter() - start
    finally:
        gc.enable()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a preset name or config YAML (default: the embedded model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    ap.add_argument("--prompt-lens", default="",
                    help="the issue's table instead: for each of these prompt lengths and each --batches, prefill "
                         "and decode as generate() runs them (no eager run), e.g. 128,512,2048")
    ap.add_argument("--peer-cells", default="",
                    help="with --prompt-lens and --peer: the LEN:BATCH cells the peer runs, e.g. 128:1,2048:8 "
                         "(default: all)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny run (CPU: the static step without a graph)")
    ap.add_argument("--peer", action="store_true", help="also time transformers generate() on the same shape")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep the model's first N layers (its real layer shapes, on one GPU where the whole "
                         "model does not fit)")
    ap.add_argument("--quantize", choices=["int8", "mxfp4"], default=None,
                    help="int8 weights for every linear layer, or MXFP4 experts")
    ap.add_argument("--routing", action="store_true",
                    help="with --prompt-lens: each cell also records its prompts' routing (each MoE layer's picks "
                         "per expert), which validate_costmodel.py prices the cell's prefill by")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel device time of one decode step (first batch size, fast mode) and of "
                         "the first --prefill case")
    ap.add_argument("--prefill", default="", help="prefill rates for LEN:BATCH pairs, e.g. 2048:8,512:32")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.new_tokens, args.reps = "1,3", 8, 2
    if args.new_tokens < 2:
        ap.error(f"--new-tokens {args.new_tokens}: expected at least 2 (per token = 2 against N + 1 new tokens)")
    try:
        lens = [int(v) for v in args.prompt_lens.split(",")] if args.prompt_lens else []
        peer_cells = {tuple(int(v) for v in cell.split(":", 1)) for cell in args.peer_cells.split(",")} \
            if args.peer_cells else None
    except ValueError:
        ap.error(f"--prompt-lens {args.prompt_lens!r} / --peer-cells {args.peer_cells!r}: expected comma-separated "
                 f"token counts / LEN:BATCH pairs, e.g. 128,2048 / 128:1,2048:8")
    if any(n < 1 for n in lens) or any(len(c) != 2 for c in peer_cells or ()):
        ap.error(f"--prompt-lens {args.prompt_lens!r} / --peer-cells {args.peer_cells!r}: expected positive token "
                 f"counts / LEN:BATCH pairs")
    if lens and (args.prefill or args.profile):
        ap.error("--prefill / --profile: not with --prompt-lens (the matrix times each cell's first token itself; "
                 "run them with --prompt-len)")
    source = args.model
    if args.layers is not None:
        source = bc.first_layers(moe_infer.loader.resolve_config(args.model), args.layers)
    engine = moe_infer.load(source, device=args.device, progress=False, quantize=args.quantize)
    engine.eos = set()  # every timed run decodes its full number of tokens (random weights can hit EOS)
    fast = "graph" if engine.decode_mode == "graph" else "static"
    vocab = engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    copy_gbs = bc.measure_copy_bandwidth(engine.device) if engine.device.type == "cuda" else None
    rows, prompts_for = [], {}
    batches = [int(b) for b in args.batches.split(",")]
    if lens:
        engine.decode_mode = fast
        return run_matrix(engine, args, lens, batches, peer_cells, gen, copy_gbs)
    for b in batches:
        engine.config.engine.max_batch_size = max(engine.config.engine.max_batch_size, b)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(b)]
        prompts_for[b] = prompts
        engine.decode_mode = "eager"
        eager_ms, eager_tokens = per_token_ms(engine, prompts, args.new_tokens, args.reps)
        engine.decode_mode = fast
        fast_ms, fast_tokens = per_token_ms(engine, prompts, args.new_tokens, args.reps)
        mid = args.prompt_len + args.new_tokens // 2  # the context the floor counts
        replay = replay_ms(engine, b)
        replay_mid = replay_ms(engine, b, slot=mid)
        same = sum(a == c for a, c in zip(eager_tokens, fast_tokens))
        nbytes = floor_bytes(engine, b, mid)
        rows.append({"batch": b, "eager_ms_per_token": eager_ms, f"{fast}_ms_per_token": fast_ms,
                     "replay_ms_per_step": replay, "replay_mid_ms_per_step": replay_mid,
                     "speedup": eager_ms / fast_ms, "rows_with_equal_tokens": same, "floor_bytes": nbytes,
                     "floor_ms": nbytes / copy_gbs / 1e6 if copy_gbs else None})
    profile = None
    if args.profile and engine.device.type == "cuda":
        b = batches[0]
        floor = floor_parts(engine, b, args.prompt_len + args.new_tokens // 2, copy_gbs)
        profile = profile_step(engine, prompts_for[b], min(args.new_tokens, 32),
                               rows[0][f"{fast}_ms_per_token"], floor)
        profile["batch"] = b
    prefill = []
    for pair in filter(None, args.prefill.split(",")):
        length, b = (int(v) for v in pair.split(":"))
        prefill.append(prefill_rate(engine, length, b, args.reps, gen,
                                    profile=args.profile and not prefill and engine.device.type == "cuda"))
    peer, peer_note = ({}, "not run (--peer)")
    if args.peer:
        # Our captured caches and weights go first: beside them a second copy of the model
        # does not fit (Qwen3-30B-A3B on an 80 GB H100, Mixtral on an H200). Nothing below
        # runs our model again.
        engine.decode_mode, engine.runner = fast, None
        engine.model.to("meta")
        bc.empty_cache(engine.device)
        peer, _, peer_note = peer_ms(engine, args, prompts_for)
        for r in rows:
            r["peer_ms_per_token"] = peer.get(r["batch"])
    run = bc.run_info(engine.device)
    m = engine.config.model
    print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | {engine.dtype}"
          f"{' | ' + args.quantize + ' weights' if args.quantize else ''}")
    print(f"model {args.model or 'default (embedded)'}: H={m.hidden_size} layers={m.num_layers} | prompts "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens, greedy")
    if copy_gbs:
        print(f"copy bandwidth {copy_gbs:.0f} GB/s; peer: {peer_note}")

    def opt(v, fmt):
        return "-" if v is None else format(v, fmt)

    def over_floor(r, key):
        return opt(r["floor_ms"] and r[key] and r[key] / r["floor_ms"], ".2f")

    print(bc.format_table(
        ["batch", "eager ms/token", f"{fast} ms/token", "speedup", "same tokens", "floor MB", "floor ms",
         f"{fast} / floor", "replay ms", "replay / floor", "mid replay ms", "mid / floor", "peer ms/token",
         "peer / ours"],
        [[r["batch"], f"{r['eager_ms_per_token']:.3f}", f"{r[f'{fast}_ms_per_token']:.3f}", f"{r['speedup']:.2f}x",
          f"{r['rows_with_equal_tokens']}/{r['batch']}", f"{r['floor_bytes'] / 1e6:.1f}", opt(r["floor_ms"], ".3f"),
          over_floor(r, f"{fast}_ms_per_token"),
          opt(r["replay_ms_per_step"], ".3f"), over_floor(r, "replay_ms_per_step"),
          opt(r["replay_mid_ms_per_step"], ".3f"), over_floor(r, "replay_mid_ms_per_step"),
          opt(r.get("peer_ms_per_token"), ".3f"),
          opt(r.get("peer_ms_per_token") and r["peer_ms_per_token"] / r[f"{fast}_ms_per_token"], ".2f")]
         for r in rows]))
    if profile:
        print(f"\ndecode step at batch {profile['batch']}: {profile['step_ms']:.3f} ms per token, kernels busy "
              f"{profile['kernel_busy_ms']:.3f} ms (the rest: gaps between kernels, the host; each kernel counts "
              f"what it adds to the device's timeline)")
        print(bc.format_table(["part", "µs/step", "launches", "floor MB", "%copy"],
                              [[r["part"], f"{r['us_per_step']:.1f}", f"{r['launches_per_step']:.0f}",
                                opt(r["floor_bytes"] and r["floor_bytes"] / 1e6, ".1f"), opt(r["pct_copy"], ".0f")]
                               for r in profile["parts"]]))
        print(bc.format_table(["kernel", "µs/step", "launches"],
                              [[k["name"][:70], f"{k['us_per_step']:.1f}", f"{k['launches_per_step']:.0f}"]
                               for k in profile["kernels"]]))
    if prefill:
        mm = bc.measure_matmul_tflops(engine.device) if engine.device.type == "cuda" else None
        print(f"\nprefill (generate() with 1 new token){f'; bf16 matmul {mm:.0f} TFLOP/s' if mm else ''}")
        for r in prefill:
            r["pct_mm"] = 100 * r["tflops"] / mm if mm else None
        print(bc.format_table(["prompt", "batch", "ms", "tokens/s", "TFLOP/s", "%mm"],
                              [[r["prompt_len"], r["batch"], f"{1e3 * r['seconds']:.1f}", f"{r['tokens_per_s']:.0f}",
                                f"{r['tflops']:.1f}", opt(r["pct_mm"], ".0f")] for r in prefill]))
        for r in prefill:
            if "kernels" in r:
                print(f"\nprefill {r['prompt_len']} x {r['batch']}: {1e3 * r['seconds']:.1f} ms, kernels busy "
                      f"{r['kernel_busy_ms']:.1f} ms; the kernels that took longest:")
                print(bc.format_table(["kernel", "ms", "launches"],
                                      [[k["name"][:80], f"{k['ms']:.2f}", k["launches"]] for k in r["kernels"]]))
                tl = r["timeline"]
                print(f"first kernel start to last kernel end {tl['span_ms']:.1f} ms, idle inside it "
                      f"{tl['idle_ms']:.2f} ms (the rest of the wall time: the host before the first launch "
                      f"and after the last); longest gaps:")
                print(bc.format_table(["µs", "after", "before"],
                                      [[f"{g['us']:.0f}", g["after"], g["before"]] for g in tl["gaps"]]))
    if not args.smoke:
        name = f"decode-{model_slug(args)}{'-' + args.quantize if args.quantize else ''}"
        bc.write_results(name, engine.device, {"run": run, "model": args.model or "default", "args": vars(args),
                                                   "copy_gbs": copy_gbs, "peer": peer_note, "rows": rows,
                                                   "profile": profile, "prefill": prefill})


if __name__ == "__main__":
    main()
