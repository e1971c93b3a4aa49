"""Stopping a training run on SIGINT (Ctrl-C) or SIGTERM: one mechanism for the whole run.

One :class:`StopRequests` per process holds the handlers, from the start of
``python -m fastrwa.train`` (before its heavy imports) to the end of its report:

* until the step loop a signal ends the run at once: the handler raises :class:`Interrupted`,
  which the CLI turns into one line and exit status 128 + the signal (130 for SIGINT, 143
  for SIGTERM), after a new run that never started is removed;
* from the step loop on (the phases ``DEFERRED``) a signal is noted: the loop stops at
  the next step boundary with a checkpoint there (:class:`Stopped`), or, after the last step,
  finishes its evaluation, checkpoint, report and learning curve first; a second SIGINT then
  ends the run at once (:class:`Interrupted` again), a second SIGTERM changes nothing (a
  scheduler or torchrun's agent may send it to every process while rank 0 writes);
* inside :meth:`StopRequests.uninterrupted` (every file the run writes atomically: the
  checkpoint, the exports, ``config.json``, the repaired logs; and the learning curve) a
  signal takes effect when the write is complete, so that no temporary file is left and no
  line claims a file that is not there; a write that fails then still ends the run on the
  signal (its line names the error).

Python runs a handler between two bytecodes of the main thread: a process blocked inside
a C call (a collective) needs SIGKILL. A handler that runs inside a callback from C (numba's
compiler calls back into Python through llvmlite) raises where the C code swallows the
exception: such an :class:`Interrupted` is not printed (``sys.unraisablehook``) but kept, and
raised at the next phase or step boundary (:meth:`StopRequests.check`); a second SIGINT
raises it again at once. ``FASTRWA_TRAIN_PAUSE_AT=PHASE[,PHASE...]`` (for
tests) makes the process wait for a signal when it reaches each ``PHASE``
(:meth:`StopRequests.pause_point`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
PAUSE = "FASTRWA_TRAIN_PAUSE_AT"     # tests: the phases where the process waits for a signal
PAUSED = "paused at"                 # the line it writes to stderr when it waits there
PAUSE_S = 60.0                       # the longest it waits
# The phases, in order, that :meth:`StopRequests.enter` names; in the last three a signal is
# noted and takes effect at a step boundary or after the report (in the others, at once).
PHASES = ("start-up", "calibration", "preparation of the run", "training", "final evaluation",
          "report")
DEFERRED = PHASES[3:]


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class Stopped(Exception):
    """The run stopped at ``step`` on ``signum``, its checkpoint written there."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped at step {step} by {_name(signum)}")
        self.signum, self.step = signum, step


class Interrupted(KeyboardInterrupt):
    """A signal that ended the run at once (``again``: a second SIGINT), in ``phase``."""

    def __init__(self, signum: int, again: bool, phase: str):
        super().__init__(f"{_name(signum)}{' again' if again else ''} during {phase}")
        self.signum, self.again, self.phase = signum, again, phase

    @property
    def status(self) -> int:
        return 128 + self.signum

    def line(self, outcome: str) -> str:
        """The one line the run ends with: the signal, the phase, the error that came with
        it (its ``__cause__``: a write that failed in :meth:`StopRequests.uninterrupted`),
        then ``outcome``."""
        error = self.__cause__
        if error is None:
            return f"{self}: stopped at once; {outcome}"
        text = " ".join(str(error).split()) or type(error).__name__
        return f"{self}: stopped at once; error: {text}; {outcome}"


class StopRequests:
    """The stop signals of a run (see the module's docstring for when each takes effect).

    ``signum``: the first signal received (0 for none); ``phase``: what the run is doing
    (named in the lines); ``step``: the step being made (``None`` before the step loop);
    ``checkpoint``: the step of the checkpoint the run directory holds, as far as this
    process knows (``None`` when it knows of none)."""

    def __init__(self):
        self.signum, self.received = 0, 0          # (received: every signal, counted)
        self.phase: str = "start-up"
        self.step: int | None = None
        self.checkpoint: int | None = None
        self._writing = 0         # depth of uninterrupted() blocks
        self._raise = None        # the Interrupted an uninterrupted() block owes at its end
        self._ending = False      # an Interrupted or Stopped is on its way: nothing more
        self._told = None         # the phase whose notice the handler wrote
        self._swallowed = None    # an Interrupted a callback from C swallowed: raised next
        self.rank = int(os.environ.get("RANK", "0"))    # (notices: rank 0's only)

    # -- the handler --------------------------------------------------------------------
    def _handle(self, signum: int, frame) -> None:
        # (os.write, not print: a signal arriving inside a write to stderr must not write
        # to the same buffered stream again)
        self.received += 1
        if self._swallowed is not None and signum == signal.SIGINT:
            self.check()              # (the stop a callback swallowed, again)
        if self._ending or (self.signum and signum == signal.SIGTERM):
            return
        again = bool(self.signum)
        self.signum = self.signum or signum
        if self.phase not in DEFERRED or again:     # at once ...
            stop = Interrupted(signum, again, self.phase)
            if self._writing:                        # ... once the write is complete
                if self._raise is None:
                    self._raise = stop
                    if again:
                        os.write(2, f"\n{_name(signum)} again: exiting once the file being "
                                    f"written is complete\n".encode())
                return
            self._ending = True
            raise stop
        self._told = self.phase
        if self.phase == "training":
            self._say(signum, "stopping after this step, with a checkpoint")
        else:
            self._say(signum, f"finishing the {self.phase} first")

    def _say(self, signum: int, what: str) -> None:
        """A notice on standard error (rank 0's: under torchrun every process gets the
        signal): the signal, what the run does now, and for SIGINT how to exit at once."""
        if self.rank != 0:
            return
        again = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
        os.write(2, f"\n{_name(signum)}: {what}{again}\n".encode())

    def _unraisable(self, unraisable) -> bool:
        """``sys.unraisablehook``'s part: keep an :class:`Interrupted` a callback from C
        swallowed (True), to raise it at the next boundary."""
        if isinstance(unraisable.exc_value, Interrupted):
            self._swallowed = unraisable.exc_value
            return True
        return False

    def check(self) -> None:
        """Raise the :class:`Interrupted` a callback from C swallowed, if there is one."""
        stop, self._swallowed = self._swallowed, None
        if stop is not None:
            self._ending = True
            raise stop

    # -- the phases -----------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """Enter ``phase`` (one of ``PHASES``: it says when a signal takes effect, and the
        lines name it); a pause point for tests. A stop a callback swallowed is raised
        here (:meth:`check`)."""
        if phase not in PHASES:
            raise ValueError(f"no phase {phase!r}: one of {PHASES}")
        self.check()
        self.phase = phase
        if phase == "final evaluation" and self._told == "training" and not self._ending:
            # (the signal came during the step that turned out to be the last: what was
            # said, "stopping after this step", is not all that happens)
            self._told = phase
            self._say(self.signum, "that step was the last: finishing the final evaluation "
                                   "first")
        self.pause_point(phase)

    @contextlib.contextmanager
    def uninterrupted(self) -> Iterator[None]:
        """A block (a file written) that no signal cuts short: a signal that would end the
        run at once does so when the block is complete, also when the block fails (a
        :class:`~fastrwa.models.files.WriteError`): the :class:`Interrupted` is raised
        then, the error as its ``__cause__`` (one line, status 128 + the signal)."""
        self._writing += 1
        error = None
        try:
            yield
        except Exception as exc:      # (raised below, unless a signal is owed)
            error = exc
        finally:
            self._writing -= 1
        if not self._writing and self._raise is not None:
            stop, self._raise, self._ending = self._raise, None, True
            raise stop from error
        if error is not None:
            raise error

    def pending(self, world: int, device) -> int:
        """The signal to stop on, agreed by every process (the largest any received), or 0:
        under torchrun each process gets its own signal, and all must stop at one step.
        A process that received none takes the agreed one (its exit status follows it).
        A stop a callback swallowed is raised here (:meth:`check`)."""
        self.check()
        if world == 1:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = self.signum or int(flag)
        return int(flag)

    def stopped(self, step: int) -> Stopped:
        """The :class:`Stopped` to raise at a step boundary (nothing more is interrupted)."""
        self._ending = True
        return Stopped(self.signum, step)

    def pause_point(self, name: str) -> None:
        """Tests: when ``$FASTRWA_TRAIN_PAUSE_AT`` names ``name`` (a comma-separated list),
        write ``paused at NAME`` to stderr and wait (at most ``PAUSE_S``) for a signal; a
        no-op otherwise."""
        if name not in os.environ.get(PAUSE, "").split(","):
            return
        seen = self.received
        os.write(2, f"{PAUSED} {name}\n".encode())
        end = time.monotonic() + PAUSE_S
        while self.received == seen and time.monotonic() < end:
            time.sleep(0.01)


_active: StopRequests | None = None


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequests]:
    """The process's :class:`StopRequests` for the block: installed here (the previous
    handlers come back after it), or, inside another such block, the same one. Outside the
    main thread nothing is caught and ``signum`` stays 0."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield StopRequests()
        return
    if _active is not None:
        yield _active
        return
    requests = StopRequests()
    previous = {s: signal.signal(s, requests._handle) for s in SIGNALS}
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: requests._unraisable(u) or hook(u)
    _active = requests
    try:
        yield requests
    finally:
        _active = None
        sys.unraisablehook = hook
        for s, handler in previous.items():   # (None: a handler set from C: the default)
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def current() -> StopRequests:
    """The installed :class:`StopRequests` (in the main thread), or an inert one."""
    if _active is None or threading.current_thread() is not threading.main_thread():
        return StopRequests()
    return _active
