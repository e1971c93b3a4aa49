"""Writing a file so that it is never left half-written (``path.tmp``, then a rename): the
model directory (:mod:`.pretrained`, :mod:`.integrity`) and the trainer's run directory use
it; and a whole directory so (:func:`staged_directory`: staged beside it, then renamed into
place), with one policy for what it may replace (:class:`ExportDirectory`): the exporters
(``fastrwa.hf.export``, ``fastrwa.export``) use it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional


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


# -- a directory written whole or not at all ----------------------------------------------
# An exporter writes its directory into a staging directory beside OUT_DIR (same parent, so
# a rename moves it), named ".OUT_DIR.fastrwa-staging-PID-RANDOM", and swaps it in with two
# renames (an earlier OUT_DIR moved aside to ".OUT_DIR.fastrwa-old-PID-RANDOM", removed once
# the new one is in place). Each is locked (flock) while its write runs and named with the
# writer's PID, so that a later run tells what a killed run (SIGKILL, a power cut) left: its
# staging is removed, an earlier directory it had moved aside is put back where it was
# missing. Names are unique: nothing left ever blocks a run.
MARK = ".fastrwa-"
STAGING, ASIDE = "staging", "old"


def write_file(path: Path, content: bytes) -> None:
    """``path.write_bytes(content)``, whose ``OSError`` names ``path`` (a failed
    ``write()``, a full disk, names no file: :func:`staged_directory`'s error then says
    which file it was)."""
    try:
        Path(path).write_bytes(content)
    except OSError as exc:
        if exc.filename is None:
            exc.filename = os.fspath(path)
        raise


def _absolute(out_dir: "str | os.PathLike") -> Path:
    """``out_dir`` as an absolute path, ``.`` and ``..`` resolved (a symbolic link is not):
    its parent is where it is staged, and "." names a directory with a name."""
    return Path(os.path.abspath(out_dir))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (on this machine); anything unsure counts as alive."""
    if pid == os.getpid() or os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _lock(directory: Path) -> Optional[int]:
    """An open descriptor of ``directory`` holding an exclusive ``flock``, for as long as
    the caller keeps it open (the kernel releases it when the process dies, however it
    dies): while it is held, :func:`recover_stale` in any process leaves ``directory``
    alone, on another machine too where the file system locks across machines. ``None``
    where the system or the file system has no ``flock``."""
    try:
        import fcntl
        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # (blocking: a check of recover_stale holds it a moment)
    except OSError:
        os.close(fd)
        return None
    return fd


def _unlock(fd: Optional[int]) -> None:
    if fd is not None:
        os.close(fd)


def _in_use(entry: Path, pid: int) -> bool:
    """Whether a write may still be using ``entry``, a staging or set-aside directory of
    process ``pid``: its lock held (:func:`_lock`), here or on another machine; or, when
    it is not, its process alive here (a write locks its directory just after making it;
    a system without ``flock``)."""
    try:
        import fcntl
        fd = os.open(entry, os.O_RDONLY)
    except (ImportError, OSError):
        return _alive(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        pass                        # (no flock on this file system)
    finally:
        os.close(fd)
    return _alive(pid)


def _sibling(out_dir: Path, kind: str) -> str:
    """The name prefix of ``out_dir``'s staging (``kind`` :data:`STAGING`) or set-aside
    (:data:`ASIDE`) directory of this process."""
    return f".{out_dir.name}{MARK}{kind}-{os.getpid()}-"


def recover_stale(out_dir: Path) -> None:
    """Tidy what a killed earlier write of ``out_dir`` left beside it (section comment):
    remove its staging directory; put back the earlier directory it had moved aside if
    ``out_dir`` is missing (killed between the two renames), else remove it. A write still
    running (its process alive) is left alone."""
    out_dir = _absolute(out_dir)
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}{re.escape(MARK)}"
                         rf"({STAGING}|{ASIDE})-(\d+)-[^/]+\Z")
    try:
        entries = sorted(out_dir.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        found = pattern.match(entry.name)
        if not found or entry.is_symlink() or not entry.is_dir() or \
                _in_use(entry, int(found[2])):
            continue
        with contextlib.suppress(OSError):
            if found[1] == ASIDE and not os.path.lexists(out_dir):
                os.rename(entry, out_dir)
            else:
                shutil.rmtree(entry)


@dataclasses.dataclass(frozen=True)
class ExportDirectory:
    """What an exporter writes into its ``OUT_DIR``, and so what ``--overwrite`` may
    replace: the one policy of every exporter (:func:`check_output_directory`).

    Attributes:
        what: the export's name in the errors, e.g. "fastrwa ONNX export".
        files: every name the export writes.
        config: the JSON file among ``files`` that says the directory is an export.
        mark: the key and value that ``config`` holds, e.g. ``("format", "fastrwa-onnx")``.
        leftovers: names an older version left in the directory (killed mid-write).
        own: a last check of an earlier export's files (why not, or ``None``), e.g. that
            its ``README.md`` is a model card the export wrote.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> policy = ExportDirectory("notes export", frozenset({"a.json"}), "a.json",
        ...                          ("format", "notes"))
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = (d / "mine.txt").write_text("keep me")
        >>> policy.foreign(d)
        'it holds mine.txt'
    """

    what: str
    files: frozenset
    config: str
    mark: tuple
    leftovers: frozenset = frozenset()
    own: Optional[Callable[[Path], Optional[str]]] = None

    def foreign(self, directory: Path) -> Optional[str]:
        """``None`` if ``directory`` is an earlier export: plain files only, each one of
        :attr:`files` or :attr:`leftovers`, and (unless it holds leftovers only) its
        :attr:`config` with :attr:`mark`, then :attr:`own`'s check; else why not, in a
        few words."""
        entries = list(Path(directory).iterdir())
        names = {p.name for p in entries}
        others = sorted(names - self.files - self.leftovers)
        if others:
            more = f" and {len(others) - 1} other file{'s' * (len(others) > 2)}" \
                if len(others) > 1 else ""
            return f"it holds {others[0]}{more}"
        odd = sorted(p.name for p in entries if p.is_symlink() or not p.is_file())
        if odd:
            return f"its {odd[0]} is not a plain file"
        if names <= self.leftovers:
            return None
        if self.config not in names:
            return f"it has no {self.config}"
        try:
            config = json.loads((Path(directory) / self.config).read_text())
        except (OSError, ValueError):
            return f"its {self.config} cannot be read"
        key, value = self.mark
        if not isinstance(config, dict) or config.get(key) != value:
            return f"its {self.config} is not of {key} {value!r}"
        return self.own(Path(directory)) if self.own is not None else None


def check_output_directory(out_dir: Path, overwrite: bool, policy: ExportDirectory) -> None:
    """Refuse (``ValueError``, one line naming ``out_dir``) to write the export
    ``policy`` describes (its ``what``, e.g. "fastrwa ONNX export") to ``out_dir`` where
    it would replace anything but an earlier one: a symbolic link (never followed or
    replaced), a file, a non-empty directory without ``overwrite``, or with it one that
    ``policy.foreign(out_dir)`` says is not an earlier export (it returns why, or
    ``None`` for an earlier one). A missing or empty ``out_dir`` is accepted. What a
    killed earlier write left is tidied first (:func:`recover_stale`)."""
    what = policy.what
    out_dir = _absolute(out_dir)
    recover_stale(out_dir)
    if out_dir.is_symlink():
        raise ValueError(f"{out_dir} is a symbolic link (to {os.readlink(out_dir)}); write the "
                         f"{what} to a real path (the link's target, or a new directory)")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory; choose a new OUT_DIR for "
                         f"the {what}")
    if os.path.ismount(out_dir):
        raise ValueError(f"{out_dir} is a mount point: the {what} is written beside its "
                         f"OUT_DIR and renamed into place, which cannot cross into another "
                         f"file system; give a directory inside it ({out_dir / 'export'})")
    try:
        empty = not any(out_dir.iterdir())
    except OSError as exc:
        raise ValueError(f"cannot read {out_dir}: {exc.strerror or exc}") from exc
    if empty:
        return
    if not overwrite:
        raise ValueError(f"{out_dir} exists and is not empty; pass --overwrite "
                         f"(overwrite=True) to replace an earlier {what}")
    reason = policy.foreign(out_dir)
    if reason is not None:
        raise ValueError(f"{out_dir} exists and is not a {what} ({reason}); --overwrite "
                         f"replaces only an earlier {what}: choose another OUT_DIR")


def _fsync(path: "str | Path") -> None:
    """Flush the file or directory ``path`` (a directory: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync(staging: Path) -> None:
    """Flush every file under ``staging`` and the directories to disk (a full disk shows
    here at the latest, before anything is swapped)."""
    for root, _, names in os.walk(staging):
        for name in (*names, "."):
            _fsync(os.path.join(root, name))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back: noted during the block, then raised again to the
    handlers in force before it (in the main thread, where Python runs its handlers; in
    another thread a block is not held): the two renames of a swap are not parted by a
    stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in before.items():    # (None: a handler set from C: the default)
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(noted):
            signal.raise_signal(signum)


def _swap(staging: Path, out_dir: Path) -> None:
    """``staging`` renamed to ``out_dir``, an existing ``out_dir`` moved aside first and
    removed after (put back if the second rename fails); no signal parts the two renames
    and the removal (:func:`_signals_held`). A ``KeyboardInterrupt`` of a signal held back
    meanwhile comes when the swap is complete: it says so (``out_dir_written`` True)."""
    try:
        with _signals_held():
            aside, held = _renamed_in(staging, out_dir)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            _unlock(held)
    except KeyboardInterrupt as stop:
        stop.out_dir_written = True
        raise


def _renamed_in(staging: Path, out_dir: Path) -> tuple[Optional[Path], Optional[int]]:
    """Rename ``staging`` to ``out_dir``, an existing ``out_dir`` moved aside first: the
    set-aside directory (or ``None``) and its lock (:func:`_lock`, taken before the move)."""
    aside = held = None
    if out_dir.exists():
        aside = out_dir.with_name(_sibling(out_dir, ASIDE) + os.urandom(4).hex())
        held = _lock(out_dir)
        try:
            os.rename(out_dir, aside)
        except BaseException:
            _unlock(held)
            raise
    try:
        os.rename(staging, out_dir)
    except BaseException:
        if aside is not None:
            os.rename(aside, out_dir)
        _unlock(held)
        raise
    return aside, held


def _cannot_write(out_dir: Path, staging: Optional[Path], existed: bool,
                  exc: BaseException) -> str:
    """The one line of a failed directory write: ``out_dir``, the file and the cause, the
    space left, and that ``out_dir`` is as it was."""
    cause = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or \
        type(exc).__name__
    where = ""
    name = getattr(exc, "filename", None)
    if name:
        name = Path(os.fsdecode(name))
        if staging is not None and staging in name.parents:
            name = name.relative_to(staging)
        where = f" (writing {name})"
    try:
        free = f"; {shutil.disk_usage(out_dir.parent).free:,} bytes free on its disk"
    except OSError:
        free = ""
    kept = f"the earlier {out_dir} is kept as it was" if existed else f"{out_dir} was not created"
    return f"cannot write {out_dir}: {cause}{where}{free}; nothing was left half-written ({kept})"


@contextlib.contextmanager
def staged_directory(out_dir: Path, overwrite: bool, policy: ExportDirectory,
                     failures: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """Write a directory whole or not at all: ``with staged_directory(out_dir, ...) as
    staging:`` the caller writes its files into ``staging``; when the block ends, they are
    flushed to disk and ``staging`` takes ``out_dir``'s place (section comment).

    ``out_dir`` is checked by :func:`check_output_directory` (``overwrite``, ``policy``:
    see there) on entry and again just before the swap. An ``OSError`` (a full
    disk, no permission), or one of ``failures`` (another library's write error), raised
    while writing or swapping is raised as :class:`WriteError`, one line naming
    ``out_dir``, the file and the cause. Whatever ends the block early (those, a
    ``KeyboardInterrupt``) removes ``staging`` and leaves ``out_dir`` as it was."""
    out_dir = _absolute(out_dir)
    check_output_directory(out_dir, overwrite, policy)
    existed = out_dir.exists()
    staging = held = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=_sibling(out_dir, STAGING), dir=out_dir.parent))
        held = _lock(staging)
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)          # (mkdtemp's 0700 would outlive the rename)
        yield staging
        _sync(staging)
        check_output_directory(out_dir, overwrite, policy)   # (changed meanwhile?)
        _swap(staging, out_dir)
        with contextlib.suppress(OSError):
            _fsync(out_dir.parent)              # (the renames, on disk)
    except (OSError, *failures) as exc:
        if isinstance(exc, WriteError):
            raise
        raise WriteError(_cannot_write(out_dir, staging, existed, exc)) from exc
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        _unlock(held)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python raises Ctrl-C's ``KeyboardInterrupt`` (inside
    :func:`sigterm_raises`): a write unwinds as for Ctrl-C (a staged directory removed)
    and a command ends with one line."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` inside the block (in the main thread only; the
    previous handler comes back after it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def stop_line(stop: KeyboardInterrupt, out_dir: Path, existed: bool,
              written: bool = False) -> tuple[str, int]:
    """The one line and exit status (130 for Ctrl-C, 143 for SIGTERM) of a command that
    writes ``out_dir`` through :func:`staged_directory` and was stopped by ``stop``:
    ``written`` (or a stop held back until the swap was complete) says the new directory
    is in place; else ``out_dir`` is as it was (``existed``) or was not created."""
    written = written or getattr(stop, "out_dir_written", False)
    signum = signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT
    how = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
    state = (f"{out_dir} is written whole" if written else
             f"{out_dir} is as it was" if existed else f"{out_dir} was not created")
    return f"stopped ({how}): {state}", 128 + signum
