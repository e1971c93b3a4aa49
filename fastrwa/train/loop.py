"""The training loop: one process or many (torchrun), atomic checkpoints, exact resume."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import stat
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..models import LMConfig, LMState, build, save_pretrained
from ..models.config import FIELDS_BEFORE_THEY_EXISTED
from ..models.pretrained import check_archive, write_atomically
from ..nn import CellState, LayerState, RRAState
from ..state import ScanState
from .config import LM_FLAG_FIELDS, RESUMABLE_CHANGES, RunConfig
from .device import Placement, placement
from .metrics import read_records
from .models import LM_LAYERS, SequenceNet, detach_state
from .optim import lr_factor, make_optimizer, set_lr
from .problems import make_problem

CHECKPOINT, CONFIG, METRICS = "checkpoint.pt", "config.json", "metrics.jsonl"
PLOT, SAMPLES, LOCK = "learning_curve.png", "samples.txt", "run.lock"
BEST, EXPORT = "best", "model"   # language models: save_pretrained directories
RUN_ID = "run_id"                # config.json's key for the run's identity (not a flag)
# Everything a run writes into its directory: --overwrite removes these and nothing else.
RUN_FILES = (CONFIG, METRICS, CHECKPOINT, PLOT, SAMPLES, LOCK, CHECKPOINT + ".tmp",
             METRICS + ".tmp", SAMPLES + ".tmp", CONFIG + ".tmp")
RUN_DIRS = (BEST, EXPORT)
MODEL_FILES = ("config.json", "model.pt", "config.json.tmp", "model.pt.tmp")
CPU = Placement(torch.device("cpu"), None)   # where checkpointed states go
# NamedTuples that a carried recurrent state may contain: allowed by weights-only loading.
torch.serialization.add_safe_globals([ScanState, LayerState, CellState, RRAState, LMState])


class RunDirError(RuntimeError):
    """A run directory that cannot be used as asked (exists, missing, incompatible)."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
        doomed = _removal_plan(run_dir)            # refuses before anything is removed
        hold.callback(os.close, lock_run_dir(run_dir))    # (refuses a run in progress)
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
    if CONFIG not in entries or others:
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


def save_checkpoint(path: Path, payload: dict) -> None:
    """Write atomically: a temporary file in the same directory, flushed to disk, then
    ``os.replace``. A failed write (a full disk: ``torch.save`` raises ``RuntimeError``)
    removes the temporary file, keeps the previous checkpoint and raises
    :class:`fastrwa.models.pretrained.WriteError` naming the file and the cause."""
    write_atomically(path, lambda f: torch.save(payload, f))


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
    changed = sorted(k for k in now.keys() | old.keys() if now.get(k) != old.get(k))
    data_before, data_now = recorded.get("data"), fingerprint
    same_bytes = data_before == data_now
    if changed == ["data"] and same_bytes and data_now is not None:
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
        raise RunDirError(f"--data {cfg.data} changed since checkpoint {path} was written: "
                          f"{show(data_before)} then, {show(data_now)} now; resume on the data "
                          f"the run trained on, or start a new run")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines logged after ``step`` (by a run killed after its last checkpoint),
    and a last line cut short by the kill."""
    if not path.is_file():
        return
    raw = [line for line in path.read_text().splitlines() if line.strip()]
    lines, records = read_records(path)
    keep = [line for line, record in zip(lines, records) if record["step"] <= step]
    if len(keep) == len(raw):
        return
    # A new file, then os.replace: a failure mid-write (a full disk) leaves the old one whole.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


SAMPLE_HEADER = re.compile(rb"^--- step (\d+) ---$", re.MULTILINE)


def _truncate_samples(path: Path, step: int) -> None:
    """Drop the samples written after ``step`` (each entry opens with ``--- step N ---``),
    and an entry cut short by a kill, as :func:`_truncate_metrics` does for metric lines."""
    if not path.is_file():
        return
    raw = path.read_bytes()
    cut = next((m.start() for m in SAMPLE_HEADER.finditer(raw) if int(m.group(1)) > step), None)
    if cut is not None:
        write_atomically(path, lambda f: f.write(raw[:cut]))


def _record_resumable_changes(run_dir: Path, cfg: RunConfig, identity: str | None) -> None:
    """Record in ``config.json`` the flags a resume changed (``--steps`` ...), so that a
    later ``--resume`` without them continues the same plan."""
    try:
        saved = json.loads((run_dir / CONFIG).read_text())
    except (OSError, ValueError):
        saved = {}
    now = cfg.to_dict()
    if any(saved.get(k) != now[k] for k in RESUMABLE_CHANGES):
        write_run_config(run_dir, cfg, identity)


def _slice(batch, lo: int, hi: int):
    """Rows ``lo:hi`` of a batch (a process's share, or one accumulation micro-batch)."""
    out = type(batch)(batch.x[lo:hi], batch.target[lo:hi], batch.mask[lo:hi])
    if hasattr(batch, "new_pass"):
        out.new_pass = batch.new_pass
    return out


def _mean_over_ranks(value: float, world: int) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


def build_model(cfg: RunConfig, problem) -> torch.nn.Module:
    """The network ``--model`` names: for a byte corpus a language model (``ByteLM`` for the
    scan models, ``RecurrentLM`` for the LSTM/GRU baselines) configured by ``--hidden``,
    ``--layers``, ``--attention`` and ``--lm``; otherwise a :class:`SequenceNet`."""
    if not cfg.is_lm:
        return SequenceNet(cfg.model, problem.input_size, cfg.hidden, cfg.layers,
                           problem.output_size, attention=cfg.attention)
    if cfg.model not in LM_LAYERS:
        raise ValueError(f"--model {cfg.model} is not a language model; --task {cfg.task} "
                         f"trains one of {sorted(LM_LAYERS)}")
    return build(lm_config(cfg))


def lm_config(cfg: RunConfig) -> LMConfig:
    """The :class:`LMConfig` of a language-model run: ``--model``, ``--hidden``, ``--layers``,
    ``--attention``, then the ``--lm`` fields over the defaults."""
    try:
        return LMConfig(layer=LM_LAYERS[cfg.model], d_model=cfg.hidden, n_layers=cfg.layers,
                        attention=cfg.attention, **cfg.lm)
    except TypeError as exc:           # an unknown field, or a bool given a number
        raise ValueError(f"--lm: {exc}") from exc


def with_every_lm_field(cfg: RunConfig) -> RunConfig:
    """A new language-model run records every ``LMConfig`` field in ``lm``, not only those
    given, so that a resume builds the same model whatever the defaults are by then."""
    if not cfg.is_lm or cfg.model not in LM_LAYERS:
        return cfg
    fields = lm_config(cfg).to_dict()
    for reserved in LM_FLAG_FIELDS:
        del fields[reserved]
    return dataclasses.replace(cfg, lm=fields)


def _better(value: float, best, higher_is_better: bool) -> bool:
    return best is None or (value > best if higher_is_better else value < best)


def train(cfg: RunConfig, run_dir: Path, resume: bool = False) -> dict:
    """Train as configured; return the latest record per split ("train", "valid", "test").
    Rank 0 writes the run directory. The test split is evaluated once, after the last step."""
    rank, world = _world()
    place = placement(cfg.device, cfg.autocast)
    torch.manual_seed(cfg.seed)
    micro, accum = cfg.batch_size, cfg.accum
    problem = make_problem(cfg, micro * accum * world)
    model = build_model(cfg, problem).to(place.device)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
    start, carried, clock, train_clock, best = 0, [None] * accum, 0.0, 0.0, None
    identity = run_id(run_dir)
    if resume and (run_dir / CHECKPOINT).is_file():
        # Everything is checked before anything in the run directory is touched.
        ckpt = load_checkpoint(run_dir / CHECKPOINT)
        check_checkpoint(ckpt, run_dir / CHECKPOINT)
        if ckpt.get("world_size", 1) != world:
            raise RunDirError(f"--resume {run_dir}: the run used {ckpt.get('world_size', 1)} "
                              f"process(es), this resume has {world}; the global batch and the "
                              f"carried states are per process, so use the same count")
        check_provenance(ckpt.get("run"), cfg, identity, problem.fingerprint, run_dir)
        if ckpt["step"] >= cfg.steps:
            raise RunDirError(
                f"--resume {run_dir}: nothing to train: the checkpoint is at step "
                f"{ckpt['step']} and --steps {cfg.steps} "
                + ("is where the run ended" if ckpt["step"] == cfg.steps else "is below it")
                + f"; pass --steps above {ckpt['step']} to train on")
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            start, best = ckpt["step"], ckpt.get("best")
            clock, train_clock = ckpt.get("elapsed", 0.0), ckpt.get("train_elapsed", 0.0)
            if ckpt["carried"]:
                carried = place.to(list(ckpt["carried"][rank]))
            torch.set_rng_state(ckpt["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            raise RunDirError(f"checkpoint {run_dir / CHECKPOINT} does not fit this run "
                              f"(written for another model or damaged: {type(exc).__name__}: "
                              f"{str(exc)[:300]}); remove it to restart the run") from exc
        if len(carried) != accum:
            raise RunDirError(f"checkpoint {run_dir / CHECKPOINT} carries {len(carried)} "
                              f"states, this run accumulates {accum} micro-batches")
    if rank == 0:
        _truncate_metrics(run_dir / METRICS, start)
        _truncate_samples(run_dir / SAMPLES, start)
        if resume:
            _record_resumable_changes(run_dir, cfg, identity)
        count = sum(p.numel() for p in dict.fromkeys(model.parameters()))
        print(f"model: {type(model).__name__} ({cfg.model}), {count:,} parameters, on "
              f"{place.device}" + (f", autocast {cfg.autocast}" if cfg.autocast != "none" else ""),
              file=sys.stderr)
    # On a stateful task the carried state replaces a layer's learned initial state after the
    # first segment of a pass, so those parameters get no gradient then: DDP must look for
    # unused parameters or it waits for their gradients forever (a crash at the next step).
    net = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[place.device.index] if place.device.type == "cuda" else None,
        find_unused_parameters=problem.stateful) if world > 1 else model
    forward = torch.compile(net) if cfg.compile else net
    last = {}   # the latest record per split
    tokens, train_time = 0, 0.0   # since the last train record
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, dynamic_ncols=True,
               disable=rank != 0 or not cfg.progress, desc=f"{cfg.task} {cfg.model}")
    for step in bar:
        began = time.perf_counter()
        model.train()
        lr = cfg.lr * lr_factor(step, cfg.warmup, cfg.decay_steps, cfg.schedule)
        set_lr(optimizer, lr)
        batch = problem.batch(step, micro * accum * world)
        batch = _slice(batch, rank * micro * accum, (rank + 1) * micro * accum)
        if problem.stateful and getattr(batch, "new_pass", False):
            carried = [None] * accum
        optimizer.zero_grad(set_to_none=True)
        loss_sum = metric_sum = 0.0
        for k in range(accum):
            part = place.to(_slice(batch, k * micro, (k + 1) * micro))
            # Gradients are averaged across processes once, after the last micro-batch.
            sync = world == 1 or k == accum - 1
            with contextlib.nullcontext() if sync else net.no_sync():
                with place.autocast():
                    output, state = forward(part.x, carried[k])
                loss, metric = problem.score(output.float(), part)
                (loss / accum).backward()
            carried[k] = detach_state(state) if problem.stateful else None
            loss_sum, metric_sum = loss_sum + float(loss.detach()), metric_sum + metric
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optimizer.step()
        tokens += batch.x.shape[0] * batch.x.shape[1] * world
        train_time += time.perf_counter() - began
        train_clock += time.perf_counter() - began
        done = step + 1
        records = []
        if done % cfg.log_every == 0 or done == cfg.steps:
            records.append({"step": done, "split": "train",
                            "loss": _mean_over_ranks(loss_sum / accum, world),
                            problem.metric: _mean_over_ranks(metric_sum / accum, world),
                            "lr": lr, "tokens_per_s": tokens / max(train_time, 1e-9)})
            tokens, train_time = 0, 0.0
        splits = (["valid"] if done % cfg.eval_every == 0 or done == cfg.steps else []) + \
            (["test"] if done == cfg.steps else [])
        for split in splits:
            model.eval()
            if getattr(problem, "shards_evaluation", False):
                result = problem.evaluate(model, micro, split, place, shard=(rank, world))
            else:       # (every process evaluates the same batches)
                result = problem.evaluate(model, micro, split, place)
                for key in ("loss", problem.metric):
                    result[key] = _mean_over_ranks(result[key], world)
            records.append({"step": done, "split": split, **result})
            if split != "valid" or rank != 0:
                continue
            if hasattr(model, "config") and _better(result[problem.metric], best,
                                                    problem.higher_is_better):
                best = result[problem.metric]
                save_pretrained(model, run_dir / BEST)
            text = problem.sample(model, done, place) if hasattr(problem, "sample") else None
            if text is not None:
                with open(run_dir / SAMPLES, "a", encoding="utf-8") as f:
                    f.write(f"--- step {done} ---\n{text}\n")
        clock += time.perf_counter() - began
        if records:
            for r in records:       # wall-clock, and the part of it spent on training steps
                r["elapsed_s"], r["train_s"] = clock, train_clock
            last.update({r["split"]: r for r in records})
            shown = {k: f"{v:.4g}" for k, v in records[0].items()
                     if k in ("loss", problem.metric, "tokens_per_s")}
            bar.set_postfix({**shown, "baseline": f"{problem.baseline:.4g}"})
            if rank == 0:
                with open(run_dir / METRICS, "a") as f:
                    for r in records:
                        f.write(json.dumps(r) + "\n")
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            states = [None] * world
            if world > 1:
                dist.all_gather_object(states, CPU.to(carried))
            else:
                states = [CPU.to(carried)]
            if rank == 0:
                save_checkpoint(run_dir / CHECKPOINT, {
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": done, "rng": torch.get_rng_state(), "world_size": world,
                    "elapsed": clock, "train_elapsed": train_clock, "best": best,
                    "carried": states if problem.stateful else None,
                    "run": provenance(cfg, identity, problem.fingerprint)})
        if done == cfg.steps and rank == 0 and hasattr(model, "config"):
            save_pretrained(model, run_dir / EXPORT)
    bar.close()
    return last

