"""The language-model comparison, in one command: ``python -m bench.experiments.lm [--minutes M]``.

Trains the fastrwa byte LM (``ByteLM``, RDA blocks) and the baselines (``RecurrentLM``'s
LSTM and GRU; ``TransformerLM``, a nanoGPT-style Transformer whose context is the BPTT;
``MinGRULM``, minGRU in ByteLM's blocks: the same embedding, norm, tied head, data and loop)
through the trainer's CLI, each on the same corpus with the same batch, BPTT, optimizer and
schedule, at equal parameter counts (the baselines' width is solved to the parameter count
nearest the fastrwa model's, within a few percent; the counts are printed; the Transformer
and minGRU have as many blocks as the fastrwa model, LSTM and GRU ``--baseline-layers``).
Two comparisons:

* ``--equal time`` (default): every model trains for ``--minutes`` of training time. Its step
  count comes from a short calibration run (seconds per step), and its cosine schedule
  decays over exactly those steps.
* ``--equal steps``: every model trains for ``--steps`` steps.

Writes the runs under ``OUT/runs/``, ``OUT/lm.json`` (every run's records and settings),
``OUT/lm.png`` (validation bpc against step and against training seconds) and prints a
markdown table: parameters, steps, s/step, tokens/s, the ratio of tokens/s to LSTM's, final
validation bpc on the first ``--eval-bytes`` of the split, and test bpc on the whole test
split. ``--out``: by default ``bench-results/lm``, which git ignores; the committed record,
bench/results/lm, only with ``--record``, never from a check run: ``--quick``, ``--minutes``
(equal time) or the batch, BPTT, ``--evals``, ``--eval-bytes``, ``--baseline-layers`` below
the defaults, ``--steps`` below 600 (equal steps), a model of 5% fewer parameters than
256 x 4's (``--d-model``, ``--layers``). docs/lm.md records a run.
``--quick`` runs each model for 4 steps (equal steps: no calibration runs) on a slice (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import torch

from bench.cli import (ROOT, add_out, check_out, choices_list, existing_file,
                       nonnegative_int, positive_float, positive_int)
from bench.cli import save_figure, save_json
from fastrwa.models import LMConfig, build
from fastrwa.models.config import LAYER_FIELDS, OPTIONAL_FIELDS
from fastrwa.train.config import RunConfig, parse_lm_field
from fastrwa.train.device import resolve_device
from fastrwa.train.models import LM_LAYERS as LAYER

BLOCKS = ("rda", "rwa", "transformer", "mingru")     # layers with ByteLM's depth


def own_fields(model: str, lm: dict) -> dict:
    """The ``--lm`` fields ``model`` reads: they go to the fastrwa models (an RDA-only field
    skips ``rwa-scan``); the baselines keep their defaults."""
    if LAYER[model] not in ("rda", "rwa"):
        return {}
    return {k: v for k, v in lm.items()
            if k in LAYER_FIELDS[LAYER[model]] or k not in OPTIONAL_FIELDS}


def params(model: str, d_model: int, n_layers: int, lm: dict) -> int:
    """The parameter count of ``model`` at ``d_model`` x ``n_layers`` with the ``LMConfig``
    fields of ``lm`` it reads (a tied embedding counted once)."""
    config = LMConfig(layer=LAYER[model], d_model=d_model, n_layers=n_layers,
                      **own_fields(model, lm))
    return sum(p.numel() for p in dict.fromkeys(build(config).parameters()))


def matched_width(model: str, target: int, n_layers: int, lm: dict | None = None) -> int:
    """The width (a multiple of 8) whose parameter count, with the ``LMConfig`` fields
    ``lm``, is closest to ``target``."""
    counts = {}
    for d in range(8, 8192, 8):            # parameters grow with d: stop past the target
        counts[d] = params(model, d, n_layers, lm or {})
        if counts[d] > target:
            break
    return min(counts, key=lambda d: abs(counts[d] - target))


def target_params(models: list[str], d_model: int, n_layers: int, lm: dict) -> int:
    """The parameter count every model is matched to: the first fastrwa model's in
    ``models``, or ByteLM's (``rda-scan``) at ``d_model`` x ``n_layers`` when only baselines
    run (so that a later run of baselines matches an earlier ByteLM run)."""
    fast = [m for m in models if LAYER[m] in ("rda", "rwa")]
    return params(fast[0] if fast else "rda-scan", d_model, n_layers, lm)


def table_or_missing_data(p: argparse.ArgumentParser, args: argparse.Namespace, table,
                          kind: str = "an lm.json of bench/experiments/lm.py") -> bool:
    """``--table JSON``: print that run's table and return ``True`` (the script is done); a
    file that is missing or not ``kind`` is refused (``p.error``: one ``error:`` line, exit
    2), and so is a run without ``--data``. ``False``: go on."""
    if args.table:
        try:
            text = table(json.loads(args.table.read_text()))
        except OSError as exc:
            p.error(f"--table {args.table}: {exc.strerror or exc}")
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            p.error(f"--table {args.table} is not {kind} ({type(exc).__name__}: {exc})")
        print(text)
        return True
    if args.data is None:
        p.error("--data FILE: a byte corpus is needed")
    return False


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Refuse, before any work, every value a run would fail on (``p.error``: one ``error:``
    line, exit 2) beyond what the flags' types refuse: the ``--lm`` fields (as ``LMConfig``
    takes them), the trainer's own checks of every run (its ``RunConfig``), ``--out`` (a
    check run never writes the record). Returns the ``--lm`` fields."""
    try:
        lm = dict(parse_lm_field(item) for item in args.lm)
        for m in args.models:
            if LAYER[m] in ("rda", "rwa"):
                params(m, args.d_model, args.layers, lm)         # LMConfig refuses a field
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        p.error(f"--lm: {exc}")
    try:
        resolve_device(args.device)                  # (--device cuda where there is none)
        for m in args.models:
            RunConfig(task="text", data=str(args.data), model=m, hidden=args.d_model,
                      layers=args.layers, batch_size=args.batch_size, bptt=args.bptt,
                      lr=args.lr, seed=args.seed, eval_bytes=args.eval_bytes,
                      device=args.device, autocast=args.autocast, steps=args.steps,
                      lm=own_fields(m, lm))
    except ValueError as exc:
        p.error(str(exc))
    check_out(p, args, "lm", sizes=run_sizes(args), small=smaller_model(p, args, lm))
    return lm


# --equal steps: the fewest steps of a full run (docs/lm.md's equal-steps records: 600)
FULL_STEPS = 600


def run_sizes(args: argparse.Namespace) -> dict:
    """The flags (dests) that make a run a check run below a full run's value (``None``: the
    default): ``--minutes`` at equal time, ``--steps`` below 600 at equal steps, the batch,
    BPTT, evaluations and the baselines' depth. Not ``--models``: the records are of chosen
    sets of models (bench/results/lm/lm.json's is three of the five)."""
    return {"minutes" if args.equal == "time" else "steps":
            None if args.equal == "time" else FULL_STEPS,
            "baseline_layers": None, "batch_size": None, "bptt": None, "evals": None,
            "eval_bytes": None}


def smaller_model(p: argparse.ArgumentParser, args: argparse.Namespace, lm: dict) -> list[str]:
    """``--d-model``/``--layers`` where the model every one is matched to has 5% fewer
    parameters than at the defaults (a check run; depth traded for width at equal
    parameters, docs/lm.md's 360 x 2 against 256 x 4, is not one)."""
    if not args.record:
        return []
    full = target_params(args.models, p.get_default("d_model"), p.get_default("layers"), lm)
    if target_params(args.models, args.d_model, args.layers, lm) >= 0.95 * full:
        return []
    shrunk = [f"--{n.replace('_', '-')}" for n in ("d_model", "layers")
              if getattr(args, n) < p.get_default(n)]
    return shrunk or ["--d-model", "--layers"]


class RunFailed(Exception):
    """A training run exited with an error (the trainer printed why)."""


def run(name: str, flags: list, out: pathlib.Path) -> list[dict]:
    """One training run through the CLI; its metrics records. Raises :class:`RunFailed`
    when the trainer exits with an error."""
    run_dir = out / "runs" / name
    cmd = [sys.executable, "-m", "fastrwa.train", *map(str, flags), "--run-dir", str(run_dir),
           "--overwrite", "--no-progress"]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    if done.returncode:
        raise RunFailed(f"the {name} run failed (python -m fastrwa.train exited with status "
                        f"{done.returncode}; its message is above)")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict | None]:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled,
    and the ``--lm`` fields; ``None`` for them when ``--table`` printed its table (done)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=existing_file, help="a byte corpus file (required)")
    p.add_argument("--equal", choices=("time", "steps"), default="time")
    p.add_argument("--minutes", type=positive_float, default=20.0,
                   help="training time per model")
    p.add_argument("--steps", type=positive_int, default=1000,
                   help="--equal steps: steps per model")
    p.add_argument("--models", type=choices_list(sorted(LAYER)),
                   default=["rda-scan", "lstm", "gru", "transformer", "mingru"],
                   help="comma-separated (default rda-scan,lstm,gru,transformer,mingru)")
    p.add_argument("--d-model", type=positive_int, default=256,
                   help="the fastrwa model's width")
    p.add_argument("--layers", type=positive_int, default=4, help="the fastrwa model's blocks")
    p.add_argument("--baseline-layers", type=positive_int, default=2,
                   help="LSTM and GRU layers")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--bptt", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--seed", type=nonnegative_int, default=0, help="every run's seed")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--autocast", choices=("none", "bf16"), default="none",
                   help="bf16: the forward in bfloat16 autocast (a GPU run)")
    p.add_argument("--evals", type=positive_int, default=10, help="evaluations per run")
    p.add_argument("--eval-bytes", type=positive_int, default=100_000)
    p.add_argument("--lm", action="append", default=[], metavar="KEY=VALUE",
                   help="LMConfig fields of the fastrwa models (each takes those it reads)")
    add_out(p, "lm", "lm.json, lm.png and the runs")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--table", type=pathlib.Path, metavar="LM_JSON",
                   help="print the table of an earlier run's lm.json and stop")
    args = p.parse_args(argv)
    if table_or_missing_data(p, args, table):
        return args, None
    return args, check_args(p, args)


def _main(argv: list[str] | None) -> int:
    args, lm = parse_args(argv)
    if lm is None:
        return 0
    if args.quick:              # seconds: tiny models on the corpus's first 100 KB
        args.equal, args.steps, args.d_model, args.layers = "steps", 4, 32, 2
        args.batch_size, args.bptt, args.evals, args.eval_bytes = 4, 32, 2, 2000
        sliced = args.out / "corpus-100k.txt"
        sliced.write_bytes(args.data.read_bytes()[:100_000])
        args.data = sliced
    models = args.models
    target = target_params(models, args.d_model, args.layers, lm)
    depth = {m: args.layers if LAYER[m] in BLOCKS else args.baseline_layers for m in models}
    shapes = {m: (args.d_model, depth[m]) if LAYER[m] in ("rda", "rwa") else
              (matched_width(m, target, depth[m]), depth[m]) for m in models}
    counts = {m: params(m, *shapes[m], lm) for m in models}   # (own_fields picks each's)
    for m in models:
        print(f"{m}: d_model {shapes[m][0]}, {shapes[m][1]} layers, {counts[m]:,} parameters "
              f"({100 * (counts[m] / target - 1):+.1f}% of the fastrwa model's)", flush=True)
    common = ["--task", "text", "--data", args.data, "--batch-size", args.batch_size,
              "--bptt", args.bptt, "--lr", args.lr, "--seed", args.seed,
              "--eval-bytes", args.eval_bytes,
              "--log-every", 10 if not args.quick else 1, "--device", args.device,
              "--autocast", args.autocast]
    results = []
    for m in models:
        d, layers = shapes[m]
        flags = [*common, "--model", m, "--hidden", d, "--layers", layers]
        if LAYER[m] in ("rda", "rwa"):
            mine = own_fields(m, lm)
            flags += [x for item in args.lm if parse_lm_field(item)[0] in mine
                      for x in ("--lm", item)]
        steps = args.steps
        if args.equal == "time":
            calib = run(f"{m}-calibration", [*flags, "--steps", 12, "--warmup", 0,
                                             "--log-every", 1, "--eval-every", 1000], args.out)
            train = {r["step"]: r["train_s"] for r in calib if r["split"] == "train"}
            per_step = (train[12] - train[4]) / 8          # (the first steps warm caches up)
            steps = max(2, int(args.minutes * 60 / per_step))
        began = time.perf_counter()
        records = run(m, [*flags, "--steps", steps, "--eval-every", max(1, steps // args.evals),
                          "--checkpoint-every", steps], args.out)
        train = [r for r in records if r["split"] == "train"]
        final = {s: [r for r in records if r["split"] == s][-1] for s in ("valid", "test")}
        results.append(dict(model=m, d_model=d, layers=layers, params=counts[m], steps=steps,
                            s_per_step=train[-1]["train_s"] / steps,
                            tokens_per_s=steps * args.batch_size * args.bptt / train[-1]["train_s"],
                            train_s=train[-1]["train_s"], wall_s=time.perf_counter() - began,
                            valid_bpc=final["valid"]["bpc"], test_bpc=final["test"]["bpc"],
                            test_bytes=final["test"]["bytes"], records=records))
    summary = dict(equal=args.equal, minutes=args.minutes,
                   data=f"{args.data.name} ({args.data.stat().st_size:,} bytes)",
                   torch=torch.__version__, threads=torch.get_num_threads(),
                   cpu=os.cpu_count(), settings={k: ",".join(v) if k == "models" else str(v)
                                                 for k, v in vars(args).items()
                                                 if k not in ("data", "out", "record")},
                   runs=results)
    save_json(args.out / "lm.json", summary)
    _plot(results, args.out / "lm.png")
    print(table(summary))
    print(f"\n{args.out / 'lm.json'}\n{args.out / 'lm.png'}")
    return 0


def bpc_at(records: list[dict], key: str, x: float) -> float | None:
    """Validation bpc at ``key`` ("step" or "train_s") = ``x``, linear between evaluations
    (``None`` beyond the run's last evaluation)."""
    valid = [(r[key], r["bpc"]) for r in records if r["split"] == "valid"]
    for (x0, y0), (x1, y1) in zip(valid, valid[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-12)
    return valid[-1][1] if valid and abs(valid[-1][0] - x) < 1e-9 else None


def table(summary: dict) -> str:
    """The markdown table of a run of this script (also: ``--table OUT/lm.json``). Besides
    each run's final numbers, validation bpc at the shortest run's training time and at the
    smallest step count, read off the curves (the evaluations are ~1/10 of a run apart)."""
    runs = summary["runs"]
    lstm = next((r["tokens_per_s"] for r in runs if r["model"] == "lstm"), None)
    t_min = min(r["train_s"] for r in runs)
    s_min = min(r["steps"] for r in runs)
    eval_bytes = int(summary["settings"]["eval_bytes"])
    lines = [f"| model | d_model x layers | params | steps | training min | tokens/s | vs LSTM "
             f"| valid bpc ({eval_bytes:,} B) | at {t_min / 60:.1f} min | at step {s_min} "
             f"| test bpc (whole split) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ratio = f"{r['tokens_per_s'] / lstm:.2f}x" if lstm else "-"
        at_t, at_s = bpc_at(r["records"], "train_s", t_min), bpc_at(r["records"], "step", s_min)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['d_model']} x {r['layers']} | {r['params']:,} "
                     f"| {r['steps']} | {r['train_s'] / 60:.1f} | {r['tokens_per_s']:,.0f} "
                     f"| {ratio} | {r['valid_bpc']:.3f} | {fmt(at_t)} | {fmt(at_s)} "
                     f"| {r['test_bpc']:.3f} |")
    return "\n".join(lines)


def _plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for r in results:
        valid = [x for x in r["records"] if x["split"] == "valid"]
        label = f"{r['model']} ({r['params'] / 1e6:.2f}M)"
        by_step.plot([x["step"] for x in valid], [x["bpc"] for x in valid], marker=".",
                     label=label)
        by_time.plot([x["train_s"] / 60 for x in valid], [x["bpc"] for x in valid], marker=".",
                     label=label)
    by_step.set(xlabel="step", ylabel="validation bits per byte", title="against steps")
    by_time.set(xlabel="training minutes", title="against training time")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
