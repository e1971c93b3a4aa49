"""The run directory: its files, and its lifecycle (create, ``--overwrite``, ``--resume``,
lock, ``config.json``, removal of a run that failed to start)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import uuid
from pathlib import Path

from ..models.config import FIELDS_BEFORE_THEY_EXISTED
from ..models.directory import BYTE_LM_FILES
from ..models.files import write_atomically
from .config import RunConfig
from .models import with_every_lm_field

CHECKPOINT, CONFIG, METRICS = "checkpoint.pt", "config.json", "metrics.jsonl"
PLOT, SAMPLES, LOCK = "learning_curve.png", "samples.txt", "run.lock"
BEST, EXPORT = "best", "model"   # language models: save_pretrained directories
RUN_ID = "run_id"                # config.json's key for the run's identity (not a flag)
# Everything a run writes into its directory: --overwrite removes these and nothing else.
RUN_FILES = (CONFIG, METRICS, CHECKPOINT, PLOT, SAMPLES, LOCK, CHECKPOINT + ".tmp",
             METRICS + ".tmp", SAMPLES + ".tmp", CONFIG + ".tmp")
RUN_DIRS = (BEST, EXPORT)
MODEL_FILES = tuple(name + tmp for name in ("config.json", "model.pt", *BYTE_LM_FILES)
                    for tmp in ("", ".tmp"))         # (what save_pretrained may leave)


class RunDirError(RuntimeError):
    """A run directory that cannot be used as asked (exists, missing, incompatible)."""


def lock_run_dir(run_dir: Path) -> int:
    """Take ``run_dir/run.lock`` (``fcntl.flock``, exclusive) for this process and return its
    descriptor; closing it, or the process ending in any way (the kernel drops the lock of a
    crashed process), releases it. A directory another process holds is refused
    (``RunDirError``, naming the process), so that two processes never write one run."""
    path = run_dir / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RunDirError(f"cannot open the lock file {path} ({exc.strerror}); it must be a "
                          f"plain file that this user may write") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(f"run directory {run_dir} is in use by another process (pid "
                          f"{holder} holds {path}); wait for it to end or stop it") from None
    except BaseException:        # ENOLCK (a file system without locks, NFS) ...
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def prepare_run_dir(run_dir: Path, cfg: RunConfig, resume: bool, overwrite: bool,
                    hold: contextlib.ExitStack) -> RunConfig:
    """Create, reuse (``--overwrite``) or reopen (``--resume``) ``run_dir`` and lock it for
    this process (:func:`lock_run_dir`; released when ``hold`` closes); return the config
    to run with (on resume, the saved one). Everything is checked before anything is
    removed or written."""
    if resume:
        if not (run_dir / CONFIG).is_file():
            raise RunDirError(f"--resume {run_dir}: no {CONFIG} there (not a run directory)")
        hold.callback(os.close, lock_run_dir(run_dir))
        return read_run_config(run_dir)
    cfg = with_every_lm_field(cfg)     # (an unusable --lm is refused before anything is removed)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} is a file, not a directory")
    existed = run_dir.exists()
    if existed and any(run_dir.iterdir()):
        if not overwrite:
            raise RunDirError(f"run directory {run_dir} exists and is not empty; pass "
                              f"--overwrite to replace it or --resume {run_dir} to continue it")
        # The lock first (it refuses a run in progress), then the plan, made while no other
        # process can write the directory; a refused plan releases the lock (and removes
        # run.lock if this process made it), before anything is removed.
        made_lock = not os.path.lexists(run_dir / LOCK)
        fd = lock_run_dir(run_dir)
        try:
            doomed = _removal_plan(run_dir)
        except BaseException:
            os.close(fd)
            if made_lock:
                with contextlib.suppress(OSError):
                    os.unlink(run_dir / LOCK)
            raise
        hold.callback(os.close, fd)
        for path in doomed:
            if path == run_dir / LOCK:                    # (held: kept for the new run)
                continue
            if stat.S_ISDIR(os.lstat(path).st_mode):      # (a link is unlinked, not followed)
                path.rmdir()
            else:
                path.unlink()
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        hold.callback(os.close, lock_run_dir(run_dir))
    try:
        write_run_config(run_dir, cfg, uuid.uuid4().hex)
    except BaseException:
        discard_unstarted_run(run_dir, created=not existed)
        raise
    return cfg


def read_run_config(run_dir: Path) -> RunConfig:
    """The :class:`RunConfig` saved in ``run_dir/config.json``, refused with a message that
    names the file when it is not one."""
    path = run_dir / CONFIG
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"--resume {run_dir}: {CONFIG} is not a fastrwa run configuration "
                          f"({exc})") from exc
    if isinstance(data, dict) and "task" not in data:
        raise RunDirError(f"--resume {run_dir}: {CONFIG} is not a fastrwa run configuration "
                          f'(it has no "task" field; every run records one); restore it')
    try:
        saved = RunConfig.from_dict(data)
    except ValueError as exc:      # not a run's configuration, or values no run can use
        raise RunDirError(f"--resume {run_dir}: {CONFIG} is not a fastrwa run "
                          f"configuration ({exc})") from exc
    if saved.is_lm:                # a run older than a field was built without it
        saved.lm = {**FIELDS_BEFORE_THEY_EXISTED, **saved.lm}
    return saved


def run_id(run_dir: Path) -> str | None:
    """The identity ``config.json`` gives the run (``None`` for a run older than it)."""
    try:
        value = json.loads((run_dir / CONFIG).read_text()).get(RUN_ID)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def write_run_config(run_dir: Path, cfg: RunConfig, identity: str | None) -> None:
    """``config.json``: every field of ``cfg`` and the run's identity, written atomically."""
    text = json.dumps({**cfg.to_dict(), RUN_ID: identity}, indent=2).encode()
    write_atomically(run_dir / CONFIG, lambda f: f.write(text))


def _removal_plan(run_dir: Path) -> list[Path]:
    """What ``--overwrite`` removes from the fastrwa run in ``run_dir``, in order (files
    before the directories that hold them). Checked in full first, with ``lstat`` (a link
    is never followed: a link where a run has a file or directory is removed itself, what
    it points to is left alone); a directory holding anything a run does not write, or a
    run's name used by something of another kind, is refused, naming what is there."""
    entries = sorted(os.listdir(run_dir))
    others, plan = [], []
    for name in entries:
        path = run_dir / name
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode) and name in RUN_FILES + RUN_DIRS:
            plan.append(path)                 # the link itself, never what it points to
        elif name in RUN_FILES:
            if stat.S_ISREG(mode):
                plan.append(path)
            else:
                others.append(f"{name} (not a file)")
        elif name in RUN_DIRS and stat.S_ISDIR(mode):
            for inner in sorted(os.listdir(path)):
                kind = os.lstat(path / inner).st_mode
                if inner in MODEL_FILES and (stat.S_ISREG(kind) or stat.S_ISLNK(kind)):
                    plan.append(path / inner)
                else:
                    others.append(f"{name}/{inner}")
            plan.append(path)
        else:
            others.append(name if name not in RUN_DIRS else f"{name} (not a directory)")
    # A directory that holds only run.lock (and a config.json.tmp) is what a run that failed
    # to start can leave: replaced like a run.
    leftover = bool(entries) and set(entries) <= {LOCK, CONFIG + ".tmp"}
    if (CONFIG not in entries and not leftover) or others:
        shown = ", ".join(others[:8]) + (" ..." if len(others) > 8 else "")
        raise RunDirError(
            f"--overwrite replaces only a fastrwa run directory, and {run_dir} "
            + (f"holds other things: {shown}" if others else f"has no {CONFIG}")
            + "; nothing was removed; choose another --run-dir")
    return plan


def discard_unstarted_run(run_dir: Path, created: bool) -> None:
    """Remove what a new run wrote before it failed to start (``config.json``, its lock),
    so that the failure does not leave a directory that blocks the same command; a
    directory holding anything else is left alone."""
    with contextlib.suppress(OSError):
        if set(os.listdir(run_dir)) <= {CONFIG, LOCK, CONFIG + ".tmp"}:
            for name in (CONFIG, CONFIG + ".tmp", LOCK):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(run_dir / name)
            if created:
                os.rmdir(run_dir)
