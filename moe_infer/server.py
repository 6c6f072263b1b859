"""OpenAI-compatible HTTP server over the continuous-batching scheduler.

    moe-infer serve --config serve.yaml [--host H] [--port P] [--api-key K]

Endpoints: /v1/completions, /v1/chat/completions (streaming as server-sent events or not),
/v1/models, /health, /metrics (Prometheus; every response counted by endpoint and status).
Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx / 5xx status; the server keeps serving, over the same connection. Which
request fields are implemented, accepted or refused: ``moe_infer.protocol``.

With ``server.api_process`` ``serve`` runs the HTTP front end in a process of its own
(``moe_infer.frontend``): the process that owns the model runs only the engine thread and
a bridge to it, so HTTP work never holds the engine's interpreter lock. It is off by
default: with the bridge's per-step messages the split measured slower than one process
(docs/performance.md, serving).
``create_app`` builds the app over the engine thread in its own process. On several ranks
(started under mpirun) rank 0 runs the engine and broadcasts each step to the others.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest  # the serve extras install these
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_infer import protocol
from moe_infer.config import ConfigError, EngineConfig, ParallelConfig
from moe_infer.engine import Engine
from moe_infer.frontend import EngineClient, EngineGone, InProcessEngine, ModelInfo, serve_from_another_process
from moe_infer.protocol import ApiError, Handler
from moe_infer.ranks import lead_or_follow
from moe_infer.scheduler import QueueFull, Scheduler


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    model_name: str | None = None  # the id /v1/models lists; default: the config's name
    block_size: int = 16  # tokens per KV-cache block
    num_blocks: int | None = None  # default: max_batch_size full-length sequences
    max_queue: int = 256  # waiting requests beyond the running batch; then 503
    prefill_chunk: int = 2048  # prompt tokens (rows x widest row) prefilled a step: bounds inter-token latency
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1
    default_max_tokens: int = 16
    # serve(): true runs HTTP in a process of its own, so its work never holds the engine's
    # interpreter lock; false: uvicorn's event loop beside the engine thread, in one process.
    api_process: bool = False
    # With HTTP beside the engine thread: the interpreter's thread switch interval while the
    # server runs. The engine thread, back from waiting on the device, takes the interpreter
    # lock from a busy event loop within this long (Python's default is 5000 us).
    switch_interval_us: int = 200

    def __post_init__(self):
        for name in ("port", "block_size", "max_queue", "max_body_bytes", "retry_after_s", "default_max_tokens",
                     "prefill_chunk", "switch_interval_us"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "port" else 1):
                raise ConfigError(f"server.{name}={v!r}: expected a positive integer")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ConfigError(f"server.num_blocks={self.num_blocks!r}: expected a positive integer or null")
        for name in ("host", "api_key", "model_name"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"server.{name}={v!r}: expected a string")
        if not isinstance(self.api_process, bool):
            raise ConfigError(f"server.api_process={self.api_process!r}: expected true or false")


@dataclass
class ServeSpec:
    """A serve YAML: which model (preset, config YAML or checkpoint), its parallel and
    engine settings, and the server section."""

    model: str | None = None
    checkpoint: str | None = None
    parallel: dict | str = field(default_factory=dict)  # or "auto": the cost model's layout
    engine: dict = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)


def _is_model_yaml(data: dict) -> bool:
    """A model config YAML (as generate --model takes) rather than a serve YAML: its
    ``model`` is a section, or it has the model-only keys."""
    return isinstance(data.get("model"), dict) or "moe" in data or "name" in data


def read_serve_config(path: str | Path | None, overrides: dict | None = None) -> ServeSpec:
    """Reads ``path``: a serve YAML, or a preset name or model config YAML (served with the
    default server settings). ``overrides`` (CLI flags) replace keys of the server section."""
    import yaml

    from moe_infer.config_files import preset_names

    data = {}
    if path is not None and not Path(path).is_file() and str(path) in preset_names():
        data = {"model": str(path)}
    elif path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror}); expected a serve YAML, a model "
                              f"config YAML or a preset name") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping with model / checkpoint / parallel / engine / server")
        if _is_model_yaml(data):
            data = {"model": str(path)}
    known = {f.name for f in dataclasses.fields(ServeSpec)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{path}: unknown section {key!r} (expected one of {sorted(known)})")
    for name in ("model", "checkpoint"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise ConfigError(f"{path}: {name}={data[name]!r}: expected a string")
    for name in ("parallel", "engine", "server"):
        if not isinstance(data.get(name) or {}, dict) and not (name == "parallel" and data[name] == "auto"):
            raise ConfigError(f"{name}: expected a mapping{' or auto' if name == 'parallel' else ''}, "
                              f"got {data[name]!r}")
    server = dict(data.get("server") or {})
    server.update({k: v for k, v in (overrides or {}).items() if v is not None})
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    for key in server:
        if key not in fields:
            raise ConfigError(f"server.{key}: unknown key (expected one of {sorted(fields)})")
    parallel = data.get("parallel")
    return ServeSpec(data.get("model"), data.get("checkpoint"), "auto" if parallel == "auto" else dict(parallel or {}),
                     dict(data.get("engine") or {}), ServerConfig(**server))


def build_engine(spec: ServeSpec, progress: bool = True) -> Engine:
    """The engine a serve spec asks for; its parallel and engine sections are checked as a
    model config's are (unknown keys and wrong types named)."""
    import moe_infer
    from moe_infer.config_files import section_from_dict

    e = spec.engine
    if spec.parallel == "auto":  # the cost model's layout of the job's ranks, none with dp-attention
        from moe_infer.costmodel import choose_layout, weight_sizes
        from moe_infer.hf import read_hf_config
        from moe_infer.job import launched_ranks
        from moe_infer.loader import resolve_config

        cfg = read_hf_config(spec.checkpoint) if spec.checkpoint else resolve_config(spec.model)
        parallel, note = choose_layout(cfg, launched_ranks(), e.get("hardware"), goal="throughput",
                                       dp_attention=False, **weight_sizes(e.get("quantize")))
    else:
        parallel, note = section_from_dict(ParallelConfig, spec.parallel, "parallel") if spec.parallel else None, None
    if parallel is not None and parallel.dp_attention:
        # Rank 0 schedules and every rank runs each step's rows, so no replica owns sequences.
        raise ConfigError("parallel.dp_attention=True: expected false for serve (rank 0 schedules every "
                          "sequence and each rank runs every step's rows); generate() splits prompts with it")
    section_from_dict(EngineConfig, e, "engine")  # names a bad key before anything loads
    engine = moe_infer.load(spec.model, checkpoint=spec.checkpoint, parallel=parallel, device=e.get("device"),
                            dtype=e.get("dtype"), progress=progress, quantize=e.get("quantize"),
                            gpu_memory_gb=e.get("gpu_memory_gb"), offload=e.get("offload"),
                            offload_dir=e.get("offload_dir"))
    engine.auto_layout = note  # parallel: auto: what the cost model chose
    if e:
        merged = {**dataclasses.asdict(engine.config.engine), **e}
        engine.config = dataclasses.replace(engine.config, engine=EngineConfig(**merged))
    return engine


# --------------------------------------------------------------------------- metrics

class Metrics:
    """Prometheus metrics in a registry of their own (several apps may live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("moe_infer_requests", "HTTP generation requests by outcome", ["status"], registry=r)
        self.responses = Counter("moe_infer_http_responses", "HTTP responses by endpoint and status",
                                 ["endpoint", "status"], registry=r)
        self.generated = Counter("moe_infer_generated_tokens", "Tokens generated", registry=r)
        self.queue = Gauge("moe_infer_queue_depth", "Requests waiting for the running batch", registry=r)
        self.batch = Gauge("moe_infer_running_batch_size", "Sequences in the running batch", registry=r)
        self.blocks = Gauge("moe_infer_kv_blocks_in_use", "KV-cache blocks held by sequences", registry=r)
        buckets = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("moe_infer_time_to_first_token_seconds", "Arrival to first token", buckets=buckets,
                              registry=r)
        self.itl = Histogram("moe_infer_inter_token_latency_seconds", "Between a sequence's tokens",
                             buckets=buckets, registry=r)

    def first_token(self, s: float):
        self.ttft.observe(s)

    def next_token(self, s: float):
        self.itl.observe(s)

    def tokens(self, n: int):
        self.generated.inc(n)

    def state(self, waiting: int, running: int, blocks: int):
        self.queue.set(waiting)
        self.batch.set(running)
        self.blocks.set(blocks)


# --------------------------------------------------------------------------- requests

def error_response(e: ApiError) -> Response:
    # json.dumps escapes non-ASCII, so a message quoting a client's odd text still encodes.
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")


def build_scheduler(engine: Engine, cfg: ServerConfig) -> Scheduler:
    """The scheduler a server config asks for; by default the KV cache holds max_batch_size
    sequences of the full context."""
    e = engine.config.engine
    blocks = cfg.num_blocks or e.max_batch_size * -(-engine.config.max_seq_len // cfg.block_size)
    return Scheduler(engine, blocks, cfg.block_size, e.max_batch_size, cfg.max_queue,
                     prefill_chunk=cfg.prefill_chunk)


class CountResponses:
    """ASGI middleware: counts every HTTP response by endpoint and status (a path the app
    does not serve counts as "other", so clients cannot grow the label set), and answers
    an exception that escaped the app with a 500 OpenAI error body. Answering it here,
    rather than in Starlette's outermost handler (which re-raises), keeps the client's
    keep-alive connection usable."""

    def __init__(self, app, metrics: Metrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.responses.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as exc:
            if started:  # the answer is under way: only closing the connection can end it
                raise
            logging.getLogger(__name__).exception("internal error on %s", scope["path"])
            await error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))(scope, receive,
                                                                                                 counted)


def create_app(engine: Engine, cfg: ServerConfig | None = None, scheduler: Scheduler | None = None):
    """The FastAPI app over the engine thread in this process; its lifespan starts and stops
    that thread."""
    cfg = cfg or ServerConfig()
    metrics = Metrics()
    scheduler = scheduler or build_scheduler(engine, cfg)
    app = app_for(engine, cfg, InProcessEngine(scheduler, metrics, cfg.switch_interval_us * 1e-6), metrics)
    app.state.scheduler = scheduler
    return app


def app_for(model: Engine | ModelInfo, cfg: ServerConfig, client: EngineClient, metrics: Metrics):
    """The FastAPI app over ``client`` (the engine in this process or another); ``model``
    gives the config and tokenizer. Its lifespan starts and stops the client."""
    handler = Handler(model, cfg)

    @asynccontextmanager
    async def lifespan(app):
        await client.start()
        yield
        await client.stop()

    app = FastAPI(title="moe-infer", lifespan=lifespan)
    app.state.client, app.state.metrics, app.state.handler = client, metrics, handler

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        if request.url.path.startswith("/v1/") and exc.status != 401:
            metrics.requests.labels(status=str(exc.status)).inc()
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       headers=exc.headers))

    def check_key(request: HttpRequest):
        if cfg.api_key is not None and request.headers.get("authorization", "") != f"Bearer {cfg.api_key}":
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", None,
                           "invalid_api_key")

    async def read_body(request: HttpRequest) -> dict:
        check_key(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {cfg.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise ApiError(413, f"request body exceeds the limit of {cfg.max_body_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON ({exc.msg} at line {exc.lineno} column "
                                f"{exc.colno})") from None
        except RecursionError:
            raise ApiError(400, f"request body: JSON nested deeper than {protocol.MAX_DEPTH} levels") from None
        except ValueError as exc:  # e.g. an integer of more digits than Python converts
            raise ApiError(400, f"request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"request body: expected a JSON object, got {type(body).__name__}")
        protocol.check_text(body)
        return body

    @app.get("/health")
    async def health():
        if not client.healthy:
            return error_response(ApiError(503, "the engine is not running", None, "server_error"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        client.update_gauges()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        check_key(request)
        return {"object": "list", "data": [{"id": handler.model_name, "object": "model", "created": 0,
                                            "owned_by": "moe-infer"}]}

    async def generate(request: HttpRequest, chat: bool):
        parsed = handler.parse(await read_body(request), chat)
        queue = asyncio.Queue()
        seqs = handler.choices(parsed)
        try:
            ticket = await client.submit(seqs, queue)
        except QueueFull as exc:
            raise ApiError(503, f"the server is at capacity ({exc}); retry later", None,
                           headers={"Retry-After": str(cfg.retry_after_s)}) from None
        except ValueError as exc:  # the KV cache could never hold it
            raise ApiError(400, str(exc), "max_tokens") from None
        except EngineGone as exc:
            raise ApiError(503, f"the engine is not running ({exc})", None, "server_error") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": handler.model_name}
        if parsed.include_usage:  # OpenAI: every chunk has the key, null until the last one
            head["usage"] = None
        metrics.requests.labels(status="200").inc()
        prompt_text = [parsed.texts[i // parsed.n] if parsed.echo else "" for i in range(len(seqs))]
        offsets = [0] * len(seqs)  # completions' text_offset: where each choice's next token starts

        def logprobs_of(index, entries):
            if chat:
                return {"content": protocol.chat_logprobs(entries, handler.token_text), "refusal": None}
            out = protocol.completion_logprobs(entries, handler.token_text, offsets[index])
            offsets[index] += sum(map(len, out["tokens"]))
            return out

        def usage(completion_tokens):
            prompt_tokens = sum(map(len, parsed.prompts))
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        def choice(index, text, finish, token_id=None, logprobs=None):
            # token_ids (an extension, as vLLM has) lets clients of tokenizer-less models
            # see each token; OpenAI clients ignore it.
            ids = {"token_ids": [token_id]} if token_id is not None else {}
            if chat:
                return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                        "finish_reason": finish, **ids}
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, **ids}

        if parsed.stream:
            async def events():
                prefix = f"data: {json.dumps(head)[:-1]}, \"choices\": "  # the same text for every chunk

                def event(choices, **extra):
                    if extra:
                        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"
                    return f"{prefix}{json.dumps(choices)}}}\n\n"

                try:
                    for i in range(len(seqs)):
                        if chat:  # the role comes first, as OpenAI streams it
                            yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])
                        elif parsed.echo and parsed.logprobs is None:  # else it comes with its logprobs
                            yield event([choice(i, prompt_text[i], None)])
                    done, completion_tokens = 0, 0
                    while done < len(seqs):
                        # Everything queued goes out in one write: a busy server sends each
                        # client its tokens per step, not one send per token.
                        items, out = [await queue.get()], []
                        while not queue.empty():
                            items.append(queue.get_nowait())
                        for index, kind, data in items:
                            if kind == "prompt":
                                out.append(event([choice(index, prompt_text[index], None, None,
                                                         logprobs_of(index, data["logprobs"]))]))
                            elif kind == "token":
                                lp = data["logprob"] and logprobs_of(index, [data["logprob"]])
                                if data["text"] or data["token_id"] is not None:
                                    out.append(event([choice(index, data["text"], None, data["token_id"], lp)]))
                            elif kind == "error":  # the status is sent already: an error event ends it
                                err = {"message": data["message"], "type": "server_error", "param": None,
                                       "code": 500}
                                yield "".join(out) + f"data: {json.dumps({'error': err})}\n\n"
                                return
                            else:
                                done += 1
                                completion_tokens += data["completion_tokens"]
                                out.append(event([choice(index, "", data["finish_reason"])]))
                        yield "".join(out)
                    if parsed.include_usage:
                        yield event([], usage=usage(completion_tokens))
                    yield "data: [DONE]\n\n"
                finally:  # a client that went away frees its KV blocks at the next step
                    client.cancel(ticket)
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        texts, finish = list(prompt_text), [None] * len(seqs)
        entries, completion_tokens = [[] for _ in seqs], 0
        try:
            done = 0
            while done < len(seqs):
                index, kind, data = await queue.get()
                if kind == "prompt":
                    entries[index][:0] = data["logprobs"]
                elif kind == "token":
                    texts[index] += data["text"]
                    if data["logprob"] is not None:
                        entries[index].append(data["logprob"])
                elif kind == "error":
                    raise ApiError(500, f"generation failed: {data['message']}")
                else:
                    done += 1
                    finish[index] = data["finish_reason"]
                    completion_tokens += data["completion_tokens"]
        finally:
            client.cancel(ticket)
        lps = [None if parsed.logprobs is None else logprobs_of(i, e) for i, e in enumerate(entries)]
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                        "finish_reason": f} for i, (t, f, lp) in enumerate(zip(texts, finish, lps))]
        else:
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                       for i, (t, f, lp) in enumerate(zip(texts, finish, lps))]
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": handler.model_name, "choices": choices,
                             "usage": usage(completion_tokens)})

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await generate(request, chat=True)

    app.add_middleware(CountResponses, metrics=metrics,
                       endpoints={r.path for r in app.routes if getattr(r, "path", None)})
    return app


# --------------------------------------------------------------------------- launch

def serve(spec: ServeSpec, engine: Engine | None = None):
    """Runs the server until interrupted (over ``engine``, else the one ``spec`` asks for);
    on several ranks, ranks > 0 follow rank 0's steps."""
    import uvicorn

    engine = engine or build_engine(spec)
    cfg = spec.server
    scheduler = build_scheduler(engine, cfg)
    release = lead_or_follow(scheduler)
    if release is None:  # a rank > 0, done following
        scheduler.release_graphs()
        return
    try:
        if cfg.api_process:
            serve_from_another_process(engine, cfg, scheduler)
        else:
            uvicorn.run(create_app(engine, cfg, scheduler), host=cfg.host, port=cfg.port, log_level="info")
    finally:
        release()
        scheduler.release_graphs()
