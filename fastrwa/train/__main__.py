"""``python -m fastrwa.train``: the signal handlers first (a Ctrl-C during the imports that
follow ends the process with one line, :mod:`fastrwa.train.stop`), then the CLI.

Once the run has said its last line its exit status is decided: a signal in the process's
teardown (a second or so of finalisers, or one that hangs) ends the process at once with
that status, its output flushed, rather than killing it without a word or a traceback.
Those handlers are installed first of all, so that they are what the run's own handlers
give back when the run ends."""

import os
import signal
import sys

_status = None              # the run's exit status, once decided


def _ended(signum: int, frame: object) -> None:
    if _status is None:     # (the moment before the run's handlers are in place)
        os.write(2, f"{signal.Signals(signum).name} during start-up: stopped at once; "
                    f"nothing was written\n".encode())
        os._exit(128 + signum)
    os._exit(_status)       # (stdout and stderr were flushed when it was decided)


for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, _ended)

from .stop import Interrupted, stop_requests  # noqa: E402 (after the handlers above)

with stop_requests() as stops:
    try:
        stops.enter("start-up")
        import torch

        # Subnormal floats flushed to zero for the whole process (every thread started from
        # here on inherits it): training on CPU makes them, and x86 matrix products with
        # subnormal operands run several times slower (docs/training.md).
        torch.set_flush_denormal(True)
        from .cli import main

        status = main()
    except Interrupted as stop:          # (before main, which says its own line)
        if stops.rank == 0:
            print(stop.line("nothing was written"), file=sys.stderr)
        status = stop.status
    sys.stdout.flush()
    sys.stderr.flush()
    _status = status
sys.exit(status)
