"""Steps until a model's validation metric beats the task's naive baseline.

    python bench/steps_to_baseline.py --task adding --seq-len 100 --models rda-scan lstm \
        --max-steps 1000 --eval-every 50 [--lr 1e-3] [--out runs/baseline]

Runs ``python -m fastrwa.train`` once per model (papers' defaults unless overridden) and
prints, per model, the first evaluated step whose validation metric beats the baseline by
``--margin`` (relative; default 10%, so noise around the baseline does not count), or "not
within N", the best validation metric and the wall time. ``--reuse`` reads existing run
directories instead of training. A training-dynamics measurement, not a speed benchmark:
numbers depend on seed and learning rate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from fastrwa.train.tasks import make_task


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="adding")
    p.add_argument("--seq-len", type=int, default=100)
    p.add_argument("--models", nargs="+", default=["rda-scan", "lstm"])
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin", type=float, default=0.1)
    p.add_argument("--reuse", action="store_true", help="read runs already in --out")
    p.add_argument("--out", type=Path, default=Path("runs/steps-to-baseline"))
    args = p.parse_args()
    task = make_task(args.task, args.seq_len)
    print(f"{args.task} T={args.seq_len}: baseline {task.metric} {task.baseline:.4g}, "
          f"lr {args.lr}, eval every {args.eval_every} steps, margin {args.margin:.0%}")
    target = task.baseline * (1 + args.margin if task.higher_is_better else 1 - args.margin)
    for model in args.models:
        run = args.out / f"{args.task}-T{args.seq_len}-{model}"
        start = time.time()
        if not args.reuse:
            subprocess.run([sys.executable, "-m", "fastrwa.train", "--task", args.task,
                            "--seq-len", str(args.seq_len), "--model", model, "--lr",
                            str(args.lr), "--steps", str(args.max_steps), "--eval-every",
                            str(args.eval_every), "--seed", str(args.seed), "--run-dir",
                            str(run), "--overwrite", "--no-progress"],
                           check=True, capture_output=True)
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
