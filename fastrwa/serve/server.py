"""uvicorn's server as ``python -m fastrwa.serve`` runs it: :class:`Server`, which drains on
a stop signal (docs/serve.md, "SIGTERM or Ctrl-C") and loses none.

The stop, from the first SIGTERM or SIGINT (uvicorn's ``handle_exit``):

1. new requests are answered 503 at once (``App.draining``; every answer then says
   ``connection: close``) and the listening socket is closed (:meth:`Server.on_tick`);
2. the open connections stay open while the engine has requests in flight, so that a
   request on an idle keep-alive connection is answered 503 rather than dropped;
3. once the engine is idle, or ``shutdown_timeout`` seconds after the signal, uvicorn's own
   shutdown closes the connections, waits what is left of the timeout for the answers still
   being written and cuts the rest (its one line: "Cancel N running task(s), timeout
   graceful shutdown exceeded"; the cut responses' tracebacks are not logged), then the
   engine stops. A second Ctrl-C exits at once (uvicorn's force exit).

Signals that came before uvicorn's handlers were in place (noted by
:class:`fastrwa.serve.signals.Signals`) are replayed into them as they are installed
(:meth:`Server.capture_signals`, uvicorn's public hook around its serving).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from types import FrameType
from typing import Iterator, Optional

import uvicorn

from .app import App
from .signals import Signals

_UVICORN_LOG = logging.getLogger("uvicorn.error")


class Server(uvicorn.Server):
    """uvicorn's server over ``app`` (module doc): ``signals`` holds the stops noted before
    it ran; ``shutdown_timeout`` is the seconds a stop waits for the requests in flight."""

    def __init__(self, config: uvicorn.Config, app: App, signals: Signals,
                 shutdown_timeout: float):
        super().__init__(config)
        self.app, self.signals, self.shutdown_timeout = app, signals, shutdown_timeout
        self.stop_at: Optional[float] = None      # (time.monotonic() of the first signal)

    def run(self, sockets: Optional[list[socket.socket]] = None) -> None:
        """uvicorn's ``run``, the cut responses' tracebacks left out of its log (those of
        the tasks its shutdown cancels, and those a second Ctrl-C leaves to asyncio)."""
        _UVICORN_LOG.addFilter(self._not_a_cut)
        try:
            super().run(sockets)
        finally:
            _UVICORN_LOG.removeFilter(self._not_a_cut)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers for the serving's span, and the signals noted before them
        replayed into :meth:`handle_exit` (none lost in between)."""
        with super().capture_signals():
            for signum in self.signals.take():
                self.handle_exit(signum, None)
            yield

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """A stop signal: requests are turned away from now on (503), then uvicorn's."""
        self.app.draining = True
        if self.stop_at is None:
            self.stop_at = time.monotonic()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick; once it would exit on a signal, the listening socket is closed and
        the exit waits for the engine to be idle (or the timeout: module doc)."""
        if not await super().on_tick(counter):
            return False
        if self.stop_at is None or self.force_exit:
            return True
        for server in self.servers:
            server.close()
        waited = time.monotonic() - self.stop_at
        engine = self.app.engine
        if engine is not None and engine.active + engine.queued > 0 \
                and waited < self.shutdown_timeout:
            return False
        self.config.timeout_graceful_shutdown = max(self.shutdown_timeout - waited, 0.0)
        return True

    def _not_a_cut(self, record: logging.LogRecord) -> bool:
        """False for the record of a response cut by the shutdown (its task cancelled)."""
        error = record.exc_info[1] if record.exc_info else None
        return not (self.should_exit and isinstance(error, asyncio.CancelledError))
