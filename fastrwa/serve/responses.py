r"""Every answer the server sends, built here (docs/serve.md, "The API"): the completion, its
streamed chunks and their ``logprobs``, the errors, the models list, the tokenizer's routes
(``/tokenize``, ``/detokenize``, ``/tokenizer_info``), ``/health`` and ``/stats``; and how
they go on the wire (``/metrics``, Prometheus' text, is :mod:`.metrics`'s). :mod:`.schema`
is the other half of the protocol (the request, checked).

A body is a ``dict`` sent as :func:`encode` writes it: compact JSON with ASCII escapes (any
``str``, a lone surrogate too, encodes; clients read the same text). A stream is server-sent
events: one :func:`event` per chunk, then :data:`DONE`. Text is bytes: a completion's bytes
become text through :class:`fastrwa.serve.tokens.Transcript` (UTF-8, incrementally: a
character split across steps comes out whole; bytes that are not UTF-8 become U+FFFD).

Example::

    >>> head = Head("cmpl-7", created=1700000000, model="bytelm")
    >>> completion(head, "hi", "length", usage(prompt_tokens=3, completion_tokens=2))["choices"]
    [{'text': 'hi', 'index': 0, 'logprobs': None, 'finish_reason': 'length'}]
    >>> event(chunk(head, "\u00e9", None))[-79:]
    b'"choices":[{"text":"\\u00e9","index":0,"logprobs":null,"finish_reason":null}]}\n\n'
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional, Sequence

from . import tokens as _tokens

DONE = b"data: [DONE]\n\n"          # a stream's last event
JSON_TYPE = b"application/json"
STREAM_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"),
                  (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


def encode(body: dict) -> bytes:
    """``body`` as the server sends it: compact JSON, ASCII escapes (module doc)."""
    return json.dumps(body, separators=(",", ":")).encode()


def event(body: dict) -> bytes:
    """One server-sent event holding ``body``: ``data: {...}\\n\\n``."""
    return b"data: " + encode(body) + b"\n\n"


# -- completions --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Head:
    """What every body of one completion starts with: its ``id`` (``cmpl-N``), ``created``
    (Unix seconds) and ``model`` (the request's, or the server's name)."""

    id: str
    created: int
    model: str

    def as_dict(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The ``usage`` of a completion (a token is a byte)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(text: str, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
    """The one choice of a completion or a chunk: ``finish`` is ``"stop"``, ``"length"`` or
    ``None`` (a chunk before the last); ``logprobs``: :func:`logprobs`'s object, or
    ``None`` (none asked for)."""
    return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}


def completion(head: Head, text: str, finish: str, usage: dict,
               logprobs: Optional[dict] = None) -> dict:
    """The answer to a request without ``stream``: the whole ``text``, why it ended, its
    :func:`usage` and its ``logprobs`` (:func:`logprobs`, when asked for)."""
    return {**head.as_dict(), "choices": [choice(text, finish, logprobs)], "usage": usage}


def chunk(head: Head, text: str, finish: Optional[str],
          logprobs: Optional[dict] = None) -> dict:
    """One event of a stream: the ``text`` since the last one (``finish`` on the last) and
    its ids' ``logprobs`` (when asked for)."""
    return {**head.as_dict(), "choices": [choice(text, finish, logprobs)]}


class ChunkEvents:
    """One stream's chunk events, the head encoded once: ``events(text, finish)`` is
    ``event(chunk(head, text, finish))`` byte for byte, the text's JSON put between two
    fixed pieces (no dict built, no head encoded again: 0.3 us an event against 4.4 here);
    with ``logprobs``, it is built as :func:`event` of :func:`chunk`.

    Example::

        >>> events = ChunkEvents(Head("cmpl-7", created=1700000000, model="bytelm"))
        >>> events("\u00e9", None) == event(chunk(Head("cmpl-7", 1700000000, "bytelm"),
        ...                                         "\u00e9", None))
        True
    """

    def __init__(self, head: Head):
        self.head = head
        # (chunk()'s keys in order: the head's, then choices, whose first key is the text)
        self._before = b"data: " + encode(head.as_dict())[:-1] + b',"choices":[{"text":'
        self._after = {None: self._tail(None)}

    @staticmethod
    def _tail(finish: Optional[str]) -> bytes:
        return b',"index":0,"logprobs":null,"finish_reason":' + json.dumps(finish).encode() \
            + b"}]}\n\n"

    def __call__(self, text: str, finish: Optional[str],
                 logprobs: Optional[dict] = None) -> bytes:
        """The event of the chunk ``text`` (``finish``, ``logprobs``: :func:`chunk`'s)."""
        if logprobs is not None:
            return event(chunk(self.head, text, finish, logprobs))
        after = self._after.get(finish)
        if after is None:
            after = self._after[finish] = self._tail(finish)
        return self._before + json.dumps(text).encode() + after


def logprobs(ids: Sequence[int], token_logprobs: Sequence[float],
             top_ids: Sequence[Sequence[int]], top_logprobs: Sequence[Sequence[float]],
             offsets: Sequence[int]) -> dict:
    """The ``logprobs`` object of OpenAI's completions for the ids ``ids`` of a text (or a
    chunk of one): per id its text (``tokens``, :func:`fastrwa.serve.tokens.token_text`),
    its log-probability given everything before it (``token_logprobs``: ``None`` where a
    NaN says it has no past, the first id of an echoed prompt), the most likely ids there
    and the id itself with theirs (``top_logprobs``, a ``{text: logprob}`` for each id,
    most likely first, ``None`` with the logprob) and its character's offset in the
    completion's text (``text_offset``).

    Example::

        >>> out = logprobs([256, 104], [math.nan, -0.5], [[-1], [105]], [[math.nan], [-0.25]],
        ...                [0, 5])
        >>> out["tokens"], out["token_logprobs"], out["text_offset"]
        (['<bos>', 'h'], [None, -0.5], [0, 5])
        >>> out["top_logprobs"]
        [None, {'i': -0.25, 'h': -0.5}]
    """
    out: dict = {"tokens": [_tokens.token_text(i) for i in ids], "token_logprobs": [],
                 "top_logprobs": [], "text_offset": list(offsets)}
    for token, lp, alt_ids, alt_lps in zip(ids, token_logprobs, top_ids, top_logprobs):
        if math.isnan(lp):
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {_tokens.token_text(i): float(v) for i, v in zip(alt_ids, alt_lps)}
        top.setdefault(_tokens.token_text(token), float(lp))
        out["token_logprobs"].append(float(lp))
        out["top_logprobs"].append(top)
    return out


def joined_logprobs(parts: Sequence[dict]) -> dict:
    """The :func:`logprobs` objects of a text's pieces, in order, as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [v for part in parts for v in part[key]] for key in keys}


def usage_chunk(head: Head, usage: dict) -> dict:
    """A stream's event after the last text, with ``stream_options.include_usage``: no
    choice, the :func:`usage`."""
    return {**head.as_dict(), "choices": [], "usage": usage}


# -- the tokenizer's routes (vLLM's, as lm-eval's remote tokenizer reads them) ------------

def tokenized(ids: Sequence[int], max_model_len: int, token_strs: bool) -> dict:
    """``POST /tokenize``: the ``tokens`` (ids), their ``count``, the longest prompt this
    server takes (``max_model_len``: its ``--max-prompt-bytes``) and, when asked for, each
    id's text (``token_strs``; else ``None``)."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids),
            "token_strs": [_tokens.token_text(i) for i in ids] if token_strs else None}


def detokenized(text: str) -> dict:
    """``POST /detokenize``: the ids' text, in ``prompt``."""
    return {"prompt": text}


def tokenizer_info(max_model_len: int) -> dict:
    """``GET /tokenizer_info``: the byte tokenizer's settings as the Hugging Face one
    saves them (its class, the special tokens' texts: BOS is also EOS, no padding) and the
    longest prompt this server takes."""
    return {"tokenizer_class": "FastRWAByteTokenizer", "bos_token": _tokens.BOS_TEXT,
            "eos_token": _tokens.BOS_TEXT, "pad_token": None, "unk_token": None,
            "bos_token_id": _tokens.BOS_ID, "eos_token_id": _tokens.BOS_ID,
            "vocab_size": _tokens.BOS_ID + 1, "model_max_length": max_model_len,
            "add_bos_token": False, "chat_template": None}


# -- the other routes ---------------------------------------------------------------------

def models(model: str, created: int) -> dict:
    """``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "fastrwa"}]}


def health(draining: bool, model: str, active: int, queued: int, capacity: int,
           decoder: str) -> tuple[int, dict]:
    """``GET /health``'s status and body: 200 ``ok`` while serving, 503 ``draining`` once
    shutting down; the engine's jobs in rows (``active``), waiting (``queued``), its rows
    (``capacity``) and its ``decoder``."""
    body = {"status": "draining" if draining else "ok", "model": model, "active": active,
            "queued": queued, "capacity": capacity, "decoder": decoder}
    return (503 if draining else 200), body


def stats(active: int, queued: int, capacity: int, counters: dict) -> dict:
    """``GET /stats``: :func:`health`'s numbers and the engine's ``counters``."""
    return {"active": active, "queued": queued, "capacity": capacity, **counters}


# -- errors -------------------------------------------------------------------------------

class RequestError(Exception):
    """A request refused, or failed: the HTTP ``status``, the ``param`` at fault (``None``:
    the body as a whole), a message for the client, OpenAI's ``code`` and extra
    ``headers`` (``Retry-After``, ``Allow``)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        """The JSON body of the answer: ``{"error": {"message", "type", "param", "code"}}``
        (``type`` ``invalid_request_error`` below 500, else ``server_error``), also the
        event a stream that fails ends with."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


def not_found(path: str) -> RequestError:
    """404: no such route."""
    return RequestError(f"no route {path}", status=404, code="not_found")


def wrong_method(path: str, allowed: str, method: str) -> RequestError:
    """405, with ``Allow``."""
    return RequestError(f"{path} takes {allowed}, got {method}", status=405,
                        headers={"allow": allowed})


def body_too_large(limit: int) -> RequestError:
    """413: the body is over ``limit`` bytes."""
    return RequestError(f"the request body is over {limit} bytes", status=413,
                        code="body_too_large")


def shutting_down(retry_after: int, message: str = "the server is shutting down") \
        -> RequestError:
    """503 with ``Retry-After``: the server takes no more requests."""
    return RequestError(message, status=503, code="shutting_down",
                        headers={"retry-after": str(retry_after)})


def busy(reason: str, retry_after: int) -> RequestError:
    """503 with ``Retry-After``: the engine's queue is full (``reason``: the engine's)."""
    return RequestError(f"the server is busy: {reason}; retry later", status=503,
                        code="queue_full", headers={"retry-after": str(retry_after)})


def generation_failed(error: Optional[str]) -> RequestError:
    """500: the request's generation failed (``error``: the engine's reason)."""
    return RequestError(f"generation failed: {error}", status=500, code="generation_failed")


def internal_error() -> RequestError:
    """500: an unexpected error (a defect, logged by the server)."""
    return RequestError("internal server error (logged by the server)", status=500,
                        code="internal_error")
