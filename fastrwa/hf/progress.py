"""transformers' progress bars off for a block (they draw one for a few megabytes)."""

from __future__ import annotations

import contextlib

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars ("Writing model shards", "Loading weights") off inside the
    block, as they were after it."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
