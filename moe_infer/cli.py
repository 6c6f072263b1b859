"""The ``moe-infer`` command line. It only fills in configs and calls the engine."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from comm import shutdown
from moe_infer import __version__
from moe_infer.config import ConfigError, ParallelConfig
from moe_infer.config_files import preset_names
from moe_infer.job import USER_ERRORS, Job, JobError

EPILOG = """examples:
  moe-infer generate --prompt "Shall I compare thee to a summer's day?"
  moe-infer generate --checkpoint ./Mixtral-8x7B-v0.1 --prompt "The capital of France is" --max-new-tokens 16
  moe-infer generate --config tiny-moe --prompt-ids 1,2,3 --temperature 0.8 --top-p 0.9 --seed 1
  scripts/launch.sh -n 4 -- moe-infer generate --tp 2 --ep 2 --prompt "Let me not to the marriage of true minds"
  moe-infer presets
  moe-infer serve --model olmoe-1b-7b --quantize int8 --port 8000
  moe-infer serve --checkpoint ./Qwen3-30B-A3B --dtype bfloat16

Without --model or --checkpoint, the embedded default model runs (a tiny Mixtral-format MoE
trained on the text in moe_infer/default_model/corpus.txt); CPU is fine.
"""


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids, e.g. 1,2,3") from None


def _prompt_options(group, prompt_help: str):
    """--prompt TEXT and --prompt-ids IDS, each repeatable (generate, routing)."""
    group.add_argument("--prompt", action="append", default=[], metavar="TEXT", help=prompt_help)
    group.add_argument("--prompt-ids", action="append", default=[], type=_ids, metavar="IDS",
                       help="a prompt as comma-separated token ids (for models without a tokenizer)")


def _model_options(parser: argparse.ArgumentParser, config_help: str | None):
    """The options that pick and place a model, the same for generate and serve."""
    src = parser.add_argument_group("model")
    names = ["--model"] if config_help is None else ["--model", "--config"]
    src.add_argument(*names, dest="model", metavar="NAME|YAML",
                     help=config_help or "a built-in preset (see `moe-infer presets`) or a model config YAML")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a Hugging Face checkpoint directory (config.json + *.safetensors); "
                          "with --model, its engine/parallel settings apply")
    src.add_argument("--device", help="cpu, cuda or cuda:N (default: the config's, else auto)")
    src.add_argument("--quantize", choices=["int8", "mxfp4"],
                     help="int8: weight-only int8 experts and linear layers; mxfp4: 4-bit experts (GPT-OSS's format)")
    src.add_argument("--gpu-memory-gb", type=float,
                     help="GB of weights kept on the device; the experts hit least live in host memory")
    src.add_argument("--offload", choices=["auto", "cpu", "stream", "layers"],
                     help="how experts in host memory run: on the CPU, or read by the device (in place at "
                          "decode sizes, copied in for larger calls); auto (default): read in place at decode "
                          "sizes, larger calls whichever way is faster; layers: every block streamed from "
                          "host memory as it runs (ZeRO-Inference, for large batches)")
    src.add_argument("--offload-dir",
                     help="memory-map the weights kept in host memory from files in this directory (for "
                          "hosts whose memory cannot hold them)")
    src.add_argument("--kv-offload", nargs="?", const="all", choices=["all", "alternate"],
                     help="keep the KV cache in host memory, each layer's copied in as it runs (batches whose "
                          "cache the GPU cannot hold); alternate: only the layers of the GPU's parity")
    src.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                     help="weight and activation dtype (default: bfloat16 on GPU, float32 on CPU)")
    par = parser.add_argument_group("parallelism (launch with scripts/launch.sh -n N -- moe-infer ...)")
    par.add_argument("--parallel", metavar="auto|LAYOUT",
                     help="auto: the layout of the launched ranks the cost model ranks first (moe-infer plan); "
                          "or a layout such as tp2-ep2 (instead of the flags below)")
    par.add_argument("--hardware", metavar="PROFILE|YAML",
                     help="the cost model's hardware profile for --parallel auto (default: this GPU's shipped one)")
    par.add_argument("--tp", type=int, help="tensor-parallel degree (heads and FFN columns split)")
    par.add_argument("--pp", type=int, help="pipeline stages (the blocks split into stages of balanced cost)")
    par.add_argument("--micro-batches", type=int,
                     help="pipeline: micro-batches while generating (default: --pp; 1 drains every token)")
    par.add_argument("--prompt-micro-batches", type=int,
                     help="pipeline: micro-batches while processing the prompts (default: 4 x --pp)")
    par.add_argument("--ep", type=int, help="expert-parallel degree (experts placed across ranks)")
    par.add_argument("--expert-slicing", type=int,
                     help="ranks that split each expert's width (default: tp / ep where ep divides tp, else 1)")
    par.add_argument("--pcc", action=argparse.BooleanOptionalAction, default=None,
                     help="parallelism-coordinated all-to-all (default on; --no-pcc: naive baseline)")
    par.add_argument("--dp-attention", action="store_true", default=None,
                     help="data-parallel replicas that share experts split the prompts (generate)")
    par.add_argument("--kv-shard", choices=["heads", "tokens"],
                     help="how the tp ranks split the KV cache (default heads; tokens: every head of 1 / tp of the "
                          "tokens, no cache copied where the KV heads are fewer than the ranks)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-infer", description="Mixture-of-experts inference: generate text with Hugging Face "
        "MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), YAML configs or built-in presets.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"moe-infer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="continue one or more prompts",
                         description="Continue prompts with a model; prints each prompt and its continuation, "
                                     "then one line of timings on stderr.",
                         epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(gen, "a built-in preset (see `moe-infer presets`) or a model config YAML (--config is "
                        "the same option)")
    _prompt_options(gen.add_argument_group("input"), "a prompt; repeat for a batch")
    smp = gen.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: 64")
    smp.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    smp.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    smp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    smp.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--quiet", action="store_true", help="no timing line on stderr")

    sub.add_parser("presets", help="list the built-in configs with their sizes")

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                         description="Serves /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                     "/metrics. --config takes a serve YAML (sections model, checkpoint, "
                                     "parallel, engine, server), or a preset name or model YAML as --model "
                                     "does; the flags override it. Under scripts/launch.sh, rank 0 serves HTTP.")
    srv.add_argument("--config", metavar="YAML|NAME",
                     help="a serve YAML, a preset name or a model YAML (default: the embedded model)")
    _model_options(srv, None)
    net = srv.add_argument_group("server")
    net.add_argument("--host", help="address to bind (default 127.0.0.1)")
    net.add_argument("--port", type=int, help="port (default 8000)")
    net.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    net.add_argument("--model-name", help="the model id clients send (default: the config's name)")
    pln = sub.add_parser("plan", help="rank the parallel layouts of N GPUs by the cost model",
                         description="Predicts, for every layout of --gpus GPUs the model takes (tp, ep, expert "
                                     "slicing, pp, dp, dp-attention), the time of a decode step (or a prefill), "
                                     "tokens/s and memory per GPU on a hardware profile, best first; with "
                                     "--parallel, that layout alone. See moe_infer/costmodel.py.")
    pln.add_argument("--model", required=True, metavar="NAME|YAML", help="a preset name or a model config YAML")
    pln.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) to lay the model over")
    pln.add_argument("--hardware", default="nvidia-h100-sxm", metavar="PROFILE|YAML",
                     help="a shipped profile (nvidia-a100-sxm, nvidia-h100-sxm, nvidia-h200, tpu-v4) or a YAML "
                          "from measurement (default: nvidia-h100-sxm)")
    pln.add_argument("--parallel", metavar="LAYOUT", help="one layout to evaluate, e.g. tp2-ep4 or tp=2,pp=2 "
                                                           "(keys tp, ep, pp, dp, slicing, dp-attention, kv-tokens)")
    pln.add_argument("--goal", choices=["latency", "throughput"], default="latency")
    pln.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    pln.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    pln.add_argument("--context", type=int, default=1024, help="cached tokens a row at decode (default 1024)")
    pln.add_argument("--prompt", type=int, default=1024, help="prompt tokens at prefill (default 1024)")
    weights = pln.add_mutually_exclusive_group()
    weights.add_argument("--int8", action="store_true", help="weight-only int8 weights")
    weights.add_argument("--mxfp4", action="store_true", help="MXFP4 experts (4.25 bits a weight), the rest bf16")
    pln.add_argument("--gpu-memory-gb", type=float, metavar="GB",
                     help="offloaded: GB of weights a GPU keeps, the other experts in host memory (as generate's)")
    pln.add_argument("--offload", choices=["auto", "cpu", "stream"], default="auto",
                     help="with --gpu-memory-gb: how the cold experts run (default auto)")
    pln.add_argument("--hit-rate", type=float, metavar="SHARE",
                     help="with --gpu-memory-gb: the measured share of routed pairs whose expert is on the device "
                          "(default: uniform routing's)")
    pln.add_argument("--routing", metavar="JSON",
                     help="a routing measured by `moe-infer routing`: the experts a batch hits follow it (default: "
                          "uniform routing)")
    pln.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")

    rte = sub.add_parser("routing", help="count each MoE layer's expert picks over prompts (for plan --routing)",
                         description="Runs each prompt through the model (one eager forward, one process) and "
                                     "writes each MoE layer's picks per routed expert as JSON, which "
                                     "`moe-infer plan --routing` prices a step's experts by.")
    _model_options(rte, "a built-in preset (see `moe-infer presets`) or a model config YAML")
    rin = rte.add_argument_group("input")
    _prompt_options(rin, "a prompt; repeat for more")
    rin.add_argument("--prompts-file", metavar="FILE", help="prompts, one a line (blank lines skipped)")
    rte.add_argument("--out", required=True, metavar="JSON", help="where to write the counts")

    cal = sub.add_parser("calibrate", help="measure this machine into a hardware profile for plan",
                         description="Measures memory bandwidth, matmul rates, host-device copies, the CPU's "
                                     "matmul rate, the MoE kernel (with --models: on those models' experts) and, "
                                     "under scripts/launch.sh -n N, all-reduce latency and bandwidth over the "
                                     "ranks; rank 0 writes a hardware profile YAML that "
                                     "`moe-infer plan --hardware FILE` reads.")
    cal.add_argument("--out", default="hardware.yaml", help="the profile to write (default hardware.yaml)")
    cal.add_argument("--name", help="the profile's name (default: the device's)")
    cal.add_argument("--device", default="auto", help="auto (default: a GPU where there is one), cpu, cuda:N")
    cal.add_argument("--models", help="comma list of MoE models (presets or config YAMLs): also time the fused MoE "
                                      "kernel on the experts a rank of each holds, by the tokens of a call")
    cal.add_argument("--moe-ranks", help="with --models: comma list of GPU counts whose shares to time "
                                         "(default 1, 2, 4, ... up to the launched ranks)")
    cal.add_argument("--moe-tokens", help="with --models: comma list of a call's token counts to time the kernel at "
                                          "(default 1 to 1024, and 4096, 16384 on GPUs)")
    cal.add_argument("--smoke", action="store_true", help="small sizes, a few seconds (tests)")
    return parser


def parse_layout(text: str, gpus: int) -> ParallelConfig:
    """``tp2-ep4``, ``tp=2,pp=2``, ``ep2-dp-attention``, ``tp4-kv-tokens``... -> the layout of ``gpus`` ranks
    (dp fills what tp and pp leave)."""
    keys = {"tp": "tp", "ep": "ep", "pp": "pp", "dp": "dp", "slicing": "expert_slicing",
            "expert_slicing": "expert_slicing"}
    kw, flags = {}, text.replace("dp-attention", "dp_attention").replace("kv-tokens", "kv_tokens")
    for part in filter(None, (p.strip() for p in flags.replace(",", "-").split("-"))):
        if part == "dp_attention":
            kw["dp_attention"] = True
            continue
        if part == "kv_tokens":
            kw["kv_shard"] = "tokens"
            continue
        name = part.rstrip("=0123456789").rstrip("=")
        value = part[len(name):].lstrip("=")
        if name not in keys or not value.isdigit():
            raise ConfigError(f"--parallel {text}: {part!r} is not one of tp N, ep N, pp N, dp N, slicing N, "
                              f"dp-attention, kv-tokens")
        kw[keys[name]] = int(value)
    tp, pp = kw.get("tp", 1), kw.get("pp", 1)
    dp = kw.setdefault("dp", gpus // (tp * pp) if gpus % (tp * pp) == 0 else 0)
    if tp * pp * dp != gpus:
        raise ConfigError(f"--parallel {text}: tp={tp} x pp={pp} x dp={dp} is not the {gpus} GPUs of --gpus")
    return ParallelConfig(**kw)


def _parallel(args, ranks: int) -> ParallelConfig | str | None:
    """The layout from --parallel, or from --tp / --pp / --ep / --expert-slicing / --pcc /
    --dp-attention / --kv-shard and the pipeline's micro-batch counts; data parallelism of the dense part
    fills the ranks the launcher started. "auto": the loader asks the cost model. None:
    no layout flags (``_default_layout``)."""
    flags = (args.tp, args.pp, args.ep, args.expert_slicing, args.pcc, args.dp_attention, args.micro_batches,
             args.prompt_micro_batches, args.kv_shard)
    if args.parallel is not None:
        if any(v is not None for v in flags):
            raise ConfigError(f"--parallel {args.parallel}: expected no --tp / --pp / --ep / --expert-slicing / "
                              f"--pcc / --dp-attention / --micro-batches / --kv-shard beside it")
        return "auto" if args.parallel == "auto" else parse_layout(args.parallel, ranks)
    if all(v is None for v in flags):
        return None
    tp, pp = args.tp or 1, args.pp or 1
    if tp < 1 or pp < 1 or ranks % (tp * pp):
        raise ConfigError(f"--tp={tp} x --pp={pp}: expected a divisor of the {ranks} ranks this job runs")
    return ParallelConfig(tp=tp, pp=pp, dp=ranks // (tp * pp), ep=args.ep or 1, expert_slicing=args.expert_slicing,
                          pcc=True if args.pcc is None else args.pcc, dp_attention=bool(args.dp_attention),
                          micro_batches=args.micro_batches, prompt_micro_batches=args.prompt_micro_batches,
                          kv_shard=args.kv_shard or "heads")


def _default_layout(ranks: int, model: str | None) -> ParallelConfig | None:
    """Without layout flags: the model config's own layout (a model YAML's ``parallel``
    section, None here: the loader applies it); where it names none, data parallelism of
    the dense part over every rank the launcher started."""
    if ranks == 1:
        return None
    if model is not None:
        from moe_infer.loader import resolve_config

        cfg = resolve_config(model)
        if cfg.parallel.world_size > 1 or cfg.parallel_auto:
            return None
    return ParallelConfig(dp=ranks)


def _print_completions(prompts, outs):
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i:
            print()
        if isinstance(prompt, str) and out.text is not None:
            print(prompt + out.text)
        else:
            print(" ".join(map(str, prompt + out.token_ids)))


def _generate(args, job: Job) -> int:
    from moe_infer.loader import load

    prompts = args.prompt + args.prompt_ids
    if not prompts:
        raise JobError("no prompt: pass --prompt TEXT or --prompt-ids IDS")
    parallel = job.stage(_parallel, args, job.size)
    if parallel is None:
        parallel = job.stage(_default_layout, job.size, args.model)
    engine = job.stage(load, args.model, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype,
                       parallel=parallel, quantize=args.quantize, gpu_memory_gb=args.gpu_memory_gb,
                       offload=args.offload, offload_dir=args.offload_dir, hardware=args.hardware,
                       kv_offload=args.kv_offload)
    if engine.auto_layout and job.leader and not args.quiet:
        print(f"moe-infer: {engine.auto_layout}", file=sys.stderr)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed)
    rows, _ = job.stage(engine.check_request, prompts, **sampling)
    outs = engine.generate(rows, **sampling)  # the token ids: the prompts are not encoded again
    if job.leader:  # every rank holds every completion; one prints them
        _print_completions(prompts, outs)
        if not args.quiet:
            sys.stdout.flush()
            print(f"moe-infer: {engine.last_stats.summary()}", file=sys.stderr)
    return 0


def _routing(args, job: Job) -> int:
    from moe_infer.loader import load
    from moe_infer.routing import measure

    if job.size > 1:
        raise JobError("moe-infer routing runs in one process (not under scripts/launch.sh)")
    prompts = args.prompt + args.prompt_ids
    if args.prompts_file:
        try:
            lines = Path(args.prompts_file).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--prompts-file {args.prompts_file}: cannot read it ({exc.strerror})") from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError("no prompt: pass --prompt TEXT, --prompt-ids IDS or --prompts-file FILE")
    engine = load(args.model, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype,
                  quantize=args.quantize, gpu_memory_gb=args.gpu_memory_gb, offload=args.offload,
                  offload_dir=args.offload_dir)
    record = measure(engine, engine.encode(prompts))
    Path(args.out).write_text(json.dumps(record) + "\n")
    print(f"moe-infer: {len(record['layers'])} MoE layers, {record['tokens']} tokens of {record['prompts']} "
          f"prompts -> {args.out}", file=sys.stderr)
    return 0


def _plan(args) -> int:
    from moe_infer.costmodel import CostModel, weight_sizes
    from moe_infer.hardware_profile import Hardware
    from moe_infer.loader import resolve_config

    if args.gpus < 1 or args.batch < 1 or args.context < 0 or args.prompt < 1:
        raise ConfigError("--gpus, --batch and --prompt: expected positive numbers (--context >= 0)")
    cfg = resolve_config(args.model)
    if args.gpu_memory_gb is not None:  # checked as the engine's own options
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, gpu_memory_gb=args.gpu_memory_gb,
                                                                  offload=args.offload))
    elif args.hit_rate is not None:
        raise ConfigError("--hit-rate: only with --gpu-memory-gb (the share of pairs an offloaded model finds on the "
                          "device)")
    if args.hit_rate is not None and not 0 <= args.hit_rate <= 1:
        raise ConfigError(f"--hit-rate {args.hit_rate:g}: expected a share between 0 and 1")
    hw = Hardware.load(args.hardware)
    quantize = "int8" if args.int8 else "mxfp4" if args.mxfp4 else None
    histogram = None
    if args.routing is not None:
        from moe_infer.routing import load as load_routing

        histogram = load_routing(args.routing, cfg)
    model = CostModel(cfg, hw, **weight_sizes(quantize), hit_rate=args.hit_rate, histogram=histogram)
    if args.parallel:
        preds = [model.predict(parse_layout(args.parallel, args.gpus), args.phase, args.batch, args.context,
                               args.prompt)]
    else:
        preds = model.rank(args.gpus, args.phase, args.batch, args.context, args.goal, args.prompt)
        if not preds:
            raise ConfigError(f"{args.model} on {args.gpus} x {hw.name}: no layout fits the memory "
                              f"({hw.memory_gb:g} GB a GPU); try more GPUs, --int8, --mxfp4 or a smaller --batch")
    what = (f"decode step, batch {args.batch}, {args.context} cached tokens" if args.phase == "decode"
            else f"prefill of {args.batch} x {args.prompt} tokens")
    kinds = {"int8": "int8 weights", "mxfp4": "MXFP4 experts", None: "bf16 weights"}
    print(f"{cfg.name} on {args.gpus} x {hw.name} ({kinds[quantize]}): {what}, "
          f"best {args.goal} first")
    # The memory's limits, each with the other held at the given value; the tokens a row
    # no further than the model's positions.
    longest = "max prompt" if args.phase == "prefill" else "max context"

    def limit(q, vary):
        n = model.largest(q.parallel, args.phase, args.batch, args.context, args.prompt, vary)
        if vary == "context" and n > cfg.model.max_position:
            return f"{cfg.model.max_position} (model)"
        return f">={n}" if n >= model.LIMIT else str(n)

    host = args.gpu_memory_gb is not None  # the cold experts' time, over the host link or on the CPU
    rows = [("layout", "ms", "tokens/s", "GB/GPU", "memory ms", "compute ms", "collectives ms",
             *(("host ms",) if host else ()), "fits", "max batch", longest)]
    for q in preds[:args.top]:
        rows.append((q.layout, f"{q.ms:.3f}", f"{q.tokens_per_s:,.0f}", f"{q.memory_gb:.1f}",
                     f"{q.split['memory']:.3f}", f"{q.split['compute']:.3f}", f"{q.split['collectives']:.3f}",
                     *((f"{q.split['host']:.3f}",) if host else ()),
                     "yes" if q.fits else "no", limit(q, "batch"), limit(q, "context")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(r[1:], widths[1:])))
    print(f"\nhardware: {hw.source}")
    return 0


def _calibrate(args, job: Job) -> int:
    import torch

    from comm import bootstrap
    from moe_infer.calibrate import measure
    from moe_infer.loader import resolve_device

    device = job.stage(resolve_device, args.device)
    models, ranks, tokens = job.stage(_calibrate_models, args)
    if job.size > 1:
        device = bootstrap(backend="nccl" if device.type == "cuda" else "gloo").device
    # The profile is written as it grows (the machine's figures, then each model's kernel
    # times): a run that a job limit cuts short leaves what it measured.
    hw = measure(torch.device(device), smoke=args.smoke, name=args.name, models=models, moe_ranks=ranks,
                 moe_tokens=tokens, progress=(lambda line: print(line, flush=True)) if job.leader else None,
                 reached=(lambda profile: profile.dump(args.out)) if job.leader else None)
    if job.leader:
        print(f"{args.out}: {hw.name}, memory {hw.mem_gbps:,.0f} GB/s, bf16 matmul {hw.matmul_tflops['bfloat16']:,.1f} "
              f"TFLOP/s, int8 {hw.matmul_tflops['int8']:,.1f}, host-to-device {hw.h2d_gbps:,.1f} GB/s, CPU matmul "
              f"{hw.cpu_matmul_gbps:,.1f} GB/s, link {hw.nvlink.alpha_us:g} us + {hw.nvlink.gbps:,.1f} GB/s")
    return 0


def _calibrate_models(args) -> tuple[list, tuple[int, ...] | None, tuple[int, ...] | None]:
    """``--models`` as Configs (each a MoE model), ``--moe-ranks`` as GPU counts and
    ``--moe-tokens`` as token counts."""
    from moe_infer.loader import resolve_config

    models = []
    for name in filter(None, (args.models or "").split(",")):
        cfg = resolve_config(name.strip())
        if cfg.moe is None:
            raise ConfigError(f"--models {name}: not a mixture-of-experts model (no moe section)")
        models.append(cfg)
    ranks, tokens = (_counts(text, flag, what, bool(models)) for text, flag, what in (
        (args.moe_ranks, "--moe-ranks", "GPU counts"), (args.moe_tokens, "--moe-tokens", "token counts")))
    return models, ranks, tokens


def _counts(text: str | None, flag: str, what: str, with_models: bool) -> tuple[int, ...] | None:
    """A comma list of positive integers given with --models, as a tuple (None: not given)."""
    if not text:
        return None
    if not with_models:
        raise ConfigError(f"{flag}: takes effect with --models only")
    try:
        counts = tuple(int(r) for r in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ConfigError(f"{flag} {text}: expected a comma list of positive {what}")
    return counts


def _presets() -> int:
    from moe_infer.config_files import load_preset
    from moe_infer.memory import model_size

    def count(n):
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

    rows = [("preset", "total", "active", "bf16")]
    for name in preset_names():
        size = model_size(load_preset(name))
        b = size.bf16_bytes()
        rows.append((name, count(size.total), count(size.active), f"{b / 1e9:.1f} GB" if b >= 1e9
                     else f"{b / 1e6:.1f} MB"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(r[1:], widths[1:])))
    print("\ntotal and active parameters (active: those one token uses, top_k of the routed experts); "
          "bf16: the weights' size at 2 bytes a parameter")
    return 0


def _serve(args, job: Job) -> int:
    try:
        from moe_infer.server import build_engine, read_serve_config, serve
    except ModuleNotFoundError as exc:
        raise JobError(f"serve needs the server's packages ({exc.name} is missing): "
                       f"pip install -e \".[serve]\"") from None
    overrides = {"host": args.host, "port": args.port, "api_key": args.api_key, "model_name": args.model_name}
    spec = job.stage(read_serve_config, args.config, overrides)
    if args.model is not None:
        spec.model = args.model
    if args.checkpoint is not None:
        spec.checkpoint = args.checkpoint
    spec.engine.update({k: v for k, v in (("device", args.device), ("dtype", args.dtype),
                                          ("quantize", args.quantize), ("gpu_memory_gb", args.gpu_memory_gb),
                                          ("offload", args.offload), ("offload_dir", args.offload_dir),
                                          ("kv_offload", args.kv_offload))
                        if v is not None})
    if args.hardware is not None:
        spec.engine["hardware"] = args.hardware
    parallel = job.stage(_parallel, args, job.size)
    if parallel is None and not spec.parallel:  # (a serve YAML's parallel section stands)
        parallel = job.stage(_default_layout, job.size, spec.model)
    if parallel is not None:
        spec.parallel = parallel if parallel == "auto" else dataclasses.asdict(parallel)
    engine = job.stage(build_engine, spec, progress=job.leader)
    if engine.auto_layout and job.leader:
        print(f"moe-infer: {engine.auto_layout}", file=sys.stderr)
    serve(spec, engine)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    job = Job()
    crashed = False
    try:
        if args.command == "generate":
            return _generate(args, job)
        if args.command == "serve":
            return _serve(args, job)
        if args.command == "presets":
            return _presets()
        if args.command == "plan":
            return _plan(args)
        if args.command == "calibrate":
            return _calibrate(args, job)
        if args.command == "routing":
            return _routing(args, job)
    except JobError as exc:  # known on every rank: one prints it
        if job.leader:
            print(f"moe-infer: error: {exc}", file=sys.stderr)
        return 2
    except USER_ERRORS as exc:  # this rank alone knows it
        return job.fail(str(exc))
    except BaseException:
        # The excepthook aborts the job: the peers may wait inside a collective (or a
        # replayed graph's), where a barrier here would only add a wait for the timeout.
        crashed = True
        raise
    finally:
        if job.size > 1 and not crashed:
            shutdown()  # a rank that left early would make gloo end its peers
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
