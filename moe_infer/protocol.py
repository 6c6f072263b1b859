"""The OpenAI request schema as this server implements it: which fields each endpoint takes,
the checks every body passes before any field is read, ``Handler`` (a body -> checked
``Parsed`` -> the ``Choice`` of each sequence to generate), and the logprobs shapes of
answers. ``Handler`` needs the model's config and tokenizer only, never its weights, so it
runs in the HTTP front end's process as well as beside the engine.

Policy for fields: an implemented field is validated (a bad value is a 400 naming it); a
field that only describes the caller (``user``, ``metadata``, ...) is accepted and has no
effect; an OpenAI field this server does not implement is a 400 naming it, unless it has
its no-op value (``tool_choice: "none"``, ``response_format: {"type": "text"}``, ...);
any other key is a 400 "Unrecognized request argument supplied", as OpenAI answers. A
null value is the same as leaving the field out.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import reprlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moe_infer.sampling import SamplingParams
from moe_infer.scheduler import Request

if TYPE_CHECKING:  # the server module imports this one
    from moe_infer.engine import Engine
    from moe_infer.frontend import ModelInfo
    from moe_infer.server import ServerConfig

DEFAULT_CHAT_TEMPLATE = (  # when the checkpoint's tokenizer_config.json has none
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")

MAX_DEPTH = 32  # JSON nesting; the deepest valid body (chat content parts) needs 5
MAX_LOGPROBS = 20  # top-N log-probabilities per token, as vLLM's default allows
SEED_MAX = (1 << 63) - 1  # seeds are int64 >= 0; choice j of n draws with seed + j

_show = reprlib.Repr()
_show.maxstring, _show.maxother, _show.maxlevel, _show.maxlist, _show.maxdict = 60, 60, 3, 6, 6


def show(value) -> str:
    """A short repr of a client's value for an error message: bounded in length and depth,
    with lone surrogates escaped."""
    return _show.repr(value)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             405: "invalid_request_error", 413: "invalid_request_error",
                             503: "server_overloaded"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


# --------------------------------------------------------------------------- fields

# Implemented by both endpoints; top_k, min_tokens, ignore_eos and repetition_penalty are
# vLLM's extensions.
_SHARED = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "stream",
           "stream_options", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_k",
           "min_tokens", "ignore_eos", "repetition_penalty"}
IMPLEMENTED = {"completions": _SHARED | {"prompt", "echo", "best_of"},
               "chat": _SHARED | {"messages", "top_logprobs"}}
# Accepted without effect: they describe the caller, not the answer. (name: expected type)
IGNORED = {"user": str, "metadata": dict, "store": bool, "service_tier": str, "safety_identifier": str,
           "prompt_cache_key": str}
_TYPE_NAMES = {str: "a string", dict: "an object", bool: "true or false"}
_NEVER = lambda v: False  # noqa: E731
# Not implemented: a 400 unless the value is the field's no-op.
UNSUPPORTED = {
    "completions": {"suffix": lambda v: v == ""},
    "chat": {"tools": _NEVER, "functions": _NEVER, "parallel_tool_calls": _NEVER, "audio": _NEVER,
             "prediction": _NEVER, "reasoning_effort": _NEVER, "web_search_options": _NEVER, "verbosity": _NEVER,
             "tool_choice": lambda v: v == "none", "function_call": lambda v: v == "none",
             "response_format": lambda v: v == {"type": "text"}, "modalities": lambda v: v == ["text"]},
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_KEYS = {"role", "content", "name", "tool_call_id"}


def check_fields(body: dict, endpoint: str) -> dict:
    """-> the body without null values; a 400 for the first field this endpoint does not take."""
    body = {k: v for k, v in body.items() if v is not None}
    unsupported = UNSUPPORTED[endpoint]
    for key, value in body.items():
        if key in IMPLEMENTED[endpoint]:
            continue
        if key in IGNORED:
            if not isinstance(value, IGNORED[key]):
                raise ApiError(400, f"{key}={show(value)}: expected {_TYPE_NAMES[IGNORED[key]]}", key)
        elif key in unsupported:
            if not unsupported[key](value):
                raise ApiError(400, f"{key}={show(value)}: not supported by this server", key)
        else:
            raise ApiError(400, f"Unrecognized request argument supplied: {show(key)[1:-1]}", key)
    return body


def check_text(body) -> None:
    """A 400 naming the place of a string with a lone UTF-16 surrogate (JSON can escape one,
    "\\ud800", but it is no Unicode text: the tokenizer and UTF-8 answers refuse it), or of
    nesting deeper than MAX_DEPTH. Iterative, so any depth json.loads built is safe."""
    stack = [(body, None, 0)]  # (value, its path from the body's top, depth)
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"{path}: nested deeper than {MAX_DEPTH} levels", path)
        if isinstance(value, dict):
            for k, v in value.items():
                _check_string(k, f"a key of {path}" if path is not None else "a top-level key", path)
                stack.append((v, k if path is None else f"{path}.{k}", depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, path or "''", path)


def _check_string(s: str, where: str, param: str | None):
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"{where}: lone UTF-16 surrogate {show(s[exc.start])} at character {exc.start}; "
                                "expected valid Unicode text", param) from None


def _range(lo, hi, lo_open: bool) -> str:
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"


def number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False, lo_open: bool = False):
    """body[name] (default when absent) checked to be a number (an integer) in [lo, hi], or
    (lo, hi] with ``lo_open``."""
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi or (lo_open and v == lo):
        kind = "an integer" if integer else "a number"
        bounds = f"[{lo}, {hi}]" if integer else _range(lo, hi, lo_open)
        raise ApiError(400, f"{name}={show(v)}: expected {kind} in {bounds}", name)
    return v


def boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise ApiError(400, f"{name}={show(v)}: expected true or false", name)
    return v


def logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} -> sorted (id, bias) pairs."""
    v = body.get("logit_bias", {})
    if not isinstance(v, dict):
        raise ApiError(400, f"logit_bias={show(v)}: expected an object of token id -> bias", "logit_bias")
    out = []
    for key, bias in v.items():
        tid = int(key) if key.isdigit() and key.isascii() and len(key) < 12 else -1
        if not 0 <= tid < vocab:
            raise ApiError(400, f"logit_bias: key {show(key)}: expected a token id in [0, {vocab})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias[{key}]={show(bias)}: expected a number in [-100, 100]", "logit_bias")
        out.append((tid, float(bias)))
    return tuple(sorted(out))


def messages(body: dict) -> list[dict]:
    """The chat messages, checked, as {role, content: str, ...} for the chat template:
    ``developer`` becomes ``system`` (as OpenAI maps it); list content must be text parts,
    joined with newlines (as vLLM joins them)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages: expected a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{at}: expected an object {{role, content}}, got {show(m)}", at)
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"{at}.role={show(role)}: expected one of {sorted(ROLES)}", f"{at}.role")
        for key in m:
            if key not in _MESSAGE_KEYS:
                what = "not supported by this server" if key in ("tool_calls", "function_call", "audio") \
                    else "unrecognized"
                raise ApiError(400, f"{at}.{show(key)[1:-1]}: {what}", f"{at}.{key}")
            if key in ("name", "tool_call_id") and not isinstance(m[key], str):
                raise ApiError(400, f"{at}.{key}={show(m[key])}: expected a string", f"{at}.{key}")
        content = m.get("content")
        if isinstance(content, list) and content:
            texts = []
            for j, part in enumerate(content):
                where = f"{at}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"} \
                        or not isinstance(part["text"], str):
                    kind = part.get("type") if isinstance(part, dict) else None
                    hint = f" ({show(kind)} parts are not supported)" if isinstance(kind, str) and kind != "text" \
                        else ""
                    raise ApiError(400, f"{where}: expected {{'type': 'text', 'text': str}}{hint}", where)
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"{at}.content={show(content)}: expected a string or a non-empty list of text "
                                "parts", f"{at}.content")
        out.append({**m, "role": ROLES[role], "content": content})
    return out


# --------------------------------------------------------------------------- logprobs

def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def completion_logprobs(entries, text_of, offset: int = 0) -> dict:
    """Legacy completions ``logprobs`` of ``moe_infer.outputs.Logprob`` entries: top_logprobs maps
    token text -> logprob over the top N and the token itself (up to N + 1, as OpenAI);
    text_offset is where each token's text starts, the lengths of earlier tokens' texts
    added to ``offset``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = text_of(e.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        if e.top is None:
            out["top_logprobs"].append(None)
        else:
            top = {text_of(t): lp for t, lp in e.top}
            top.setdefault(text, e.logprob)
            out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries, text_of) -> list[dict]:
    """Chat ``logprobs.content`` items of ``moe_infer.outputs.Logprob`` entries."""
    def item(t, lp):
        text = text_of(t)
        return {"token": text, "logprob": lp, "bytes": token_bytes(text)}
    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]


# --------------------------------------------------------------------------- requests

@dataclass
class Parsed:
    """A generation request with every field checked (the module docstring's policy)."""

    prompts: list[list[int]]
    texts: list[str]  # each prompt as text, for echo
    params: SamplingParams
    max_tokens: int  # 0 only with echo: score the prompt, generate nothing
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: int | None  # top-N log-probabilities per token; None: none
    echo: bool
    min_tokens: int
    ignore_eos: bool


@dataclass
class Choice:
    """One sequence to generate (choice j of prompt i): plain values, so that it can travel
    to an engine in another process, which makes the scheduler ``Request`` of it."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    min_tokens: int
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None

    def request(self, on_event: Callable[[str, dict], None]) -> Request:
        return Request(self.prompt, self.params, self.max_tokens, on_event, self.stop, min_tokens=self.min_tokens,
                       ignore_eos=self.ignore_eos, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)


class Outbox:
    """Events from the engine thread to the queues of one event loop, handed over in
    batches: the loop is woken once for everything posted since it last ran, not once per
    token of every stream."""

    def __init__(self, loop):
        self.loop, self.items, self.lock, self.armed = loop, [], threading.Lock(), False

    def post(self, queue, item):
        with self.lock:
            self.items.append((queue, item))
            if self.armed:
                return
            self.armed = True
        self.loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self):
        with self.lock:
            items, self.items, self.armed = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class Handler:
    """Turns OpenAI request bodies into checked requests and the choices they generate.
    ``model`` is an ``Engine`` or a ``frontend.ModelInfo``: its ``config``, ``tokenizer``
    and ``encode`` are all it uses."""

    def __init__(self, model: Engine | ModelInfo, cfg: ServerConfig):
        self.engine, self.cfg = model, cfg
        self.model_name = cfg.model_name or model.config.name
        self.chat_template = self._chat_template()
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def _chat_template(self):
        import jinja2

        source = DEFAULT_CHAT_TEMPLATE
        ckpt = self.engine.config.checkpoint
        if ckpt is not None and (Path(ckpt) / "tokenizer_config.json").is_file():
            tc = json.loads((Path(ckpt) / "tokenizer_config.json").read_text())
            if isinstance(tc.get("chat_template"), str):
                source = tc["chat_template"]
        return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(source)

    def _token_text(self, token_id: int) -> str:
        """A token's text in logprobs; "token_id:N" (vLLM's form) when there is no tokenizer."""
        tok = self.engine.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    # ----------------------------------------------------------------- parsing

    def check_model(self, body: dict):
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, f"model={show(model)}: expected a string", "model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {show(model)} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def parse(self, body: dict, chat: bool) -> Parsed:
        """Every field of a request body checked; the first bad one is a 400 naming it."""
        body = check_fields(body, "chat" if chat else "completions")
        self.check_model(body)
        limit, vocab = self.engine.config.max_seq_len, self.engine.config.model.vocab_size
        stream = boolean(body, "stream")
        echo = not chat and boolean(body, "echo")
        least = 0 if echo else 1  # max_tokens 0 scores an echoed prompt only
        max_tokens = number(body, "max_tokens", self.cfg.default_max_tokens, least, limit, integer=True)
        max_tokens = number(body, "max_completion_tokens", max_tokens, least, limit, integer=True)
        n = number(body, "n", 1, 1, 16, integer=True)
        best_of = number(body, "best_of", n, 1, 16, integer=True)
        if best_of not in (1, n):
            raise ApiError(400, f"best_of={best_of}: only best_of equal to n ({n}) or 1 is supported", "best_of")
        params = SamplingParams(
            temperature=float(number(body, "temperature", 1.0, 0, 2)),
            top_k=max(0, number(body, "top_k", 0, -1, vocab, integer=True)),  # -1: off, as vLLM takes it
            top_p=float(number(body, "top_p", 1.0, 0, 1, lo_open=True)),
            seed=number(body, "seed", None, 0, SEED_MAX, integer=True),
            presence_penalty=float(number(body, "presence_penalty", 0.0, -2, 2)),
            frequency_penalty=float(number(body, "frequency_penalty", 0.0, -2, 2)),
            repetition_penalty=float(number(body, "repetition_penalty", 1.0, 0.01, 100)),
            logit_bias=logit_bias(body, vocab))
        min_tokens = number(body, "min_tokens", 0, 0, max_tokens, integer=True)
        most = min(MAX_LOGPROBS, vocab)
        if chat:
            top = number(body, "top_logprobs", None, 0, most, integer=True)
            if top is not None and not boolean(body, "logprobs"):
                raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
            logprobs = (top or 0) if boolean(body, "logprobs") else None
        else:
            logprobs = number(body, "logprobs", None, 0, most, integer=True)
        include_usage = False
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
            if not isinstance(options, dict):
                raise ApiError(400, f"stream_options={show(options)}: expected an object", "stream_options")
            for key, v in options.items():
                if key not in ("include_usage", "include_obfuscation") or not isinstance(v, bool):
                    raise ApiError(400, f"stream_options.{show(key)[1:-1]}={show(v)}: expected include_usage: "
                                        "true or false", f"stream_options.{key}")
            include_usage = options.get("include_usage", False)
        stop = self.stop(body)
        if chat:
            prompts, texts = [self.chat_prompt(body)], [""]
        else:
            prompts, texts = self.prompts(body)
        return Parsed(prompts, texts, params, max_tokens, n, stop, stream, include_usage, logprobs, echo,
                      min_tokens, boolean(body, "ignore_eos"))

    def stop(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, f"stop={show(body.get('stop'))}: expected a non-empty string or a list of up to 4",
                           "stop")
        if stop and self.engine.tokenizer is None:
            raise ApiError(400, "stop: this model has no tokenizer, so text stops cannot be matched", "stop")
        return stop

    def prompts(self, body: dict) -> tuple[list[list[int]], list[str]]:
        """-> the prompts' token ids, and their texts (for echo)."""
        if "prompt" not in body:
            raise ApiError(400, "prompt: required", "prompt")
        p = body["prompt"]
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            p = [p]
        if not isinstance(p, list) or not p or len(p) > 64:
            raise ApiError(400, "prompt: expected a string, a list of token ids, or a list of up to 64 of them",
                           "prompt")
        try:
            ids = self.engine.encode(p)
        except ValueError as exc:
            raise ApiError(400, str(exc).replace("prompts[", "prompt["), "prompt") from None
        tok = self.engine.tokenizer
        return ids, [q if isinstance(q, str) else tok.decode(i) if tok is not None else "" for q, i in zip(p, ids)]

    def chat_prompt(self, body: dict) -> list[int]:
        import jinja2

        msgs = messages(body)
        if self.engine.tokenizer is None:
            raise ApiError(400, "messages: this model has no tokenizer; use /v1/completions with token ids",
                           "messages")
        try:
            text = self.chat_template.render(messages=msgs, add_generation_prompt=True, bos_token="", eos_token="")
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # a template may refuse an order of roles
            raise ApiError(400, f"messages: the chat template refused them ({type(exc).__name__}: {exc})",
                           "messages") from None
        ids = self.engine.tokenizer.encode(text)
        if not ids:
            raise ApiError(400, "messages: the chat template rendered an empty prompt", "messages")
        return ids

    # ----------------------------------------------------------------- generation

    def choices(self, parsed: Parsed) -> list[Choice]:
        """-> the sequences to generate, n per prompt (choice i * n + j: prompt i, seed + j);
        a 400 for a prompt that cannot fit the context with its max_tokens."""
        limit, n = self.engine.config.max_seq_len, parsed.n
        for i, p in enumerate(parsed.prompts):
            if len(p) + parsed.max_tokens > limit:
                raise ApiError(400, f"prompt[{i}]: {len(p)} tokens + max_tokens={parsed.max_tokens} exceed the "
                               f"context length {limit}", "max_tokens" if len(p) < limit else "prompt",
                               "context_length_exceeded")
        seed = parsed.params.seed
        return [Choice(p, dataclasses.replace(parsed.params, seed=None if seed is None else seed + j),
                       parsed.max_tokens, parsed.stop, parsed.min_tokens, parsed.ignore_eos, parsed.logprobs,
                       parsed.logprobs if parsed.echo else None)
                for p in parsed.prompts for j in range(n)]
