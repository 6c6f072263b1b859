#!/usr/bin/env python
"""A/B runs of the decode benchmark with parts of the decode path switched off or on
inside this process (the library itself reads no such switch), to show what each part
is worth in the same run and on the same device:

    PYTHONPATH=. python scripts/diag_decode_ab.py --off moe-cuda [bench_decode.py arguments]

--off (repeatable):
  moe-cuda    the tuning table's CUDA MoE entries are dropped: the Triton grouped GEMM,
              the routing launch and the combine run as before those kernels
  cuda-pdl    the CUDA C++ kernels (SBI-GeMM, MoE) launch without PDL
  fused-attention  the QKV epilogue launch and SDPA, not kernels.qkv_attention
  pdl-early   every kernel lets the next launch only after its own wait
  fused-context  the static decode step's positions, mask and rotary rows by torch's ops
              (about twenty launches), not kernels.decode_context_triton (one)
  preload-kv  kernels.qkv_attention loads its keys and values after its PDL wait, not before
  router-preload  the norm + router launch loads its weights after its PDL wait, not before
  norm-in-qkv the attention's residual add and RMSNorm in a launch of their own, not inside
              the QKV GEMM's
--on (repeatable; each measured slower or no faster, so off by default):
  route-in    the gating inside the CUDA MoE kernels, no routing launch
  l2-prefetch the CUDA GEMMs send all their weights to L2 before their wait
  topk-in-router  the top-k table in the norm + router launch's last program, no gating launch
--dense-entry KEY/BUCKET=VALUE (repeatable): one entry of the dense table for this device
  replaced, e.g. 'N2048:K4096:bfloat16/1={"backend": "cuda", "bn": 4, "warps": 8,
  "unroll": 1, "split_k": 1}' or 'N5120:K2048:bfloat16/1="cublas"' (VALUE is JSON); how
  the table's "pinned" entries were chosen, in the step rather than alone
--moe-entry KEY/BUCKET=VALUE (repeatable): the same for the MoE table, e.g.
  'up:E128:N1536:K2048:bfloat16:k8/1={"backend": "cuda", "bn": 4, "warps": 4, "unroll": 2}'
  (BUCKET: T)

Between processes the replay time of one step moves by 1-2%, more than most of the parts
above are worth. (The first two CUDA graphs of a process replay 2-2.6% slower than later
ones, whatever they hold: scripts/diag_capture_order.py. The engine now makes two
one-kernel graphs before its first decode step's, so round 0 below is no longer special.)
``--alternate ROUNDS`` compares in one process instead: one model is built, and each round
captures the batch-1 step as it is ("base") and with the --off / --on switches set and the
table entries replaced ("switched"; switches named in SWITCHES, which the model reads at
each call), and times both. Round 0 holds the process's first captures and is printed but
not summed:

    PYTHONPATH=. python scripts/diag_decode_ab.py --on route-in --alternate 3 --model olmoe-1b-7b

``--variants FILE`` times several variants in the same rounds, each against the one base
(one model build for all of them). FILE is a JSON object of named variants, e.g.
{"o bn 2": {"dense": {"N2048:K4096:bfloat16/1": {"backend": "cuda", "bn": 2, "warps": 8,
"unroll": 1, "split_k": 1}}}, "route in": {"switch": ["route-in"]}} ("moe" takes MoE
table entries the same way).
"""
from __future__ import annotations

import argparse
import importlib
import json
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dense import attention  # noqa: E402
from kernels import cuda_common, linear_select, moe_triton, norm, pdl  # noqa: E402
from moe_infer import model, moe_layer  # noqa: E402

# The module, not kernels.qkv_attention (the package's function of that name, which an import
# from the package returns: a switch set on it changed nothing).
qkv_attention = importlib.import_module("kernels.qkv_attention")

OFF = ("moe-cuda", "cuda-pdl", "fused-attention", "pdl-early", "fused-context", "preload-kv", "router-preload",
       "norm-in-qkv")
ON = ("route-in", "l2-prefetch", "topk-in-router")
# The switches a built model reads at each call: name -> (a module's class, whose every
# instance in the model gets the attribute, or a module, which gets it; attribute; value
# when switched). ``--alternate`` takes only these.
SWITCHES = {
    "fused-attention": (attention.Attention, "fused_attention", False),
    "norm-in-qkv": (model.Block, "norm_in_qkv", False),
    "route-in": (moe_layer.MoELayer, "route_in_experts", True),
    "topk-in-router": (moe_layer.MoELayer, "topk_in_router", True),
    "pdl-early": (pdl, "EARLY_TRIGGER", False),
    "fused-context": (attention, "FUSED_DECODE_CONTEXT", False),
    "preload-kv": (qkv_attention, "PRELOAD_KV", False),
    "router-preload": (norm, "ROUTER_PRELOAD", False),
    "l2-prefetch": (cuda_common, "L2_PREFETCH", True),
}


def switch(part: str) -> None:
    """Switches ``part`` (--off or --on) for every model this process builds."""
    if part == "moe-cuda":
        table = moe_triton._tuned()
        for entries in table.values():
            for buckets in entries.values():
                for t in [t for t, cfg in buckets.items() if cfg.get("backend") == "cuda"]:
                    del buckets[t]
        moe_triton.launch_config.cache_clear()
    elif part == "cuda-pdl":
        cuda_common.pdl_on = lambda device: False
    else:
        where, attr, value = SWITCHES[part]
        if isinstance(where, type):
            _after_init(where, attr, value)
        else:
            setattr(where, attr, value)


def table_entry(kind: str, spec: str) -> tuple[dict, str, object]:
    """'KEY/BUCKET=VALUE' of ``--dense-entry`` or ``--moe-entry`` (``kind``) -> (the table's
    entries of KEY for the device this process runs on, BUCKET, the JSON VALUE)."""
    where, sep, value = spec.partition("=")
    key, _, bucket = where.partition("/")
    if kind == "dense":
        table, buckets = linear_select._table(), {str(b) for b in linear_select.BUCKETS}
    else:
        table, buckets = moe_triton._tuned(), {str(t) for t in range(1, moe_triton.FROM_IDS_PAIRS + 1)}
    if not sep or bucket not in buckets:
        raise SystemExit(f"--{kind}-entry {spec!r}: expected KEY/BUCKET=JSON with BUCKET one of "
                         f"{sorted(buckets, key=int)}")
    try:
        entry = json.loads(value)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--{kind}-entry {spec!r}: VALUE is not JSON ({exc})") from None
    device = moe_triton.device_key(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return table.setdefault(device, {}).setdefault(key, {}), bucket, entry


def set_entries(edits: list[tuple[dict, str, object]], switched: bool, saved: dict) -> None:
    """Puts the ``edits`` (``table_entry``) into their tables (``switched``) or restores what
    they replaced (``saved`` keeps it between calls); the tables' caches are cleared."""
    for i, (entries, bucket, entry) in enumerate(edits):
        saved.setdefault(i, entries.get(bucket))
        if switched:
            entries[bucket] = entry
        elif saved[i] is None:
            entries.pop(bucket, None)
        else:
            entries[bucket] = saved[i]
    linear_select._choice.cache_clear()
    moe_triton.launch_config.cache_clear()


def _after_init(cls, flag: str, value: bool = True) -> None:
    """Every instance of ``cls`` built from now on has ``flag`` set to ``value``."""
    init = cls.__init__

    def init_then_set(self, *args, **kwargs):
        init(self, *args, **kwargs)
        setattr(self, flag, value)
    cls.__init__ = init_then_set


def set_switches(net, parts, switched: bool) -> dict:
    """Sets (``switched``) or restores the SWITCHES ``parts`` on the built model ``net`` and
    their modules; returns {part: value now}."""
    now = {}
    for part in parts:
        where, attr, value = SWITCHES[part]
        value = value if switched else not value
        targets = [m for m in net.modules() if isinstance(m, where)] if isinstance(where, type) else [where]
        if not targets:
            raise SystemExit(f"--alternate: the model has no {where.__name__} for {part!r}")
        for target in targets:
            setattr(target, attr, value)
        now[part] = value
    return now


def alternate(variants: list[tuple[str, list[str], list]], rounds: int, model_name: str | None, new_tokens: int,
              reps: int, quantize: str | None = None) -> list[dict]:
    """``rounds`` rounds of the batch-1 step captured as it is ("base") and as each of
    ``variants`` — (name, SWITCHES parts switched, table edits made, ``table_entry``) — on one
    built model; the median of ``reps`` replays a variant and round. Returns a row each;
    round 0 holds the first captures."""
    import bench_common as bc
    import bench_decode
    import moe_infer

    engine = moe_infer.load(model_name, device="cuda", progress=False, quantize=quantize)
    engine.decode_mode = "graph"
    prompts = [torch.randint(0, engine.config.model.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
               .tolist()]
    copy = bc.measure_copy_bandwidth(engine.device)
    print(f"{model_name or 'default'}{' int8' if quantize else ''}: copy {copy:.0f} GB/s, {new_tokens} new tokens; "
          f"variants: {', '.join(name for name, _, _ in variants)}", flush=True)
    rows, first, saved = [], {}, {name: {} for name, _, _ in variants}
    runs = [("base", [], [])] + variants
    for r in range(rounds + 1):
        for name, parts, edits in runs:
            set_switches(engine.model, parts, True)
            set_entries(edits, True, saved.get(name, {}))
            engine._decoders.clear()  # the step is captured again, with the switches as set
            tokens = engine.generate(prompts, max_new_tokens=new_tokens)[0].token_ids
            step = bench_decode.captured_step(engine, 1)
            ms = bc.time_fn(step, warmup=3, reps=reps, device=engine.device) / 1e3
            set_switches(engine.model, parts, False)
            set_entries(edits, False, saved.get(name, {}))
            first.setdefault(name, tokens)
            rows.append({"round": r, "variant": name, "replay_ms": ms, "same_tokens": tokens == first["base"]})
            print(f"round {r} {name}: replay {ms:.4f} ms; tokens equal to base: {tokens == first['base']}",
                  flush=True)
    base = None
    for name, _, _ in runs:
        ms = sorted(row["replay_ms"] for row in rows if row["variant"] == name and row["round"] > 0)
        median = ms[len(ms) // 2]
        base = median if base is None else base
        print(f"{name}: replay {ms[0]:.4f}-{ms[-1]:.4f} ms, median {median:.4f} over rounds 1-{rounds}"
              f"{'' if name == 'base' else f' ({100 * (median / base - 1):+.1f}% against base)'}", flush=True)
    return rows


def load_variants(path: str) -> list[tuple[str, list[str], list]]:
    """``--variants FILE``: a JSON object {name: {"dense": {KEY/BUCKET: VALUE}, "moe": {...},
    "switch": [SWITCHES parts]}} -> ``alternate``'s variants, in the file's order."""
    import bench_common as bc

    spec = bc.read_json_object(path, "--variants", "named variants")
    variants = []
    for name, v in spec.items():
        extra = set(v) - {"dense", "moe", "switch"} if isinstance(v, dict) else {"(not an object)"}
        if extra or name == "base":
            raise SystemExit(f"--variants {path}: variant {name!r}: expected keys dense, moe, switch and a "
                             f"name other than 'base' (got {sorted(extra) or name})")
        parts = list(v.get("switch", []))
        if any(p not in SWITCHES for p in parts):
            raise SystemExit(f"--variants {path}: variant {name!r}: switches are {', '.join(SWITCHES)}")
        edits = [table_entry(kind, f"{where}={json.dumps(value)}")
                 for kind in ("dense", "moe") for where, value in v.get(kind, {}).items()]
        variants.append((name, parts, edits))
    return variants


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--off", action="append", choices=OFF, default=[])
    ap.add_argument("--on", action="append", choices=ON, default=[])
    ap.add_argument("--dense-entry", action="append", default=[], metavar="KEY/BUCKET=JSON")
    ap.add_argument("--moe-entry", action="append", default=[], metavar="KEY/BUCKET=JSON")
    ap.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                    help="base and switched in this process, ROUNDS timed rounds (batch 1; see above)")
    ap.add_argument("--variants", default=None, metavar="FILE",
                    help="with --alternate: several named variants from a JSON file, each against base")
    args, rest = ap.parse_known_args()
    edits = [table_entry("dense", spec) for spec in args.dense_entry] + \
        [table_entry("moe", spec) for spec in args.moe_entry]
    if args.alternate < 0:
        raise SystemExit(f"--alternate {args.alternate}: expected a number of rounds >= 1")
    if args.alternate:
        more = argparse.ArgumentParser(prog="diag_decode_ab.py --alternate ROUNDS")
        more.add_argument("--model", default=None, help="a preset name or config YAML")
        more.add_argument("--new-tokens", type=int, default=64, help="tokens generated before the replays")
        more.add_argument("--reps", type=int, default=200, help="replays timed a variant and round")
        more.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights for every linear layer")
        opts = more.parse_args(rest)
        parts = args.off + args.on
        variants = load_variants(args.variants) if args.variants else []
        if parts or edits or not variants:
            if not (parts or edits) or any(p not in SWITCHES for p in parts):
                raise SystemExit(f"--alternate: switch one or more of {', '.join(SWITCHES)}, or table entries, "
                                 f"or give --variants (got {parts or 'none'})")
            variants.insert(0, ("switched", parts, edits))
        if not torch.cuda.is_available():
            raise SystemExit("--alternate: needs a GPU (the step is replayed as a CUDA graph)")
        alternate(variants, args.alternate, opts.model, opts.new_tokens, opts.reps, opts.quantize)
        return
    set_entries(edits, True, {})
    for part in args.off + args.on:
        switch(part)
    print(f"switched off: {', '.join(args.off) or 'nothing'}; on: {', '.join(args.on) or 'nothing'}; dense entries: "
          f"{'; '.join(args.dense_entry) or 'as in the table'}", flush=True)
    sys.argv = [str(ROOT / "scripts" / "bench_decode.py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
