"""The answers without a server: each body's exact bytes on the wire (compact JSON, ASCII
escapes, OpenAI's key order), the error shape, and a job's bytes reaching a route as whole
characters however the engine splits them (:class:`fastrwa.serve.app.Released`)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastrwa.serve import responses
from fastrwa.serve.app import Released

HEAD = responses.Head("cmpl-3", created=1700000000, model="m\u00e9")
START = b'{"id":"cmpl-3","object":"text_completion","created":1700000000,"model":"m\\u00e9",'


def test_completion_and_chunks_are_openais_bytes():
    usage = responses.usage(prompt_tokens=2, completion_tokens=3)
    assert responses.encode(responses.completion(HEAD, "a\ud800", "stop", usage)) == START + (
        b'"choices":[{"text":"a\\ud800","index":0,"logprobs":null,"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}}')
    assert responses.event(responses.chunk(HEAD, "\u20ac", None)) == b"data: " + START + (
        b'"choices":[{"text":"\\u20ac","index":0,"logprobs":null,"finish_reason":null}]}\n\n')
    assert responses.encode(responses.usage_chunk(HEAD, usage)) == START + (
        b'"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}}')
    assert responses.DONE == b"data: [DONE]\n\n"


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(exclude_categories=())),      # (lone surrogates too)
       finish=st.sampled_from([None, "stop", "length"]),
       model=st.text(min_size=1, max_size=8))
def test_pre_encoded_chunk_events_are_the_chunks_bytes(text, finish, model):
    # (any text: escapes, lone surrogates, non-ASCII; the head's model too)
    head = responses.Head("cmpl-9", created=1700000001, model=model)
    events = responses.ChunkEvents(head)
    assert events(text, finish) == responses.event(responses.chunk(head, text, finish))
    assert events(text, finish) == events(text, finish)        # (the tails kept are right)


def test_pre_encoded_chunk_events_on_the_wire():
    events = responses.ChunkEvents(HEAD)
    assert events("\ud800", None) == responses.event(responses.chunk(HEAD, "\ud800", None))
    assert events("\u20ac\n", "length") == b"data: " + START + (
        b'"choices":[{"text":"\\u20ac\\n","index":0,"logprobs":null,'
        b'"finish_reason":"length"}]}\n\n')
    scored = responses.logprobs([104], [-0.5], [[105]], [[-0.25]], [0])
    assert events("h", None, scored) == responses.event(
        responses.chunk(HEAD, "h", None, scored))


def test_errors_have_openais_shape():
    error = responses.busy("3 requests are waiting", retry_after=2)
    assert (error.status, error.headers) == (503, {"retry-after": "2"})
    assert responses.encode(error.body()) == (
        b'{"error":{"message":"the server is busy: 3 requests are waiting; retry later",'
        b'"type":"server_error","param":null,"code":"queue_full"}}')
    refused = responses.RequestError("top_k must be ...", "top_k")
    assert refused.body() == {"error": {"message": "top_k must be ...", "type":
                                        "invalid_request_error", "param": "top_k",
                                        "code": None}}
    assert responses.wrong_method("/health", "GET", "POST").headers == {"allow": "GET"}
    assert responses.generation_failed("NaN").body()["error"]["type"] == "server_error"


def test_the_other_routes_bodies():
    assert responses.encode(responses.models("m", 5)) == (
        b'{"object":"list","data":[{"id":"m","object":"model","created":5,'
        b'"owned_by":"fastrwa"}]}')
    assert responses.health(False, "m", 1, 2, 4, "fused") == (200, {
        "status": "ok", "model": "m", "active": 1, "queued": 2, "capacity": 4,
        "decoder": "fused"})
    assert responses.health(True, "m", 0, 0, 4, "fused")[0] == 503
    assert list(responses.stats(1, 2, 4, {"steps": 9})) == ["active", "queued", "capacity",
                                                          "steps"]


class FakeJob:
    """What :class:`Released` reads of a job: ``waker``, and ``take()`` handing out the
    scripted ``(bytes, finish)`` pieces one at a time."""

    def __init__(self, pieces: list):
        self.pieces, self._lock = list(pieces), threading.Lock()
        self.waker = asyncio.Event()
        self.waker.set()

    def take(self):
        with self._lock:
            piece = self.pieces.pop(0)
        if self.pieces:
            self.waker.set()
        return piece


@pytest.mark.parametrize("finish", ["length", "stop", "error", "cancelled"])
def test_released_sends_characters_whole_and_ends_at_the_finish(finish):
    euro = "\u20ac".encode()            # (3 bytes, split across three steps)
    pieces = [(b"a" + euro[:1], None), (euro[1:2], None), (b"", None),
              (euro[2:] + b"\xff", None), (b"b\xe2", finish)]

    async def run():
        return [piece async for piece in Released(FakeJob(pieces))]
    got = asyncio.run(run())
    assert got == [("a", None), ("", None), ("", None), ("\u20ac\ufffd", None),
                   ("b\ufffd", finish)]


def test_time_to_first_byte_is_observed_when_the_first_bytes_go_out():
    """/metrics' time to first byte counts a stream as soon as its first bytes reach the
    route, not when it ends (a long stream was missing from it until then)."""
    import time
    import types

    from fastrwa.serve.app import Pieces
    from fastrwa.serve.metrics import Metrics

    job = FakeJob([(b"a", None), (b"b", None), (b"c", "length")])
    job.request = types.SimpleNamespace(echo=False)
    metrics = Metrics()
    pieces = Pieces(job, None, metrics, time.perf_counter())

    async def first():
        return await pieces.__anext__()
    assert asyncio.run(first())[0] == "a"
    assert metrics.first_byte.count == 1          # (the stream has not ended)
