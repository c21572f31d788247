"""The OpenAI API's request and response bodies as the server reads and writes them: a request body checked into a
`Job` (bad input: `BadRequest`, one line naming the field, answered with HTTP 400), and the JSON of completions,
chat completions, their streamed chunks and errors.

Fields the server does not act on but clients send by default (user, logprobs: null, penalties of 0, ...) are
accepted; a value that would change the answer and that the server cannot honour (n > 1, logprobs, echo, a
penalty) is refused rather than ignored."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

from specformer_jax.decoding.acceptance.sampling import SamplingConfig

MAX_STOPS = 4
REFUSED_UNLESS_DEFAULT = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None,
                          "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "suffix": None,
                          "tools": None, "tool_choice": None, "functions": None, "response_format": None}


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Job:
    """A checked request: what to decode and how to answer."""

    chat: bool
    prompt: Any  # text, token ids, or (chat) the messages
    max_tokens: int | None  # None: up to the context
    sampling: SamplingConfig
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_job(body: Any, chat: bool, served: str) -> Job:
    """The Job of a /v1/chat/completions (chat) or /v1/completions body; `served`: the model name it must ask."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served:
        raise BadRequest(f"model {model!r} is not served here: this server serves {served!r} (GET /v1/models)",
                         "model")
    for name, default in REFUSED_UNLESS_DEFAULT.items():
        if body.get(name, default) not in (default, None):
            raise BadRequest(f"{name}={body[name]!r} is not supported by this server (only {default!r})", name)
    prompt = _messages(body) if chat else _prompt(body)
    tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
    stream_options = _field(body, "stream_options", dict, "an object", {})
    return Job(chat, prompt,
               None if tokens is None else _int(tokens, "max_tokens", 1),
               _sampling(body), None if body.get("seed") is None else _int(body["seed"], "seed", 0),
               _stops(body.get("stop")), _field(body, "stream", bool, "true or false", False),
               _field(stream_options, "include_usage", bool, "true or false", False))


def _field(body: dict, name: str, kind, what: str, default):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise BadRequest(f"{name} must be {what}, got {value!r:.60}", name)
    return value


def _int(value, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise BadRequest(f"{name} must be an integer >= {least}, got {value!r:.60}", name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise BadRequest(f"{name} must be a number in [{lo}, {hi}], got {value!r:.60}", name)
    return float(value)


def _sampling(body: dict) -> SamplingConfig:
    """OpenAI's defaults: temperature 1, top_p 1; top_k (0: off) as vLLM and llama.cpp take it."""
    top_k = body.get("top_k")
    top_k = 0 if top_k is None or top_k == -1 else _int(top_k, "top_k", 0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("top_p must be above 0, got 0", "top_p")
    return SamplingConfig(_number(body, "temperature", 1.0, 0.0, 2.0), top_k, top_p)


def _stops(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOPS}, got {stop!r:.60}", "stop")
    return tuple(stops)


def _prompt(body: dict):
    """/v1/completions' prompt: a string, or token ids; a list of one of those (one prompt a request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadRequest(f"prompt must be a non-empty string or list of token ids (one prompt a request), got "
                     f"{prompt!r:.60}", "prompt")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages must be a non-empty list, got {messages!r:.60}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}] must be an object with role system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string, got {content!r:.60}", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(job: Job, rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    """The whole answer (stream: false)."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
              if job.chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
    return {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}


def chunk(job: Job, rid: str, model: str, text: str | None, finish: str | None = None, use: dict | None = None,
          first: bool = False) -> dict:
    """One streamed chunk: new text (None: none, as in the usage-only chunk), or the finish reason."""
    if text is None and finish is None:
        choices = []
    elif job.chat:
        delta = {"role": "assistant", "content": text or ""} if first else {} if text is None else {"content": text}
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
    out = {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
