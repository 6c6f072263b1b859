"""The OpenAI-compatible server on loopback, with the embedded default model: the official
``openai`` client, 64 concurrent streams, bad requests, back-pressure and disconnects."""
import asyncio
import gc
import json
import sys
import threading
import time

import httpx
import pytest
import torch

import moe_infer
from moe_infer.config import ConfigError
from moe_infer.config_files import DEFAULT_MODEL
from moe_infer.server import ServerConfig, build_engine, create_app, read_serve_config
from ports import free_port

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


class LiveServer:
    """uvicorn in a thread, on a free loopback port."""

    def __init__(self, app):
        self.port = free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def engine():
    eng = moe_infer.load(progress=False)
    eng.config.engine.max_batch_size = 8  # fewer slots than the load test's requests: they queue and join
    return eng


@pytest.fixture(scope="module")
def server(engine):
    # Prefill in chunks of 16 tokens a step: long prompts take several steps, mixed with decodes.
    live = LiveServer(create_app(engine, ServerConfig(block_size=8, max_queue=128, model_name="default",
                                                      prefill_chunk=16)))
    yield live
    live.stop()


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


def alone(engine, prompt, n):
    return engine.generate([prompt], max_new_tokens=n)[0]


def test_openai_client_completions_and_chat(server, engine):
    c = client(server)
    prompt = "Shall I compare thee to a summer's day?"
    ref = alone(engine, prompt, 24)
    out = c.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(engine.encode(prompt)[0])
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="default", prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert streamed == ref.text

    messages = [{"role": "user", "content": "Let me not to the marriage"}]
    chat_prompt = "user: Let me not to the marriage\nassistant:"  # the documented default template
    ref = alone(engine, chat_prompt, 16)
    out = c.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    chunks = list(c.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in c.models.list().data] == ["default"]


def test_stop_strings_n_and_seed(server, engine):
    c = client(server)
    prompt = "Shall I compare thee to a summer's day?"
    full = alone(engine, prompt, 24).text
    stop = full[10:13]
    out = c.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="default", prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == full[:full.index(stop)]
    a = c.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=2)
    b = c.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=2)
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices] and len(a.choices) == 2


def test_64_concurrent_streams_match_each_request_alone(server, engine):
    lines = (DEFAULT_MODEL / "corpus.txt").read_text().splitlines()
    lines = [ln for ln in lines if len(ln) > 8]
    gen = torch.Generator().manual_seed(0)
    cases = []
    for i in range(64):
        line = lines[i % len(lines)]
        cut = int(torch.randint(3, len(line), (1,), generator=gen))
        cases.append((line[:cut], int(torch.randint(1, 40, (1,), generator=gen))))

    async def one(ac, prompt, n):
        text, finish = "", None
        async for ch in await ac.completions.create(model="default", prompt=prompt, max_tokens=n, temperature=0,
                                                    stream=True):
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(ac, p, n) for p, n in cases))
        finally:
            await ac.close()

    results = asyncio.run(run_all())
    assert len(results) == 64
    for (prompt, n), (text, finish) in zip(cases, results):
        ref = alone(engine, prompt, n)
        assert text == ref.text, prompt
        assert finish == ref.finish_reason
    assert server.scheduler.blocks_in_use == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert "moe_infer_kv_blocks_in_use 0.0" in metrics
    assert "moe_infer_time_to_first_token_seconds_count" in metrics
    assert "moe_infer_inter_token_latency_seconds_bucket" in metrics


BAD = [
    ("invalid JSON", b'{"prompt": "x", ', 400, "not valid JSON"),
    ("not an object", b'["prompt"]', 400, "expected a JSON object"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("unknown model", json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "gpt-9"),
    ("no prompt", json.dumps({"max_tokens": 3}).encode(), 400, "prompt: required"),
    ("negative max_tokens", json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens=-1"),
    ("absurd max_tokens", json.dumps({"prompt": "x", "max_tokens": 10 ** 12}).encode(), 400, "max_tokens="),
    ("max_tokens as text", json.dumps({"prompt": "x", "max_tokens": "5"}).encode(), 400, "max_tokens='5'"),
    ("temperature", json.dumps({"prompt": "x", "temperature": 7}).encode(), 400, "temperature=7"),
    ("token id outside vocab", json.dumps({"prompt": [1, 10 ** 6]}).encode(), 400, "outside the vocabulary"),
    ("bad stop", json.dumps({"prompt": "x", "stop": [""]}).encode(), 400, "stop="),
    ("bad messages", json.dumps({"messages": [{"role": "user"}]}).encode(), 400, "messages[0]"),
]


@pytest.mark.parametrize("name,body,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(server, name, body, status, words):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] and err["code"] == status
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_prompt_longer_than_the_context(server, engine):
    limit = engine.config.max_seq_len
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1] * limit, "max_tokens": 1})
    assert r.status_code == 400 and "exceed the context length" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"


def test_ten_megabyte_body_is_refused(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (10 << 20) + b'"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_route_is_an_openai_error(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_mid_stream_frees_the_blocks(server, engine):
    prompt = "Shall I compare thee"  # and as many tokens as the context allows: still running when we leave
    body = {"model": "default", "prompt": prompt, "stream": True,
            "max_tokens": engine.config.max_seq_len - len(engine.encode(prompt)[0])}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few events arrive, then the client leaves
            assert any(ln.startswith("data: ") for ln in got)
            assert server.scheduler.blocks_in_use > 0
    deadline = time.time() + 5
    while server.scheduler.blocks_in_use and time.time() < deadline:
        time.sleep(0.01)
    assert server.scheduler.blocks_in_use == 0 and not server.scheduler.running


def test_api_key(engine):
    live = LiveServer(create_app(engine, ServerConfig(api_key="s3cret", model_name="default")))
    try:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = httpx.get(live.url + "/v1/models", headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model="default", prompt="When", max_tokens=2).choices[0].text
    finally:
        live.stop()


def test_the_switch_interval_holds_while_the_server_runs(engine):
    """HTTP beside the engine thread: the interpreter switches threads every
    server.switch_interval_us while the app runs, and as before once it stops; what exists
    when serving starts is frozen out of the collector's passes until then. The interval in
    force before is one the interpreter would truncate a microsecond off if set back as read."""
    sys.setswitchinterval(200e-6)  # held as 199 µs; set back as read, it would become 198
    before = sys.getswitchinterval()
    live = LiveServer(create_app(engine, ServerConfig(model_name="default", switch_interval_us=300)))
    try:
        assert round(sys.getswitchinterval() * 1e6) == 300
        assert gc.get_freeze_count() > 0  # the objects made before serving are out of the collector's passes
        assert httpx.post(live.url + "/v1/completions", json={"prompt": "When", "max_tokens": 2}).status_code == 200
    finally:
        live.stop()
    restored = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default, for the tests after this one
    assert restored == before and gc.get_freeze_count() == 0
    with pytest.raises(ConfigError, match=r"server\.switch_interval_us=0: expected a positive integer"):
        ServerConfig(switch_interval_us=0)


def test_full_queue_answers_503_with_retry_after(engine, monkeypatch):
    # The engine thread is held at its next step, so nothing leaves the queue: A waits in
    # it (it holds one request) and B is refused; once released, A completes.
    cfg = ServerConfig(block_size=8, max_queue=1, model_name="default", retry_after_s=2)
    live = LiveServer(create_app(engine, cfg))
    gate, step = threading.Event(), live.scheduler.step

    def held():
        gate.wait(timeout=60)
        step()
    monkeypatch.setattr(live.scheduler, "step", held)
    answers = []
    a = threading.Thread(target=lambda: answers.append(
        httpx.post(live.url + "/v1/completions", json={"prompt": "When", "max_tokens": 4}, timeout=60)))
    try:
        a.start()
        deadline = time.time() + 10
        while not live.scheduler.waiting and time.time() < deadline:
            time.sleep(0.01)
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "server_overloaded"
        gate.set()
        a.join(timeout=60)
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["finish_reason"] == "length"
        assert live.scheduler.blocks_in_use == 0
    finally:
        gate.set()
        live.stop()


def test_serve_config_errors(tmp_path):
    p = tmp_path / "serve.yaml"
    p.write_text("model: default\nserver: {port: 9000, colour: blue}\n")
    with pytest.raises(ConfigError, match=r"server\.colour: unknown key"):
        read_serve_config(p)
    p.write_text("model: default\nservr: {}\n")
    with pytest.raises(ConfigError, match=r"unknown section 'servr'"):
        read_serve_config(p)
    p.write_text("server: {max_queue: 0}\n")
    with pytest.raises(ConfigError, match=r"server\.max_queue=0: expected a positive integer"):
        read_serve_config(p)
    p.write_text("model: default\nengine: {max_batch_size: 4}\nserver: {port: 9001}\n")
    spec = read_serve_config(p, {"port": 9002, "host": None})
    assert spec.server.port == 9002 and spec.engine == {"max_batch_size": 4} and spec.model == "default"
    p.write_text("model: tiny-moe\nparallel: {dp: 2, ep: 2, dp_attention: true}\n")
    with pytest.raises(ConfigError, match=r"parallel\.dp_attention=True: expected false for serve"):
        build_engine(read_serve_config(p))  # before anything loads (one process: a 2-rank layout would fail later)


def wait_healthy(proc, url: str, timeout_s: float = 90):
    """Waits until the server process ``proc`` answers /health with 200 (it must not exit)."""
    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"the server at {url} did not come up"
        time.sleep(0.2)


def front_ends(root: int) -> list[int]:
    """The spawned HTTP front-end processes among the descendants of process ``root``."""
    from pathlib import Path

    parent, spawned = {}, set()
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if b"spawn_main" in (d / "cmdline").read_bytes():
                    spawned.add(int(d.name))
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            pass

    def descends(pid):
        while pid in parent and pid != root:
            pid = parent[pid]
        return pid == root
    return sorted(p for p in spawned if p != root and descends(p))


def serve_two_ranks(tmp_path, parallel: str, engine_yaml: str, server_yaml: str):
    """``moe_infer serve`` under the launcher at 2 ranks (gloo), from a config of the default
    model with these ``parallel`` / ``engine`` / extra ``server`` YAML mappings' bodies ->
    (the launcher's process, in a session of its own; the server's URL, answering /health)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec (the test extras install mpich)")
    port = free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: default\nparallel: {{{parallel}}}\nengine: {{{engine_yaml}}}\n"
                   f"server: {{port: {port}, model_name: default, block_size: 8{server_yaml}}}\n")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(["bash", str(root / "scripts" / "launch.sh"), "-n", "2", "--", sys.executable, "-m",
                             "moe_infer", "serve", "--config", str(cfg)], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
    except BaseException:
        stop_job(proc)
        raise
    return proc, url


def stop_job(proc):
    """Ends a launcher's whole session (its ranks and their children)."""
    import os

    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


@pytest.mark.parametrize("layout", ["tp: 2", "ep: 2, dp: 2", "pp: 2"], ids=["tp2", "ep2", "pp2"])
def test_two_ranks_serve(tmp_path, engine, layout):
    """Under the launcher, rank 0 serves HTTP and broadcasts every step; rank 1 follows.
    With tp = 2 each rank holds half the heads, with ep = 2 half the experts, with pp = 2
    half the blocks; the answers equal one process's."""
    import os

    proc, url = serve_two_ranks(tmp_path, layout, "max_batch_size: 4", ", api_process: true")
    try:
        prompts = ["Shall I compare thee", "When in disgrace with fortune", "Let me"]
        outs = [httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0},
                           timeout=60).json()["choices"][0]["text"] for p in prompts]
        assert outs == [alone(engine, p, 12).text for p in prompts]
        # At once, with different lengths: under pp the requests share the pipeline's
        # slots (a unit per slot, each request in one), and each still gets its own text.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda a: httpx.post(
                url + "/v1/completions", json={"prompt": a[0], "max_tokens": a[1], "temperature": 0},
                timeout=60).json()["choices"][0]["text"], zip(prompts * 2, (12, 5, 9, 12, 7, 3))))
        assert together == [alone(engine, p, n).text for p, n in zip(prompts * 2, (12, 5, 9, 12, 7, 3))]
        # Echo with logprobs: rank 0 alone computes every prompt position's logits; the
        # follower runs the same layers and the server keeps answering.
        out = httpx.post(url + "/v1/completions", json={"prompt": prompts[1], "max_tokens": 3, "temperature": 0,
                                                        "echo": True, "logprobs": 1}, timeout=60).json()
        ids = engine.encode(prompts[1])[0]
        ref = engine.logits([ids])[0].log_softmax(-1)
        got = out["choices"][0]["logprobs"]["token_logprobs"]
        assert got[0] is None and got[1:len(ids)] == pytest.approx([ref[i - 1, ids[i]].item()
                                                                    for i in range(1, len(ids))], abs=1e-3)
        assert httpx.post(url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 12, "temperature": 0},
                          timeout=60).json()["choices"][0]["text"] == outs[0]
        # HTTP runs in a process of its own beside rank 0; when it exits, rank 0 stops and
        # releases the follower, and the whole job ends.
        front = front_ends(proc.pid)
        assert len(front) == 1
        os.kill(front[0], 9)
        code = proc.wait(timeout=60)
        log = proc.stdout.read().decode()
        assert "the HTTP front end exited with code -9; stopping the engine" in log, log[-3000:]
        assert code == 0, log[-3000:]
    finally:
        stop_job(proc)


def test_an_idle_multi_rank_server_outlasts_the_collective_timeout(tmp_path, engine):
    """Rank 1 waits on a collective for rank 0's next step; idle longer than
    ``parallel.timeout_s``, rank 0 keeps it alive (a step of no rows), and a request after
    the idle spell gets its answer."""
    proc, url = serve_two_ranks(tmp_path, "tp: 2, timeout_s: 5", "max_batch_size: 2", "")
    try:
        time.sleep(7.5)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        out = httpx.post(url + "/v1/completions", json={"prompt": "Let me", "max_tokens": 6, "temperature": 0},
                         timeout=60).json()
        assert out["choices"][0]["text"] == alone(engine, "Let me", 6).text, out
    finally:
        stop_job(proc)


def test_a_failing_forward_answers_500_and_the_server_keeps_serving(engine, monkeypatch):
    live = LiveServer(create_app(engine, ServerConfig(model_name="default")))
    try:
        runner = live.scheduler.runner
        real = runner.decode

        def broken(rows):
            raise RuntimeError("CUDA out of memory (simulated)")
        monkeypatch.setattr(runner, "decode", broken)
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "When", "max_tokens": 3}, timeout=30)
        assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]
        with httpx.stream("POST", live.url + "/v1/completions", json={"prompt": "When", "max_tokens": 3,
                                                                     "stream": True}, timeout=30) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ")]
        assert "out of memory" in events[-1]["error"]["message"]
        assert live.scheduler.blocks_in_use == 0
        monkeypatch.setattr(runner, "decode", real)
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "When", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        live.stop()


def test_top_k_top_p_and_the_checkpoints_chat_template(tmp_path, server, engine):
    import shutil

    c = client(server)
    kw = dict(model="default", prompt="When", max_tokens=10, temperature=0.9, top_k=5, top_p=0.8, seed=3)
    kw_extra = {"top_k": kw.pop("top_k")}  # top_k is not an OpenAI field: it travels as an extra
    a = c.completions.create(**kw, extra_body=kw_extra).choices[0].text
    b = c.completions.create(**kw, extra_body=kw_extra).choices[0].text
    assert a == b and a
    # A checkpoint whose tokenizer_config.json has a chat template: that template is used.
    from moe_infer.config_files import DEFAULT_MODEL
    from moe_infer.server import Handler

    ckpt = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_MODEL, ckpt)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}"}))
    other = moe_infer.load(checkpoint=ckpt, progress=False)
    h = Handler(other, ServerConfig())
    ids = h.chat_prompt({"messages": [{"role": "user", "content": "Hi"}]})
    assert other.tokenizer.decode(ids) == "<user>Hi<assistant>"
