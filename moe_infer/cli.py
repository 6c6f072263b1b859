"""The ``moe-infer`` command line. It only fills in configs and calls the engine."""
from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from moe_infer import __version__
from moe_infer.checkpoint import CheckpointError
from moe_infer.config import ConfigError, ParallelConfig, preset_names

EPILOG = """examples:
  moe-infer generate --prompt "Shall I compare thee to a summer's day?"
  moe-infer generate --checkpoint ./Mixtral-8x7B-v0.1 --prompt "The capital of France is" --max-new-tokens 16
  moe-infer generate --config tiny-moe --prompt-ids 1,2,3 --temperature 0.8 --top-p 0.9 --seed 1
  scripts/launch.sh -n 4 -- moe-infer generate --tp 2 --ep 2 --prompt "Let me not to the marriage of true minds"
  moe-infer presets

Without --config or --checkpoint, the embedded default model runs (a tiny Mixtral-format MoE
trained on the text in moe_infer/default_model/corpus.txt); CPU is fine.
"""


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids, e.g. 1,2,3") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-infer", description="Mixture-of-experts inference: generate text with Hugging Face "
        "MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), YAML configs or built-in presets.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"moe-infer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="continue one or more prompts",
                         description="Continue prompts with a model; prints each prompt and its continuation.",
                         epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = gen.add_argument_group("model")
    src.add_argument("--config", metavar="NAME|YAML",
                     help="a built-in preset (see `moe-infer presets`) or a YAML config file")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a Hugging Face checkpoint directory (config.json + *.safetensors); "
                          "with --config, its engine/parallel settings apply")
    src.add_argument("--device", help="cpu, cuda or cuda:N (default: the config's, else auto)")
    src.add_argument("--quantize", choices=["int8"], help="weight-only int8 experts and linear layers")
    src.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                     help="weight and activation dtype (default: bfloat16 on GPU, float32 on CPU)")
    inp = gen.add_argument_group("input")
    inp.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                     help="a prompt; repeat for a batch")
    inp.add_argument("--prompt-ids", action="append", default=[], type=_ids, metavar="IDS",
                     help="a prompt as comma-separated token ids (for models without a tokenizer)")
    par = gen.add_argument_group("parallelism (launch with scripts/launch.sh -n N -- moe-infer ...)")
    par.add_argument("--tp", type=int, help="tensor-parallel degree (heads and FFN columns split)")
    par.add_argument("--ep", type=int, help="expert-parallel degree (experts placed across ranks)")
    par.add_argument("--expert-slicing", type=int, help="ranks that split each expert's width")
    par.add_argument("--pcc", action=argparse.BooleanOptionalAction, default=None,
                     help="parallelism-coordinated all-to-all (default on; --no-pcc: naive baseline)")
    smp = gen.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: 64")
    smp.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    smp.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    smp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    smp.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")

    sub.add_parser("presets", help="list the built-in configs")

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                         description="Serves /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                     "/metrics. The YAML has the sections model (a preset name or config "
                                     "YAML), checkpoint, parallel, engine and server; flags override the "
                                     "server section. Under scripts/launch.sh, rank 0 serves HTTP.")
    srv.add_argument("--config", metavar="YAML", help="serve config (default: the embedded model, defaults)")
    srv.add_argument("--host", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="port (default 8000)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    srv.add_argument("--model-name", help="the model id clients send (default: the config's name)")
    return parser


def _parallel(args) -> ParallelConfig | None:
    """The layout from --tp / --ep / --expert-slicing / --pcc; the dense part's data
    parallelism fills the ranks mpirun started."""
    if all(v is None for v in (args.tp, args.ep, args.expert_slicing, args.pcc)):
        return None
    world = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
    tp = args.tp or 1
    if world % tp:
        raise ConfigError(f"--tp={tp}: expected a divisor of the {world} ranks this job runs")
    return ParallelConfig(tp=tp, dp=world // tp, ep=args.ep or 1, expert_slicing=args.expert_slicing or 1,
                          pcc=True if args.pcc is None else args.pcc)


def _generate(args) -> int:
    from moe_infer.loader import load

    if not args.prompt and not args.prompt_ids:
        raise ValueError("no prompt: pass --prompt TEXT or --prompt-ids IDS")
    engine = load(args.config, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype,
                  parallel=_parallel(args), quantize=args.quantize)
    prompts = args.prompt + args.prompt_ids
    outs = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0  # every rank computed the same tokens; rank 0 prints them
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i:
            print()
        if isinstance(prompt, str) and out.text is not None:
            print(prompt + out.text)
        else:
            print(" ".join(map(str, prompt + out.token_ids)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from moe_infer.server import read_serve_config, serve

            serve(read_serve_config(args.config, {"host": args.host, "port": args.port, "api_key": args.api_key,
                                                  "model_name": args.model_name}))
            return 0
        if args.command == "presets":
            print("\n".join(preset_names()))
            return 0
    except (ConfigError, CheckpointError, ValueError) as exc:
        print(f"moe-infer: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
