"""The ByteLM ablation, in one command: ``python -m bench.experiments.ablate --data FILE``.

Trains the fastrwa byte LM once per row through the trainer's CLI, each row one change from
a base (the defaults with the output gate off): an ``LMConfig`` field, the learning rate, the
warmup, or depth against width at equal parameters, all else equal: the same corpus, batch, BPTT,
steps and schedule, each row once per seed (``--seeds``, 0 and 1 by default: the spread of
the two is the run-to-run variation a row has to beat). The study runs at a reduced size
(``--d-model 128 --layers 4`` by default, about 0.2 s/step on two cores) so that its
eighteen rows fit in about 35 minutes per seed; a choice it favours is then checked in the
full-size comparison (``bench/experiments/lm.py``).

Writes ``OUT/ablate.json`` (every run's records) and prints a markdown table: what, parameters,
validation bpc on the first ``--eval-bytes`` of the split and test bpc on the whole test split
(the mean over the seeds, then each seed's), s/step. ``--only NAME,...`` runs a subset;
``--table OUT/ablate.json`` reprints a table. ``--out``: by default ``bench-results/ablate``,
which git ignores; the committed study, bench/results/ablate, only with ``--record`` (and
never from ``--quick``, ``--only``, fewer ``--seeds`` or sizes below the defaults).
docs/lm.md records a run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from bench.cli import (add_out, check_out, check_record, choices_list,
                       existing_file, in_records, make_dir, nonnegative_int, positive_int,
                       results_dir, scratch_dir)
from bench.experiments.lm import matched_width, params, run, table_or_missing_data
from bench.cli import save_json
from fastrwa.train.config import RunConfig, parse_lm_field

# The study's base: the defaults with the output gate off (its row turns it on).
BASE_LM = ["output_gate=false"]
# name -> trainer flags beyond the base ones, LMConfig fields (--lm), and blocks (None: the
# base depth; else the width is solved for the base model's parameter count)
ROWS = {
    "base": ([], [], None),
    "discount_init=spread": ([], ["discount_init=spread"], None),
    "discount_groups=8": ([], ["discount_groups=8"], None),     # groups of 16 channels at 128
    "discount_groups=2": ([], ["discount_groups=2"], None),     # groups of 64 channels at 128
    "token_shift=false": ([], ["token_shift=false"], None),
    "output_gate=true": ([], ["output_gate=true"], None),
    "f_h=tanh": ([], ["f_h=tanh"], None),
    "f_o=tanh": ([], ["f_o=tanh"], None),
    "attention=exp": (["--attention", "exp"], [], None),
    "mlp_ratio=2": ([], ["mlp_ratio=2"], None),
    "lr 1e-3": (["--lr", "1e-3"], [], None),
    "lr 4e-3": (["--lr", "4e-3"], [], None),
    "no warmup": (["--warmup", "0"], [], None),
    "warmup 100": (["--warmup", "100"], [], None),
    "tie_embeddings=false": ([], ["tie_embeddings=false"], None),
    "learn_initial_state=false": ([], ["learn_initial_state=false"], None),
    "2 layers at equal params": ([], [], 2),
    "8 layers at equal params": ([], [], 8),
}


# the flags (dests) below whose defaults a run is a check run (--record refuses it): the
# study's size, and fewer seeds (--warmup and --only choose a variant, not a size)
SIZES = ("d_model", "layers", "steps", "batch_size", "bptt", "eval_bytes", "seeds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace | None:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``args.names`` (the
    rows) and ``--out`` settled; ``--quick``'s sizes applied. ``None`` when ``--table`` printed
    its table (done)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=existing_file, help="a byte corpus file (required)")
    p.add_argument("--d-model", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=400)
    p.add_argument("--warmup", type=nonnegative_int, default=40)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--bptt", type=positive_int, default=128)
    p.add_argument("--eval-bytes", type=positive_int, default=100_000)
    p.add_argument("--seeds", type=nonnegative_int, nargs="+", default=[0, 1])
    p.add_argument("--only", type=choices_list(list(ROWS)),
                   help="comma-separated row names (default: every row)")
    add_out(p, "ablate", "ablate.json and the runs")
    p.add_argument("--quick", action="store_true", help="tiny runs of two rows (CI)")
    p.add_argument("--table", type=pathlib.Path, metavar="ABLATE_JSON",
                   help="print the table of an earlier run's ablate.json and stop")
    p.add_argument("--retime", type=existing_file, metavar="ABLATE_JSON",
                   help="time each row of an earlier run again on an idle machine (30 steps, "
                        "steps 10-30 timed, no evaluation), update its s/step and stop (a "
                        "file under bench/results/ only with --record)")
    args = p.parse_args(argv)
    if args.retime:                # (rewrites that file; --out holds the retiming's runs)
        check_record(p, "--retime", args.retime, args.record, ["--quick"] * args.quick)
        args.out = args.out or scratch_dir("ablate")
        if in_records(args.out):
            check_record(p, "--out", args.out, args.record)
        _check_retime(p, args.retime)
        make_dir(p, "--out", args.out)
        return args
    if table_or_missing_data(p, args, table, "an ablate.json of bench/experiments/ablate.py"):
        return None
    if args.only and args.record and (args.out is None or args.out.resolve()
                                      == results_dir("ablate").resolve()):
        p.error("--only writes an ablate.json of those rows alone, and bench/results/ablate "
                "keeps the whole study: --record them with --out elsewhere")
    try:
        for seed in args.seeds:
            RunConfig(task="text", data=str(args.data), model="rda-scan", hidden=args.d_model,
                      layers=args.layers, batch_size=args.batch_size, bptt=args.bptt,
                      steps=args.steps, warmup=args.warmup, seed=seed,
                      eval_bytes=args.eval_bytes, lm=_fields())
    except ValueError as exc:
        p.error(str(exc))
    check_out(p, args, "ablate", sizes=SIZES)
    args.names = args.only or list(ROWS)
    if args.quick:
        args.d_model, args.steps, args.warmup, args.batch_size = 16, 4, 1, 4
        args.bptt, args.eval_bytes = 16, 2000
        args.names = args.names if args.only else ["base", "2 layers at equal params"]
        args.seeds = args.seeds[:1]
    return args


def _check_retime(p: argparse.ArgumentParser, path: pathlib.Path) -> None:
    """Refuse a ``--retime`` file that is not an ablate.json, or whose corpus is gone."""
    try:
        for row in json.loads(path.read_text())["rows"]:
            corpus = pathlib.Path(row["flags"][row["flags"].index("--data") + 1])
            if not corpus.is_file():
                p.error(f"--retime {path}: the corpus of row {row['name']!r}, {corpus}, is gone")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        p.error(f"--retime {path} is not an ablate.json of bench/experiments/ablate.py "
                f"({type(exc).__name__}: {exc})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args is None:
        return 0
    if args.retime:
        return retime(args.retime, args.out)
    names = args.names
    base = ["--task", "text", "--data", args.data, "--model", "rda-scan", "--batch-size",
            args.batch_size, "--bptt", args.bptt, "--steps", args.steps, "--warmup",
            args.warmup, "--eval-every", max(1, args.steps // 4), "--eval-bytes",
            args.eval_bytes, "--log-every", 10, "--device", "cpu",
            "--checkpoint-every", args.steps]
    rows = []
    for name, seed in ((name, seed) for name in names for seed in args.seeds):
        extra, lm, layers = ROWS[name]
        width, layers = args.d_model, layers or args.layers
        if layers != args.layers:       # depth against width at equal parameters
            width = matched_width("rda-scan", _params(args.d_model, args.layers), layers,
                                  _fields())
        flags = [*base, "--hidden", width, "--layers", layers, "--seed", seed, *extra,
                 *[x for item in BASE_LM + lm for x in ("--lm", item)]]
        slug = "".join(c if c.isalnum() else "-" for c in name) + f"-seed{seed}"
        records = run(slug, flags, args.out)
        train = [r for r in records if r["split"] == "train"]
        final = {s: [r for r in records if r["split"] == s][-1] for s in ("valid", "test")}
        rows.append(dict(name=name, seed=seed, d_model=width, layers=layers,
                         flags=[str(f) for f in flags],
                         params=_params(width, layers, lm),
                         s_per_step=train[-1]["train_s"] / args.steps,
                         valid_bpc=final["valid"]["bpc"], test_bpc=final["test"]["bpc"],
                         records=records))
        print(table(dict(rows=rows[-1:], settings=_settings(args))), flush=True)
    summary = dict(settings=_settings(args), rows=rows)
    save_json(args.out / "ablate.json", summary)
    print(table(summary))
    print(f"\n{args.out / 'ablate.json'}")
    return 0


def retime(path: pathlib.Path, out: pathlib.Path) -> int:
    """``--retime``: s/step of each row from a short run of its own flags (the study's runs
    may have shared the machine; their bpc does not depend on that, their times do)."""
    summary = json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    sliced = {}            # corpus -> its first 1 MB (a small test split: the final
    for row in summary["rows"]:                 # evaluation of a run is not what is timed)
        flags = list(row["flags"])
        corpus = flags[flags.index("--data") + 1]
        if corpus not in sliced:
            sliced[corpus] = out / f"retime-corpus-{len(sliced)}.txt"
            with open(corpus, "rb") as f:
                sliced[corpus].write_bytes(f.read(1_000_000))
        for flag, value in (("--steps", "30"), ("--eval-every", "1000"), ("--log-every", "1"),
                            ("--checkpoint-every", "1000"), ("--data", str(sliced[corpus]))):
            flags[flags.index(flag) + 1] = value
        records = run("retime", flags + ["--warmup", "0"], out)
        train = {r["step"]: r["train_s"] for r in records if r["split"] == "train"}
        row["s_per_step"] = (train[30] - train[10]) / 20
        row["s_per_step_note"] = "retimed: steps 10-30 of a 30-step run"
        print(f"{row['name']}: {row['s_per_step']:.3f} s/step", flush=True)
    save_json(path, summary)
    print(table(summary))
    return 0


def _params(d_model: int, layers: int, lm: list[str] = ()) -> int:
    return params("rda-scan", d_model, layers, _fields(lm))


def _fields(lm: list[str] = ()) -> dict:
    """The study's LMConfig fields: the base's, then a row's."""
    return dict(parse_lm_field(item) for item in [*BASE_LM, *lm])


def _settings(args) -> dict:
    return dict(torch=torch.__version__, threads=torch.get_num_threads(),
                data=f"{args.data.name} ({args.data.stat().st_size:,} bytes)",
                **{k: str(v) for k, v in vars(args).items()
                   if k not in ("data", "out", "record", "names")})


def table(summary: dict) -> str:
    """The markdown table of a run of this script (also: ``--table OUT/ablate.json``)."""
    eval_bytes = int(summary["settings"]["eval_bytes"])
    lines = [f"| what | d_model x layers | params | valid bpc ({eval_bytes:,} B) "
             f"| test bpc (whole split) | s/step |", "|---|---|---|---|---|---|"]
    groups = {}                          # a row per name, its seeds together
    for r in summary["rows"]:
        groups.setdefault(r["name"], []).append(r)

    def cell(runs: list, key: str) -> str:
        values = [r[key] for r in runs]
        mean = f"{sum(values) / len(values):.3f}"
        return mean if len(values) == 1 else f"{mean} ({', '.join(f'{v:.3f}' for v in values)})"
    for name, runs in groups.items():
        r = runs[0]
        lines.append(f"| {name} | {r['d_model']} x {r['layers']} | {r['params']:,} "
                     f"| {cell(runs, 'valid_bpc')} | {cell(runs, 'test_bpc')} "
                     f"| {sum(x['s_per_step'] for x in runs) / len(runs):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
