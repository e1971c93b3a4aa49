"""``python -m fastrwa.serve``: the stop signals noted first (:mod:`.signals`: a SIGTERM or
Ctrl-C during the imports that follow is not lost), then the command line (:mod:`.cli`)."""

import logging
import sys

from .signals import STOPS

STOPS.install()

from .cli import main  # noqa: E402 (after the handlers above)

logging.basicConfig()
sys.exit(main())
