"""Writing a file so that it is never left half-written (``path.tmp``, then a rename): the
model directory (:mod:`.pretrained`, :mod:`.integrity`) and the trainer's run directory use
it."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable


class WriteError(OSError):
    """A file that could not be written (a full disk, no permission): the message names the
    file and the cause; the temporary file is removed and the earlier file, if any, kept."""


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``path.tmp``: ``write(file)``, flush to disk, ``os.replace``.

    A failure (``OSError``, or the ``RuntimeError`` that ``torch.save`` raises for a full
    disk) removes ``path.tmp``, leaves ``path`` as it was and raises :class:`WriteError`;
    anything else raised in the middle (a ``KeyboardInterrupt``, a bug in ``write``) also
    removes ``path.tmp`` and is raised as it is."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        cause = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or \
            type(exc).__name__
        try:
            free = f"; {shutil.disk_usage(path.parent).free:,} bytes free on its disk"
        except OSError:
            free = ""
        raise WriteError(f"cannot write {path}: {cause}{free}; nothing was left half-written "
                         f"({tmp.name} is removed, an earlier {path.name} is kept)") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
