"""Checkpoints: atomic save, checked load, the provenance a checkpoint records, and the
repair of a run directory's logs to the step a resume starts from."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import torch

from ..models import LMState
from ..models.files import write_atomically
from ..models.storage import check_archive, save_with_crcs
from ..nn import CellState, LayerState, RRAState
from ..state import ScanState
from .config import RECORDED_ON_RESUME, RELOCATABLE, RESUMABLE_CHANGES, RunConfig
from .metrics import read_records
from .models import with_every_lm_field
from .rundir import CHECKPOINT, CONFIG, RunDirError, write_run_config
from .stop import current

# NamedTuples that a carried recurrent state may contain: allowed by weights-only loading.
# Checkpoints written before LMState moved to fastrwa.models.cache name it as it was,
# fastrwa.models.lm.LMState (a name torch >= 2.6 can allow for the class).
SAFE_GLOBALS = [ScanState, LayerState, CellState, RRAState, LMState]
if torch.__version__ >= "2.6":
    SAFE_GLOBALS.append((LMState, "fastrwa.models.lm.LMState"))
torch.serialization.add_safe_globals(SAFE_GLOBALS)


def save_checkpoint(path: Path, payload: dict) -> None:
    """Write atomically: a temporary file in the same directory, flushed to disk, then
    ``os.replace``. A failed write (a full disk: ``torch.save`` raises ``RuntimeError``)
    removes the temporary file, keeps the previous checkpoint and raises
    :class:`fastrwa.models.files.WriteError` naming the file and the cause. (The loop
    writes it inside :meth:`fastrwa.train.stop.StopRequests.uninterrupted`: a signal does
    not cut it short.)"""
    def write(f) -> None:
        save_with_crcs(payload, f)
        current().pause_point("checkpoint")     # (tests: a signal while the file is written)

    write_atomically(path, write)


def load_checkpoint(path: Path) -> dict:
    """Read a checkpoint with ``weights_only=True`` (tensors and plain data only), after
    checking every record against the CRC-32 that ``torch.save``'s zip format stores with it
    (a flipped byte would otherwise load as a silently different number)."""
    advice = "remove it to restart the run or restore a good copy"
    try:
        check_archive(path, "checkpoint")
    except ValueError as exc:
        raise RunDirError(f"{exc}; {advice}") from exc
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:           # no permission, an I/O error: its own message, not "corrupt"
        raise
    except Exception as exc:  # any unreadable file is reported the same way
        raise RunDirError(f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}: "
                          f"{exc}); {advice}") from exc


def _number(value, low: float = 0.0) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and value >= low)


def check_checkpoint(ckpt, path: Path) -> None:
    """Refuse (``RunDirError``, naming the field) a checkpoint whose fields no run writes:
    checked before anything in the run directory is touched."""
    if not isinstance(ckpt, dict):
        raise RunDirError(f"checkpoint {path} is not a fastrwa checkpoint (a "
                          f"{type(ckpt).__name__}, not a dict)")
    problems = []
    for key in ("model", "optimizer", "step", "rng"):
        if key not in ckpt:
            problems.append(f"no {key!r}")
    step = ckpt.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        problems.append(f"step {step!r} (an integer >= 0 is expected)")
    world = ckpt.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        problems.append(f"world_size {world!r} (an integer >= 1 is expected)")
    for key in ("elapsed", "train_elapsed"):
        if not _number(ckpt.get(key, 0.0)):
            problems.append(f"{key} {ckpt.get(key)!r} (seconds, a finite number >= 0)")
    best = ckpt.get("best")
    if best is not None and not _number(best, -math.inf):
        problems.append(f"best {best!r} (a finite number or None)")
    if "rng" in ckpt and not (isinstance(ckpt["rng"], torch.Tensor)
                              and ckpt["rng"].dtype == torch.uint8):
        problems.append("rng (a uint8 tensor is expected)")
    carried = ckpt.get("carried")
    if carried is not None and not (isinstance(carried, list) and len(carried) == world):
        problems.append(f"carried (one list of states per process, {world}, is expected)")
    if problems:
        raise RunDirError(f"checkpoint {path} is damaged or not a fastrwa checkpoint: "
                          + "; ".join(problems) + "; remove it to restart the run or "
                          "restore a good copy")


def provenance(cfg: RunConfig, identity: str | None, fingerprint: dict | None) -> dict:
    """What a checkpoint records of what its run depends on: the run's identity, its
    configuration (the fields that may not change on resume) and the data's size and
    sha256 (``None`` for generated data). A language model's ``lm`` is recorded with every
    field, given or default, so that two spellings of one model compare equal."""
    fixed = {k: v for k, v in with_every_lm_field(cfg).to_dict().items()
             if k not in RESUMABLE_CHANGES}
    return {"id": identity, "config": fixed, "data": fingerprint}


def _differs(recorded, now) -> bool:
    """Whether a recorded value differs from the current one; of two dicts (an LM's
    ``lm``), only the keys the record has are compared."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        return any(k not in now or _differs(v, now[k]) for k, v in recorded.items())
    return recorded != now


def check_provenance(recorded, cfg: RunConfig, identity: str | None, fingerprint: dict | None,
                     run_dir: Path) -> None:
    """Refuse a checkpoint written by another run, or for another configuration or data,
    than the run in ``run_dir`` resumes with, naming each field that differs and its two
    values. A moved corpus (another ``data`` path, the same bytes) is allowed, with a note."""
    path = run_dir / CHECKPOINT
    if recorded is None:           # a checkpoint older than this record: nothing to compare
        return
    if not isinstance(recorded, dict) or not isinstance(recorded.get("config"), dict):
        raise RunDirError(f"checkpoint {path} is damaged: its 'run' record is not one")
    if recorded.get("id") != identity:
        raise RunDirError(f"checkpoint {path} does not fit this run: it was written by another "
                          f"run (run id {recorded.get('id')}; {run_dir / CONFIG} says "
                          f"{identity}); remove it to restart the run or restore its own")
    now = provenance(cfg, identity, fingerprint)["config"]
    old = recorded["config"]
    # Only what the record has is compared: a field added in a later version (of RunConfig or
    # of an LM's config) is missing from older records, which is no change.
    changed = sorted(k for k in old if _differs(old[k], now.get(k)))
    data_before, data_now = recorded.get("data"), fingerprint
    same_bytes = data_before == data_now
    if changed == ["data"] and data_now is not None:     # (the bytes decide, below)
        if same_bytes:
            print(f"note: --data moved from {old['data']} to {now['data']} (the same "
                  f"{data_now['size']:,} bytes, sha256 {data_now['sha256'][:16]}...)",
                  file=sys.stderr)
        changed = []
    if changed:
        shown = "; ".join(f"{k}: {old.get(k)!r} when the checkpoint was written, now "
                          f"{now.get(k)!r}" for k in changed)
        raise RunDirError(f"checkpoint {path} does not fit this run's {CONFIG} (edited since "
                          f"the checkpoint?): {shown}; restore {CONFIG} or start a new run")
    if not same_bytes:
        def show(fp):
            return "none" if fp is None else f"{fp['size']:,} bytes, sha256 {fp['sha256'][:16]}..."
        then = old.get("data")
        where = f" (it was {then} then)" if then not in (None, cfg.data) else ""
        raise RunDirError(f"--data {cfg.data} changed since checkpoint {path} was written"
                          f"{where}: {show(data_before)} then, {show(data_now)} now; resume on "
                          f"the data the run trained on, or start a new run")


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines logged after ``step`` (by a run killed after its last checkpoint),
    and a last line cut short by the kill; written through :func:`write_atomically` (a failed
    write, a full disk, leaves the old file whole and no temporary file)."""
    if not path.is_file():
        return
    raw = [line for line in path.read_text().splitlines() if line.strip()]
    lines, records = read_records(path)
    keep = [line for line, record in zip(lines, records) if record["step"] <= step]
    if len(keep) == len(raw):
        return
    text = "".join(line + "\n" for line in keep).encode()
    write_atomically(path, lambda f: f.write(text))


SAMPLE_HEADER = re.compile(rb"^--- step (\d+) ---$", re.MULTILINE)


def truncate_samples(path: Path, step: int) -> None:
    """Drop the samples written after ``step`` (each entry opens with ``--- step N ---``),
    and an entry cut short by a kill, as :func:`truncate_metrics` does for metric lines."""
    if not path.is_file():
        return
    raw = path.read_bytes()
    cut = next((m.start() for m in SAMPLE_HEADER.finditer(raw) if int(m.group(1)) > step), None)
    if cut is not None:
        write_atomically(path, lambda f: f.write(raw[:cut]))


def record_resumable_changes(run_dir: Path, cfg: RunConfig, identity: str | None) -> None:
    """Record in ``config.json`` the flags of the run's schedule that a resume changed
    (:data:`RECORDED_ON_RESUME`: ``--steps`` and the intervals; and ``--data`` by another
    path, :data:`RELOCATABLE`, once its bytes are known to be the same), so that a later
    ``--resume`` without them continues the same plan. Per-invocation flags (``--device``,
    ``--no-progress``) apply to this invocation only and are not recorded."""
    try:
        saved = json.loads((run_dir / CONFIG).read_text())
    except (OSError, ValueError):
        saved = None
    now = cfg.to_dict()
    if not isinstance(saved, dict):
        write_run_config(run_dir, cfg, identity)
        return
    recorded = (*RECORDED_ON_RESUME, *RELOCATABLE)
    if any(saved.get(k) != now[k] for k in recorded):
        updated = {**saved, **{k: now[k] for k in recorded}}
        text = json.dumps(updated, indent=2).encode()
        write_atomically(run_dir / CONFIG, lambda f: f.write(text))
