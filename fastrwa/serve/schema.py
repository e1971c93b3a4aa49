"""The request body of ``POST /v1/completions``, checked: :func:`parse_completion` turns the
JSON body into a :class:`Completion` or raises :class:`RequestError` naming the field (the
OpenAI error shape, ``{"error": {"message", "type", "param", "code"}}``). This is half of the
server's protocol; :mod:`.responses` builds every answer.

A prompt is text (its UTF-8 bytes) or token ids: the bytes 0-255 and the BOS id 256
(:attr:`fastrwa.models.LMConfig.bos_token`, anywhere: lm-eval starts its windows with it).
``logprobs: k`` (0 to :data:`MAX_LOGPROBS`) asks for each byte's log-probability and the
``k`` most likely bytes at each position; ``echo: true`` returns the prompt before the
completion (with its log-probabilities when ``logprobs`` is given), ``max_tokens`` 0 too.

``max_tokens``, ``temperature``, ``top_p`` and ``top_k`` are checked by
:mod:`fastrwa.models.sampling`'s checks of ``generate``'s arguments, so the server takes what
``ByteLM.generate`` takes (the messages say it as JSON does), and besides: ``temperature`` 0
(greedy), ``top_k`` -1 (off, as vLLM), ``max_tokens`` 0, and its own limits.

What OpenAI's completions API takes and this server does not (refused by name, 400):
``best_of > 1``, ``n > 1``, ``suffix``, non-zero ``presence_penalty``/``frequency_penalty``,
a non-empty ``logit_bias``, several prompts in one request. Any other unknown field is
refused too (OpenAI does the same), so a typo such as ``max_token`` is an error, not a silent
default. ``null`` is every field's default (``prompt`` excepted); ``true``/``false`` are not
numbers and numbers are not booleans (``best_of: true``, ``logprobs: true`` and ``echo: 0``
are refused, as Python's ``True == 1`` would accept them); ``user`` is any string (an
identifier of the end user: ignored).

Whatever JSON can carry is answered with a 400 naming the field: a string that is not valid
Unicode (a lone surrogate such as ``"\\ud800"``, which has no UTF-8 and could not be echoed
back), an integer of any length (one longer than ``MAX_INT_DIGITS`` digits is out of range
for every field and is not converted: Python refuses to convert more than 4,300), a number
beyond float64 (``1e400``), nesting of any depth. ``NaN`` and ``Infinity``, which are not
JSON, make the body invalid JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable, Optional, Union

from ..models.sampling import FLOAT32_MAX, check_sampling_args, check_temperature, check_top_p
from .responses import RequestError     # (the error answer: .responses builds every answer)
from .tokens import BOS_ID

# OpenAI's defaults
DEFAULT_MAX_TOKENS = 16
MAX_STOPS = 4
MAX_STOP_BYTES = 256
MAX_SEED = 2 ** 64 - 1          # torch.Generator.manual_seed's largest
MAX_LOGPROBS = 20               # the most alternatives per position (vLLM's default limit)
MAX_INT_DIGITS = 100            # a longer JSON integer is out of range for every field
SHOWN_CHARS = 40                # a value is shown in a message up to this many characters

# Fields accepted with their neutral value (or null) only: what OpenAI sends by default (a
# bool is never one of these numbers).
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": ""}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
          "stream", "stream_options", "n", "echo", "logprobs", "best_of", "user", *_NEUTRAL}


@dataclasses.dataclass
class Limits:
    """What the server accepts (its command line's ``--max-*`` options)."""

    max_prompt_bytes: int = 16384
    max_tokens_limit: int = 4096


@dataclasses.dataclass
class Completion:
    """One checked completion request. ``prompt``: its ids, as ``bytes`` (UTF-8 of the
    text, or the byte ids given) or, when the ids hold BOS (256), a ``tuple`` of ints;
    ``temperature`` 0 means greedy; ``stop``: byte strings; ``logprobs``: ``None`` (none
    asked for) or how many alternatives per position; ``echo``: the prompt comes back
    before the completion."""

    prompt: Union[bytes, tuple]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop: tuple = ()
    seed: Optional[int] = None
    stream: bool = False
    include_usage: bool = False
    model: Optional[str] = None
    logprobs: Optional[int] = None
    echo: bool = False


class _OutOfRange:
    """A JSON number beyond every field's range (``what``: it, shortened), parsed as this
    rather than as a Python number."""

    def __init__(self, what: str):
        self.what = what


def _parse_int(text: str) -> object:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return _OutOfRange(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _parse_float(text: str) -> object:
    value = float(text)
    if math.isinf(value):
        return _OutOfRange(f"{_shorten(text)} (beyond float64's range)")
    return value


def _not_json(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _shorten(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _got(value: object) -> str:
    """``value`` as a message shows it: JSON's spelling, short (a list or object by kind)."""
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, _OutOfRange):
        return value.what
    # (ASCII escapes: a lone surrogate shows as \ud800 rather than failing to encode)
    return _shorten(json.dumps(value))


def _check_json(body: dict) -> None:
    """Raise a :class:`RequestError` naming the first field of ``body`` that holds a string
    that is not valid Unicode (a key too) or a number out of every range, at any depth."""
    for name in body:
        _unicode(name, None, "a field's name")
    for name, value in body.items():
        stack = [value]
        while stack:                    # (iterative: nesting of any depth)
            value = stack.pop()
            if isinstance(value, str):
                _unicode(value, name, name)
            elif isinstance(value, _OutOfRange):
                raise RequestError(f"{name}: {value.what} is out of range", name)
            elif isinstance(value, list):
                stack.extend(value)
            elif isinstance(value, dict):
                for key in value:
                    _unicode(key, name, f"{name}: a key")
                stack.extend(value.values())


def _unicode(text: str, param: Optional[str], what: str) -> None:
    """Refuse ``text`` if it has no UTF-8 (a lone surrogate, from a ``\\uD800`` escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        hint = (": send the bytes as a list of ids 0-255 instead" if param == "prompt"
                else "")
        raise RequestError(f"{what} is not valid Unicode text ({exc.reason} "
                           f"{ascii(text[exc.start])} at character {exc.start} of "
                           f"{ascii(_shorten(text))}){hint}", param) from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bool(value: object, name: str, param: Optional[str] = None) -> bool:
    """A boolean field's value: a JSON boolean, or null for false (the default)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    raise RequestError(f"{name} must be true, false or null, got {_got(value)}", param or name)


def _prompt(value: object, limits: Limits) -> Union[bytes, tuple]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]                # ([text] or [[ids]]: one prompt in a list)
    if isinstance(value, str):
        data = value.encode("utf-8")        # (valid Unicode: _check_json)
    elif isinstance(value, list) and any(isinstance(v, (str, list)) for v in value):
        raise RequestError("prompt: one prompt per request (a string, or a list of token "
                           "ids); send several prompts as several requests", "prompt")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if not _is_int(v) or not 0 <= v <= BOS_ID:
                raise RequestError(f"prompt: token ids are bytes here, each an int in "
                                   f"[0, 255], or the BOS id {BOS_ID}; got {_got(v)} at "
                                   f"index {i}", "prompt")
        data = tuple(value) if BOS_ID in value else bytes(value)
    else:
        raise RequestError(f"prompt must be a string or a list of token ids (bytes 0-255, "
                           f"BOS {BOS_ID}), got {_got(value)}", "prompt")
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
        data = s.encode("utf-8")            # (valid Unicode: _check_json)
        if not data:
            raise RequestError("stop: an empty sequence would stop before the first byte",
                               "stop")
        if len(data) > MAX_STOP_BYTES:
            raise RequestError(f"stop: each sequence at most {MAX_STOP_BYTES} bytes (UTF-8), "
                               f"got {len(data)}", "stop")
        out.append(data)
    return tuple(dict.fromkeys(out))


def _check_max_tokens(max_tokens: object) -> None:
    check_sampling_args(max_tokens, 1.0, None, None)   # (generate's, the others neutral)


def _check_top_k(top_k: object) -> None:
    check_sampling_args(0, 1.0, top_k, None)           # (generate's, the others neutral)


def _sampling(body: dict, name: str, check: Callable[[object], None], wanted: str) -> object:
    """``body[name]`` (``None`` if absent or null) once ``check``, one of
    :mod:`fastrwa.models.sampling`'s checks of ``generate``'s arguments, takes it (the
    server accepts what ``generate`` does); else a :class:`RequestError` naming the field:
    ``wanted``, then the value as JSON spells it."""
    value = body.get(name)
    if value is not None:
        try:
            check(value)
        except ValueError:
            raise RequestError(f"{wanted}, got {_got(value)}", name) from None
    return value


def parse_completion(raw: bytes, limits: Limits) -> Completion:
    """The request of body ``raw`` (JSON), checked against ``limits``: a
    :class:`RequestError` names the first field that is wrong.

    Example::

        >>> req = parse_completion(b'{"prompt": "hi", "temperature": 0, "stop": "."}', Limits())
        >>> req.prompt, req.max_tokens, req.temperature, req.stop
        (b'hi', 16, 0.0, (b'.',))
    """
    body = _json_object(raw)
    _refuse_unsupported(body)
    for name in ("user", "model"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise RequestError(f"{name} must be a string, got {_got(body[name])}", name)
    if body.get("prompt") is None:
        raise RequestError("prompt is required", "prompt")
    req = Completion(prompt=_prompt(body["prompt"], limits), model=body.get("model"),
                     max_tokens=_max_tokens(body, limits))
    temperature = body.get("temperature")
    if not (_is_number(temperature) and temperature == 0):             # (0: greedy)
        temperature = _sampling(body, "temperature", check_temperature,
                                f"temperature must be a number >= 0 (0: greedy) and at most "
                                f"{FLOAT32_MAX:.4g}")
    if temperature is not None:
        req.temperature = float(temperature)
    top_p = _sampling(body, "top_p", check_top_p, "top_p must be a number in (0, 1] (and at "
                      "least 1.4e-45, the smallest float32; 1: off)")
    if top_p is not None:
        req.top_p = None if top_p == 1 else float(top_p)
    top_k = body.get("top_k")
    if not (_is_int(top_k) and top_k == -1):                            # (-1: off, vLLM's)
        req.top_k = _sampling(body, "top_k", _check_top_k,
                              "top_k must be a positive integer, -1 or null (off)")
    req.stop = _stop(body.get("stop"))
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise RequestError(f"seed must be an integer from 0 to {MAX_SEED} (2**64 - 1), "
                               f"got {_got(seed)}", "seed")
        req.seed = seed
    req.stream = _bool(body.get("stream"), "stream")
    req.echo = _bool(body.get("echo"), "echo")
    req.logprobs = _logprobs(body.get("logprobs"))
    req.include_usage = _include_usage(body.get("stream_options"), req.stream)
    return req


def _json_object(raw: bytes) -> dict:
    """``raw`` parsed: a JSON object whose strings are all Unicode and whose numbers are in
    range (:func:`_check_json`), else a :class:`RequestError`."""
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_not_json)
    except RecursionError:
        raise RequestError("the body is not valid JSON here: nested too deeply",
                           code="invalid_json") from None
    except ValueError as exc:           # (JSONDecodeError, UnicodeDecodeError, NaN)
        raise RequestError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {_got(body)}")
    _check_json(body)
    return body


def _refuse_unsupported(body: dict) -> None:
    """Refuse a field this server does not know, or one it does not support with a value
    other than its neutral one (module doc)."""
    for name in body:
        if name not in _KNOWN:
            raise RequestError(f"unrecognized request argument supplied: {_shorten(name)}",
                               name)
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value != neutral):
            raise RequestError(f"{name} is not supported by this server (only "
                               f"{json.dumps(neutral)} or null), got {_got(value)}", name,
                               code="unsupported")
    for name, what in (("best_of", "best_of is not supported by this server"),
                       ("n", "n: one completion per request")):
        value = body.get(name)
        if value is not None and not (_is_int(value) and value == 1):
            raise RequestError(f"{what} (only 1), got {_got(value)}", name,
                               code="unsupported")


def _max_tokens(body: dict, limits: Limits) -> int:
    max_tokens = _sampling(body, "max_tokens", _check_max_tokens,
                           "max_tokens must be an integer >= 0")
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, limits.max_tokens_limit)
    if max_tokens > limits.max_tokens_limit:
        raise RequestError(f"max_tokens is {max_tokens}, over this server's limit of "
                           f"{limits.max_tokens_limit} (--max-tokens-limit)", "max_tokens",
                           code="max_tokens_too_large")
    return max_tokens


def _logprobs(value: object) -> Optional[int]:
    """``logprobs``: ``None`` (null: none), or how many alternatives per position."""
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise RequestError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (the most "
                           f"likely bytes given at each position) or null, got {_got(value)}",
                           "logprobs")
    return value


def _include_usage(options: object, stream: bool) -> bool:
    """``stream_options.include_usage``: false when ``options`` is null."""
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError('stream_options must be {"include_usage": true|false}',
                           "stream_options")
    if not stream:
        raise RequestError("stream_options is only allowed with stream: true",
                           "stream_options")
    return _bool(options.get("include_usage"), "stream_options.include_usage",
                 "stream_options")


# -- the tokenizer's routes (vLLM's request bodies, as lm-eval's remote tokenizer sends them)

@dataclasses.dataclass
class Tokenize:
    """A checked ``POST /tokenize``: the ``text`` (``prompt``), whether the special tokens
    are added (``add_special_tokens``, default true: an empty text is BOS) and whether each
    id's text comes back too (``return_token_strs``)."""

    text: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


def parse_tokenize(raw: bytes) -> Tokenize:
    """The body ``raw`` of ``POST /tokenize``, checked (a :class:`RequestError` names the
    field that is wrong).

    Example::

        >>> parse_tokenize(b'{"prompt": "hi", "add_special_tokens": false}')
        Tokenize(text='hi', add_special_tokens=False, return_token_strs=False)
    """
    body = _json_object(raw)
    _only(body, ("model", "prompt", "add_special_tokens", "return_token_strs"))
    if not isinstance(body.get("prompt"), str):
        raise RequestError(f"prompt must be a string, got {_got(body.get('prompt'))}",
                           "prompt")
    special = body.get("add_special_tokens")
    return Tokenize(body["prompt"], True if special is None else _bool(special,
                                                                       "add_special_tokens"),
                    _bool(body.get("return_token_strs"), "return_token_strs"))


def parse_detokenize(raw: bytes) -> list[int]:
    """The ids (``tokens``: bytes 0-255 and BOS 256) of a ``POST /detokenize`` body
    ``raw``, checked.

    Example::

        >>> parse_detokenize(b'{"tokens": [256, 104, 105]}')
        [256, 104, 105]
    """
    body = _json_object(raw)
    _only(body, ("model", "tokens"))
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise RequestError(f"tokens must be a list of token ids, got {_got(ids)}", "tokens")
    for i, v in enumerate(ids):
        if not _is_int(v) or not 0 <= v <= BOS_ID:
            raise RequestError(f"tokens: each id is an int in [0, 255] (a byte), or the BOS "
                               f"id {BOS_ID}; got {_got(v)} at index {i}", "tokens")
    return ids


def _only(body: dict, known: tuple) -> None:
    """Refuse a field of ``body`` not in ``known``; ``model`` is a string if given."""
    for name in body:
        if name not in known:
            raise RequestError(f"unrecognized request argument supplied: {_shorten(name)}",
                               name)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError(f"model must be a string, got {_got(body['model'])}", "model")
