#!/usr/bin/env python
"""Why does the batch-1 decode step replay faster from its third capture on in a process?
(diag_replay_settle.py: captures 0 and 1 slower by 2-2.6% than captures 2, 3 and 4, with
the KV cache and logits at the same addresses in captures 0, 2 and 4.) Answer, on an H100
(2026-11-25): the first two CUDA graphs a process makes replay slower, whatever they hold
(``dummy2`` is as fast as ``alternate``'s third capture; the DOT prints of a slow and a fast
capture are the same graph; the step's buffers, its pool and the rotary tables' placement
do not matter). ``Engine`` now makes two one-kernel graphs first (``engine`` mode).

Each mode runs in a fresh process, loads the model, captures the step through
``Engine.generate`` as ``bench_decode.py`` does, and times that capture's replays:

- ``first``: the process's first capture, with the engine's priming graphs turned off.
- ``engine``: as the engine runs (``Engine.graph_primers`` graphs made before the step's).
- ``dummy``, ``dummy2``, ``dummy3``: the engine's priming with one, two or three one-kernel
  CUDA graphs (``Engine.graph_primers``; ``engine`` is its default, two).
- ``recapture``: the first capture destroyed (nothing of it left alive), then a second.
- ``empty-cache``: as ``recapture``, with the allocator's cache emptied in between.
- ``alternate``: diag_replay_settle's pattern (each new capture while the one before is
  alive), with ``--dump`` writing each capture's graph (CUDA's verbose DOT print) so two
  captures can be compared node by node. ``alt-graph`` keeps only the previous capture's
  graph (and its memory pool) alive, ``alt-buffers`` only its KV cache and input buffers.
  Each capture prints where its buffers and its graph pool's segments lie.
- ``tokens``: as ``engine``, then the step run as generate() runs it (the token copied in,
  the slot set, the graph replayed) with one token every time, and with 64 random tokens
  in turn (other experts each step): does the step's time depend on its input?
- ``burst``: as ``engine``, then bursts of 64 replays each after the GPU idled 30 ms (a
  generate() call's decode after its host-bound prefill), mean ms a replay, against the
  sustained median.

    PYTHONPATH=. python scripts/diag_capture_order.py --model olmoe-1b-7b --dump $OUT
"""
from __future__ import annotations

import argparse
import gc
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import bench_decode  # noqa: E402
import moe_infer  # noqa: E402

MODES = ("first", "engine", "dummy", "dummy2", "dummy3", "recapture", "empty-cache", "alternate", "alt-graph",
         "alt-buffers", "tokens", "burst")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_GRAPH_NO = re.compile(r"\b(graph|cluster)_\d+")  # each print numbers its graph anew


class _DumpedGraph(torch.cuda.CUDAGraph):
    """A CUDA graph kept after instantiation, so ``debug_dump`` can print it."""

    def __new__(cls, keep_graph=False):
        return super().__new__(cls, True)

    def __init__(self, keep_graph=False):
        super().__init__(True)  # pybind builds the C++ graph here, not in __new__
        self.enable_debug_mode()


def _time(engine, reps: int, blocks: int, stream: str = "current") -> list[float]:
    """Median replay ms of the batch-1 step in each of ``blocks`` blocks, replayed on the
    current stream, a new one ("side") or a new one of the highest priority ("high")."""
    step = bench_decode.captured_step(engine, 1)
    on = torch.cuda.current_stream(engine.device)
    if stream != "current":
        on = torch.cuda.Stream(engine.device, priority=-1 if stream == "high" else 0)
        on.wait_stream(torch.cuda.current_stream(engine.device))
    with torch.cuda.stream(on):
        return [bc.time_fn(step, warmup=3, reps=reps, device=engine.device) / 1e3 for _ in range(blocks)]


def _time_tokens(engine, reps: int, blocks: int) -> None:
    """Median ms of ``decoder.run`` at one slot, fed one token every call or 64 in turn."""
    decoder = bench_decode.captured_decoder(engine, 1)
    slot = int(decoder.slot)
    gen = torch.Generator().manual_seed(1)
    varied = [torch.randint(0, engine.config.model.vocab_size, (1,), generator=gen).to(engine.device)
              for _ in range(64)]
    for name, inputs in (("same", varied[:1]), ("varied", varied), ("same", varied[:1]), ("varied", varied)):
        ms = [bc.time_fn(lambda t: decoder.run(t, slot), warmup=3, reps=reps, inputs=inputs,
                         device=engine.device) / 1e3 for _ in range(blocks)]
        print(f"RESULT tokens {name}: " + " ".join(f"{m:.4f}" for m in ms), flush=True)


def _time_bursts(engine, bursts: int = 10, length: int = 64, idle_s: float = 0.03) -> None:
    """Mean ms a replay over ``length`` back-to-back replays, each burst after ``idle_s`` idle."""
    step = bench_decode.captured_step(engine, 1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    means = []
    for _ in range(bursts):
        torch.cuda.synchronize(engine.device)
        time.sleep(idle_s)
        start.record()
        for _ in range(length):
            step()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / length)
    print("RESULT burst: " + " ".join(f"{m:.4f}" for m in means), flush=True)


def _print_layout(decoder, capture: int) -> None:
    """Addresses of the step's own buffers and of its graph pool's segments."""
    named = {"keys": decoder.cache.k, "values": decoder.cache.v, "tokens": decoder.tokens, "slot": decoder.slot,
             "key_valid": decoder.key_valid, "positions": decoder.positions, "logits": decoder.out[0]}
    for i, t in enumerate(decoder.tables or ()):
        named[f"rotary{i}"] = t
    print(f"LAYOUT capture {capture}: " + " ".join(f"{k}={t.data_ptr():#x}" for k, t in named.items()), flush=True)
    pool = tuple(decoder.graph.pool())
    segs = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool]
    print(f"LAYOUT capture {capture}: pool {pool} segments " + " ".join(
        f"{s['address']:#x}+{s['total_size'] >> 10}K" for s in sorted(segs, key=lambda s: s["address"])), flush=True)


def _placed(t: torch.Tensor, offset: int, align: int = 1 << 16) -> torch.Tensor:
    """A copy of ``t`` whose first byte lies ``offset`` bytes past an ``align``-byte boundary."""
    raw = torch.empty(t.nbytes + align + offset, dtype=torch.uint8, device=t.device)
    start = (-raw.data_ptr()) % align + offset
    out = raw[start:start + t.nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def run_mode(args) -> None:
    engine = moe_infer.load(args.model, device="cuda", progress=False, quantize=args.quantize)
    if args.rotary_offset is not None:
        tables = engine.model.rotary_tables

        def placed_tables(slots):
            cos, sin = tables(slots)
            return _placed(cos, args.rotary_offset), _placed(sin, args.rotary_offset)
        engine.model.rotary_tables = placed_tables
    engine.decode_mode = "graph"
    prompt = torch.randint(0, engine.config.model.vocab_size, (16,),
                           generator=torch.Generator().manual_seed(0)).tolist()

    def capture():
        out = engine.generate([prompt], max_new_tokens=args.new_tokens)
        return out[0].token_ids

    def drop():
        engine._decoders.clear()
        gc.collect()
        torch.cuda.synchronize(engine.device)

    mode = args.mode
    if mode.startswith("dummy"):
        engine.graph_primers = int(mode[5:] or 1)
    elif mode not in ("engine", "tokens", "burst"):
        engine.graph_primers = 0
    if mode.startswith("alt"):
        if args.dump and mode == "alternate":
            torch.cuda.CUDAGraph = _DumpedGraph
        alive = None
        for c in range(args.captures):
            if alive is not None and mode == "alt-graph":
                alive = alive.graph, alive.out  # the buffers go, the graph and its pool stay
            elif alive is not None and mode == "alt-buffers":
                alive.graph = alive.out = None  # the graph and its pool go, the buffers stay
            engine._decoders.clear()  # the previous capture stays alive through `alive`
            gc.collect()
            tokens = capture()
            decoder = next(iter(engine._decoders.values()))
            _print_layout(decoder, c)
            if args.dump and mode == "alternate":
                decoder.graph.debug_dump(str(Path(args.dump) / f"capture{c}.dot"))
            alive = decoder
            ms = _time(engine, args.reps, 2)
            print(f"RESULT {mode} capture {c}: " + " ".join(f"{m:.4f}" for m in ms)
                  + f" last-token {tokens[-1]}", flush=True)
        del alive
        return
    tokens = capture()
    if mode in ("recapture", "empty-cache"):
        drop()
        if mode == "empty-cache":
            torch.cuda.empty_cache()
        tokens = capture()
    _print_layout(next(iter(engine._decoders.values())), 0)
    if mode == "tokens":
        _time_tokens(engine, args.reps, args.blocks)
    if mode == "burst":
        _time_bursts(engine)
    ms = _time(engine, args.reps, args.blocks, args.replay_stream)
    print(f"RESULT {mode}: " + " ".join(f"{m:.4f}" for m in ms) + f" last-token {tokens[-1]}", flush=True)


def compare_dumps(a: Path, b: Path) -> None:
    """Prints how two DOT prints differ, their graph numbers aside: lines that differ only in
    hex values (addresses, handles) are counted apart from lines that differ otherwise."""
    la, lb = ([_GRAPH_NO.sub(r"\1_N", ln) for ln in f.read_text().splitlines()] for f in (a, b))
    print(f"{a.name}: {len(la)} lines, {b.name}: {len(lb)} lines")
    addr_only, other = 0, []
    for x, y in zip(la, lb):
        if x == y:
            continue
        if _HEX.sub("#", x) == _HEX.sub("#", y):
            addr_only += 1
        else:
            other.append((x, y))
    print(f"lines differing only in hex values: {addr_only}; otherwise: {len(other)}")
    for x, y in other[:40]:
        print(f"  - {x[:200]}\n  + {y[:200]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-1b-7b")
    ap.add_argument("--quantize", choices=["int8"], default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200, help="replays a block")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--captures", type=int, default=4, help="captures in mode alternate")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, each in its own process")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--replay-stream", choices=["current", "side", "high"], default="current",
                    help="the stream the step is replayed on (modes that time one capture)")
    ap.add_argument("--rotary-offset", type=lambda v: int(v, 0), default=None,
                    help="place the step's rotary tables this many bytes past a 64 KiB boundary")
    ap.add_argument("--dump", default=None, help="folder for the DOT prints of mode alternate")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_capture_order.py: needs a GPU (the step is replayed as a CUDA graph)")
    if args.mode:
        run_mode(args)
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; expected some of {', '.join(MODES)}")
    print(f"{args.model}{' int8' if args.quantize else ''}: copy {bc.measure_copy_bandwidth('cuda'):.0f} GB/s, "
          f"{args.reps} replays a block", flush=True)
    passed = ["--model", args.model, "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
              "--blocks", str(args.blocks), "--captures", str(args.captures)]
    passed += ["--quantize", args.quantize] if args.quantize else []
    passed += ["--dump", args.dump] if args.dump else []
    passed += ["--replay-stream", args.replay_stream]
    passed += ["--rotary-offset", str(args.rotary_offset)] if args.rotary_offset is not None else []
    for m in modes:
        proc = subprocess.run([sys.executable, __file__, *passed, "--mode", m],
                              capture_output=True, text=True)
        for ln in proc.stdout.splitlines():
            if ln.startswith(("RESULT ", "LAYOUT ")):
                print(ln.split(" ", 1)[1], flush=True)
        if proc.returncode:
            print(f"{m}: exit {proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
        elif args.dump and m == "alternate":
            print("\n".join(ln for ln in proc.stderr.splitlines() if "DEBUG" in ln or "Warning" in ln)[-2000:])
    if args.dump and "alternate" in modes:
        dumps = sorted(Path(args.dump).glob("capture*.dot"))
        if len(dumps) >= 4:
            compare_dumps(dumps[0], dumps[2])
            compare_dumps(dumps[1], dumps[3])


if __name__ == "__main__":
    main()
