"""``python -m fastrwa.train``: the signal handlers first (a Ctrl-C during the imports that
follow ends the process with one line, :mod:`fastrwa.train.stop`), then the CLI."""

import sys

from .stop import Interrupted, stop_requests

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
        print(stop.line("nothing was written"), file=sys.stderr)
        status = stop.status
sys.exit(status)
