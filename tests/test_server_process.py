"""The server as ``moe-infer serve`` runs it: the engine in this process (``EngineHost``),
FastAPI / uvicorn in a spawned child. Its answers equal ``generate()``'s and the
in-process server's, errors included; a client that leaves frees its KV blocks; either
process ending ends the other, and SIGTERM stops both."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import moe_infer
from moe_infer.config import ConfigError
from moe_infer.frontend import EngineHost
from moe_infer.server import ServerConfig, build_scheduler, create_app

pytest.importorskip("uvicorn")
from ports import free_port  # noqa: E402
from test_server import LiveServer, alone, front_ends, wait_healthy  # noqa: E402

CFG = dict(block_size=8, num_blocks=32, model_name="default", retry_after_s=3)  # 256 tokens of KV cache
PROMPT = "Shall I compare thee to a summer's day?"


@pytest.fixture(scope="module")
def engine():
    eng = moe_infer.load(progress=False)
    eng.config.engine.max_batch_size = 4
    return eng


class RemoteServer:
    """An ``EngineHost`` on a free port: its scheduler is here, its HTTP in a child."""

    def __init__(self, engine, **kw):
        cfg = ServerConfig(port=0, **{**CFG, **kw})
        self.scheduler = build_scheduler(engine, cfg)
        self.host = EngineHost(engine, cfg, self.scheduler, log_level="warning")
        _, port = self.host.start()
        self.url = f"http://127.0.0.1:{port}"

    def stop(self):
        self.host.stop()


@pytest.fixture(scope="module")
def remote(engine):
    server = RemoteServer(engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def local(engine):
    live = LiveServer(create_app(engine, ServerConfig(**CFG)))
    yield live
    live.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def stream(server, path, body) -> list[str]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [ln for ln in r.iter_lines() if ln]


def without_ids(answer):
    """An answer (a JSON body, or a stream's lines) less the fields that differ per request."""
    if isinstance(answer, list):
        return [without_ids(json.loads(ln[6:])) if ln.startswith("data: {") else ln for ln in answer]
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def test_greedy_answers_equal_generate(remote, engine):
    ref = alone(engine, PROMPT, 20)
    out = post(remote, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}).json()
    assert out["choices"][0]["text"] == ref.text and out["usage"]["completion_tokens"] == len(ref.token_ids)
    lines = stream(remote, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0})
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text and lines[-1] == "data: [DONE]"
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == ref.token_ids

    messages = [{"role": "user", "content": "Let me not to the marriage"}]
    ref = alone(engine, "user: Let me not to the marriage\nassistant:", 12)  # the default template
    out = post(remote, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0}).json()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    lines = stream(remote, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ref.text
    assert httpx.get(remote.url + "/v1/models").json()["data"][0]["id"] == "default"


ANSWERS = [
    ("completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}),
    ("completions", {"prompt": ["When", [5, 6, 7]], "max_tokens": 5, "temperature": 0, "n": 2}),
    ("completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": ["summer", "\n"],
                     "stream_options": {"include_usage": True}}),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
              "temperature": 0}),
]


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint,body", ANSWERS, ids=["echo-logprobs", "n-seed", "stop-usage", "chat-logprobs"])
def test_answers_equal_the_in_process_servers(remote, local, endpoint, body, streamed):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if streamed:
        assert without_ids(stream(remote, path, body)) == without_ids(stream(local, path, body))
    else:
        body = {k: v for k, v in body.items() if k != "stream_options"}
        assert without_ids(post(remote, path, body).json()) == without_ids(post(local, path, body).json())


ERRORS = [
    ("bad field", {"prompt": "x", "temperature": 7}),
    ("unknown field", {"prompt": "x", "colour": "blue"}),
    ("token outside the vocabulary", {"prompt": [1, 10 ** 6]}),
    ("context exceeded", {"prompt": [1] * 600, "max_tokens": 1}),
    ("more than the KV cache holds", {"prompt": "x", "max_tokens": 300}),  # refused by the scheduler
    ("unknown model", {"model": "gpt-9", "prompt": "x"}),
    ("bad messages", {"messages": [{"role": "robot", "content": "x"}]}),
]


@pytest.mark.parametrize("name,body", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_equal_the_in_process_servers(remote, local, name, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    a, b = post(remote, path, body), post(local, path, body)
    assert 400 <= a.status_code < 500 and (a.status_code, a.json()) == (b.status_code, b.json())


def test_full_queue_is_a_503_with_the_in_process_servers_body(remote, local, monkeypatch):
    """Each engine thread is held at its next step, so its queue (bounded at 2) fills: a
    request of n = 2 waits, the next is refused; once released, the first completes."""
    answers = {}
    for name, server in (("remote", remote), ("local", local)):
        gate, step = threading.Event(), server.scheduler.step

        def held(gate=gate, step=step):
            gate.wait(timeout=60)
            step()
        monkeypatch.setattr(server.scheduler, "step", held)
        monkeypatch.setattr(server.scheduler, "max_queue", 2)
        first = []
        waiter = threading.Thread(target=lambda s=server: first.append(
            post(s, "/v1/completions", {"prompt": "When", "max_tokens": 3, "n": 2})))
        try:
            waiter.start()
            deadline = time.time() + 10
            while len(server.scheduler.waiting) < 2 and time.time() < deadline:
                time.sleep(0.01)
            answers[name] = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        finally:
            gate.set()
            waiter.join(timeout=60)
        assert first[0].status_code == 200 and len(first[0].json()["choices"]) == 2
        monkeypatch.undo()
    a, b = answers["remote"], answers["local"]
    assert a.status_code == 503 and a.headers["retry-after"] == "3" and a.json()["error"]["type"] == "server_overloaded"
    assert (b.status_code, b.headers["retry-after"], b.json()) == (503, "3", a.json())


def test_disconnect_mid_stream_frees_the_blocks(remote, engine, monkeypatch):
    submitted, submit = [], remote.scheduler.submit
    monkeypatch.setattr(remote.scheduler, "submit", lambda r: (submitted.append(r), submit(r))[1])
    body = {"prompt": PROMPT, "stream": True, "max_tokens": 200}  # still running when the client leaves
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", remote.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert any([next(lines).startswith("data: ") for _ in range(6)])
            assert remote.scheduler.blocks_in_use > 0
    deadline = time.time() + 10
    while (remote.scheduler.blocks_in_use or remote.scheduler.running) and time.time() < deadline:
        time.sleep(0.01)
    assert remote.scheduler.blocks_in_use == 0 and not remote.scheduler.running
    assert submitted[0].finish == "cancelled" and len(submitted[0].generated) < 200
    deadline = time.time() + 10  # the gauges reach the front end with the engine's next message
    while "moe_infer_kv_blocks_in_use 0.0" not in (m := httpx.get(remote.url + "/metrics").text):
        assert time.time() < deadline, m
        time.sleep(0.05)
    assert "moe_infer_time_to_first_token_seconds_count" in m and "moe_infer_generated_tokens_total" in m


def test_a_failing_step_answers_500_and_the_server_keeps_serving(remote, monkeypatch):
    def broken(rows):
        raise RuntimeError("CUDA out of memory (simulated)")
    monkeypatch.setattr(remote.scheduler.runner, "decode", broken)
    r = post(remote, "/v1/completions", {"prompt": "When", "max_tokens": 3})
    assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]
    with httpx.stream("POST", remote.url + "/v1/completions", timeout=30,
                      json={"prompt": "When", "max_tokens": 3, "stream": True}) as s:
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ")]
    assert "out of memory" in events[-1]["error"]["message"] and remote.scheduler.blocks_in_use == 0
    monkeypatch.undo()
    r = post(remote, "/v1/completions", {"prompt": "When", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_front_end_exit_stops_the_engine_side(engine):
    server = RemoteServer(engine)
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        server.host.proc.kill()
        done = threading.Thread(target=server.host.wait)
        done.start()
        done.join(timeout=10)
        assert not done.is_alive(), "the engine side did not notice its front end exit"
    finally:
        server.stop()
    assert not server.host.engine_thread.is_alive() and not server.host.proc.is_alive()


def test_engine_gone_fails_in_flight_requests_answers_503_then_the_front_end_exits(engine, monkeypatch):
    server = RemoteServer(engine)
    gate, step = threading.Event(), server.scheduler.step

    def held():
        gate.wait(timeout=60)
        step()
    monkeypatch.setattr(server.scheduler, "step", held)  # the request stays in flight
    try:
        # Chat streams its role first, so the answer has begun before any token.
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "When"}], "max_tokens": 8, "stream": True}) as r:
            assert r.status_code == 200
            deadline = time.time() + 10
            while not server.scheduler.waiting and time.time() < deadline:
                time.sleep(0.01)
            assert server.scheduler.waiting
            # What the front end sees when the engine's process dies: its pipe closes.
            with socket.fromfd(server.host.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.shutdown(socket.SHUT_RDWR)
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert events[-1]["error"]["message"] == "the engine process has stopped"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
        refused = post(server, "/v1/completions", {"prompt": "When", "max_tokens": 2})
        assert refused.status_code == 503 and "engine" in refused.json()["error"]["message"]
        server.host.proc.join(timeout=30)
        assert server.host.proc.exitcode == 0
    finally:
        gate.set()
        server.stop()


def test_api_process_is_validated():
    with pytest.raises(ConfigError, match=r"server\.api_process='yes': expected true or false"):
        ServerConfig(api_process="yes")


def test_sigterm_stops_both_processes(tmp_path, engine):
    port = free_port()
    root = Path(__file__).resolve().parent.parent
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: default\nserver: {{api_process: true, port: {port}, model_name: default}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "moe_infer", "serve", "--config", str(cfg)],
                            env=dict(os.environ, PYTHONPATH=str(root)), cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        out = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                         timeout=60).json()
        assert out["choices"][0]["text"] == alone(engine, PROMPT, 8).text
        front = front_ends(proc.pid)
        assert len(front) == 1 and front[0] != proc.pid
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.time() + 10
        while front_ends(proc.pid) and time.time() < deadline:
            time.sleep(0.05)
        assert not front_ends(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
