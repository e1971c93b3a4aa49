"""The HTTP side: a plain ASGI application (no framework) over the :class:`Engine`.

Routes: ``POST /v1/completions`` (OpenAI's completions API: docs/serve.md), ``GET
/v1/models``, ``GET /health`` (200 while serving, 503 while shutting down) and ``GET
/stats`` (the engine's counters and where its time goes). Text is bytes: the prompt is
encoded as UTF-8, the completion's bytes are decoded as UTF-8 incrementally (a character
split across steps is sent whole; bytes that are not UTF-8 become U+FFFD). Any error is
answered in OpenAI's shape (an unexpected one: a 500, logged, if the answer has not started).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import threading
import time
from typing import Callable, Optional

from .batcher import Closed, Engine, Job, QueueFull
from .schema import Limits, RequestError, parse_completion

log = logging.getLogger("fastrwa.serve")

MIN_BODY_BYTES = 1 << 20    # a request body over this (or 8 bytes a prompt byte) is refused: 413
RETRY_AFTER_S = 1


def _json(data: dict) -> bytes:
    # (ASCII escapes: any str, a lone surrogate too, encodes; clients read the same text)
    return json.dumps(data, separators=(",", ":")).encode()


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
                error = RequestError("internal server error (logged by the server)",
                                     status=500, code="internal_error")
                try:
                    await _send_json(tracked, 500, error.body())
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
            raise RequestError(f"no route {path}", status=404, code="not_found")
        allowed, handler = routes[path]
        if method != allowed and not (allowed == "GET" and method == "HEAD"):
            raise RequestError(f"{path} takes {allowed}, got {method}", status=405,
                               headers={"allow": allowed})
        await handler(scope, receive, send)

    # -- the small routes -----------------------------------------------------------------
    async def _health(self, scope, receive, send) -> None:
        e = self.engine
        status = "draining" if self.draining else "ok"
        await _send_json(send, 503 if self.draining else 200,
                         {"status": status, "model": self.model_name, "active": e.active,
                          "queued": e.queued, "capacity": e.capacity,
                          "decoder": e.rows.kind})

    async def _models(self, scope, receive, send) -> None:
        await _send_json(send, 200, {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.started,
             "owned_by": "fastrwa"}]})

    async def _stats(self, scope, receive, send) -> None:
        e = self.engine
        await _send_json(send, 200, {"active": e.active, "queued": e.queued,
                                     "capacity": e.capacity, **e.stats.as_dict()})

    # -- completions ----------------------------------------------------------------------
    async def _completions(self, scope, receive, send) -> None:
        raw = await _read_body(receive, self.max_body)
        request = parse_completion(raw, self.limits)
        if self.draining or self.engine.closing:
            raise RequestError("the server is shutting down", status=503,
                               code="shutting_down", headers={"retry-after": str(self.retry_after)})
        try:
            job = self.engine.submit(request)
        except QueueFull as exc:
            raise RequestError(f"the server is busy: {exc}; retry later", status=503,
                               code="queue_full",
                               headers={"retry-after": str(self.retry_after)}) from None
        except Closed as exc:
            raise RequestError(str(exc), status=503, code="shutting_down",
                               headers={"retry-after": str(self.retry_after)}) from None
        job.waker = asyncio.Event()
        if job.done.is_set():
            job.waker.set()
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

    def _head(self, job: Job) -> dict:
        return {"id": f"cmpl-{job.number}", "object": "text_completion", "created":
                int(time.time()), "model": job.request.model or self.model_name}

    def _usage(self, job: Job) -> dict:
        prompt, completion = len(job.request.prompt), len(job.generated)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def _complete(self, job: Job, send) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        parts = []
        while True:
            await job.waker.wait()
            job.waker.clear()
            data, finish = job.take()
            parts.append(decoder.decode(data, final=finish is not None))
            if finish is not None:
                break
        if finish == "cancelled":
            return
        if finish == "error":
            raise RequestError(f"generation failed: {job.error}", status=500,
                               code="generation_failed")
        body = {**self._head(job), "choices": [{"text": "".join(parts), "index": 0,
                                                "logprobs": None, "finish_reason": finish}],
                "usage": self._usage(job)}
        await _send_json(send, 200, body)

    async def _stream(self, job: Job, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        head = self._head(job)
        while True:
            await job.waker.wait()
            job.waker.clear()
            data, finish = job.take()
            text = decoder.decode(data, final=finish is not None)
            if finish == "cancelled":
                return
            if finish == "error":
                if text:            # (what was released before the error: sent first)
                    await _send_event(send, {**head, "choices": [{
                        "text": text, "index": 0, "logprobs": None, "finish_reason": None}]})
                chunk = {"error": {"message": f"generation failed: {job.error}",
                                   "type": "server_error", "param": None,
                                   "code": "generation_failed"}}
                await _send_event(send, chunk)
                break
            if text or finish is not None:
                chunk = {**head, "choices": [{"text": text, "index": 0, "logprobs": None,
                                              "finish_reason": finish}]}
                await _send_event(send, chunk)
            if finish is not None:
                if job.request.include_usage:
                    await _send_event(send, {**head, "choices": [], "usage": self._usage(job)})
                break
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})


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
            raise RequestError(f"the request body is over {limit} bytes", status=413,
                               code="body_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send, status: int, body: dict, headers: Optional[dict] = None) -> None:
    data = _json(body)
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *extra]})
    await send({"type": "http.response.body", "body": data})


async def _send_event(send, chunk: dict) -> None:
    await send({"type": "http.response.body", "body": b"data: " + _json(chunk) + b"\n\n",
                "more_body": True})
