"""The HTTP side: a plain ASGI application (no framework) over the :class:`Engine`. It only
routes: a request is parsed by :mod:`.schema`, submitted to the engine, and answered with
what :mod:`.responses` builds.

Routes: ``POST /v1/completions`` (OpenAI's completions API: docs/serve.md), ``GET
/v1/models``, ``GET /health`` (200 while serving, 503 while shutting down), ``GET /stats``
(the engine's counters and where its time goes), ``GET /metrics`` (Prometheus' text:
:mod:`.metrics`) and the tokenizer's ``POST /tokenize``, ``POST /detokenize`` and ``GET
/tokenizer_info`` (vLLM's, which lm-eval's ``local-completions`` reads: :mod:`.tokens`). A
completion's bytes reach its route as text through :class:`Released` (streamed or not);
:class:`Pieces` puts the echoed prompt before them and their log-probabilities beside them
when asked for (:class:`Scoring`: the engine's notes of each draw's logits, and the model's
own forward of an echoed prompt, :func:`fastrwa.models.scoring.score`, on a thread of its
own). Any error is answered in
OpenAI's shape (an unexpected one: a 500, logged, if the answer has not started).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from ..models import ByteLM
from ..models.scoring import score
from . import responses, tokens
from .batcher import Closed, Engine, Job, QueueFull
from .metrics import CONTENT_TYPE as METRICS_TYPE
from .metrics import Metrics
from .responses import RequestError
from .schema import Completion, Limits, parse_completion, parse_detokenize, parse_tokenize

log = logging.getLogger("fastrwa.serve")

MIN_BODY_BYTES = 1 << 20    # a request body over this (or 8 bytes a prompt byte) is refused: 413
RETRY_AFTER_S = 1


class App:
    """The ASGI application. ``make_engine(notify)`` builds the engine at startup (in the
    server's event loop: ``notify`` hands the engine's updates to it). ``draining``, set by
    the server on a stop signal: new requests are answered 503 and every answer closes its
    connection."""

    def __init__(self, make_engine: Callable[[Callable[[list], None]], Engine],
                 model_name: str, limits: Limits, retry_after: int = RETRY_AFTER_S,
                 model: Optional[ByteLM] = None):
        """``model_name``: the id in answers and ``/v1/models``; ``limits``: what requests
        may ask for; ``retry_after``: the seconds of a 503's ``Retry-After``; ``model``:
        the model the engine decodes, whose forward gives ``logprobs`` (``None``: a
        request with ``logprobs`` is refused)."""
        self.make_engine, self.model_name, self.limits = make_engine, model_name, limits
        self.retry_after, self.model = retry_after, model
        self.metrics = Metrics()
        # (one thread scores every request's bytes, in turn: the forward's memory is one
        # request's at a time, and the engine's thread keeps the other cores)
        self.scoring = ThreadPoolExecutor(1, thread_name_prefix="fastrwa-serve-scoring")
        # (a prompt of byte ids is up to 4 JSON characters a byte; escaped text up to 6)
        self.max_body = max(MIN_BODY_BYTES, 8 * limits.max_prompt_bytes)
        self.engine: Optional[Engine] = None
        self.draining = False
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.started = int(time.time())
        self._woken: set = set()
        self._woken_lock = threading.Lock()
        self._wake_pending = False

    # -- plumbing -------------------------------------------------------------------------
    def start(self) -> None:
        """Build the engine (once), in the running event loop: ASGI lifespan startup, or
        the first request when the server runs without lifespan."""
        self.loop = asyncio.get_running_loop()
        if self.engine is None:
            self.engine = self.make_engine(self._notify)

    def _notify(self, jobs: list) -> None:            # (the engine's thread)
        """Wake the jobs' consumers: one callback in the event loop at a time, however
        many steps run before it does (a fast model's steps would flood the loop)."""
        with self._woken_lock:
            self._woken.update(jobs)
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:        # (the loop has closed: a forced exit, no one to wake)
            pass

    def _wake(self) -> None:                          # (the event loop)
        with self._woken_lock:
            jobs, self._woken = self._woken, set()
            self._wake_pending = False
        for job in jobs:
            if job.waker is not None:
                job.waker.set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        if self.engine is None:         # (run without lifespan: start on the first request)
            self.start()
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.draining:       # (shutting down: the connection ends with the answer)
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"connection", b"close")]}
            await send(message)
        try:
            await self._route(scope, receive, tracked)
        except RequestError as exc:
            if not started:
                await _send_json(tracked, exc.status, exc.body(), exc.headers)
        except OSError:                 # (the client left before its answer: nothing to do)
            pass
        except Exception:               # (a defect: answer 500 if the answer has not started)
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                try:
                    await _send_json(tracked, 500, responses.internal_error().body())
                except OSError:
                    pass

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.draining = True
                if self.engine is not None:
                    await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
                self.scoring.shutdown(wait=False)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        routes = {"/v1/completions": ("POST", self._completions),
                  "/health": ("GET", self._health), "/v1/models": ("GET", self._models),
                  "/stats": ("GET", self._stats), "/metrics": ("GET", self._metrics),
                  "/tokenize": ("POST", self._tokenize),
                  "/detokenize": ("POST", self._detokenize),
                  "/tokenizer_info": ("GET", self._tokenizer_info)}
        if path not in routes:
            raise responses.not_found(path)
        allowed, handler = routes[path]
        if method != allowed and not (allowed == "GET" and method == "HEAD"):
            raise responses.wrong_method(path, allowed, method)
        await handler(scope, receive, send)

    # -- the small routes -----------------------------------------------------------------
    async def _health(self, scope, receive, send) -> None:
        e = self.engine
        status, body = responses.health(self.draining, self.model_name, e.active, e.queued,
                                        e.capacity, e.rows.kind)
        await _send_json(send, status, body)

    async def _models(self, scope, receive, send) -> None:
        await _send_json(send, 200, responses.models(self.model_name, self.started))

    async def _stats(self, scope, receive, send) -> None:
        e = self.engine
        await _send_json(send, 200, responses.stats(e.active, e.queued, e.capacity,
                                                    e.stats.as_dict()))

    async def _metrics(self, scope, receive, send) -> None:
        e = self.engine
        data = self.metrics.render(e.queued, e.active, e.capacity,
                                   getattr(e.rows, "prefix_cache", None)).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", METRICS_TYPE), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    # -- the tokenizer --------------------------------------------------------------------
    async def _tokenize(self, scope, receive, send) -> None:
        request = parse_tokenize(await _read_body(receive, self.max_body))
        ids = tokens.encode(request.text, request.add_special_tokens)
        await _send_json(send, 200, responses.tokenized(ids, self.limits.max_prompt_bytes,
                                                        request.return_token_strs))

    async def _detokenize(self, scope, receive, send) -> None:
        ids = parse_detokenize(await _read_body(receive, self.max_body))
        await _send_json(send, 200, responses.detokenized(tokens.decode(ids)))

    async def _tokenizer_info(self, scope, receive, send) -> None:
        await _send_json(send, 200, responses.tokenizer_info(self.limits.max_prompt_bytes))

    # -- completions ----------------------------------------------------------------------
    async def _completions(self, scope, receive, send) -> None:
        arrived = time.perf_counter()
        try:
            request = parse_completion(await _read_body(receive, self.max_body), self.limits)
            if request.logprobs is not None and self.model is None:
                raise RequestError("logprobs: this server has no model to score with",
                                   "logprobs", code="unsupported")
            job = self._submit(request)
        except RequestError:
            self.metrics.finished("refused")
            raise
        self.metrics.prompt_tokens += len(request.prompt)
        scoring = None if request.logprobs is None else Scoring(
            self.model, request.logprobs, self.scoring)
        released = Pieces(job, scoring, self.metrics, arrived)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, job))
        try:
            if request.stream:
                await self._stream(released, send)
            else:
                await self._complete(released, send)
        except OSError:                 # (the client went away while we wrote)
            job.cancel()
        finally:
            watcher.cancel()
            if job.finish is None:
                job.cancel()
            self.metrics.finished(released.finish if released.finish in (
                "stop", "length", "error") else "cancelled")

    def _submit(self, request: Completion) -> Job:
        """``request``'s job in the engine, its ``waker`` set up for :class:`Released`
        (503 when shutting down or the queue is full)."""
        if self.draining or self.engine.closing:
            raise responses.shutting_down(self.retry_after)
        try:
            job = self.engine.submit(request)
        except QueueFull as exc:
            raise responses.busy(str(exc), self.retry_after) from None
        except Closed as exc:
            raise responses.shutting_down(self.retry_after, str(exc)) from None
        job.waker = asyncio.Event()
        if job.done.is_set():
            job.waker.set()
        return job

    def _head(self, job: Job) -> responses.Head:
        return responses.Head(f"cmpl-{job.number}", int(time.time()),
                              job.request.model or self.model_name)

    @staticmethod
    def _usage(job: Job) -> dict:
        return responses.usage(len(job.request.prompt), len(job.generated))

    async def _complete(self, released: Pieces, send) -> None:
        job, parts, scored, finish = released.job, [], [], None
        async for text, finish, logprobs in released:
            parts.append(text)
            if logprobs is not None:
                scored.append(logprobs)
        if finish == "cancelled":
            return
        if finish == "error":
            raise responses.generation_failed(job.error)
        logprobs = responses.joined_logprobs(scored) if scored else None
        await _send_json(send, 200, responses.completion(self._head(job), "".join(parts),
                                                         finish, self._usage(job), logprobs))

    async def _stream(self, released: Pieces, send) -> None:
        job = released.job
        await send({"type": "http.response.start", "status": 200,
                    "headers": list(responses.STREAM_HEADERS)})
        head = self._head(job)
        events = responses.ChunkEvents(head)
        async for text, finish, logprobs in released:
            if finish == "cancelled":
                return
            if finish == "error":
                if text:            # (what was released before the error: sent first)
                    await _send_body(send, events(text, None, logprobs))
                await _send_event(send, responses.generation_failed(job.error).body())
            elif text or finish is not None or (logprobs and logprobs["tokens"]):
                await _send_body(send, events(text, finish, logprobs))
                if finish is not None and job.request.include_usage:
                    await _send_event(send, responses.usage_chunk(head, self._usage(job)))
        await send({"type": "http.response.body", "body": responses.DONE, "more_body": False})


class Released:
    """A job's text as the engine releases it, for ``async for text, finish in
    Released(job)``: each time the job's ``waker`` is set, the bytes released since (decoded
    by ``transcript``, a :class:`fastrwa.serve.tokens.Transcript`: a fresh one by default)
    and ``finish``, ``None`` until the last (``"stop"``, ``"length"``, ``"cancelled"`` or
    ``"error"``), after which it ends. After each piece, ``data`` holds its bytes and, with
    ``offsets``, ``text_offset`` their characters' offsets in the text."""

    def __init__(self, job: Job, transcript: Optional[tokens.Transcript] = None,
                 offsets: bool = False):
        self.job, self.finish, self.offsets = job, None, offsets
        self.transcript = transcript or tokens.Transcript()
        self.data, self.text_offset = b"", []

    def __aiter__(self) -> Released:
        return self

    async def __anext__(self) -> tuple[str, Optional[str]]:
        if self.finish is not None:
            raise StopAsyncIteration
        job = self.job
        await job.waker.wait()
        job.waker.clear()
        self.data, self.finish = job.take()
        text, self.text_offset = self.transcript.add(self.data, self.finish is not None,
                                                     self.offsets)
        return text, self.finish


class Pieces:
    """What a completion's route sends, for ``async for text, finish, logprobs in
    Pieces(job, scoring, metrics, arrived)``: first, with ``echo``, the prompt's text; then
    :class:`Released`'s pieces (decoded with the prompt's when echoed); ``logprobs``: each
    piece's :func:`fastrwa.serve.responses.logprobs` from ``scoring`` (``None`` without
    it). The generated bytes' counts and times go to ``metrics`` (``arrived``: the
    request's ``time.perf_counter()`` on arrival: its time to the first generated bytes
    is observed when they go out)."""

    def __init__(self, job: Job, scoring: Optional[Scoring], metrics: Metrics,
                 arrived: float):
        self.job, self.scoring, self.metrics, self.arrived = job, scoring, metrics, arrived
        self.released = Released(job, offsets=scoring is not None)
        self.echo = job.request.echo            # (the prompt is still to be given out)
        self.taken = 0                          # (generated bytes given out so far)
        self._last: Optional[float] = None      # (when bytes were last released)

    @property
    def finish(self) -> Optional[str]:
        return self.released.finish

    def __aiter__(self) -> Pieces:
        return self

    async def __anext__(self) -> tuple[str, Optional[str], Optional[dict]]:
        want = self.scoring is not None
        if self.echo:
            self.echo = False
            ids = list(self.job.request.prompt)
            text, offsets = self.released.transcript.add(ids, offsets=want)
            return text, None, (await self.scoring.prompt(ids, offsets) if want else None)
        text, finish = await self.released.__anext__()
        data = self.released.data
        self._count(len(data))
        logprobs = None
        if want:            # (the engine noted a byte's scores before releasing it)
            scores = self.job.scores[self.taken:self.taken + len(data)]
            logprobs = self.scoring.generated(data, scores, self.released.text_offset)
        self.taken += len(data)
        return text, finish, logprobs

    def _count(self, n: int) -> None:
        if not n:
            return
        now = time.perf_counter()
        if self._last is None:
            self.metrics.first_byte_seen(now - self.arrived)
        self.metrics.observe_bytes(n, None if self._last is None else now - self._last)
        self._last = now


class Scoring:
    """One request's ``logprobs`` (``top`` alternatives a position): the echoed prompt's
    from ``model``'s forward (:func:`fastrwa.models.scoring.score`, run by ``pool``; its
    first id has no past), the generated bytes' from what the engine noted as it drew them
    (``Job.scores``: the logits each draw read, :func:`fastrwa.models.scoring.scores_of`)."""

    def __init__(self, model: ByteLM, top: int, pool: ThreadPoolExecutor):
        self.model, self.top, self.pool = model, top, pool

    async def prompt(self, ids: Sequence[int], offsets: Sequence[int]) -> dict:
        """The echoed prompt's ``ids`` (``offsets``: their characters')."""
        loop = asyncio.get_running_loop()
        s = await loop.run_in_executor(self.pool, score, self.model, ids, self.top)
        return responses.logprobs(ids, s.logprobs.tolist(), s.top_ids.tolist(),
                                  s.top_logprobs.tolist(), offsets)

    @staticmethod
    def generated(ids: Sequence[int], scores: Sequence[tuple],
                  offsets: Sequence[int]) -> dict:
        """Generated ``ids`` with the engine's ``scores`` of them (``(logprob, top ids, top
        logprobs)`` each) and ``offsets``."""
        return responses.logprobs(ids, [s[0] for s in scores], [s[1] for s in scores],
                                  [s[2] for s in scores], offsets)


async def _watch_disconnect(receive, job: Job) -> None:
    """Cancel ``job`` when the client disconnects (the body is read already: the next
    message is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            if job.waker is not None:
                job.waker.set()
            return


async def _read_body(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise OSError("the client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise responses.body_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send, status: int, body: dict, headers: Optional[dict] = None) -> None:
    data = responses.encode(body)
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", responses.JSON_TYPE), (b"content-length", str(len(data)).encode()),
        *extra]})
    await send({"type": "http.response.body", "body": data})


async def _send_event(send, body: dict) -> None:
    await _send_body(send, responses.event(body))


async def _send_body(send, data: bytes) -> None:
    """One more piece of a streamed answer (``data``: an event)."""
    await send({"type": "http.response.body", "body": data, "more_body": True})
