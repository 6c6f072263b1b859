"""The ``moe-infer`` command line. It only fills in configs and calls the engine."""
from __future__ import annotations

import argparse
import sys

from moe_infer import __version__
from moe_infer.checkpoint import CheckpointError
from moe_infer.config import ConfigError, preset_names

EPILOG = """examples:
  moe-infer generate --prompt "Shall I compare thee to a summer's day?"
  moe-infer generate --checkpoint ./Mixtral-8x7B-v0.1 --prompt "The capital of France is" --max-new-tokens 16
  moe-infer generate --config tiny-moe --prompt-ids 1,2,3 --temperature 0.8 --top-p 0.9 --seed 1
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
    src.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                     help="weight and activation dtype (default: bfloat16 on GPU, float32 on CPU)")
    inp = gen.add_argument_group("input")
    inp.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                     help="a prompt; repeat for a batch")
    inp.add_argument("--prompt-ids", action="append", default=[], type=_ids, metavar="IDS",
                     help="a prompt as comma-separated token ids (for models without a tokenizer)")
    smp = gen.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: 64")
    smp.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    smp.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    smp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    smp.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")

    sub.add_parser("presets", help="list the built-in configs")
    return parser


def _generate(args) -> int:
    from moe_infer.loader import load

    if not args.prompt and not args.prompt_ids:
        raise ValueError("no prompt: pass --prompt TEXT or --prompt-ids IDS")
    engine = load(args.config, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype)
    prompts = args.prompt + args.prompt_ids
    outs = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed)
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
