#!/usr/bin/env python
"""Models larger than the device: decode and prefill with experts in host memory
(``engine.gpu_memory_gb``), beside the floor of the placement, the all-GPU run where the
model fits, and transformers + accelerate at the same budget.

    python scripts/bench_offload.py --model mixtral-8x7b --budgets 70,40 --peer
    python scripts/bench_offload.py --model qwen3-30b-a3b --budgets 16
    python scripts/bench_offload.py --model mixtral-8x7b --budgets "" --layers-batches 64,256   # ZeRO alone
    python scripts/bench_offload.py --smoke          # tiny-moe on the CPU, every mode

Random weights. Per budget and mode (``engine.offload``: auto, cpu, stream): decode ms per
step at each batch (generate()'s own clock, 128-token prompts), prefill tokens/s of
``--prefill`` prompts (time to the first token, the median of ``--reps`` runs), and from the
layers' counters over the same decode steps (``decode_run``) the share of routed pairs that
found their expert on the device (hit rate) and the cold experts a step met, and the share
of the calls with cold pairs that ran them on the CPU (the rest read them in place or
streamed them). The floor of a decode step: the device-resident bytes it reads (everything
but the routed experts, and the device experts it is expected to hit: the run's hit rate of
a token's picks, spread evenly over them) over the copy bandwidth, plus the cold experts it
met over the bandwidth of the way they ran (pinned host-to-device copy for streamed ones,
the CPU's matmul read rate for CPU ones), both measured in this run.
The peer: transformers' ``generate()`` on a model of the same shape placed by accelerate
(``device_map="auto"``, ``max_memory`` = the budget on the GPU, the rest in CPU memory).
``--layers-batches``: ZeRO-Inference mode (``engine.offload: layers``), prefill tokens/s and
TFLOP/s at large batches, each batch in one forward, against the bf16 matmul rate and the
blocks' pinned host-to-device copy, both measured in the same run.
``--kv-batches``: the KV cache in host memory (``engine.kv_offload``), decode ms per step at
each batch beside the same batch with the cache on the device (where it fits) and the floor
of the cache's trips: its whole pools in, the written slots out, over the pinned
host-to-device bandwidth measured in this run.
Writes bench/results/offload-<model>-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import moe_infer  # noqa: E402
from bench_decode import decode_step_ms, prefill_flops  # noqa: E402
from peer_configs import hf_config  # noqa: E402
from moe_infer import offload as off  # noqa: E402


def counters(engine) -> dict:
    """The offloaded layers' counters, summed, then zeroed."""
    total = dict.fromkeys(off.STATS, 0)
    for m in engine.model.modules():
        if isinstance(m, off.OffloadedExperts):
            for k, v in m.stats.items():
                total[k] += v
            m.tally.zero_()
    return total


def hit_rate(seen: dict) -> float:
    """The share of a run's routed pairs (the layers' counters ``seen``) whose expert was on the device."""
    return 1 - seen["cold_pairs"] / seen["pairs"] if seen["pairs"] else 1.0


def floor_ms(engine, batch: int, tokens: int, seen: dict, copy_bytes_s: float) -> float | None:
    """The placement's floor of one decode step (see the module doc) from ``seen``, the
    counters of a run that decoded ``tokens`` steps."""
    layers = [m for m in engine.model.modules() if isinstance(m, off.OffloadedExperts)]
    if not layers or not tokens:
        return None
    inside = {id(p) for m in layers for p in (m.w13, m.w2)}
    dense = sum(p.numel() * p.element_size() for p in engine.model.parameters() if id(p) not in inside)
    k = engine.config.moe.top_k
    one, profile = layers[0].cost.expert_bytes, layers[0].cost.profile
    # The device experts a step reads: a token's picks that found their expert on the device
    # (k x the run's hit rate) spread evenly over each layer's device experts. (At batch 1
    # exactly k x the hit rate; not k / E of them, as uniform routing would have it, once the
    # placement follows the prompts' own routing and a step meets few cold experts.)
    picks = k * hit_rate(seen)
    hot_hit = sum(len(m.hot) * (1 - (1 - min(1.0, picks / len(m.hot))) ** batch) for m in layers if m.hot)
    device = (dense + hot_hit * one) / copy_bytes_s
    cold = 0.0
    if seen["cold_experts"]:  # the bandwidth of the ways the calls took, weighed by their number
        calls = seen["cpu"] + seen["stream"]
        rate = (seen["cpu"] * profile.cpu_bytes_s + seen["stream"] * profile.h2d_bytes_s) / calls
        cold = seen["cold_experts"] / tokens * one / rate
    return 1e3 * (device + cold)


def decode_run(engine, prompts, n: int, reps: int) -> tuple[float, dict, int]:
    """-> (ms per decode step, the layers' counters summed over those steps, the steps):
    after a warm-up, ``reps`` generate() runs of n new tokens, their decode steps timed by
    generate()'s own clock (``bench_decode.decode_step_ms``) and counted in the same runs
    (the experts move between runs as the routing counts say, so time and floor must come
    from the same steps). A call of more tokens than the batch (a prefill) leaves the
    counters as they were. The figures are the runs' totals: time over steps."""
    layers = [m for m in engine.model.modules() if isinstance(m, off.OffloadedExperts)]
    rows = 1 << (len(prompts) - 1).bit_length()  # a decode step's tokens, padded to its bucket at most

    def counting(m):
        call = m.fused

        def fused(x, *args, **kwargs):
            if x.shape[0] <= rows:  # (decode steps replayed from graphs count without this call)
                return call(x, *args, **kwargs)
            before = m.tally.clone()
            out = call(x, *args, **kwargs)
            m.tally.copy_(before)
            return out
        return fused

    engine.generate(prompts, max_new_tokens=n)
    counters(engine)
    for m in layers:
        m.fused = counting(m)
    seconds, steps = 0.0, 0
    try:
        for _ in range(reps):
            engine.generate(prompts, max_new_tokens=n)
            s = engine.last_stats
            if s.generated_tokens != n * len(prompts) or not s.decoded_tokens:
                raise RuntimeError(f"decode_run: {s.generated_tokens} tokens, {s.decoded_tokens} decoded; "
                                   f"expected {n * len(prompts)} (eos cleared) and some decoded")
            seconds += s.decode_s
            steps += s.decoded_tokens // len(prompts)
    finally:
        for m in layers:
            del m.fused  # the class's method again
    return 1e3 * seconds / steps, counters(engine), steps


def prefill_tokens_s(engine, prompts, reps: int = 1) -> float:
    """Prompt tokens a second of ``prompts`` (time to the first token), the median of ``reps`` runs."""
    engine.generate(prompts, max_new_tokens=1)  # warm-up
    times = []
    for _ in range(reps):
        bc.synchronize(engine.device)
        t = time.perf_counter()
        engine.generate(prompts, max_new_tokens=1)
        bc.synchronize(engine.device)
        times.append(time.perf_counter() - t)
    return sum(map(len, prompts)) / statistics.median(times)


def peer_ms(model_name: str, budget_gb: float, prompts, n: int) -> float | None:
    """transformers generate() ms per token with accelerate's placement at ``budget_gb``."""
    import transformers
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    cfg = hf_config(moe_infer.config_files.load_preset(model_name))
    if cfg is None:
        return None
    # Built without weights, then filled with random bf16 values in host memory, drawn on the
    # GPU: transformers' own initialisation, or drawing tens of billions of values on the
    # CPU, takes minutes.
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        value = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda:0").normal_(0, 0.02, generator=gen)
        set_module_tensor_to_device(model, name, "cpu", value=value.cpu())
    model.tie_weights()
    host_gb = max(1, int(bc.free_memory_bytes("cpu") / 2 ** 30) - 8)
    placement = infer_auto_device_map(model, max_memory={0: f"{budget_gb}GiB", "cpu": f"{host_gb}GiB"},
                                      no_split_module_classes=getattr(model, "_no_split_modules", None))
    model = dispatch_model(model, placement).eval()
    ids = torch.tensor(prompts, device="cuda:0")

    def run(new):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    run(2)
    return 1e3 * (run(n + 1) - run(2)) / (n - 1)


def kv_rows(args, device, prompts_of) -> list[dict]:
    """Decode with the KV cache in host memory at each of ``--kv-batches``, beside the cache on
    the device (None where it does not fit) and the floor of the cache's trips."""
    out, h2d = [], None  # pinned host-to-device bytes/s, measured once
    for b in [int(x) for x in args.kv_batches.split(",")]:
        row = {"batch": b}
        for kv_offload in ("all", None):
            engine = moe_infer.load(args.model, device=device, progress=False, kv_offload=kv_offload)
            engine.eos = set()
            ps = prompts_of(engine, b, args.prompt_len)
            try:
                ms = decode_step_ms(engine, ps, args.new_tokens, args.reps)
            except torch.OutOfMemoryError:
                ms = None
            if kv_offload:
                cache, m = engine.runner.cache, engine.config.model
                pools = cache.host_k.numel() * cache.host_k.element_size() + \
                    cache.host_v.numel() * cache.host_v.element_size()
                per_token = pools / cache.host_k.shape[1]  # every layer's keys and values of one slot
                if h2d is None:
                    h2d = off.MachineProfile.measure(engine.device, engine.dtype, m.hidden_size,
                                                     m.hidden_size).h2d_bytes_s
                row.update(ms_per_token=ms, cache_gb=pools / 1e9, floor_ms=1e3 * (pools + b * per_token) / h2d)
            else:
                row["device_ms_per_token"] = ms
            del engine
            bc.empty_cache(device or "cuda")
        out.append(row)
        print(f"kv offload batch {b}: {row['ms_per_token'] or float('nan'):.3f} ms/token", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mixtral-8x7b", help="a preset name or config YAML (random weights)")
    ap.add_argument("--budgets", default="70,40", help="GB of weights on the device, comma list ('' for none: "
                                                       "with --layers-batches or --kv-batches alone)")
    ap.add_argument("--modes", default="auto,cpu,stream")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill", default="8x512", help="ROWSxLEN prompts for the prefill rate")
    ap.add_argument("--all-gpu", action="store_true", help="also the unbounded model (where it fits)")
    ap.add_argument("--layers-batches", default="",
                    help="ZeRO-Inference (offload: layers): prefill throughput at these batches of "
                         "--layers-prompt-len prompts, against the matmul rate")
    ap.add_argument("--layers-prompt-len", type=int, default=512)
    ap.add_argument("--kv-batches", default="", help="batches to decode with the KV cache in host memory")
    ap.add_argument("--peer", action="store_true", help="transformers + accelerate at each budget (GPU)")
    ap.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, every mode, few tokens")
    ap.add_argument("--no-json", action="store_true")
    args = ap.parse_args()
    device = None if torch.cuda.is_available() else "cpu"  # a GPU where there is one
    if args.smoke:
        args.model, args.budgets, args.batches, args.new_tokens, args.reps = "tiny-moe", "0.0016", "1,4", 4, 1
        args.prefill, args.prompt_len, args.all_gpu, device = "2x16", 8, True, "cpu"
        args.layers_batches, args.layers_prompt_len, args.kv_batches = "2,4", 16, "2,4"
    gen = torch.Generator().manual_seed(0)
    rows, width = map(int, args.prefill.split("x"))
    rows_out = []
    copy_bytes_s = None

    def prompts_of(engine, b, n):
        vocab = engine.config.model.vocab_size
        return [torch.randint(0, vocab, (n,), generator=gen).tolist() for _ in range(b)]

    runs = [(None, "all")] if args.all_gpu else []
    runs += [(float(b), m) for b in filter(None, args.budgets.split(",")) for m in args.modes.split(",")]
    for budget, mode in runs:
        engine = moe_infer.load(args.model, device=device, progress=False, gpu_memory_gb=budget,
                                offload=None if budget is None else mode)
        engine.eos = set()
        if copy_bytes_s is None:
            copy_bytes_s = bc.measure_copy_bandwidth(engine.device) * 1e9
        mine = []
        for b in [int(x) for x in args.batches.split(",")]:
            ps = prompts_of(engine, b, args.prompt_len)
            ms, seen, steps = decode_run(engine, ps, args.new_tokens, args.reps)
            fl = floor_ms(engine, b, steps, seen, copy_bytes_s)
            hit = hit_rate(seen)
            mine.append({"budget_gb": budget, "mode": mode, "batch": b, "ms_per_token": ms, "floor_ms": fl,
                         "hit_rate": hit, "cold_experts_per_step": seen["cold_experts"] / steps,
                         "cpu_calls": seen["cpu"] / max(1, seen["cpu"] + seen["stream"]), "prefill_tokens_s": None})
            rows_out.append(mine[-1])
            # each row in full as it is measured: a run cut short (a job's time limit) keeps what it reached
            print(f"budget {budget} {mode} batch {b}: {ms:.3f} ms/token, floor "
                  f"{'-' if fl is None else format(fl, '.3f')} ms, hit rate {hit:.2f}, cold experts a step "
                  f"{seen['cold_experts'] / steps:.1f}", flush=True)
        # After the decode runs: the prompts' routing counts would otherwise place the
        # device experts for the prefill's tokens, not for those the decode runs meet.
        prefill = prefill_tokens_s(engine, prompts_of(engine, rows, width), args.reps)
        for row in mine:
            row["prefill_tokens_s"] = prefill
        print(f"budget {budget} {mode}: prefill {prefill:.0f} tokens/s", flush=True)
        del engine
        bc.empty_cache(device or "cuda")
    layers = []
    if args.layers_batches:
        engine = moe_infer.load(args.model, device=device, progress=False, offload="layers")
        rate = bc.measure_matmul_tflops(engine.device)
        # Every forward copies each block over the host link once: the whole batch in one
        # forward (as ZeRO-Inference is run) is what amortises the copies.
        blocks = sum(t.numel() * t.element_size() for t in engine.model.layers.state_dict().values())
        h2d = off.MachineProfile.measure(engine.device, engine.dtype, 64, 64).h2d_bytes_s
        for b in [int(x) for x in args.layers_batches.split(",")]:
            n = b * args.layers_prompt_len
            engine.config.engine.max_batch_size = max(engine.config.engine.max_batch_size, b)
            engine.config.engine.prefill_tokens = max(engine.config.engine.prefill_tokens, n)
            ps = prompts_of(engine, b, args.layers_prompt_len)
            tps = prefill_tokens_s(engine, ps)
            flops = prefill_flops(engine, args.layers_prompt_len, b)
            tflops = flops * tps / n / 1e12
            # the larger of the blocks' copies and the matmuls at the measured rate
            floor_s = max(blocks / h2d, flops / (rate * 1e12))
            layers.append({"batch": b, "prompt_len": args.layers_prompt_len, "tokens_s": tps, "tflops": tflops,
                           "matmul_tflops": rate, "block_gb": blocks / 1e9, "h2d_gb_s": h2d / 1e9,
                           "floor_tokens_s": n / floor_s})
            print(f"layers batch {b}: {tps:.0f} tokens/s, {tflops:.1f} TFLOP/s "
                  f"({100 * tflops / rate:.0f}% of {rate:.0f}), floor {n / floor_s:.0f} tokens/s", flush=True)
        del engine
        bc.empty_cache(device or "cuda")
    kv = kv_rows(args, device, prompts_of) if args.kv_batches else []
    if args.peer and not args.smoke:
        for budget in {r["budget_gb"] for r in rows_out if r["budget_gb"] is not None}:
            b = 1
            ms = peer_ms(args.model, budget, [[1] * args.prompt_len] * b, args.new_tokens)
            rows_out.append({"budget_gb": budget, "mode": "transformers+accelerate", "batch": b, "ms_per_token": ms,
                             "floor_ms": None, "hit_rate": None, "cold_experts_per_step": None,
                             "cpu_calls": None, "prefill_tokens_s": None})
    run = bc.run_info(device or "cuda")
    print(f"device {run['device']} | date {run['date']} | commit {run['commit']} | model {args.model}, random "
          f"weights | copy {'-' if copy_bytes_s is None else format(copy_bytes_s / 1e9, '.0f')} GB/s | prompts {args.prompt_len} tokens, {args.new_tokens} new, "
          f"prefill {args.prefill}")

    def opt(v, fmt):
        return "-" if v is None else format(v, fmt)
    cols = ["budget GB", "mode", "batch", "ms/token", "floor ms", "x floor", "hit rate", "cold experts/step",
            "cold on CPU", "prefill tok/s"]
    if rows_out:
        print(bc.format_table(cols, [[opt(r["budget_gb"], "g"), r["mode"], r["batch"], opt(r["ms_per_token"], ".3f"),
                                      opt(r["floor_ms"], ".3f"),
                                      opt(r["ms_per_token"] / r["floor_ms"] if r["floor_ms"] else None, ".2f"),
                                      opt(r["hit_rate"], ".2f"), opt(r["cold_experts_per_step"], ".1f"),
                                      opt(r["cpu_calls"], ".0%"), opt(r["prefill_tokens_s"], ".0f")]
                                     for r in rows_out]))
    if layers:
        print(f"ZeRO-Inference (offload: layers, prefetch 1): prefill of {args.layers_prompt_len}-token prompts, the "
              f"batch in one forward; blocks {layers[0]['block_gb']:.1f} GB over {layers[0]['h2d_gb_s']:.0f} GB/s "
              f"pinned, matmul {layers[0]['matmul_tflops']:.0f} TFLOP/s; floor: the slower of the two")
        print(bc.format_table(["batch", "tokens/s", "floor tokens/s", "TFLOP/s", "% of matmul"],
                              [[r["batch"], f"{r['tokens_s']:.0f}", f"{r['floor_tokens_s']:.0f}", f"{r['tflops']:.1f}",
                                f"{100 * r['tflops'] / r['matmul_tflops']:.0f}"] for r in layers]))
    if kv:
        print(f"KV cache in host memory (engine.kv_offload), {args.prompt_len}-token prompts: decode ms/token")
        print(bc.format_table(["batch", "cache GB", "host cache", "device cache", "floor", "x floor"],
                              [[r["batch"], f"{r['cache_gb']:.2f}", opt(r["ms_per_token"], ".3f"),
                                opt(r["device_ms_per_token"], ".3f"), f"{r['floor_ms']:.3f}",
                                opt(r["ms_per_token"] and r["ms_per_token"] / r["floor_ms"], ".2f")] for r in kv]))
    if not args.no_json and not args.smoke:
        bc.write_results(f"offload-{Path(args.model).stem}", device or "cuda",
                         {"run": run, "model": args.model, "args": vars(args), "rows": rows_out, "layers": layers,
                          "kv_offload": kv})


if __name__ == "__main__":
    main()
