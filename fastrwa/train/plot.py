"""``python -m fastrwa.train.plot RUN_DIR [RUN_DIR ...] [--out FILE]``: learning curves from
``metrics.jsonl``, several runs overlaid (e.g. RWA against LSTM, as in the papers' figures)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .metrics import read_records


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a fastrwa.train run directory)")
    return read_records(path)[1]


def _config(run_dir: Path) -> dict:
    path = Path(run_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is missing or not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a run configuration")
    return config


def plot_runs(run_dirs: list[Path], out: Path, skipped: list | None = None) -> Path:
    """Plot each run's train and valid metric against the step into ``out`` (PNG). The
    first run's metric sets the axis; a run without it cannot be overlaid and is listed in
    ``skipped`` as ``(run_dir, reason)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .tasks import TASKS, make_task

    fig, ax = plt.subplots(figsize=(7, 4.5))
    metric = None
    baselines = set()
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        config = _config(run_dir)
        name = f"{config.get('model')} ({Path(run_dir).name})"
        keys = [k for k in (records[0] if records else {}) if k not in ("step", "split", "loss")]
        own = keys[0] if keys else "loss"
        metric = metric or own
        if own != metric:
            if skipped is not None:
                skipped.append((run_dir, f"its metric is {own}, the plot's is {metric}"))
            continue
        if config.get("task") in TASKS:
            task = make_task(config["task"], int(config["seq_len"]))
            if task.metric == metric:
                baselines.add((task.name, task.baseline))
        for split, style in (("train", "-"), ("valid", "o--")):
            pts = [(r["step"], r[metric]) for r in records if r["split"] == split and metric in r]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{name} {split}", markersize=3)
    for name, value in sorted(baselines):
        ax.axhline(value, color="gray", linestyle=":", label=f"{name} naive baseline")
    ax.set_xlabel("step")
    ax.set_ylabel(metric or "metric")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = plot_path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_path(out: Path) -> Path:
    """The file a plot is written to: ``out``, with ``.png`` added when it has no suffix
    (what matplotlib would add unasked, so that the path reported is the path written). A
    directory is refused (``ValueError``): name a file in it."""
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name a file, e.g. "
                         f"{out / 'curves.png'}")
    return out if out.suffix else out.with_name(out.name + ".png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastrwa.train.plot", description=__doc__)
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="default: learning_curve.png in the single run "
                                            "directory, or curves.png here for several")
    args = p.parse_args(argv)
    out = args.out or (args.run_dirs[0] / "learning_curve.png" if len(args.run_dirs) == 1
                       else Path("curves.png"))
    skipped: list = []
    try:
        plot_path(out)                 # (refused before the runs are read)
        print(plot_runs(args.run_dirs, out, skipped))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for run_dir, reason in skipped:
        print(f"not overlaid: {run_dir} ({reason})", file=sys.stderr)
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
