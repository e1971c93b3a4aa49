"""Stopping a training run cleanly: SIGINT (Ctrl-C) or SIGTERM asks the loop to stop at the
next step boundary, where it writes a checkpoint and the CLI prints how to resume; a second
Ctrl-C exits as soon as Python runs again, leaving the run directory as it is (its last
checkpoint, written atomically, stays good). A second SIGTERM changes nothing: a scheduler
or torchrun's agent may send it to every process while rank 0 writes the checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run stopped at ``step`` on ``signum``, its checkpoint written there."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped at step {step} by {signal.Signals(signum).name}")
        self.signum, self.step = signum, step


class StopRequests:
    """The first SIGINT/SIGTERM received (:attr:`signum`, 0 for none); a SIGINT after it
    ends the process at once (exit status 130)."""

    def __init__(self):
        self.signum = 0

    def _handle(self, signum, frame) -> None:
        # (os.write, not print: a signal arriving inside a write to stderr must not write
        # to the same buffered stream again)
        name = signal.Signals(signum).name
        if self.signum and signum == signal.SIGINT:
            os.write(2, f"\n{name} again: exiting now (the run directory keeps its last "
                        f"checkpoint)\n".encode())
            os._exit(128 + signum)
        if self.signum:
            return
        self.signum = signum
        again = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
        os.write(2, f"\n{name}: stopping after this step, with a checkpoint{again}\n".encode())

    def pending(self, world: int, device: torch.device) -> int:
        """The signal to stop on, agreed by every process (the largest any received), or 0:
        under torchrun each process gets its own signal, and all must stop at one step."""
        if world == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)


@contextlib.contextmanager
def stop_requests():
    """Install the handlers for the block (main thread only: elsewhere nothing is caught and
    :attr:`StopRequests.signum` stays 0); the previous handlers come back after it."""
    requests = StopRequests()
    if threading.current_thread() is not threading.main_thread():
        yield requests
        return
    previous = {s: signal.signal(s, requests._handle) for s in SIGNALS}
    try:
        yield requests
    finally:
        for s, handler in previous.items():   # (None: a handler set from C: the default)
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
