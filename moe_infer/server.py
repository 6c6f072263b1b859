"""OpenAI-compatible HTTP server over the continuous-batching scheduler.

    moe-infer serve --config serve.yaml [--host H] [--port P] [--api-key K]

Endpoints: /v1/completions, /v1/chat/completions (streaming as server-sent events or not),
/v1/models, /health, /metrics (Prometheus). Every error is an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx / 5xx status; the server
keeps serving. On several ranks (started under mpirun) rank 0 serves HTTP and broadcasts
each step to the others.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import FastAPI, Request as HttpRequest  # the serve extras install these
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_infer.config import ConfigError, EngineConfig, ParallelConfig
from moe_infer.engine import Engine
from moe_infer.sampling import SamplingParams
from moe_infer.scheduler import QueueFull, Request, Row, Scheduler, follow

DEFAULT_CHAT_TEMPLATE = (  # when the checkpoint's tokenizer_config.json has none
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    model_name: str | None = None  # the id /v1/models lists; default: the config's name
    block_size: int = 16  # tokens per KV-cache block
    num_blocks: int | None = None  # default: max_batch_size full-length sequences
    max_queue: int = 256  # waiting requests beyond the running batch; then 503
    prefill_chunk: int = 512  # prompt tokens prefilled per engine step (bounds inter-token latency)
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1
    default_max_tokens: int = 16

    def __post_init__(self):
        for name in ("port", "block_size", "max_queue", "max_body_bytes", "retry_after_s", "default_max_tokens",
                     "prefill_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "port" else 1):
                raise ConfigError(f"server.{name}={v!r}: expected a positive integer")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ConfigError(f"server.num_blocks={self.num_blocks!r}: expected a positive integer or null")
        for name in ("host", "api_key", "model_name"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"server.{name}={v!r}: expected a string")


@dataclass
class ServeSpec:
    """A serve YAML: which model (preset, config YAML or checkpoint), its parallel and
    engine settings, and the server section."""

    model: str | None = None
    checkpoint: str | None = None
    parallel: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)


def read_serve_config(path: str | Path | None, overrides: dict | None = None) -> ServeSpec:
    """Reads a serve YAML; ``overrides`` (CLI flags) replace keys of its server section."""
    import yaml

    data = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping with model / checkpoint / parallel / engine / server")
    known = {f.name for f in dataclasses.fields(ServeSpec)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{path}: unknown section {key!r} (expected one of {sorted(known)})")
    server = dict(data.get("server") or {})
    server.update({k: v for k, v in (overrides or {}).items() if v is not None})
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    for key in server:
        if key not in fields:
            raise ConfigError(f"server.{key}: unknown key (expected one of {sorted(fields)})")
    for name in ("parallel", "engine"):
        if not isinstance(data.get(name) or {}, dict):
            raise ConfigError(f"{name}: expected a mapping, got {data[name]!r}")
    return ServeSpec(data.get("model"), data.get("checkpoint"), dict(data.get("parallel") or {}),
                     dict(data.get("engine") or {}), ServerConfig(**server))


def build_engine(spec: ServeSpec, progress: bool = True) -> Engine:
    import moe_infer

    parallel = ParallelConfig(**spec.parallel) if spec.parallel else None
    e = spec.engine
    engine = moe_infer.load(spec.model, checkpoint=spec.checkpoint, parallel=parallel, device=e.get("device"),
                            dtype=e.get("dtype"), progress=progress, quantize=e.get("quantize"))
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

class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 503: "server_overloaded"}.get(status, "server_error")


def error_response(e: ApiError):
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"{name}={v!r}: expected {kind} in [{lo}, {hi}]", name)
    return v


class Handler:
    """Turns validated OpenAI requests into scheduler requests and their answers."""

    def __init__(self, engine: Engine, scheduler: Scheduler, cfg: ServerConfig, metrics: Metrics):
        self.engine, self.scheduler, self.cfg, self.metrics = engine, scheduler, cfg, metrics
        self.model_name = cfg.model_name or engine.config.name
        self.chat_template = self._chat_template()

    def _chat_template(self):
        import jinja2

        source = DEFAULT_CHAT_TEMPLATE
        ckpt = self.engine.config.checkpoint
        if ckpt is not None and (Path(ckpt) / "tokenizer_config.json").is_file():
            tc = json.loads((Path(ckpt) / "tokenizer_config.json").read_text())
            if isinstance(tc.get("chat_template"), str):
                source = tc["chat_template"]
        return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(source)

    # ----------------------------------------------------------------- parsing

    def check_model(self, body: dict):
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    def sampling(self, body: dict) -> tuple[SamplingParams, int, int, list[str], bool]:
        limit = self.engine.config.max_seq_len
        max_tokens = _number(body, "max_tokens", self.cfg.default_max_tokens, 1, limit, integer=True)
        if "max_completion_tokens" in body:
            max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, limit, integer=True)
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0:
            raise ApiError(400, "top_p=0: expected a number in (0, 1]", "top_p")
        top_k = _number(body, "top_k", 0, 0, self.engine.config.model.vocab_size, integer=True)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, f"seed={seed!r}: expected an integer", "seed")
        n = _number(body, "n", 1, 1, 16, integer=True)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, f"stop={body.get('stop')!r}: expected a non-empty string or a list of up to 4",
                           "stop")
        if stop and self.engine.tokenizer is None:
            raise ApiError(400, "stop: this model has no tokenizer, so text stops cannot be matched", "stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream={stream!r}: expected true or false", "stream")
        params = SamplingParams(float(temperature), int(top_k), float(top_p), seed)
        return params, max_tokens, n, stop, stream

    def prompts(self, body: dict) -> list[list[int]]:
        if "prompt" not in body:
            raise ApiError(400, "prompt: required", "prompt")
        p = body["prompt"]
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            p = [p]
        if not isinstance(p, list) or not p or len(p) > 64:
            raise ApiError(400, "prompt: expected a string, a list of token ids, or a list of up to 64 of them",
                           "prompt")
        try:
            return self.engine.encode(p)
        except ValueError as exc:
            raise ApiError(400, str(exc).replace("prompts[", "prompt["), "prompt") from None

    def chat_prompt(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages: expected a non-empty list of {role, content}", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ApiError(400, f"messages[{i}]: expected {{'role': str, 'content': str}}", "messages")
        if self.engine.tokenizer is None:
            raise ApiError(400, "messages: this model has no tokenizer; use /v1/completions with token ids",
                           "messages")
        text = self.chat_template.render(messages=msgs, add_generation_prompt=True, bos_token="", eos_token="")
        ids = self.engine.tokenizer.encode(text)
        if not ids:
            raise ApiError(400, "messages: the chat template rendered an empty prompt", "messages")
        return ids

    # ----------------------------------------------------------------- generation

    def submit(self, prompts: list[list[int]], params, max_tokens, n, stop, loop, queue) -> list[Request]:
        limit = self.engine.config.max_seq_len
        for i, p in enumerate(prompts):
            if len(p) + max_tokens > limit:
                raise ApiError(400, f"prompt[{i}]: {len(p)} tokens + max_tokens={max_tokens} exceed the context "
                               f"length {limit}", "max_tokens" if len(p) < limit else "prompt",
                               "context_length_exceeded")
        reqs = []
        for i, p in enumerate(prompts):
            for j in range(n):
                choice = i * n + j
                seed = None if params.seed is None else params.seed + j
                r = Request(p, dataclasses.replace(params, seed=seed), max_tokens,
                            lambda kind, data, c=choice: loop.call_soon_threadsafe(queue.put_nowait, (c, kind, data)),
                            stop)
                reqs.append(r)
        try:
            for r in reqs:
                self.scheduler.submit(r)
        except QueueFull as exc:
            for r in reqs:
                self.scheduler.cancel(r)
            raise ApiError(503, f"the server is at capacity ({exc}); retry later", None,
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
        except ValueError as exc:
            for r in reqs:
                self.scheduler.cancel(r)
            raise ApiError(400, str(exc), "max_tokens") from None
        return reqs


def build_scheduler(engine: Engine, cfg: ServerConfig) -> Scheduler:
    """The scheduler a server config asks for; by default the KV cache holds max_batch_size
    sequences of the full context."""
    e = engine.config.engine
    blocks = cfg.num_blocks or e.max_batch_size * -(-engine.config.max_seq_len // cfg.block_size)
    return Scheduler(engine, blocks, cfg.block_size, e.max_batch_size, cfg.max_queue,
                     prefill_chunk=cfg.prefill_chunk)


def create_app(engine: Engine, cfg: ServerConfig | None = None, scheduler: Scheduler | None = None):
    """The FastAPI app; its lifespan starts and stops the engine thread."""
    cfg = cfg or ServerConfig()
    metrics = Metrics()
    scheduler = scheduler or build_scheduler(engine, cfg)
    scheduler.metrics = metrics
    handler = Handler(engine, scheduler, cfg, metrics)

    @asynccontextmanager
    async def lifespan(app):
        stop = threading.Event()
        thread = threading.Thread(target=scheduler.run, args=(stop,), name="moe-infer-engine", daemon=True)
        thread.start()
        yield
        stop.set()
        with scheduler.lock:
            scheduler.wake.notify_all()
        thread.join(timeout=30)

    app = FastAPI(title="moe-infer", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.handler = scheduler, metrics, handler

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        if request.url.path.startswith("/v1/") and exc.status != 401:
            metrics.requests.labels(status=str(exc.status)).inc()
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

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
        if not isinstance(body, dict):
            raise ApiError(400, f"request body: expected a JSON object, got {type(body).__name__}")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        scheduler._report()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        check_key(request)
        return {"object": "list", "data": [{"id": handler.model_name, "object": "model", "created": 0,
                                            "owned_by": "moe-infer"}]}

    async def generate(request: HttpRequest, chat: bool):
        body = await read_body(request)
        handler.check_model(body)
        params, max_tokens, n, stop, stream = handler.sampling(body)
        prompts = [handler.chat_prompt(body)] if chat else handler.prompts(body)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        reqs = handler.submit(prompts, params, max_tokens, n, stop, loop, queue)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": handler.model_name}
        metrics.requests.labels(status="200").inc()

        def choice(index, text, finish, token_id=None):
            # token_ids (an extension, as vLLM has) lets clients of tokenizer-less models
            # see each token; OpenAI clients ignore it.
            ids = {"token_ids": [token_id]} if token_id is not None else {}
            if chat:
                return {"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish, **ids}
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, **ids}

        if stream:
            async def events():
                try:
                    if chat:  # the role comes first, as OpenAI streams it
                        for i in range(len(reqs)):
                            first = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "finish_reason": None}]}
                            yield f"data: {json.dumps(first)}\n\n"
                    done = 0
                    while done < len(reqs):
                        index, kind, data = await queue.get()
                        if kind == "token":
                            if data["text"] or data["token_id"] is not None:
                                out = {**head, "choices": [choice(index, data["text"], None, data["token_id"])]}
                                yield f"data: {json.dumps(out)}\n\n"
                        elif kind == "error":  # the status is sent already: an error event ends it
                            err = {"message": data["message"], "type": "server_error", "param": None, "code": 500}
                            yield f"data: {json.dumps({'error': err})}\n\n"
                            return
                        else:
                            done += 1
                            out = {**head, "choices": [choice(index, '', data['finish_reason'])]}
                            yield f"data: {json.dumps(out)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # a client that went away frees its KV blocks at the next step
                    for r in reqs:
                        if r.finish is None:
                            scheduler.cancel(r)
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        texts, finish, usage = [""] * len(reqs), [None] * len(reqs), [0, 0]
        try:
            done = 0
            while done < len(reqs):
                index, kind, data = await queue.get()
                if kind == "token":
                    texts[index] += data["text"]
                elif kind == "error":
                    raise ApiError(500, f"generation failed: {data['message']}")
                else:
                    done += 1
                    finish[index] = data["finish_reason"]
                    usage[1] += data["completion_tokens"]
        finally:
            for r in reqs:
                if r.finish is None:
                    scheduler.cancel(r)
        usage[0] = sum(len(r.prompt) for r in reqs[::n])
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": f}
                       for i, (t, f) in enumerate(zip(texts, finish))]
        else:
            choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                       for i, (t, f) in enumerate(zip(texts, finish))]
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": handler.model_name, "choices": choices,
                             "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                       "total_tokens": usage[0] + usage[1]}})

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await generate(request, chat=True)

    return app


# --------------------------------------------------------------------------- launch

def _row_channel():
    """(send, receive) of step rows from rank 0 over torch.distributed, as JSON bytes."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def send(rows):
        data = json.dumps(None if rows is None else [[r.tokens, r.start, r.table] for r in rows]).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        dist.broadcast(size, src=0)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), src=0)

    def receive():
        size = torch.empty(1, dtype=torch.int64, device=dev)
        dist.broadcast(size, src=0)
        buf = torch.empty(int(size), dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=0)
        data = json.loads(buf.cpu().numpy().tobytes().decode())
        return None if data is None else [Row(*r) for r in data]

    return send, receive


def serve(spec: ServeSpec):
    """Runs the server until interrupted; on several ranks, ranks > 0 follow rank 0's steps."""
    import torch.distributed as dist
    import uvicorn

    engine = build_engine(spec)
    cfg = spec.server
    multi = dist.is_initialized() and dist.get_world_size() > 1
    scheduler = build_scheduler(engine, cfg)
    if multi:
        send, receive = _row_channel()
        if dist.get_rank() != 0:
            follow(scheduler.runner, receive)
            return
        scheduler.broadcast = send
    app = create_app(engine, cfg, scheduler)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info")
    finally:
        if multi:
            send(None)  # the followers leave their loop
