#!/usr/bin/env python
"""Serving benchmark: throughput, time to first token and inter-token latency against the
request rate, beside the offline ``generate()`` throughput of the same requests.

    python scripts/bench_serve.py                         # OLMoE-shaped, random bf16 weights, GPU
    python scripts/bench_serve.py --model qwen3-30b-a3b --requests 64 --rates 2,8,inf
    python scripts/bench_serve.py --smoke                 # tiny-moe on the CPU, end to end
    scripts/launch.sh -n 2 -- python scripts/bench_serve.py --tp 2   # two GPUs (rank 0 serves)

The server runs as ``moe-infer serve`` runs it: the engine thread and uvicorn's event loop
(on a loopback port) in this process (``--api-process``: uvicorn in a process of its own,
``server.api_process``); the clients run in processes of their own (``--client-processes``),
as users' clients would, and stream /v1/completions with token-id prompts, arriving as a
Poisson process at each rate (inf: all at once). Throughput counts from the first arrival to
the last streamed token. Every request asks for exactly ``--max-tokens`` tokens
(``ignore_eos`` is not an OpenAI field, so random-weight models may stop early at EOS;
the tokens actually generated are counted). TTFT is arrival to the first streamed token;
ITL the gaps between a request's streamed tokens. Their references, measured in the same
run through ``generate()``: the decode step at the server's largest batch (ITL) and one
prefill of the median prompt (TTFT). Under ``scripts/launch.sh`` every rank runs the offline
``generate()`` calls and the server's steps (rank 0 serves HTTP and broadcasts each step, as
``moe-infer serve`` does); the clients run beside rank 0. Writes
bench/results/serve-<model>[-<N>ranks]-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]

import bench_common as bc  # noqa: E402
import moe_infer  # noqa: E402
from comm import shutdown  # noqa: E402
from moe_infer.frontend import EngineHost  # noqa: E402
from moe_infer import ParallelConfig  # noqa: E402
from moe_infer.job import launched_ranks  # noqa: E402
from moe_infer.ranks import lead_or_follow  # noqa: E402
from moe_infer.server import ServerConfig, build_scheduler, create_app  # noqa: E402


def start_server(engine, cfg: ServerConfig, scheduler):
    """-> (a function that stops it, its URL): HTTP in a process of its own when
    ``cfg.api_process``, else uvicorn in a thread of this process."""
    if cfg.api_process:
        host = EngineHost(engine, cfg, scheduler, log_level="warning")
        _, port = host.start()
        return host.stop, f"http://127.0.0.1:{port}"
    return serve_in_thread(create_app(engine, cfg, scheduler))


def serve_in_thread(app):
    """-> (a function that stops it, its URL): uvicorn serving ``app`` on a loopback port
    from a thread of this process."""
    import uvicorn

    # (port 0: uvicorn binds a free one itself, so no other socket can take it in between)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(timeout=30)
    return stop, f"http://127.0.0.1:{port}"


def http_ceiling(clients, prompts, max_tokens) -> float:
    """Streamed tokens/s these clients take from a stub with no model: uvicorn in this
    process streaming completion chunks shaped as the server's, each request one token per
    turn of the event loop. The server cannot stream faster than this."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        async def events():
            for i in range(body["max_tokens"]):
                yield "data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0,
                                             "model": "default", "choices": [{"index": 0, "text": " t",
                                                                              "logprobs": None, "finish_reason": None,
                                                                              "token_ids": [i]}]}) + "\n\n"
                await asyncio.sleep(0)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    stop, url = serve_in_thread(app)
    try:
        clients(url, prompts, max_tokens, float("inf"), 0)  # warm-up
        res, wall = clients(url, prompts, max_tokens, float("inf"), 0)
    finally:
        stop()
    return sum(r["tokens"] for r in res) / wall


async def one(client, url, prompt, max_tokens, arrive_at):
    """One streamed request, sent at ``arrive_at`` (``time.monotonic``: one clock for every
    process of the machine) -> its arrival, TTFT, ITLs and token count, and when it ended."""
    await asyncio.sleep(max(0.0, arrive_at - time.monotonic()))
    arrived = time.monotonic()
    stamps = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"][0].get("token_ids"):
                stamps.append(time.monotonic())
    return {"arrived": arrived, "ttft": stamps[0] - arrived if stamps else None,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": len(stamps),
            "done": stamps[-1] if stamps else arrived}


async def run_share(url, prompts, max_tokens, arrive_at):
    """One client process's requests, each sent at its ``arrive_at``."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*(one(client, url, p, max_tokens, t) for p, t in zip(prompts, arrive_at)))


def _client_loop(conn):
    """A clients' process: one ``run_share`` per job received, until None."""
    import httpx  # noqa: F401  (before the first job: its import must not delay the arrivals)

    while (job := conn.recv()) is not None:
        conn.send(asyncio.run(run_share(*job)))


class Clients:
    """The clients, in ``processes`` processes of their own, started once for every run (a
    spawned process imports this script's modules again, seconds each). Requests go to
    them in turn: one process parses at most some ten thousand streamed tokens a second,
    below what a fast model serves, and the benchmark must time the server, not its
    clients; nor may the clients' JSON parsing take the server's interpreter lock."""

    START_S = 0.5  # from sending the jobs to the first arrival: every process has its job by then

    def __init__(self, processes: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(processes):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_client_loop, args=(child,), daemon=True)
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)

    def __call__(self, url, prompts, max_tokens, rate, seed) -> tuple[list[dict], float]:
        """The requests of ``prompts`` arriving as a Poisson process of ``rate`` a second (inf:
        all at once) -> (per request, in order: arrival, TTFT, ITLs, tokens, end; the
        seconds from the first arrival to the last token)."""
        rng = random.Random(seed)
        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if rate != float("inf"):
                t += rng.expovariate(rate)
        start = time.monotonic() + self.START_S
        n = len(self.conns)
        for i, conn in enumerate(self.conns):
            conn.send((url, prompts[i::n], max_tokens, [start + d for d in delays[i::n]]))
        res = [None] * len(prompts)
        for i, conn in enumerate(self.conns):
            res[i::n] = conn.recv()
        return res, max(r["done"] for r in res) - start

    def close(self):
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():  # (a client that raised has ended its process)
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)


def reference_times(engine, prompts, batch: int) -> tuple[float, float]:
    """-> (seconds of one decode step at ``batch`` rows, seconds to prefill the median
    prompt alone and sample its first token), through generate()."""
    def run(p, n):
        bc.synchronize(engine.device)
        t0 = time.perf_counter()
        engine.generate(p, max_new_tokens=n)
        bc.synchronize(engine.device)
        return time.perf_counter() - t0

    rows = prompts[:batch]
    short, long = (statistics.median(run(rows, n) for _ in range(3)) for n in (8, 40))
    median = sorted(prompts, key=len)[len(prompts) // 2]
    prefill = statistics.median(run([median], 1) for _ in range(5))
    return (long - short) / 32, prefill


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(rate_text, res, wall, offline_rate, step_s, prefill_s) -> dict:
    """One rate's row: throughput against offline generate()'s, TTFT and ITL percentiles
    against their references."""
    tokens = sum(r["tokens"] for r in res)
    ttft = [r["ttft"] for r in res if r["ttft"] is not None]
    itl = [x for r in res for x in r["itl"]]
    return {"rate": rate_text, "requests": len(res), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "requests_per_s": len(res) / wall,
            "vs_offline": (tokens / wall) / offline_rate,
            "ttft_ms": {q: 1e3 * pct(ttft, q) for q in (50, 90, 99)},
            "itl_ms": {q: 1e3 * pct(itl, q) for q in (50, 90, 99)},
            "itl_mean_ms": 1e3 * statistics.fmean(itl) if itl else float("nan"),
            "itl_p50_vs_step": pct(itl, 50) / step_s, "ttft_p50_vs_prefill": pct(ttft, 50) / prefill_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-1b-7b", help="a preset name or config YAML (random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="32,512", help="uniform range of prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rates", default="2,8,32,inf", help="requests per second, comma list (inf: all at once)")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=ServerConfig.prefill_chunk,
                    help="prompt tokens prefilled per server step (server.prefill_chunk)")
    ap.add_argument("--api-process", action="store_true",
                    help="uvicorn in a process of its own (server.api_process: true)")
    ap.add_argument("--client-processes", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                    help="processes the clients run in (default: a quarter of the cores, 1 to 4)")
    ap.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, few requests, 2 client processes")
    ap.add_argument("--tp", type=int, default=1, help="under scripts/launch.sh: tensor-parallel degree")
    ap.add_argument("--ep", type=int, default=1, help="under scripts/launch.sh: expert-parallel degree")
    ap.add_argument("--pp", type=int, default=1, help="under scripts/launch.sh: pipeline stages")
    ap.add_argument("--expert-slicing", type=int, default=None,
                    help="under scripts/launch.sh: ranks that split each expert (default tp / ep)")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.device, args.requests, args.prompt_len = "tiny-moe", "cpu", 8, "4,24"
        args.max_tokens, args.rates, args.max_batch, args.client_processes = 8, "50,inf", 4, 2
    if args.client_processes < 1:
        ap.error(f"--client-processes={args.client_processes}: expected at least 1")
    ranks = launched_ranks()
    parallel = None
    if ranks > 1:  # every rank runs generate() and the server's steps; rank 0 alone the clients
        if ranks % (args.tp * args.pp):
            ap.error(f"--tp={args.tp} x --pp={args.pp}: expected a divisor of the {ranks} ranks")
        parallel = ParallelConfig(tp=args.tp, pp=args.pp, dp=ranks // (args.tp * args.pp), ep=args.ep,
                                  expert_slicing=args.expert_slicing)
    engine = moe_infer.load(args.model, device=None if ranks > 1 and args.device == "cuda" else args.device,
                            parallel=parallel, progress=False)
    engine.config.engine.max_batch_size = args.max_batch
    lo, hi = map(int, args.prompt_len.split(","))
    rng = random.Random(0)
    vocab = engine.config.model.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests)]
    max_len = hi + args.max_tokens
    engine.config.engine.max_seq_len = max(max_len, 64)

    # Offline: the same requests through generate(), max_batch at a time.
    # Warm-ups compile every kernel variant the runs meet (Triton specialises on sizes) and
    # size generate()'s KV cache and capture its decode steps: the same call here, the
    # server's row counts below.
    engine.generate(prompts, max_new_tokens=args.max_tokens)
    bc.synchronize(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=args.max_tokens)
    bc.synchronize(engine.device)
    offline_s = time.perf_counter() - t0
    offline_tokens = sum(len(o.token_ids) for o in outs)  # as streamed: an EOS is not a token
    step_s, prefill_s = reference_times(engine, prompts, args.max_batch)

    blocks = args.max_batch * -(-max_len // args.block_size)
    cfg = ServerConfig(port=0, block_size=args.block_size, num_blocks=blocks, prefill_chunk=args.prefill_chunk,
                       max_queue=args.requests + 8, api_process=args.api_process)
    scheduler = build_scheduler(engine, cfg)
    release = lead_or_follow(scheduler)
    if release is None:  # a rank > 0: it followed rank 0's server to the end
        scheduler.release_graphs()
        shutdown()  # (waits for rank 0: a rank that left first would make gloo end it)
        return
    stop, url = start_server(engine, cfg, scheduler)
    clients = Clients(args.client_processes)
    rows = []
    try:
        try:
            clients(url, prompts, args.max_tokens, float("inf"), 0)  # warm-up: the whole workload
            for rate_text in args.rates.split(","):
                rate = float(rate_text)
                res, wall = clients(url, prompts, args.max_tokens, rate, 1)
                rows.append(summarize(rate_text, res, wall, offline_tokens / offline_s, step_s, prefill_s))
        finally:
            stop()
            release()  # (the other ranks go on while the clients time the stub)
            scheduler.release_graphs()
        ceiling = http_ceiling(clients, prompts, args.max_tokens)
    finally:
        clients.close()

    run = bc.run_info(engine.device)
    m = engine.config.model
    layout = (f" x {ranks} ranks, {parallel.tp=}, {parallel.pp=}, {parallel.ep=}, {parallel.expert_slicing=}"
              if parallel else "")
    print(f"device {run['device']}{layout} | date {run['date']} | commit {run['commit']} | {engine.dtype}")
    print(f"model {args.model}: H={m.hidden_size} layers={m.num_layers} vocab={m.vocab_size}, random weights | "
          f"{args.requests} requests, prompts {lo}-{hi} tokens, {args.max_tokens} new tokens each, "
          f"max batch {args.max_batch}, KV blocks {blocks} x {args.block_size}, prefill chunk {args.prefill_chunk}, "
          f"HTTP {'in a process of its own' if args.api_process else 'in this process'}, "
          f"clients in {args.client_processes} process{'es' if args.client_processes > 1 else ''}")
    print(f"offline generate(): {offline_tokens} tokens in {offline_s:.2f} s = {offline_tokens / offline_s:.1f} "
          "tokens/s (same prompts, batches of max batch, no server)")
    print(f"HTTP ceiling: these clients take {ceiling:.0f} tokens/s from a stub with no model (uvicorn in this "
          "process, the same requests)")
    print(f"references through generate(): decode step at batch {args.max_batch} {1e3 * step_s:.2f} ms, "
          f"prefill of the median prompt {1e3 * prefill_s:.1f} ms")
    cols = ["rate req/s", "tokens/s", "x offline", "req/s", "TTFT p50 ms", "TTFT p90", "TTFT p99", "TTFT/prefill",
            "ITL p50 ms", "ITL p90", "ITL p99", "ITL/step", "wall s"]
    print(bc.format_table(cols, [[r["rate"], f"{r['tokens_per_s']:.1f}", f"{r['vs_offline']:.3f}",
                                  f"{r['requests_per_s']:.2f}",
                                  *(f"{r['ttft_ms'][q]:.1f}" for q in (50, 90, 99)),
                                  f"{r['ttft_p50_vs_prefill']:.2f}",
                                  *(f"{r['itl_ms'][q]:.1f}" for q in (50, 90, 99)),
                                  f"{r['itl_p50_vs_step']:.2f}", f"{r['wall_s']:.2f}"]
                                 for r in rows]))
    if not args.smoke:
        # one file per model: a later model's run the same day must not replace this one's
        bc.write_results(f"serve-{Path(args.model).stem}" + (f"-{ranks}ranks" if parallel else ""), engine.device, {
            "run": run, "model": args.model, "args": vars(args), "ranks": ranks,
            "offline": {"tokens": offline_tokens, "seconds": offline_s, "decode_step_s": step_s,
                        "median_prefill_s": prefill_s},
            "http_ceiling_tokens_per_s": ceiling,
            "rates": rows})
    shutdown()


if __name__ == "__main__":
    main()
