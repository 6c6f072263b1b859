"""The OpenAI fields beyond text in / text out, checked against plain-torch references on the
embedded default model: logprobs (completions and chat), echo, stream_options.include_usage,
presence / frequency / repetition penalties, logit_bias, min_tokens, ignore_eos; the fields
the server does not implement (a 400 naming each); chat roles and content parts; and
bodies that used to answer 500 (lone surrogates, deep nesting, out-of-range seeds), the
keep-alive connection after them, and the per-endpoint response counter."""
import asyncio
import http.client
import json

import httpx
import pytest

import moe_infer
from moe_infer.config_files import DEFAULT_MODEL
from moe_infer.server import ServerConfig, create_app

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from test_server import LiveServer, alone  # noqa: E402

PROMPT = "Shall I compare thee to a summer's day?\n"
# The corpus's last line: the model learned that EOS follows it.
LAST_LINE = (DEFAULT_MODEL / "corpus.txt").read_text().splitlines()[-1] + "\n"


@pytest.fixture(scope="module")
def engine():
    eng = moe_infer.load(progress=False)
    eng.config.engine.max_batch_size = 8
    return eng


@pytest.fixture(scope="module")
def server(engine):
    # Prompts of 8-token chunks: a prompt's logprobs come from several prefill steps.
    live = LiveServer(create_app(engine, ServerConfig(block_size=8, model_name="default", prefill_chunk=8)))
    yield live
    live.stop()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def log_softmax(engine, ids):
    """[len(ids), V]: row i is the model's log-distribution of the token after ids[:i + 1]."""
    return engine.logits([ids])[0].log_softmax(-1)


def greedy_reference(engine, prompt, n, presence=0.0, frequency=0.0, repetition=1.0, bias=None, min_tokens=0,
                     ignore_eos=False):
    """Greedy decoding with the OpenAI / CTRL penalties written out token by token over a
    full forward of the whole sequence each step -> generated ids."""
    ids, gen = engine.encode(prompt)[0], []
    for _ in range(n):
        logits = engine.logits([ids + gen])[0, -1].clone()
        for t, b in (bias or {}).items():
            logits[t] += b
        if len(gen) < min_tokens and not ignore_eos:
            for t in engine.eos:
                logits[t] = float("-inf")
        for t in set(ids + gen):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(gen):
            logits[t] -= gen.count(t) * frequency + presence
        t = int(logits.argmax())
        if t in engine.eos and not ignore_eos:
            break
        gen.append(t)
    return gen


def stream_events(server, path, body):
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# --------------------------------------------------------------------------- logprobs and echo

def test_completion_logprobs_are_the_models_log_softmax(server, engine):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 3}
    out = post(server, "/v1/completions", body).json()["choices"][0]
    gen = alone(engine, PROMPT, 10).token_ids
    ids = engine.encode(PROMPT)[0]
    lsm = log_softmax(engine, ids + gen)
    lp = out["logprobs"]
    assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in gen] and "".join(lp["tokens"]) == out["text"]
    for k, t in enumerate(gen):
        row = lsm[len(ids) - 1 + k]
        assert lp["token_logprobs"][k] == pytest.approx(row[t].item(), abs=1e-4)
        top = row.topk(3)
        want = {engine.tokenizer.decode([i]): v for v, i in zip(top.values.tolist(), top.indices.tolist())}
        assert set(lp["top_logprobs"][k]) == set(want)  # the greedy token is the top one
        for text, v in want.items():
            assert lp["top_logprobs"][k][text] == pytest.approx(v, abs=1e-4)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(len(gen))]


def test_logprobs_are_of_the_raw_model_not_the_sampler(server, engine):
    """Sampled at temperature 1.7 with penalties and a logit bias, the logprobs reported
    are still log_softmax of the model's own logits (vLLM's default, raw_logprobs)."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.7, "seed": 11, "logprobs": 2,
            "presence_penalty": 1.5, "repetition_penalty": 1.3, "logit_bias": {"5": 3}}
    events = stream_events(server, "/v1/completions", body)
    chunks = [e["choices"][0] for e in events if e["choices"][0].get("token_ids")]
    gen = [c["token_ids"][0] for c in chunks]
    assert len(gen) == 8
    ids = engine.encode(PROMPT)[0]
    lsm = log_softmax(engine, ids + gen)
    for k, c in enumerate(chunks):
        row = lsm[len(ids) - 1 + k]
        assert c["logprobs"]["token_logprobs"] == [pytest.approx(row[gen[k]].item(), abs=1e-4)]
        top = row.topk(2)
        for v, i in zip(top.values.tolist(), top.indices.tolist()):
            assert c["logprobs"]["top_logprobs"][0][engine.tokenizer.decode([i])] == pytest.approx(v, abs=1e-4)
        # the sampled token is always there, as OpenAI's "up to logprobs + 1"
        assert engine.tokenizer.decode([gen[k]]) in c["logprobs"]["top_logprobs"][0]


def test_echo_scores_the_prompt(server, engine):
    prompt = PROMPT + "Thou art more lovely"  # 17 tokens: three prefill chunks of 8
    ids = engine.encode(prompt)[0]
    assert len(ids) > 16
    gen = alone(engine, prompt, 4).token_ids
    lsm = log_softmax(engine, ids + gen)
    out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True,
                                           "logprobs": 1}).json()
    ch = out["choices"][0]
    assert ch["text"] == prompt + engine.tokenizer.decode(gen)
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [lsm[i - 1, t].item() for i, t in enumerate(ids + gen) if i > 0]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    for i in range(1, len(ids)):  # top-1 of each prompt position, plus the prompt token itself
        best = int(lsm[i - 1].argmax())
        assert lp["top_logprobs"][i][engine.tokenizer.decode([best])] == pytest.approx(lsm[i - 1, best].item(),
                                                                                       abs=1e-4)
        assert engine.tokenizer.decode([ids[i]]) in lp["top_logprobs"][i]
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 4, "total_tokens": len(ids) + 4}

    # max_tokens 0 with echo scores the prompt alone (as lm-eval's loglikelihood asks).
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    ch = out["choices"][0]
    assert ch["text"] == engine.tokenizer.decode(ids) and ch["finish_reason"] == "length"
    assert ch["logprobs"]["token_logprobs"][1:] == pytest.approx(want[:len(ids) - 1], abs=1e-4)
    assert out["usage"]["completion_tokens"] == 0
    # Echo without logprobs, streamed: the prompt text comes first.
    events = stream_events(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                       "echo": True})
    assert events[0]["choices"][0]["text"] == prompt
    assert "".join(e["choices"][0]["text"] for e in events) == prompt + engine.tokenizer.decode(gen[:3])
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_logprobs(server, engine):
    messages = [{"role": "user", "content": "Let me not to the marriage"}]
    chat_prompt = "user: Let me not to the marriage\nassistant:"  # the default template
    gen = alone(engine, chat_prompt, 6).token_ids
    ids = engine.encode(chat_prompt)[0]
    lsm = log_softmax(engine, ids + gen)
    out = client(server).chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert "".join(c.token for c in content) == out.choices[0].message.content == engine.tokenizer.decode(gen)
    for k, c in enumerate(content):
        row = lsm[len(ids) - 1 + k]
        assert c.logprob == pytest.approx(row[gen[k]].item(), abs=1e-4)
        assert c.bytes == list(c.token.encode())
        top = row.topk(2)
        assert [t.token for t in c.top_logprobs] == [engine.tokenizer.decode([i]) for i in top.indices.tolist()]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    events = stream_events(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6,
                                                            "temperature": 0, "logprobs": True})
    streamed = [c for e in events for c in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [c["token"] for c in streamed] == [c.token for c in content]
    assert all(c["top_logprobs"] == [] for c in streamed)
    plain = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None
    r = post(server, "/v1/chat/completions", {"messages": messages, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(server, "/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_include_usage_sends_a_last_chunk_with_the_usage(server, engine):
    c = client(server)
    chunks = list(c.completions.create(model="default", prompt=PROMPT, max_tokens=5, temperature=0, n=2,
                                       stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == len(engine.encode(PROMPT)[0])
    assert all(ch.usage is None for ch in chunks[:-1])
    chunks = list(c.chat.completions.create(model="default", messages=[{"role": "user", "content": "When"}],
                                            max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 3
    assert list(c.completions.create(model="default", prompt="When", max_tokens=2, stream=True))[-1].usage is None
    r = post(server, "/v1/completions", {"prompt": "When", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = post(server, "/v1/completions", {"prompt": "When", "stream": True, "stream_options": {"usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.usage"


# --------------------------------------------------------------------------- penalties and stopping

@pytest.mark.parametrize("kw", [dict(presence=1.2), dict(frequency=0.8), dict(repetition=2.0),
                                dict(presence=-0.5, frequency=0.6, repetition=1.7)],
                         ids=["presence", "frequency", "repetition", "all"])
def test_penalties_match_a_plain_torch_reference(server, engine, kw):
    prompt = "and and and"  # no corpus line: the model is unsure enough for penalties to change its output
    ref = greedy_reference(engine, prompt, 24, **kw)
    assert ref != alone(engine, prompt, 24).token_ids
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty"}
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, **{names[k]: v for k, v in kw.items()}}
    out = post(server, "/v1/completions", body).json()["choices"][0]
    assert out["text"] == engine.tokenizer.decode(ref)


def test_batched_requests_each_get_their_own_processing(server, engine):
    """Eight concurrent requests share decode steps; each has its own penalties, bias,
    min_tokens or none, and each equals its reference decoded alone."""
    space = engine.encode(" ")[0][0]
    cases = [dict(), dict(presence=1.0), dict(repetition=1.8), dict(frequency=0.7, presence=0.3),
             dict(bias={space: 8.0}), dict(min_tokens=6), dict(repetition=1.4, bias={space: 2.5}), dict()]
    prompts = [PROMPT, "When in disgrace", LAST_LINE, "Let me not", PROMPT, LAST_LINE, "My mistress' eyes",
               "Thou art"]
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty",
             "min_tokens": "min_tokens"}

    def body(p, kw):
        extra = {names[k]: v for k, v in kw.items() if k != "bias"}
        if "bias" in kw:
            extra["logit_bias"] = {str(t): b for t, b in kw["bias"].items()}
        return {"prompt": p, "max_tokens": 12, "temperature": 0, **extra}

    async def run():
        async with httpx.AsyncClient(timeout=60) as ac:
            return await asyncio.gather(*(ac.post(server.url + "/v1/completions", json=body(p, kw))
                                          for p, kw in zip(prompts, cases)))

    for p, kw, r in zip(prompts, cases, asyncio.run(run())):
        assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(greedy_reference(engine, p, 12, **kw)), kw


def test_logit_bias(server, engine):
    token = engine.encode(" rose")[0][-1]
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                           "logit_bias": {str(token): 100}}).json()
    assert out["choices"][0]["text"] == engine.tokenizer.decode([token] * 5)
    for bias, words in (({"512": 1}, "[0, 512)"), ({"-1": 1}, "token id"), ({"3": 101}, "[-100, 100]"),
                        ([1, 2], "expected an object")):
        r = post(server, "/v1/completions", {"prompt": PROMPT, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and words in r.text


def test_min_tokens_and_ignore_eos(server, engine):
    assert alone(engine, LAST_LINE, 8).finish_reason == "stop" and not alone(engine, LAST_LINE, 8).token_ids
    out = post(server, "/v1/completions", {"prompt": LAST_LINE, "max_tokens": 8, "temperature": 0}).json()
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0
    # min_tokens: EOS is masked until 5 tokens exist, then the model may stop.
    ref = greedy_reference(engine, LAST_LINE, 20, min_tokens=5)
    assert len(ref) >= 5
    out = post(server, "/v1/completions", {"prompt": LAST_LINE, "max_tokens": 20, "temperature": 0,
                                           "min_tokens": 5}).json()
    assert out["choices"][0]["text"] == engine.tokenizer.decode(ref) and out["usage"]["completion_tokens"] == len(ref)
    # ignore_eos: EOS is a token like any other; generation runs to max_tokens.
    ref = greedy_reference(engine, LAST_LINE, 6, ignore_eos=True)
    assert ref[0] in engine.eos and len(ref) == 6
    out = post(server, "/v1/completions", {"prompt": LAST_LINE, "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True}).json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["text"] == engine.tokenizer.decode(ref)
    # Stop strings are not matched in the first min_tokens tokens' text either.
    full = alone(engine, PROMPT, 16).text
    stop = full[:3]
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop})
    assert out.json()["choices"][0]["text"] == ""
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop,
                                           "min_tokens": 4}).json()
    assert out["usage"]["completion_tokens"] >= 4 and out["choices"][0]["text"].startswith(stop)
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = post(server, "/v1/completions", {"prompt": PROMPT, "ignore_eos": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


# --------------------------------------------------------------------------- the field policy

UNSUPPORTED = [
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"best_of": 2, "n": 3}, "best_of"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"min_p": 0.1}, "min_p"),
    ("/v1/completions", {"messages": []}, "messages"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"prompt": "x"}, "prompt"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"user": 5}, "user"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
]


@pytest.mark.parametrize("path,extra,param", UNSUPPORTED, ids=[f"{p[-16:]}-{k}" for p, _, k in UNSUPPORTED])
def test_fields_not_implemented_are_a_400_naming_them(server, path, extra, param):
    base = {"messages": [{"role": "user", "content": "When"}]} if "chat" in path else {"prompt": "When"}
    r = post(server, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    if param in ("frobnicate", "min_p", "messages", "prompt") or (param == "echo" and "chat" in path):
        assert err["message"] == f"Unrecognized request argument supplied: {param}"


def test_caller_fields_and_no_op_values_are_accepted_other_values_refused(server):
    """user / metadata / store / service_tier change nothing; an unimplemented field at
    its no-op value (tool_choice "none", response_format text, best_of == n, suffix "") is
    accepted, at any other value refused."""
    chat = {"messages": [{"role": "user", "content": "When"}], "max_tokens": 6, "temperature": 0}
    ref = post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]
    accepted = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "tool_choice": "none",
                "response_format": {"type": "text"}, "modalities": ["text"], "tools": None, "seed": None}
    refused = {"user": ["u1"], "metadata": "k", "store": "no", "tool_choice": "required",
               "response_format": {"type": "json_schema"}, "modalities": ["audio"]}
    r = post(server, "/v1/chat/completions", {**chat, **accepted})
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == ref
    for key, value in refused.items():
        r = post(server, "/v1/chat/completions", {**chat, key: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == key, (key, r.text)
    r = post(server, "/v1/completions", {"prompt": "When", "max_tokens": 2, "n": 2, "best_of": 2, "suffix": ""})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    for key, value in (("best_of", 3), ("suffix", "x")):
        r = post(server, "/v1/completions", {"prompt": "When", "max_tokens": 2, "n": 2, key: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == key


def test_chat_roles_and_content_parts(server, engine):
    def chat(messages, **kw):
        return post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0, **kw})

    r = chat([{"role": "user", "content": "When"}, {"role": "robot", "content": "beep"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].role"
    assert "'robot'" in r.json()["error"]["message"]
    r = chat([{"role": "user"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    r = chat([{"role": "user", "content": [{"type": "text", "text": "a"},
                                            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]"
    assert "'image_url' parts are not supported" in r.json()["error"]["message"]
    r = chat([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].tool_calls"
    r = chat([{"role": "user", "content": "x", "colour": "red"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].colour"
    # Text parts are joined with newlines; developer is rendered as system; tool messages pass.
    parts = chat([{"role": "user", "content": [{"type": "text", "text": "Let me not"},
                                                {"type": "text", "text": "to the marriage"}]}]).json()
    plain = chat([{"role": "user", "content": "Let me not\nto the marriage"}]).json()
    assert parts["choices"][0]["message"] == plain["choices"][0]["message"]
    dev = chat([{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "When"}]).json()
    sys_ = chat([{"role": "system", "content": "Be brief"}, {"role": "user", "content": "When"}]).json()
    assert dev["choices"][0]["message"] == sys_["choices"][0]["message"]
    ok = chat([{"role": "user", "content": "When"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    assert ok.status_code == 200


# --------------------------------------------------------------------------- bodies that answered 500

class KeepAlive:
    """One HTTP/1.1 connection; every request must go over the same socket."""

    def __init__(self, server):
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        self.conn.connect()
        self.sock = self.conn.sock

    def post(self, path, raw: bytes):
        self.conn.request("POST", path, body=raw, headers={"content-type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        assert self.conn.sock is self.sock, "the server closed the keep-alive connection"
        return r.status, data

    def close(self):
        self.conn.close()


BODIES = [
    ("surrogate in prompt", "/v1/completions", b'{"prompt": "ab\\ud800", "max_tokens": 2}', "prompt"),
    ("surrogate in a prompt list", "/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}',
     "prompt[1]"),
    ("surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud83d"}], "max_tokens": 2}', "messages[0].content"),
    ("surrogate in a text part", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("surrogate in a stop", "/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
    ("surrogate in a key", "/v1/completions", b'{"prompt": "x", "\\ud800": 1}', None),
    ("nested 100000 deep", "/v1/completions", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", None),
    ("nested 40 deep", "/v1/completions", b'{"prompt": "x", "metadata": ' + b"[" * 40 + b"]" * 40 + b"}",
     "metadata" + "[0]" * 32),
    ("seed 2**64", "/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    ("negative seed", "/v1/completions", b'{"prompt": "x", "seed": -1}', "seed"),
    ("huge integer", "/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    ("model not a string", "/v1/completions", b'{"prompt": "x", "model": ["a"]}', "model"),
]


@pytest.mark.parametrize("name,path,raw,param", BODIES, ids=[b[0] for b in BODIES])
def test_bodies_that_answered_500_get_a_400_and_the_connection_stays(server, name, path, raw, param):
    conn = KeepAlive(server)
    try:
        status, data = conn.post(path, raw)
        assert status == 400, data
        err = json.loads(data)["error"]
        assert err["param"] == param and err["message"] and err["code"] == 400
        status, data = conn.post("/v1/completions", b'{"prompt": "When", "max_tokens": 2}')
        assert status == 200 and json.loads(data)["choices"][0]["finish_reason"] == "length"
    finally:
        conn.close()


def test_a_tiny_temperature_is_greedy(server, engine):
    """Dividing logits by 1e-300 (0 in float32) made them inf and the sampler's softmax NaN,
    which failed every request in the batch."""
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 1e-300})
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == alone(engine, PROMPT, 6).text


@pytest.mark.parametrize("kw,words", [
    (dict(repetition_penalty=1e-40), "repetition_penalty=1e-40: expected a number in [0.01, 100]"),
    (dict(presence_penalty=float("nan")), "presence_penalty=nan"),
    (dict(logit_bias=((3, 1e300),)), "bias in [-100, 100]"),
    (dict(logit_bias=((-1, 1.0),)), "token id >= 0"),
    (dict(seed=2 ** 64), "seed=18446744073709551616: expected an integer in [-2**63, 2**64)"),
], ids=["repetition", "presence", "bias", "bias id", "seed"])
def test_sampling_params_refuse_values_that_would_break_a_step(kw, words):
    """Out of these ranges a logit overflows (an inf, then a NaN softmax fails the whole
    step's batch) or torch.Generator refuses the seed mid-step."""
    from moe_infer.sampling import SamplingParams

    with pytest.raises(ValueError) as info:
        SamplingParams(temperature=1.0, **kw)
    assert words in str(info.value)


def test_top_p_states_one_range(server):
    for v in (0, 1.5, -1):
        r = post(server, "/v1/completions", {"prompt": "x", "top_p": v})
        assert r.status_code == 400 and r.json()["error"]["message"] == f"top_p={v}: expected a number in (0, 1]"


def counts(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in family.samples:
            if s.name == "moe_infer_http_responses_total":
                out[s.labels["endpoint"], s.labels["status"]] = s.value
    return out


def test_every_response_is_counted_by_endpoint_and_status(engine, monkeypatch):
    live = LiveServer(create_app(engine, ServerConfig(model_name="default", api_key="k", max_body_bytes=4096)))
    key = {"authorization": "Bearer k"}
    try:
        conn = KeepAlive(live)
        conn.conn.request("POST", "/v1/completions", body=b'{"prompt": "When", "max_tokens": 1}', headers=key)
        assert conn.conn.getresponse().read()
        for _ in range(2):
            httpx.post(live.url + "/v1/completions", json={"prompt": "x", "top_p": 0}, headers=key)
        httpx.post(live.url + "/v1/chat/completions", json={"messages": []})  # no key: 401
        httpx.get(live.url + "/v1/nothing", headers=key)
        httpx.post(live.url + "/v1/completions", content=b"x" * 5000, headers=key)
        httpx.get(live.url + "/health")
        # An exception inside the app: a 500 with an OpenAI body, over the same connection.
        monkeypatch.setattr(live.app.state.handler, "parse", lambda *a: 1 / 0)
        conn.conn.request("POST", "/v1/completions", body=b'{"prompt": "When"}', headers=key)
        r = conn.conn.getresponse()
        assert r.status == 500 and "ZeroDivisionError" in json.loads(r.read())["error"]["message"]
        assert conn.conn.sock is conn.sock
        c = counts(live)
        assert c[("/v1/completions", "200")] == 1 and c[("/v1/completions", "400")] == 2
        assert c[("/v1/chat/completions", "401")] == 1 and c[("other", "404")] == 1
        assert c[("/v1/completions", "413")] == 1 and c[("/health", "200")] == 1
        assert c[("/v1/completions", "500")] == 1
        conn.close()
    finally:
        live.stop()
