"""``python -m fastrwa.train``: train a task on one machine or many (torchrun).

With no arguments: the adding problem (T=100) with an RWA scan layer, a few minutes on a
laptop CPU, into ``runs/adding-rwa-scan-<time>``, with a progress bar, ``metrics.jsonl``, a
checkpoint and ``learning_curve.png``. ``--resume RUN_DIR`` continues a run (killed or
finished) exactly where its last checkpoint left it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..kernels.codes import ATTENTIONS
from ..models.files import WriteError
from ..options import add_device, add_overwrite
from .config import (AUTOCASTS, DEFAULTS, DEVICES, LM_ONLY_MODELS, RELOCATABLE, RESUMABLE_CHANGES,
                     SCHEDULES, RunConfig, flag_name, parse_lm_field)
from .budget import Deadline, calibrate, plan
from .data import check_corpus_path
from .device import process_group_backend, resolve_device
from .loop import train
from .models import LM_LAYERS, MODELS, check_lm_flags
from .problems import ALL_TASKS, make_problem
from .rundir import (CHECKPOINT, CONFIG, PLOT, RunDirError, discard_unstarted_run,
                     prepare_run_dir)
from .stop import Interrupted, StopRequests, Stopped, stop_requests
from .tasks import TASKS
from .threads import parse_threads, pick
from .verdict import verdict


def unescape(text: str) -> str:
    """``--pack SEP``: backslash escapes (``\\n``, ``\\t``, ``\\x00``, ``\\u2028``) read,
    every other character kept as it is."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--pack {text!r}: a broken escape ({exc.reason})")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastrwa.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = RunConfig()
    seq, lm = DEFAULTS["sequence"], DEFAULTS["lm"]
    per_kind = lambda name: f"default {seq[name]}, byte corpora {lm[name]}"  # noqa: E731
    add = lambda flag, **kw: p.add_argument(flag, default=None, **kw)  # noqa: E731
    add("--task", choices=ALL_TASKS, help=f"default {defaults.task}; synthetic: {sorted(TASKS)}")
    add("--model", choices=MODELS + LM_ONLY_MODELS, help=f"{per_kind('model')}; byte corpora take "
                                        f"{sorted(LM_LAYERS)}")
    add("--seq-len", type=int, help=f"synthetic tasks' T (default {defaults.seq_len})")
    add("--hidden", type=int, help=f"units per layer, d_model of an LM ({per_kind('hidden')})")
    add("--layers", type=int, help=f"stacked layers or LM blocks ({per_kind('layers')})")
    add("--attention", choices=ATTENTIONS, help=f"f_a of RDA models ({per_kind('attention')})")
    add("--batch-size", type=int, help=f"per process and micro-batch ({per_kind('batch_size')})")
    add("--accum", type=int, help="micro-batches accumulated per optimizer step (default 1)")
    add("--context-parallel", type=int, metavar="N",
        help="byte corpora, scan models: split each BPTT segment along time over N processes "
             "of torchrun (which runs a multiple of N: that many data-parallel replicas); "
             "docs/distributed.md (default 1)")
    add("--lr", type=float, help=f"peak AdamW learning rate ({per_kind('lr')})")
    add("--weight-decay", type=float, help=f"AdamW weight decay of matrices, not of norms, "
                                           f"biases or embeddings ({per_kind('weight_decay')})")
    add("--warmup", type=int, help=f"linear warmup steps ({per_kind('warmup')})")
    add("--schedule", choices=SCHEDULES, help=f"after warmup ({per_kind('schedule')})")
    add("--decay-steps", type=int, help="steps the schedule decays over (default --steps; "
                                         "fixed when a run starts, so --resume with more "
                                         "--steps keeps it)")
    add("--clip", type=float, help=f"gradient-norm clipping, 0 = off (default {defaults.clip})")
    add("--steps", type=int, help=f"optimizer steps ({per_kind('steps')})")
    p.add_argument("--minutes", type=float, metavar="M",
                   help="instead of --steps: a run that ends within M minutes (fractions "
                        "allowed) of its start, evaluations included: the steps that fill "
                        "them from a short calibration of this run's model and batch (the "
                        "schedule decays over them; the warm-up and the intervals not given "
                        "scale to them); a run whose steps get slower ends earlier, and "
                        "says so")
    add("--seed", type=int, help=f"default {defaults.seed}")
    add("--bptt", type=int, help=f"byte corpora: segment length (default {defaults.bptt})")
    add("--pack", nargs="?", const="\n\n", type=unescape, metavar="SEP",
        help="byte corpora, scan models: documents end with SEP, text in UTF-8 (escapes "
             "such as \\n read; \\xNN is the character U+00NN; --pack=SEP for one that "
             "starts with -; alone: blank lines); each is run from the initial state, packed "
             "into the rows without padding, nothing carried between steps "
             "(docs/training.md)")
    add("--data", help="enwik8 (raw or .zip) / text: a file; mnist, pmnist: the IDX directory")
    add_device(p, default=None)
    add("--autocast", choices=AUTOCASTS, help="bf16: forward in bfloat16 autocast (default none)")
    p.add_argument("--lm", type=parse_lm_field, action="append", metavar="KEY=VALUE",
                   help="byte corpora: an LMConfig field of the model, e.g. --lm mlp_ratio=2 "
                        "(repeatable; see docs/lm.md)")
    add("--eval-every", type=int, help=f"steps between evaluations ({per_kind('eval_every')})")
    add("--eval-batches", type=int, help=f"synthetic tasks (default {defaults.eval_batches})")
    add("--eval-bytes", type=int, help="byte corpora: validation bytes scored, 0 = the whole "
                                       "split (default 0; the test split is always whole)")
    add("--log-every", type=int, help=f"default {defaults.log_every}")
    add("--checkpoint-every", type=int, help=per_kind("checkpoint_every"))
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar")
    p.add_argument("--run-dir", type=Path, help="default runs/<task>-<model>-<time>")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue this run; it says the step it resumes from (the flags the "
                        "run started with may be given again, with the same values)")
    add_overwrite(p, "--run-dir", "fastrwa run")
    p.add_argument("--threads", type=parse_threads, default="auto", metavar="N",
                   help="CPU threads of each process (not recorded: a machine's setting); "
                        "auto: PyTorch's count, less, in a one-process CPU run, the cores "
                        "other programs keep busy when the run starts "
                        "(threads sharing a busy core make steps several times slower; "
                        "docs/training.md). A resume is bit-identical on the same count "
                        "(default auto)")
    return p


def _config(args: argparse.Namespace) -> tuple[RunConfig, dict]:
    """The run's config from the flags, and the flags given. On ``--resume`` the saved run's
    config is the one trained, the flags given are compared with it (:func:`_resolve_run`),
    and only those that may change are read here: a flag the run was started with
    (``--pack SEP``, ``--context-parallel N``) means nothing without its ``--task``."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if "lm" in given:
        given["lm"] = dict(given["lm"])
    if "data" in given:        # (absolute: a run resumes from any directory)
        given["data"] = os.path.abspath(given["data"])
    if args.resume is not None:
        return RunConfig(**{k: v for k, v in given.items() if k in RESUMABLE_CHANGES}), given
    cfg = RunConfig(**given)
    if cfg.is_lm:
        check_lm_flags(cfg.model, given.get("lm", {}), "attention" in given)
    return cfg, given


def _budgeted(args, cfg: RunConfig, given: dict, started: float) -> tuple[RunConfig, Deadline]:
    """``cfg`` planned to end ``--minutes`` after ``started`` (``time.monotonic()``), and
    the deadline the loop keeps to (:mod:`fastrwa.train.budget`)."""
    if "steps" in given:
        raise ValueError("--minutes sets the steps of a new run: not with --steps")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--minutes calibrates in one process; under torchrun give --steps")
    cal = calibrate(cfg)
    budget = args.minutes * 60
    planned = plan(cfg, given, budget - (time.monotonic() - started), cal)
    print(f"--minutes {args.minutes:g}: {cal.step_s:.3g} s a step here, {cal.valid_s:.3g} s "
          f"an evaluation: {planned.steps} steps, evaluated every {planned.eval_every}, "
          f"warm-up {planned.warmup}", file=sys.stderr)
    return planned, Deadline(started + budget, args.minutes, cal)


def _resolve_run(args, cfg: RunConfig, given: dict,
                 hold: contextlib.ExitStack) -> tuple[Path, RunConfig]:
    """The run directory and the config to train with; the directory is checked, made or
    reopened and locked for this process (released when ``hold`` closes)."""
    if args.resume is not None:
        if args.run_dir is not None and args.run_dir.resolve() != args.resume.resolve():
            raise RunDirError("--resume RUN_DIR and --run-dir name different directories")
        saved = prepare_run_dir(args.resume, cfg, resume=True, overwrite=False, hold=hold)
        if saved.is_lm:
            check_lm_flags(saved.model, given.get("lm", {}), "attention" in given)
        if "lm" in given:              # --lm on resume names fields, over the saved ones
            given = {**given, "lm": {**saved.lm, **given["lm"]}}
        # Flags that differ from the saved run are named first: a config built from them
        # could fail on their combination (--task adding with the saved run's --lm).
        before = saved.to_dict()
        clash = [f"{flag_name(k)}: saved {before[k]!r}, given {v!r}" for k, v in given.items()
                 if k not in (*RESUMABLE_CHANGES, *RELOCATABLE) and before[k] != v]
        if clash:
            raise RunDirError(f"--resume {args.resume}: flags that cannot change on resume: "
                              + "; ".join(clash))
        # (a --data that names the corpus another way is taken: the checkpoint's record of
        # its bytes decides whether it is the same corpus)
        changes = {k: v for k, v in given.items() if k in (*RESUMABLE_CHANGES, *RELOCATABLE)}
        return args.resume, dataclasses.replace(saved, **changes)
    run_dir = args.run_dir or Path("runs") / f"{cfg.task}-{cfg.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    return run_dir, prepare_run_dir(run_dir, cfg, resume=False, overwrite=args.overwrite,
                                    hold=hold)


def run_device(args, cfg: RunConfig, given: dict) -> str:
    """The ``--device`` the run will train on, known before the process group exists (which
    must match it): the flag when given, else on ``--resume`` the saved run's (read here
    without checks: rank 0 validates the directory next), else the default."""
    if "device" in given or args.resume is None:
        return cfg.device
    try:
        saved = json.loads((Path(args.resume) / CONFIG).read_text()).get("device")
    except (OSError, ValueError, AttributeError):
        return cfg.device
    return saved if saved in DEVICES else cfg.device


@dataclasses.dataclass
class _Run:
    """Where a run stands, for the line that ends it when a signal stops it at once."""

    resume: Path | None                  # --resume
    world: int = 1
    rank: int = 0
    run_dir: Path | None = None          # once made (or reopened) and locked

    def resume_command(self) -> str:
        how = "python -m fastrwa.train" if self.world == 1 else \
            f"torchrun with {self.world} processes, -m fastrwa.train"
        return f"{how} --resume {self.run_dir}"

    def kept(self, stops: StopRequests) -> str:
        """What the run directory holds after the stop."""
        if self.run_dir is None:
            return "nothing was written" if self.resume is None else \
                f"{self.resume} is as it was"
        if not (self.run_dir / CONFIG).is_file():
            return "nothing was kept (the new run's files are removed)"
        if stops.phase == "report":
            return (f"the run had ended: its checkpoint (step {stops.checkpoint}) and "
                    f"{PLOT} are written")
        if stops.checkpoint is not None and stops.checkpoint == stops.step:
            if stops.phase == "final evaluation":
                return (f"the run had ended: its checkpoint (step {stops.checkpoint}) is "
                        f"written; python -m fastrwa.train.plot {self.run_dir} draws its "
                        f"learning curve")
            return (f"the checkpoint of step {stops.checkpoint} is written; resume with: "
                    f"{self.resume_command()}")
        if (self.run_dir / CHECKPOINT).is_file():
            lost = "no checkpoint was written for this stop; " \
                if stops.phase in ("training", "final evaluation") else ""
            at = "" if stops.checkpoint is None else f" (step {stops.checkpoint})"
            return (f"{lost}{self.run_dir} keeps its last checkpoint{at}; resume with: "
                    f"{self.resume_command()}")
        return f"the run has no checkpoint: {self.resume_command()} starts it over"


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status. SIGINT and SIGTERM end it with one line
    (:mod:`fastrwa.train.stop`): at once before the step loop and on a second SIGINT (exit
    status 128 + the signal), at a step boundary with a checkpoint in it, and after the
    last step once the report and the learning curve are written."""
    started = time.monotonic()
    threads = torch.get_num_threads()   # (restored at the end: main may be called from a program)
    with stop_requests() as stops, _restored_threads(threads):
        run = _Run(None, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))
        try:
            args = parser().parse_args(argv)
            run.resume = args.resume
            return _main(args, stops, run, started)
        except Interrupted as stop:
            if run.rank == 0:
                print(stop.line(run.kept(stops)), file=sys.stderr)
            return stop.status


def _main(args: argparse.Namespace, stops: StopRequests, run: _Run, started: float) -> int:
    try:
        cfg, given = _config(args)
        threads_line = None       # (said once the flags are known to be good)
        if args.threads != "auto" or (
                run.world == 1 and resolve_device(run_device(args, cfg, given)).type == "cpu"):
            threads_line = _set_threads(args.threads)
        if cfg.is_lm and args.resume is None:  # (before a run directory is named or made)
            if not cfg.data:
                raise ValueError(f"--task {cfg.task} needs --data PATH (a corpus file)")
            check_corpus_path(cfg.data)
        deadline = None
        if args.minutes is not None and not (math.isfinite(args.minutes) and args.minutes > 0):
            raise ValueError(f"--minutes must be a positive finite number, got {args.minutes}")
        if args.overwrite and args.resume is not None:
            raise ValueError(f"--overwrite replaces a new run's --run-dir; --resume "
                             f"{args.resume} continues that run as it is: give one of them")
        if args.minutes is not None and args.resume is not None:
            # (the whole command of a --minutes run with --resume added: config.json keeps
            # the steps its plan made, or the --steps it was started with)
            print(f"--minutes {args.minutes:g} does not apply to a resume: the run trains to "
                  f"the steps its {CONFIG} holds (or --steps), without a deadline",
                  file=sys.stderr)
        elif args.minutes is not None:
            threads_line = _say(threads_line) if run.rank == 0 else None
            stops.enter("calibration")
            cfg, deadline = _budgeted(args, cfg, given, started)
            stops.enter("start-up")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    world = run.world
    if world > 1 and not dist.is_initialized():
        try:
            device = resolve_device(run_device(args, cfg, given))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend(device))
    rank = run.rank = dist.get_rank() if world > 1 else 0
    hold = contextlib.ExitStack()      # the run directory's lock, while this run lasts
    run_dir, fresh = None, args.resume is None
    try:
        answer = [None, None, None]
        if rank == 0:
            created = not (args.run_dir is not None and args.run_dir.exists())
            try:
                if args.overwrite and args.resume is None:
                    make_problem(cfg, 1)   # (the data is refused before the old run is removed)
                with stops.uninterrupted():    # (made, locked and known here as one)
                    answer[:2] = _resolve_run(args, cfg, given, hold)
                    run_dir = run.run_dir = answer[0]
            except (RunDirError, ValueError, OSError) as exc:
                # (OSError: flock's ENOLCK on NFS, an unlink that fails ...: every rank is
                # told, none waits forever in the broadcast)
                answer[2] = _one_line(exc)
        if world > 1:
            dist.broadcast_object_list(answer, src=0)
        run_dir, cfg, error = answer
        if error:
            run_dir = None             # (nothing was made)
            raise RunDirError(error)
        run.run_dir = run_dir
        if rank == 0:
            _say(threads_line)
            print(f"run directory: {run_dir}", file=sys.stderr)
        last = train(cfg, run_dir, resume=args.resume is not None, deadline=deadline)
        fresh = False
        if rank == 0:
            _report(cfg, run_dir, last, stops)
        if stops.signum:               # (received after the last step: noted until here)
            if rank == 0:
                print(f"{signal.Signals(stops.signum).name}: the run ended after its last "
                      f"step ({stops.checkpoint}), with its checkpoint, report and "
                      f"{PLOT}", file=sys.stderr)
            return 128 + stops.signum
        return 0
    except Stopped as stop:
        fresh = False
        if rank == 0:
            print(f"{stop}: the checkpoint is saved; resume with: {run.resume_command()}",
                  file=sys.stderr)
        return 128 + stop.signum
    except (RunDirError, ValueError, FileNotFoundError, WriteError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:     # a full disk, a directory that cannot be written
        kept = (f"the files written in {run_dir} before it (metrics, the last checkpoint) "
                f"are kept; only a new run that had written nothing but its {CONFIG} is "
                f"removed" if run_dir is not None else "nothing was written")
        print(f"error: {_one_line(exc)}; {kept}", file=sys.stderr)
        return 2
    finally:
        if fresh and rank == 0 and run_dir is not None:   # a new run that never started
            discard_unstarted_run(run_dir, created)
        hold.close()
        if world > 1 and dist.is_initialized():
            # (DDP's reducer, in reference cycles, holds the groups: collected here, their
            # gloo threads end now rather than in the interpreter's teardown, where they
            # could abort the process: "terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()


@contextlib.contextmanager
def _restored_threads(threads: int):
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _set_threads(flag: int | str) -> str | None:
    """``--threads`` (``auto`` only for a one-process CPU run), before anything is timed
    (the ``--minutes`` calibration) or run; the line that says why fewer threads than
    PyTorch's (``None``: nothing to say), said once the flags are known to be good."""
    threads, line = pick(flag, torch.get_num_threads())
    torch.set_num_threads(threads)
    return line


def _say(line: str | None) -> None:
    """Write ``line`` (if any) to stderr; ``None``: it has been said."""
    if line is not None:
        print(line, file=sys.stderr)


def _one_line(exc: Exception) -> str:
    """The message of an error, an ``OSError`` from the system as its cause and file."""
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, WriteError):
        return f"{exc.strerror} ({exc.filename or 'the run directory'})"
    return str(exc)


def _report(cfg: RunConfig, run_dir: Path, last: dict, stops: StopRequests) -> None:
    """The learning curve, then the final records against the task's baseline. The report
    phase starts with the curve drawn whole (a signal waits for it): a run stopped in it has
    its curve."""
    with stops.uninterrupted():
        stops.enter("report")
        from .plot import plot_runs

        png = plot_runs([run_dir], run_dir / PLOT)
    problem = make_problem(cfg, 1) if cfg.task in TASKS else None
    for split in ("valid", "test"):
        record = last.get(split)
        if record is None:
            continue
        if problem is not None:
            value = record[problem.metric]
            said = verdict(value, problem.baseline, problem.higher_is_better,
                           scored=record.get("scored") if problem.metric == "accuracy" else None,
                           se=record.get("se"), batches=record.get("batches", 0))
            print(f"{cfg.task}: {split} {problem.metric} {value:.4g} vs naive baseline "
                  f"{problem.baseline:.4g}: {said}")
        else:
            whole = "" if record.get("whole", True) else \
                f" (the first {record['bytes']:,} bytes of the split, not all of it)"
            print(f"{cfg.task}: {split} " + ", ".join(
                f"{k} {v:.4g}" for k, v in record.items()
                if k not in ("step", "split", "bytes", "whole", "elapsed_s", "train_s"))
                + whole)
    print(f"learning curve: {png}")
