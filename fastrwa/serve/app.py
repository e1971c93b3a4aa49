"""The HTTP side: a plain ASGI application (no framework) over the :class:`Engine`. It only
routes: a request is parsed by :mod:`.schema`, submitted to the engine, and answered with
what :mod:`.responses` builds.

Routes: ``POST /v1/completions`` (OpenAI's completions API: docs/serve.md), ``GET
/v1/models``, ``GET /health`` (200 while serving, 503 while shutting down) and ``GET
/stats`` (the engine's counters and where its time goes). A completion's bytes reach its
route as text through :class:`Released` (streamed or not). Any error is answered in
OpenAI's shape (an unexpected one: a 500, logged, if the answer has not started).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Optional

from . import responses
from .batcher import Closed, Engine, Job, QueueFull
from .responses import RequestError
from .schema import Completion, Limits, parse_completion

log = logging.getLogger("fastrwa.serve")

MIN_BODY_BYTES = 1 << 20    # a request body over this (or 8 bytes a prompt byte) is refused: 413
RETRY_AFTER_S = 1


class App:
    """The ASGI application. ``make_engine(notify)`` builds the engine at startup (in the
    server's event loop: ``notify`` hands the engine's updates to it). ``draining``, set by
    the server on a stop signal: new requests are answered 503 and every answer closes its
    connection."""

    def __init__(self, make_engine: Callable[[Callable[[list], None]], Engine],
                 model_name: str, limits: Limits, retry_after: int = RETRY_AFTER_S):
        """``model_name``: the id in answers and ``/v1/models``; ``limits``: what requests
        may ask for; ``retry_after``: the seconds of a 503's ``Retry-After``."""
        self.make_engine, self.model_name, self.limits = make_engine, model_name, limits
        self.retry_after = retry_after
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
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        routes = {"/v1/completions": ("POST", self._completions),
                  "/health": ("GET", self._health), "/v1/models": ("GET", self._models),
                  "/stats": ("GET", self._stats)}
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

    # -- completions ----------------------------------------------------------------------
    async def _completions(self, scope, receive, send) -> None:
        request = parse_completion(await _read_body(receive, self.max_body), self.limits)
        job = self._submit(request)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, job))
        try:
            if request.stream:
                await self._stream(job, send)
            else:
                await self._complete(job, send)
        except OSError:                 # (the client went away while we wrote)
            job.cancel()
        finally:
            watcher.cancel()
            if job.finish is None:
                job.cancel()

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

    async def _complete(self, job: Job, send) -> None:
        parts, finish = [], None
        async for text, finish in Released(job):
            parts.append(text)
        if finish == "cancelled":
            return
        if finish == "error":
            raise responses.generation_failed(job.error)
        await _send_json(send, 200, responses.completion(self._head(job), "".join(parts),
                                                         finish, self._usage(job)))

    async def _stream(self, job: Job, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": list(responses.STREAM_HEADERS)})
        head = self._head(job)
        async for text, finish in Released(job):
            if finish == "cancelled":
                return
            if finish == "error":
                if text:            # (what was released before the error: sent first)
                    await _send_event(send, responses.chunk(head, text, None))
                await _send_event(send, responses.generation_failed(job.error).body())
            elif text or finish is not None:
                await _send_event(send, responses.chunk(head, text, finish))
                if finish is not None and job.request.include_usage:
                    await _send_event(send, responses.usage_chunk(head, self._usage(job)))
        await send({"type": "http.response.body", "body": responses.DONE, "more_body": False})


class Released:
    """A job's text as the engine releases it, for ``async for text, finish in
    Released(job)``: each time the job's ``waker`` is set, the bytes released since (decoded
    by :func:`fastrwa.serve.responses.text_decoder`) and ``finish``, ``None`` until the last
    (``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``), after which it ends."""

    def __init__(self, job: Job):
        self.job, self.finish = job, None
        self.decoder = responses.text_decoder()

    def __aiter__(self) -> Released:
        return self

    async def __anext__(self) -> tuple[str, Optional[str]]:
        if self.finish is not None:
            raise StopAsyncIteration
        job = self.job
        await job.waker.wait()
        job.waker.clear()
        data, self.finish = job.take()
        return self.decoder.decode(data, final=self.finish is not None), self.finish


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


async def _send_event(send, chunk: dict) -> None:
    await send({"type": "http.response.body", "body": responses.event(chunk),
                "more_body": True})
