"""``python -m fastrwa.train``: the signal handlers first (a Ctrl-C during the imports that
follow ends the process with one line, :mod:`fastrwa.train.stop`), then the CLI.

Once the run has said its last line its exit status is decided: a signal in the process's
teardown (a second or so of finalisers) is ignored rather than killing it without a word
(the handlers are ignored from before the run's own are installed, so that it is they that
come back when the run ends)."""

import os
import signal
import sys

for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, signal.SIG_IGN)

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
        if os.environ.get("RANK", "0") == "0":
            print(stop.line("nothing was written"), file=sys.stderr)
        status = stop.status
sys.exit(status)
