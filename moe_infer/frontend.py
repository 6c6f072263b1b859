"""The engine clients the HTTP app talks to, and the HTTP front end in a process of its own
(as vLLM and SGLang run it).

The app (``server.app_for``) reaches the engine through an ``EngineClient``: submit a
request's choices, cancel them, keep the gauges current. ``InProcessEngine`` is the
scheduler's thread in the app's own process (``server.create_app``). ``RemoteEngine`` is a
pipe to the engine's process: with ``server.api_process`` the process that owns the model keeps only the scheduler's thread and a bridge
(``EngineHost``), and a spawned child runs uvicorn: body checks, parsing, tokenization,
chat templates, SSE and JSON answers. The engine thread then shares its interpreter lock
with no HTTP work, only with the bridge, which pickles a step's events into one message.

Over the pipe (a ``multiprocessing`` socket pair):
- front end -> engine: ("listening", host, port) once it accepts connections;
  ("submit", key, [Choice]); ("cancel", key);
- engine -> front end: ("ready",) once the engine thread runs (uvicorn starts then), then
  ``Batch``es: answers to submits, every request's events (its ``on_event`` calls), the
  TTFT / inter-token / token-count observations and the scheduler's gauges. While one batch
  is being sent the next accumulates; the end of a step sends what the step produced.
Either side ending ends the other: the engine host stops when the front end exits; the
front end ends in-flight requests with an error event and exits, at once when the engine
said it stops, else (its process died) after answering new requests 503 for
``GONE_GRACE_S``.
"""
from __future__ import annotations

import abc
import asyncio
import functools
import gc
import itertools
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field

from moe_infer.config import Config
from moe_infer.engine import Engine
from moe_infer.protocol import Choice, Outbox
from moe_infer.scheduler import QueueFull, Scheduler
from moe_infer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GONE_GRACE_S = 3.0  # the front end answers 503 this long after the engine died, then exits
FLUSH_S = 0.005  # events wait at most this for their step's end, to travel in one message
_ENDED = ("done", "error")  # the event kinds that end a choice


class EngineGone(Exception):
    """The engine (its process or its thread) has stopped: the server answers 503."""


@dataclass
class ModelInfo:
    """What the front end needs of the model: its config and tokenizer, no weights."""

    config: Config
    tokenizer: Tokenizer | None
    encode = Engine.encode  # the same checks of prompts; it reads only config and tokenizer


# --------------------------------------------------------------------------- clients

class EngineClient(abc.ABC):
    """What the app needs of the engine. The events of choice i of a submission reach the
    queue given to ``submit`` as (i, kind, data) on the app's event loop, with the kinds and
    data of ``scheduler.Request.on_event``."""

    async def start(self):
        """In the app's lifespan, on its event loop, before the first request."""

    async def stop(self):
        """In the app's lifespan, after the last request."""

    @abc.abstractmethod
    async def submit(self, choices: list[Choice], queue: asyncio.Queue):
        """Queues every choice or none -> a ticket for ``cancel``. Raises ``QueueFull`` (the
        waiting queue is at its bound), ValueError (the KV cache could never hold one) or
        ``EngineGone``."""

    @abc.abstractmethod
    def cancel(self, ticket):
        """Ends the ticket's unfinished choices; their KV blocks come back at the next step."""

    def update_gauges(self):
        """Brings the queue, batch and KV-block gauges up to date (before /metrics answers)."""

    @property
    @abc.abstractmethod
    def healthy(self) -> bool:
        """Whether the engine still runs (else /health answers 503)."""


def _set_switch_interval(seconds: float):
    """sys.setswitchinterval to the nearest whole microsecond. The interpreter keeps whole
    microseconds and truncates, so 200e-6 alone becomes 199 and restoring a value read back
    loses one more each time; half a microsecond added makes the truncation a rounding."""
    sys.setswitchinterval((round(seconds * 1e6) + 0.5) * 1e-6)


class InProcessEngine(EngineClient):
    """The scheduler's thread in the app's own process: the app's lifespan starts it. While
    it runs, the interpreter switches threads every ``switch_interval`` seconds (Python's
    default when None)."""

    def __init__(self, scheduler: Scheduler, metrics, switch_interval: float | None = None):
        self.scheduler, self.metrics = scheduler, metrics
        scheduler.metrics = metrics  # the engine thread observes TTFT, ITL and tokens itself
        self.stopping, self.thread, self.outbox = threading.Event(), None, None
        self.switch_interval, self.saved_interval = switch_interval, None

    async def start(self):
        self.scheduler.warm_up()  # before the first request: none waits for a capture or a compile
        # What exists now (the model, its graphs, the app) lives as long as the server: out
        # of the collector's full passes, which hold the interpreter lock for as long as they
        # take to walk every object and stalled the engine thread mid-stream.
        gc.collect()
        gc.freeze()
        if self.switch_interval is not None:
            self.saved_interval = sys.getswitchinterval()
            _set_switch_interval(self.switch_interval)
        self.stopping.clear()
        self.thread = threading.Thread(target=self.scheduler.run, args=(self.stopping,), name="moe-infer-engine",
                                       daemon=True)
        self.thread.start()

    async def stop(self):
        if self.thread is None:
            return
        self.stopping.set()
        with self.scheduler.lock:
            self.scheduler.wake.notify_all()
        self.thread.join(timeout=30)
        if self.saved_interval is not None:
            _set_switch_interval(self.saved_interval)
            self.saved_interval = None
        gc.unfreeze()

    async def submit(self, choices, queue):
        loop = asyncio.get_running_loop()
        if self.outbox is None or self.outbox.loop is not loop:
            self.outbox = Outbox(loop)
        post = functools.partial(self.outbox.post, queue)
        reqs = [c.request(lambda kind, data, i=i: post((i, kind, data))) for i, c in enumerate(choices)]
        try:
            for r in reqs:
                self.scheduler.submit(r)
        except (QueueFull, ValueError):
            self.cancel(reqs)
            raise
        return reqs

    def cancel(self, ticket):
        for r in ticket:
            if r.finish is None:
                self.scheduler.cancel(r)

    def update_gauges(self):
        s = self.scheduler
        with s.lock:
            self.metrics.state(len(s.waiting), len(s.running), s.blocks_in_use)

    @property
    def healthy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


@dataclass
class Batch:
    """One message from the engine to the front end."""

    answers: list = field(default_factory=list)  # (key, None: accepted | ("queue_full" | "invalid" | "error", message))
    events: list = field(default_factory=list)  # (key, choice, kind, data)
    ttft: list = field(default_factory=list)  # seconds, arrival to first token
    itl: list = field(default_factory=list)  # seconds between a sequence's tokens
    tokens: int = 0  # tokens generated
    gauges: tuple[int, int, int] | None = None  # (waiting, running, KV blocks in use) when they changed
    closing: str | None = None  # in the last batch: why the engine stops

    def empty(self) -> bool:
        return not (self.answers or self.events or self.ttft or self.itl or self.tokens or self.gauges
                    or self.closing)


class RemoteEngine(EngineClient):
    """The engine in another process, over ``conn``. A reader thread hands each message to
    the event loop; everything else (routing, sends) runs on the loop. ``on_gone(expected)``
    runs there once the engine is gone (``expected``: it said it stops)."""

    def __init__(self, conn, metrics, on_gone=None):
        self.conn, self.metrics, self.on_gone = conn, metrics, on_gone
        self.keys = itertools.count()
        self.routes: dict[int, tuple[asyncio.Queue, set[int]]] = {}  # key -> (its queue, choices not ended)
        self.answers: dict[int, asyncio.Future] = {}  # key -> the submit's answer, while awaited
        self.gone: str | None = None  # why the engine cannot be reached; None while it can
        self.loop = None

    async def start(self):
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="moe-infer-engine-reader", daemon=True).start()

    def _read(self):
        try:
            while True:
                batch = self.conn.recv()
                self.loop.call_soon_threadsafe(self._deliver, batch)
        except (EOFError, OSError):
            pass
        except RuntimeError:  # the loop closed: the front end is exiting anyway
            return
        try:
            self.loop.call_soon_threadsafe(self._lost, "the engine process has stopped")
        except RuntimeError:
            pass

    def _deliver(self, batch: Batch):
        for key, refused in batch.answers:
            answer = self.answers.pop(key, None)
            if answer is not None and not answer.done():
                answer.set_result(refused)
        for key, index, kind, data in batch.events:
            route = self.routes.get(key)
            if route is None:  # cancelled or refused: nobody reads it
                continue
            queue, running = route
            queue.put_nowait((index, kind, data))
            if kind in _ENDED:
                running.discard(index)
                if not running:
                    del self.routes[key]
        m = self.metrics
        for s in batch.ttft:
            m.first_token(s)
        for s in batch.itl:
            m.next_token(s)
        if batch.tokens:
            m.tokens(batch.tokens)
        if batch.gauges is not None:
            m.state(*batch.gauges)
        if batch.closing is not None:
            self._lost(batch.closing, expected=True)

    def _lost(self, why: str, expected: bool = False):
        """The engine is gone (``expected``: it said it stops): what waits for an answer gets
        EngineGone, every running choice an error event."""
        if self.gone is not None:
            return
        self.gone = why
        for answer in self.answers.values():
            if not answer.done():
                answer.set_exception(EngineGone(why))
        self.answers.clear()
        for queue, running in self.routes.values():
            for i in sorted(running):
                queue.put_nowait((i, "error", {"message": why}))
        self.routes.clear()
        if self.on_gone is not None:
            self.on_gone(expected)

    def send(self, message):
        """On the loop's thread (or before the loop runs): the only writer of the pipe."""
        if self.gone is not None:
            raise EngineGone(self.gone)
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # a broken pipe, or it is closed
            if self.loop is not None:
                self._lost("the engine process has stopped")
            raise EngineGone("the engine process has stopped") from None

    async def submit(self, choices, queue):
        if self.gone is not None:
            raise EngineGone(self.gone)
        key = next(self.keys)
        self.routes[key] = (queue, set(range(len(choices))))
        answer = self.answers[key] = self.loop.create_future()
        try:
            self.send(("submit", key, choices))
            refused = await answer
        except asyncio.CancelledError:  # the client left before the answer: the engine drops it
            self.cancel(key)
            raise
        except EngineGone:
            self.routes.pop(key, None)
            self.answers.pop(key, None)
            raise
        if refused is not None:
            self.routes.pop(key, None)
            kind, message = refused
            raise {"queue_full": QueueFull, "invalid": ValueError}.get(kind, RuntimeError)(message)
        return key

    def cancel(self, ticket):
        if self.routes.pop(ticket, None) is not None and self.gone is None:
            try:
                self.send(("cancel", ticket))
            except EngineGone:
                pass

    @property
    def healthy(self) -> bool:
        return self.gone is None


# --------------------------------------------------------------------------- the engine's side

class EngineHost:
    """The engine's side of a server whose HTTP front end runs in a child process: the
    scheduler's thread, the child, and the bridge between them (a receiver thread that turns
    messages into ``Scheduler.submit`` / ``cancel``, a sender thread that ships ``Batch``es).
    The scheduler reports to it as to ``server.Metrics``, so its observations travel with
    the events. ``log_level`` is uvicorn's in the front end ("info" logs every request)."""

    def __init__(self, engine: Engine, cfg, scheduler: Scheduler, log_level: str = "info"):
        self.engine, self.cfg, self.scheduler, self.log_level = engine, cfg, scheduler, log_level
        scheduler.metrics = self
        self.cond = threading.Condition()  # guards batch, flush, gauges, live, closing
        self.batch, self.flush, self.gauges, self.closing = Batch(), False, None, False
        self.live: dict[int, list] = {}  # key -> [its Requests, how many have not ended]
        self.stopped = threading.Event()  # the front end is gone, or stop() was called
        self.listening = threading.Event()
        self.address: tuple[str, int] | None = None  # where the front end listens
        self.engine_stop = threading.Event()
        self.proc = self.conn = self.engine_thread = self.receiver = self.sender = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> tuple[str, int]:
        """Starts the front end's process, warms the engine up meanwhile, starts the engine
        thread and the bridge -> (host, port) once the front end accepts connections.
        Raises RuntimeError if the front end exits first (a port in use, say)."""
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        tok = self.engine.tokenizer
        self.proc = ctx.Process(target=front_end_main, name="moe-infer-http", daemon=True,
                                args=(theirs, self.engine.config, None if tok is None else str(tok.path), self.cfg,
                                      self.log_level))
        self.proc.start()
        theirs.close()  # the child's end lives in the child alone: its exit closes the pipe
        self.receiver = self._thread(self._receive, "moe-infer-bridge-in")
        try:
            self.scheduler.warm_up()  # while the front end imports and loads its tokenizer
            self.engine_thread = self._thread(lambda: self.scheduler.run(self.engine_stop), "moe-infer-engine")
            try:
                self.conn.send(("ready",))  # before the sender starts: the pipe has one writer at a time
            except OSError:
                pass  # the front end is gone already: reported below
            self.sender = self._thread(self._send_loop, "moe-infer-bridge-out")
            while not self.listening.wait(0.1):
                if self.stopped.is_set():
                    self.proc.join(timeout=5)
                    raise RuntimeError(f"the HTTP front end exited (code {self.proc.exitcode}) before it listened on "
                                       f"{self.cfg.host}:{self.cfg.port}; its log above says why")
        except BaseException:
            self.stop()
            raise
        return self.address

    def wait(self):
        """Until the front end exits, the engine thread ends, or ``stop``."""
        while not self.stopped.wait(0.5):
            if not self.engine_thread.is_alive():
                log.error("the engine thread has ended; stopping the server")
                return
        self.proc.join(timeout=1)
        if self.proc.exitcode not in (None, 0):
            log.error("the HTTP front end exited with code %s; stopping the engine", self.proc.exitcode)

    def stop(self):
        """Stops the engine thread, ships what it produced, closes the pipe (the front end
        fails what is still in flight and exits) and waits for the front end's process; one
        that does not exit is terminated."""
        self.stopped.set()
        if self.engine_thread is not None:
            self.engine_stop.set()
            with self.scheduler.lock:
                self.scheduler.wake.notify_all()
            self.engine_thread.join(timeout=30)
        with self.cond:
            self.closing = True
            self.batch.closing = "the server is shutting down"
            self.cond.notify_all()
        if self.sender is not None:
            self.sender.join(timeout=10)
        if self.conn is not None and not self.conn.closed:
            # Shutting the socket down, rather than closing the descriptor the receiver
            # reads, wakes both ends' readers with an end of file.
            with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self.receiver is not None:
            self.receiver.join(timeout=10)
        if self.proc is not None:
            self.proc.join(timeout=GONE_GRACE_S + 10)
            if self.proc.is_alive():
                log.warning("the HTTP front end did not exit; terminating it")
                self.proc.terminate()
                self.proc.join(timeout=5)
                if self.proc.is_alive():
                    self.proc.kill()
                    self.proc.join()
        if self.conn is not None:
            self.conn.close()

    @staticmethod
    def _thread(target, name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t

    # ----------------------------------------------------------------- front end -> engine

    def _receive(self):
        try:
            while True:
                message = self.conn.recv()
                kind = message[0]
                if kind == "submit":
                    self._submit(message[1], message[2])
                elif kind == "cancel":
                    self._cancel(message[1])
                elif kind == "listening":
                    self.address = (message[1], message[2])
                    self.listening.set()
        except (EOFError, OSError):  # the front end exited
            pass
        except Exception:
            log.exception("the engine's bridge failed; stopping the server")
        finally:
            self.stopped.set()

    def _submit(self, key: int, choices: list[Choice]):
        reqs = [c.request(functools.partial(self._event, key, i)) for i, c in enumerate(choices)]
        with self.cond:
            self.live[key] = [reqs, len(reqs)]
        refused = None
        try:
            for r in reqs:
                self.scheduler.submit(r)
        except QueueFull as exc:
            refused = ("queue_full", str(exc))
        except ValueError as exc:
            refused = ("invalid", str(exc))
        except Exception as exc:  # a bug: this request fails (a 500), the server keeps serving
            log.exception("submitting request %d failed", key)
            refused = ("error", f"{type(exc).__name__}: {exc}")
        if refused is not None:
            self._cancel(key)
        with self.cond:
            self.batch.answers.append((key, refused))
            self.flush = True
            self.cond.notify()

    def _cancel(self, key: int):
        with self.cond:
            entry = self.live.pop(key, None)
        for r in entry[0] if entry is not None else ():
            if r.finish is None:
                self.scheduler.cancel(r)

    # ----------------------------------------------------------------- engine -> front end

    def _wake(self):
        """Under the lock, before adding to the batch: the sender sleeps while it is empty."""
        if self.batch.empty():
            self.cond.notify()

    def _event(self, key: int, index: int, kind: str, data: dict):
        """A request's ``on_event``, on the engine thread."""
        with self.cond:
            self._wake()
            self.batch.events.append((key, index, kind, data))
            if kind in _ENDED:
                entry = self.live.get(key)
                if entry is not None:
                    entry[1] -= 1
                    if not entry[1]:
                        del self.live[key]
                if kind == "error":  # a failed step ends without a report: send it now
                    self.flush = True
                    self.cond.notify()

    def first_token(self, s: float):
        with self.cond:
            self._wake()
            self.batch.ttft.append(s)

    def next_token(self, s: float):
        with self.cond:
            self._wake()
            self.batch.itl.append(s)

    def tokens(self, n: int):
        with self.cond:
            self._wake()
            self.batch.tokens += n

    def state(self, waiting: int, running: int, blocks: int):
        """The scheduler's report at the end of each step: the step's batch can go."""
        with self.cond:
            if (waiting, running, blocks) != self.gauges:
                self._wake()
                self.gauges = self.batch.gauges = (waiting, running, blocks)
            if not self.batch.empty():
                self.flush = True
                self.cond.notify()

    def _send_loop(self):
        while True:
            with self.cond:
                while self.batch.empty() and not self.closing:
                    self.cond.wait()
                if not self.flush:  # events without their step's end yet: give it a moment
                    self.cond.wait_for(lambda: self.flush or self.closing, timeout=FLUSH_S)
                batch, self.batch, self.flush, closing = self.batch, Batch(), False, self.closing
            if not batch.empty():
                try:
                    self.conn.send(batch)
                except (OSError, ValueError):  # the front end is gone
                    return
            if closing:
                return


def serve_from_another_process(engine: Engine, cfg, scheduler: Scheduler):
    """``server.serve`` with ``api_process``: the engine here, HTTP in a child process, until
    either ends or Ctrl-C / SIGTERM stops both."""
    def terminated(signum, frame):
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main else None
    host = EngineHost(engine, cfg, scheduler)
    try:
        try:
            host.start()
        except RuntimeError as exc:  # as uvicorn ends a process whose port is taken
            raise SystemExit(f"moe-infer: error: {exc}") from None
        host.wait()
    except KeyboardInterrupt:  # a clean stop, as uvicorn's own handling of Ctrl-C is
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut the stop short
        host.stop()
        if main:
            signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- the front end's process

def front_end_main(conn, config: Config, tokenizer_path: str | None, cfg, log_level: str = "info"):
    """The front end's process: the app over a ``RemoteEngine``, served by uvicorn once the
    engine is ready. It loads the tokenizer, never the weights."""
    # No CUDA context here, whatever a library does: the engine's process owns the GPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import uvicorn

    from moe_infer.server import Metrics, app_for

    metrics = Metrics()
    server = None

    def engine_gone(expected: bool):  # unexpected: new requests get 503 for a while, then the process ends
        asyncio.get_running_loop().call_later(0 if expected else GONE_GRACE_S, setattr, server, "should_exit", True)

    client = RemoteEngine(conn, metrics, on_gone=engine_gone)
    model = ModelInfo(config, Tokenizer(tokenizer_path) if tokenizer_path is not None else None)
    server = uvicorn.Server(uvicorn.Config(app_for(model, cfg, client, metrics), host=cfg.host, port=cfg.port,
                                           log_level=log_level))
    try:
        sock = server.config.bind_socket()  # a port in use ends the process here, logged
        if conn.recv() != ("ready",):
            return
    except (EOFError, KeyboardInterrupt):  # the engine failed to start, or Ctrl-C
        return

    async def run():
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            try:
                client.send(("listening", cfg.host, sock.getsockname()[1]))
            except EngineGone:
                server.should_exit = True
        await serving

    factory = getattr(server.config, "get_loop_factory", lambda: None)()
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(run())
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled
        pass
