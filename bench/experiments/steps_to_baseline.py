"""Steps until a model's validation metric beats the task's naive baseline.

    python -m bench.experiments.steps_to_baseline --task adding --seq-len 100 \
        --models rda-scan lstm \
        --max-steps 1000 --eval-every 50 [--lr 1e-3] [--out DIR]

Runs ``python -m fastrwa.train`` once per model (papers' defaults unless overridden) and
prints, per model, the first evaluated step whose validation metric beats the baseline by
``--margin`` (relative; default 10%, so noise around the baseline does not count), or "not
within N", the best validation metric and the wall time. ``--reuse`` reads existing run
directories instead of training. The runs go to ``--out`` (by default
``bench-results/steps_to_baseline``, which git ignores; a folder under bench/results only with
``--record``). A training-dynamics measurement, not a speed benchmark:
numbers depend on seed and learning rate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.cli import (add_out, check_out, fraction, nonnegative_int, positive_float,
                       positive_int, scratch_dir)
from fastrwa.train.config import RunConfig
from fastrwa.train.models import MODELS
from fastrwa.train.tasks import TASKS, make_task


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2) before any run,
    ``--out`` settled."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="adding", choices=sorted(TASKS))
    p.add_argument("--seq-len", type=positive_int, default=100)
    p.add_argument("--models", nargs="+", default=["rda-scan", "lstm"], choices=MODELS)
    p.add_argument("--max-steps", type=positive_int, default=1000)
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--margin", type=fraction, default=0.1,
                   help="relative, from 0 to below 1 (default 0.1)")
    p.add_argument("--reuse", action="store_true", help="read runs already in --out")
    add_out(p, "steps_to_baseline", "the training runs", record=False)
    args = p.parse_args(argv)
    if args.eval_every > args.max_steps:
        p.error(f"--eval-every ({args.eval_every}) must not exceed --max-steps "
                f"({args.max_steps}): a run evaluates every --eval-every steps")
    try:
        make_task(args.task, args.seq_len)
        for model in args.models:
            RunConfig(task=args.task, seq_len=args.seq_len, model=model, lr=args.lr,
                      steps=args.max_steps, eval_every=args.eval_every, seed=args.seed)
    except ValueError as exc:
        p.error(str(exc))
    if args.reuse:                       # (reads --out, writes nothing)
        args.out = args.out or scratch_dir("steps_to_baseline")
        missing = [str(run_dir(args, m)) for m in args.models
                   if not (run_dir(args, m) / "metrics.jsonl").is_file()]
        if missing:
            p.error(f"--reuse: no run in {', '.join(missing)}")
    else:
        check_out(p, args, "steps_to_baseline", record=False)
    return args


def run_dir(args: argparse.Namespace, model: str) -> Path:
    """Where ``model``'s run is kept."""
    return args.out / f"{args.task}-T{args.seq_len}-{model}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = make_task(args.task, args.seq_len)
    print(f"{task.name} T={args.seq_len}: baseline {task.metric} {task.baseline:.4g}, "
          f"lr {args.lr}, eval every {args.eval_every} steps, margin {args.margin:.0%}")
    target = task.baseline * (1 + args.margin if task.higher_is_better else 1 - args.margin)
    for model in args.models:
        run = run_dir(args, model)
        start = time.time()
        if not args.reuse:
            done = subprocess.run([sys.executable, "-m", "fastrwa.train", "--task", task.name,
                                   "--seq-len", str(args.seq_len), "--model", model, "--lr",
                                   str(args.lr), "--steps", str(args.max_steps),
                                   "--eval-every", str(args.eval_every), "--seed",
                                   str(args.seed), "--run-dir", str(run), "--overwrite",
                                   "--no-progress"], capture_output=True, text=True)
            if done.returncode:
                sys.stderr.write(done.stderr)
                print(f"error: the {model} run failed (python -m fastrwa.train exited with "
                      f"status {done.returncode})", file=sys.stderr)
                return 1
        seconds = time.time() - start
        valid = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        valid = [r for r in valid if r["split"] == "valid"]
        beats = [r["step"] for r in valid if (r[task.metric] > target if task.higher_is_better
                                              else r[task.metric] < target)]
        best = (max if task.higher_is_better else min)(r[task.metric] for r in valid)
        when = f"beats the baseline by {args.margin:.0%} at step {beats[0]}" if beats else \
            f"does not beat the baseline by {args.margin:.0%} within {args.max_steps} steps"
        timing = "" if args.reuse else f"; {seconds:.0f} s"
        print(f"  {model:<10} {when}; best {task.metric} {best:.4g}{timing}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
