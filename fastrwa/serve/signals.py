"""The server's stop signals (SIGTERM, SIGINT: Ctrl-C), none lost between the start of
``python -m fastrwa.serve`` and the end of uvicorn's shutdown.

:data:`SIGNALS` are noted by :class:`Signals`' handler from before the command's heavy
imports: a signal while the model loads stops the server before it serves (one line, exit
0); one in the moment between the ready line and uvicorn's own handlers is replayed into
them once they are in place (``fastrwa.serve.server.Server.capture_signals``), so the
server drains and exits as if the signal had come a moment later. After uvicorn's shutdown
the same handler takes the signal uvicorn raises again (to die of it): a graceful stop
exits 0. This module imports nothing heavy (it is imported before torch).
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Signals:
    """The stop signals received while no server handles them, in order. While the
    command starts (``starting``: from :meth:`install` to :meth:`serving`, the model's
    load) the first says in one line that the command stops before it serves (it does so
    at the next step of its start, exit status 0), and a second SIGINT exits at once
    (status 130)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.starting = False

    def install(self) -> None:
        """Note :data:`SIGNALS` from now on (in the main thread)."""
        self.starting = True
        for signum in SIGNALS:
            signal.signal(signum, self._note)

    def serving(self) -> None:
        """The command is about to serve: a signal from now on is replayed into the
        server (no notice)."""
        self.starting = False

    def _note(self, signum: int, frame: Optional[FrameType]) -> None:
        # (os.write, not print: a signal inside a write to stderr must not write to the
        # same buffered stream again)
        self.received.append(signum)
        if not self.starting:
            return
        name = signal.Signals(signum).name
        if len(self.received) == 1:
            again = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
            os.write(2, f"fastrwa.serve: {name}: stopping before it serves{again}\n"
                        .encode())
        elif signum == signal.SIGINT:
            os.write(2, f"fastrwa.serve: {name} again: exiting at once\n".encode())
            os._exit(128 + signum)

    def take(self) -> list[int]:
        """The signals noted since the last call (then forgotten)."""
        taken, self.received = self.received, []
        return taken

    def first(self) -> Optional[str]:
        """The name of the first signal noted and not taken (``"SIGTERM"``), or None."""
        return signal.Signals(self.received[0]).name if self.received else None


STOPS = Signals()           # (the process's: its handlers are the command's)
