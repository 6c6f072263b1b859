"""Property-based: generated malformed bodies (random JSON values, random types for every
known field, random extra fields, lone surrogates, deep nesting, non-JSON bytes) at
/v1/completions and /v1/chat/completions. None may answer 5xx; every error is an OpenAI
error body with a message and a ``param`` that names a field of the body (or one it
lacks); and after each one the same keep-alive connection still gets a valid answer."""
import http.client
import json

import pytest

import moe_infer
from moe_infer.server import ServerConfig, create_app

pytest.importorskip("hypothesis")
pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402
from test_server import LiveServer  # noqa: E402

SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

# Text with lone surrogates, control characters and ordinary letters.
odd_text = st.text(alphabet=st.characters(categories=["Cs", "Lu", "Ll", "Nd", "Zs", "Po", "Cc"]), max_size=12)
text = st.one_of(st.text(max_size=12), odd_text, st.sampled_from(["", "When", "\ud800", "a\udfffb", "default"]))
leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-3, 600),
                 st.floats(allow_nan=True, allow_infinity=True), text)
json_value = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                          max_leaves=10)
deep = st.integers(1, 900).map(lambda d: json.loads("[" * d + "]" * d))  # json.loads builds up to ~1000
small_int = st.integers(-2, 3)
prob = st.floats(-0.5, 2.5)

part = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url", 3]), "text": text})
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot"]), json_value),
     "content": st.one_of(st.text(max_size=12), odd_text, st.lists(part, min_size=1, max_size=3), json_value)},
    optional={"name": text, "tool_calls": json_value})
# Each known field with values near its valid range (some in it, some just outside).
SHARED = {
    "model": st.sampled_from(["default", "gpt-4"]), "max_tokens": small_int, "max_completion_tokens": small_int,
    "temperature": prob, "top_p": prob, "top_k": small_int, "n": st.integers(0, 3),
    "stop": st.one_of(text, st.lists(text, max_size=5)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "other": json_value}),
    "seed": st.integers(-2, 2 ** 65), "presence_penalty": prob, "frequency_penalty": prob,
    "repetition_penalty": prob, "min_tokens": small_int, "ignore_eos": st.booleans(), "user": text,
    "logit_bias": st.dictionaries(st.one_of(st.integers(-1, 600).map(str), text), st.floats(-150, 150), max_size=3),
    "metadata": st.dictionaries(text, text, max_size=2), "tools": json_value, "tool_choice": st.just("none"),
    "response_format": st.just({"type": "text"}), "best_of": st.integers(0, 3),
}
COMPLETIONS = {**SHARED, "prompt": st.one_of(text, st.lists(st.integers(-1, 600), max_size=6),
                                             st.lists(text, max_size=3),
                                             st.lists(st.lists(st.integers(-1, 600), max_size=4), max_size=3)),
               "echo": st.booleans(), "logprobs": st.integers(-1, 22), "suffix": text}
CHAT = {**SHARED, "messages": st.lists(message, max_size=3), "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 22)}
# Each field within its valid range: together, valid requests that mix the features.
words = st.text(alphabet="abcdefghij ,.\n", min_size=1, max_size=12)
VALID = {
    "max_tokens": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "n": st.integers(1, 2), "stop": st.lists(words, max_size=4), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "seed": st.integers(0, 2 ** 63 - 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 100), "min_tokens": st.integers(0, 1), "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=3),
    "user": words, "metadata": st.dictionaries(words, words, max_size=2),
}
VALID_COMPLETIONS = {**VALID, "prompt": st.one_of(words, st.lists(st.integers(0, 511), min_size=1, max_size=6),
                                                  st.lists(words, min_size=1, max_size=3)),
                     "echo": st.booleans(), "logprobs": st.integers(0, 20)}
# Valid messages, but for the odd text (lone surrogates among it) that content may hold.
content = st.one_of(words, odd_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}),
                                              min_size=1, max_size=2))
VALID_CHAT = {**VALID, "messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]), "content": content}),
    min_size=1, max_size=3), "logprobs": st.just(True), "top_logprobs": st.integers(0, 20)}
EXPENSIVE = {"max_tokens": 2, "max_completion_tokens": 2, "min_tokens": 2, "n": 2}


def some(fields: dict, required: str, most: int):
    """Objects of the required field and up to ``most`` others."""
    return st.lists(st.sampled_from(sorted(set(fields) - {required})), max_size=most, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in [required, *keys]}))


def bodies(fields, valid):
    """Valid requests mixing features; objects with a few known fields at near-valid values;
    objects with any known field at any JSON value, random extra keys and deep nesting; or
    a JSON value that is no object at all."""
    required = "prompt" if "prompt" in fields else "messages"
    near = some(fields, required, 4)
    anything = st.fixed_dictionaries({}, optional={k: st.one_of(v, json_value) for k, v in fields.items()})
    extra = st.dictionaries(text, st.one_of(json_value, deep), max_size=2)
    wild = st.tuples(anything, extra).map(lambda kv: {**kv[1], **kv[0]})
    return st.one_of(some(valid, required, 6).map(cheap), near.map(cheap), wild.map(cheap), json_value)


def cheap(body: dict) -> dict:
    """Valid but long generations cut short, so examples stay fast: an integer in the
    range the server accepts for these fields becomes a small one."""
    for key, small in EXPENSIVE.items():
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and small < v <= 600:
            body[key] = small
    return body


def encode(body) -> bytes:
    # NaN and Infinity as Python writes them: not strict JSON, but what clients send.
    return json.dumps(body).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def server():
    engine = moe_infer.load(progress=False)
    live = LiveServer(create_app(engine, ServerConfig(model_name="default", block_size=8, default_max_tokens=2,
                                                      max_queue=4096)))
    yield live
    live.stop()


A_VALID_REQUEST = b'{"prompt": "When", "max_tokens": 1}'


def exchange(conn, path: str, raw: bytes) -> tuple[int, bytes]:
    sock = conn.sock
    conn.request("POST", path, body=raw, headers={"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    assert conn.sock is sock and sock is not None, "the server closed the keep-alive connection"
    return r.status, data


def names_a_field(param: str, body: dict) -> bool:
    """param is a key of the body, a place inside one ("messages[0].role"), or a field the
    body lacks that the error is about (a required prompt, the default max_tokens)."""
    fields = list(body) + ["prompt", "messages", "max_tokens"]
    return any(param == k or param.startswith(k + ".") or param.startswith(k + "[") for k in fields)


def check(server, path: str, raw: bytes, body=None):
    """Sends one body, then a valid request over the same connection (a new connection per
    example, so a failure replays the same way)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.connect()
    try:
        answer(conn, path, raw, body)
        status, data = exchange(conn, "/v1/completions", A_VALID_REQUEST)
        assert status == 200 and json.loads(data)["choices"][0]["finish_reason"] == "length"
    finally:
        conn.close()


def answer(conn, path: str, raw: bytes, body):
    status, data = exchange(conn, path, raw)
    assert status < 500, (status, data[:400], raw[:400])
    if status == 200:
        if data.startswith(b"data: "):  # a stream: no error events, ends with [DONE]
            events = [ln[6:] for ln in data.decode().split("\n") if ln.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e[:12] for e in events), data[:400]
        else:
            assert json.loads(data)["choices"]
    else:
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["message"] and err["code"] == status and err["type"]
        if isinstance(body, dict) and err["param"] is not None:
            assert names_a_field(err["param"], body), (err, raw[:400])


@settings(max_examples=150, **SETTINGS)
@given(body=bodies(COMPLETIONS, VALID_COMPLETIONS))
@example(body={"prompt": "\ud800", "max_tokens": 2})  # each body that once answered 500, always tried
@example(body={"prompt": "x", "seed": 2 ** 64})
def test_fuzz_completions(server, body):
    check(server, "/v1/completions", encode(body), body)


@settings(max_examples=150, **SETTINGS)
@given(body=bodies(CHAT, VALID_CHAT))
@example(body={"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2})
@example(body={"messages": [{"role": [], "content": ""}]})
def test_fuzz_chat_completions(server, body):
    check(server, "/v1/chat/completions", encode(body), body)


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 100000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}"),
    st.integers(1, 100000).map(lambda d: b'{"messages": [{"role": "user", "content": ' + b'{"a": ' * d + b"1"
                               + b"}" * d + b"}]}"),
    st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"\xef\xbb\xbf{}", b'{"prompt": "x",}', b"NaN",
                     b'{"prompt": 1' + b"0" * 5000 + b"}", b'{"prompt": "\\ud800"}', b'{"prompt": "\\u"}']),
    json_value.map(encode).map(lambda b: b[: len(b) // 2]))


@settings(max_examples=150, **SETTINGS)
@given(raw=raw_bodies, chat=st.booleans())
@example(raw=b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", chat=False)
def test_fuzz_raw_bytes(server, raw, chat):
    check(server, "/v1/chat/completions" if chat else "/v1/completions", raw)
