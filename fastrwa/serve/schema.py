"""The request body of ``POST /v1/completions``, checked: :func:`parse_completion` turns the
JSON body into a :class:`Completion` or raises :class:`RequestError` naming the field (the
OpenAI error shape, ``{"error": {"message", "type", "param", "code"}}``).

What OpenAI's completions API takes and this server does not (refused by name, 400):
``echo: true``, ``logprobs``, ``best_of > 1``, ``n > 1``, ``suffix``, non-zero
``presence_penalty``/``frequency_penalty``, a non-empty ``logit_bias``, several prompts in
one request. Any other unknown field is refused too (OpenAI does the same), so a typo such
as ``max_token`` is an error, not a silent default. ``true``/``false`` are not numbers here
(``best_of: true`` is refused, as Python's ``True == 1`` would accept it); ``user`` is any
string (an identifier of the end user: ignored).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

# OpenAI's defaults
DEFAULT_MAX_TOKENS = 16
MAX_STOPS = 4
MAX_STOP_BYTES = 256
MAX_SEED = 2 ** 64 - 1          # torch.Generator.manual_seed's largest
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45

# Fields accepted with their neutral value only (what OpenAI sends by default; a bool is
# never one of these numbers).
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
            "logit_bias": ({},), "suffix": (None, "")}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
          "stream", "stream_options", "n", "echo", "logprobs", "best_of", "user", *_NEUTRAL}


class RequestError(Exception):
    """A request refused: the HTTP ``status``, the ``param`` at fault (``None``: the body as
    a whole) and a message for the client."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        """The JSON body of the answer: ``{"error": {"message", "type", "param", "code"}}``
        (``type`` ``invalid_request_error`` below 500, else ``server_error``)."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass
class Limits:
    """What the server accepts (its command line's ``--max-*`` options)."""

    max_prompt_bytes: int = 16384
    max_tokens_limit: int = 4096


@dataclasses.dataclass
class Completion:
    """One checked completion request. ``prompt``: its bytes (UTF-8 of the text, or the byte
    ids given); ``temperature`` 0 means greedy; ``stop``: byte strings."""

    prompt: bytes
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop: tuple = ()
    seed: Optional[int] = None
    stream: bool = False
    include_usage: bool = False
    model: Optional[str] = None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_neutral(value: object, neutral: tuple) -> bool:
    return not isinstance(value, bool) and value in neutral


def _prompt(value: object, limits: Limits) -> bytes:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]                # ([text] or [[ids]]: one prompt in a list)
    if isinstance(value, str):
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"prompt is not valid Unicode text ({exc.reason} at "
                               f"character {exc.start}): send the bytes as a list of ids "
                               f"0-255 instead", "prompt") from None
    elif isinstance(value, list) and any(isinstance(v, (str, list)) for v in value):
        raise RequestError("prompt: one prompt per request (a string, or a list of byte ids "
                           "0-255); send several prompts as several requests", "prompt")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if not _is_int(v) or not 0 <= v <= 255:
                raise RequestError(f"prompt: token ids are bytes here, each an int in "
                                   f"[0, 255]; got {v!r} at index {i}", "prompt")
        data = bytes(value)
    else:
        raise RequestError(f"prompt must be a string or a list of byte ids 0-255, got "
                           f"{type(value).__name__}", "prompt")
    if len(data) > limits.max_prompt_bytes:
        raise RequestError(f"prompt is {len(data)} bytes, over this server's limit of "
                           f"{limits.max_prompt_bytes} (--max-prompt-bytes)", "prompt",
                           code="prompt_too_long")
    return data


def _stop(value: object) -> tuple:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string, a list of strings or null", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop: at most {MAX_STOPS} sequences, got {len(stops)}", "stop")
    out = []
    for s in stops:
        try:
            data = s.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("stop: not valid Unicode text", "stop") from None
        if not data:
            raise RequestError("stop: an empty sequence would stop before the first byte",
                               "stop")
        if len(data) > MAX_STOP_BYTES:
            raise RequestError(f"stop: each sequence at most {MAX_STOP_BYTES} bytes (UTF-8), "
                               f"got {len(data)}", "stop")
        out.append(data)
    return tuple(dict.fromkeys(out))


def parse_completion(raw: bytes, limits: Limits) -> Completion:
    """The request of body ``raw`` (JSON), checked against ``limits``: a
    :class:`RequestError` names the first field that is wrong."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise RequestError("the body is not valid JSON here: nested too deeply",
                           code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name not in _KNOWN:
            raise RequestError(f"unrecognized request argument supplied: {name}", name)
    for name, neutral in _NEUTRAL.items():
        if name in body and not _is_neutral(body[name], neutral):
            raise RequestError(f"{name} is not supported by this server (only "
                               f"{neutral[0]!r})", name, code="unsupported")
    if body.get("echo") not in (None, False) or _is_int(body.get("echo")):
        raise RequestError("echo is not supported by this server (only false)", "echo",
                           code="unsupported")
    if body.get("logprobs") is not None:
        raise RequestError("logprobs is not supported by this server", "logprobs",
                           code="unsupported")
    if not _is_neutral(body.get("best_of"), (None, 1)):
        raise RequestError("best_of is not supported by this server (only 1)", "best_of",
                           code="unsupported")
    if not _is_neutral(body.get("n"), (None, 1)):
        raise RequestError("n: one completion per request (only 1)", "n", code="unsupported")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError(f"user must be a string, got {type(body['user']).__name__}",
                           "user")
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    req = Completion(prompt=_prompt(body["prompt"], limits))

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    req.model = model
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        if not _is_int(max_tokens) or max_tokens < 0:
            raise RequestError(f"max_tokens must be an integer >= 0, got {max_tokens!r}",
                               "max_tokens")
        if max_tokens > limits.max_tokens_limit:
            raise RequestError(f"max_tokens is {max_tokens}, over this server's limit of "
                               f"{limits.max_tokens_limit} (--max-tokens-limit)", "max_tokens",
                               code="max_tokens_too_large")
        req.max_tokens = max_tokens
    else:
        req.max_tokens = min(DEFAULT_MAX_TOKENS, limits.max_tokens_limit)
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or not 0 <= temperature <= FLOAT32_MAX:
            raise RequestError(f"temperature must be a number >= 0 (0: greedy) and at most "
                               f"{FLOAT32_MAX:.4g}, got {temperature!r}", "temperature")
        req.temperature = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not FLOAT32_TINY <= top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1] (and at least 1.4e-45, the "
                               f"smallest float32; 1: off), got {top_p!r}", "top_p")
        req.top_p = None if top_p == 1 else float(top_p)
    top_k = body.get("top_k")
    if top_k is not None and top_k != -1:          # (-1: off, vLLM's convention)
        if not _is_int(top_k) or top_k < 1:
            raise RequestError(f"top_k must be a positive integer, -1 or null (off), got "
                               f"{top_k!r}", "top_k")
        req.top_k = top_k
    req.stop = _stop(body.get("stop"))
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise RequestError(f"seed must be an integer from 0 to {MAX_SEED} (2**64 - 1), "
                               f"got {seed!r}", "seed")
        req.seed = seed
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    req.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise RequestError('stream_options must be {"include_usage": true|false}',
                               "stream_options")
        if not req.stream:
            raise RequestError("stream_options is only allowed with stream: true",
                               "stream_options")
        req.include_usage = options.get("include_usage", False)
    return req
