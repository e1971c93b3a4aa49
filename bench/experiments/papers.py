"""The RDA paper's steps-to-threshold tables, measured here: ``python -m bench.experiments.papers``.

The RDA paper ("Efficiently applying attention to sequential data with the Recurrent
Discounted Attention unit") trains each model on each task with one recipe and reports the
training steps until a threshold: 250 units, batch 100, Adam at 1e-3, gradients clipped to
[-1, 1], sequences of length 1000 with full backpropagation. This script runs that recipe
(``fastrwa.train``'s tasks and ``SequenceNet``) for the models asked for, per seed, and
evaluates every ``--eval-every`` steps on a held-out batch of 100 (the validation split's
first batch) until the threshold is met, ``--max-steps`` is reached or ``--time-limit``
seconds have passed. Prints the paper's table beside ours and writes ``OUT/papers.json``
and one learning-curve PNG per task (``OUT/<task>.png``).

Models: ``rwa-scan``, ``rda-exp-tanh``, ``rda-sigmoid-id`` (the scan layers, the RDA
presets), ``rwa-cell``, ``rda-cell`` (the faithful cells) and ``gru``, ``lstm``
(PyTorch's). ``--quick`` runs every task for 3 steps at T = 20 (to check the script).
``--device cuda`` trains on a GPU (``bash bench/gpu_run.sh papers``: the runs this project's
CPUs cannot afford); ``--join`` adds runs saved elsewhere to ``OUT/papers.json`` without
training.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import torch

from bench import cli
from fastrwa.train.models import SequenceNet
from fastrwa.train.device import placement
from fastrwa.train.tasks import make_task
from fastrwa.nn import RDA

PAPER_LR = 1e-3            # the RDA paper's Adam learning rate

# The RDA paper's tables (steps to the threshold; None: not reached in the steps given).
PAPER = {
    "adding": {"metric": "loss", "below": 0.001, "limit": 10000,
               "steps": {"gru": 2036, "lstm": None, "rda-exp-tanh": 1781,
                         "rda-sigmoid-id": 2016, "rwa": 1735}},
    "classify-length": {"metric": "accuracy", "at_least": 1.0, "limit": 10000,
                        "steps": {"gru": 71, "lstm": 776, "rda-exp-tanh": 164,
                                  "rda-sigmoid-id": 414, "rwa": 133}},
    "copy": {"metric": "accuracy", "above": 0.999, "limit": 20000,
             "steps": {"gru": 5329, "lstm": None, "rda-exp-tanh": 11831,
                       "rda-sigmoid-id": 9840, "rwa": 5660}},
    "multicopy": {"metric": "accuracy", "above": 0.99, "limit": 10000,
                  "steps": {"gru": 3984, "lstm": 4048, "rda-exp-tanh": 1114,
                            "rda-sigmoid-id": 1316, "rwa": None}},
}
# Our model -> (SequenceNet kind, RDA preset, the paper's row it answers)
MODELS = {
    "rwa-scan": ("rwa-scan", None, "rwa"),
    "rda-exp-tanh": ("rda-scan", "exp-tanh", "rda-exp-tanh"),
    "rda-sigmoid-id": ("rda-scan", "sigmoid-id", "rda-sigmoid-id"),
    "rwa-cell": ("rwa-cell", None, "rwa"),
    "rda-cell": ("rda-cell", None, "rda-exp-tanh"),
    "gru": ("gru", None, "gru"),
    "lstm": ("lstm", None, "lstm"),
}
SCAN_MODELS = ("rwa-scan", "rda-exp-tanh", "rda-sigmoid-id")


def met(task: str, value: float) -> bool:
    """Whether a held-out ``value`` meets the paper's threshold for ``task``."""
    rule = PAPER[task]
    if "below" in rule:
        return value < rule["below"]
    if "above" in rule:
        return value > rule["above"]
    return value >= rule["at_least"]


@torch.no_grad()
def evaluate(net, task, batch) -> float:
    """The paper's metric on ``batch``: the loss (adding) or the accuracy of the scored
    positions."""
    out, _ = net(batch.x)
    if PAPER[task.name]["metric"] == "loss":
        return float(task.score(out, batch)[0])
    hits = out[batch.mask].argmax(-1) == batch.target[batch.mask]
    return hits.sum().item() / hits.numel()    # exact: 0.99 in float32 would be above 0.99


def run(task_name: str, model: str, seed: int, seq_len: int, max_steps: int,
        eval_every: int, time_limit: float, hidden: int = 250, batch: int = 100,
        timescales: tuple | None = None, layers: int = 1, lr: float = PAPER_LR,
        progress: bool = False, device: str = "cpu") -> dict:
    """One model on one task with one seed: the steps to the threshold (or ``None``).
    ``timescales``: ``(shortest, longest)`` memory lengths for the RDA scan layers'
    discount initialisation (``fastrwa.nn.RDA.set_discount_timescales``, every layer;
    default: the paper's bias of 1). ``layers``: stacked recurrent layers (the paper: 1).
    ``lr``: Adam's learning rate (the paper's: 1e-3).
    ``device``: where the model trains (the batches are made on the CPU, as the same
    seed makes the same data anywhere, and moved there).
    ``progress``: print each evaluation as it comes."""
    kind, preset, _ = MODELS[model]
    place = placement(device, "none")
    torch.manual_seed(seed)
    task = make_task(task_name, seq_len, seed)
    net = SequenceNet(kind, task.input_size, hidden, layers, task.output_size, preset=preset)
    net.to(place.device)
    if timescales is not None and kind == "rda-scan":
        for layer in net.core:
            layer.set_discount_timescales(*timescales)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    held_out = place.to(task.batch(0, batch, "valid"))
    curve, reached, began = [], None, time.perf_counter()
    step = 0
    while step < max_steps and time.perf_counter() - began < time_limit:
        step += 1
        data = place.to(task.batch(step, batch))
        out, _ = net(data.x)
        loss, _ = task.score(out, data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(net.parameters(), 1.0)
        optimizer.step()
        if step % eval_every == 0 or step == max_steps:
            value = evaluate(net, task, held_out)
            curve.append((step, value))
            if progress:
                print(f"  {task_name} {model} seed {seed} step {step}: {value:.4f} "
                      f"({time.perf_counter() - began:.0f} s)", flush=True)
            if not math.isfinite(value):
                break
            if met(task_name, value):
                reached = step
                break
    return {"task": task_name, "model": model, "seed": seed,
            "timescales": timescales if kind == "rda-scan" else None, "layers": layers,
            "lr": lr, "device": place.device.type,
            "steps_to_threshold": reached,
            "steps_run": step, "seconds": time.perf_counter() - began, "curve": curve}


def _cell(runs: list) -> str:
    """Median and range of the steps to the threshold over seeds; a seed that did not reach
    it shows as ``>N`` (the steps it ran)."""
    if not runs:
        return "-"
    steps = [r["steps_to_threshold"] for r in runs]
    if any(s is None for s in steps):
        return ", ".join(str(s) if s is not None else f">{r['steps_run']}"
                         for s, r in zip(steps, runs))
    if len(steps) == 1:
        return str(steps[0])
    return f"{statistics.median(steps):g} ({min(steps)}-{max(steps)})"


def variant(r: dict) -> str:
    """How a run differs from the paper's recipe: its RDA discount initialisation (the
    paper's bias, "paper", also for the models without a discount, or a spread of memories)
    and, where not the paper's, its number of layers and its learning rate; then the device,
    where not the CPU."""
    ts = r.get("timescales")
    label = "paper" if not ts else f"spread {ts[0]:g}-{ts[1]:g}"
    layers, lr = r.get("layers", 1), r.get("lr", PAPER_LR)
    label = label if layers == 1 else f"{label}, {layers} layers"
    label = label if lr == PAPER_LR else f"{label}, lr {lr:g}"
    device = r.get("device", "cpu")
    return label if device == "cpu" else f"{label}, {device}"


def merged(path: pathlib.Path, new: list, seq_len: int) -> list:
    """The results in ``path`` (earlier invocations) with ``new`` added: a run of the same
    task, model, seed, length, discount initialisation, layers and learning rate replaces the
    earlier one (whichever device either ran on; each replaced run is named on stderr) unless
    it measured nothing (no step: the earlier one stays, and that is said), and of such runs
    within ``new`` the last is kept. New runs without a length take
    ``seq_len``.
    Runs saved without a field (older versions) take the record's value or the default."""
    new = [dict(r, seq_len=r.get("seq_len", seq_len), layers=r.get("layers", 1),
                lr=r.get("lr", PAPER_LR),
                timescales=list(r["timescales"]) if r.get("timescales") else None) for r in new]
    key = lambda r: (r["task"], r["model"], r["seed"], r["seq_len"],  # noqa: E731
                     tuple(r["timescales"] or ()), r["layers"], r["lr"])
    old = []
    if path.is_file():
        record = json.loads(path.read_text())
        old = [dict(r, seq_len=r.get("seq_len", record.get("seq_len")),
                    quick=r.get("quick", record.get("quick", False)),
                    timescales=r.get("timescales") or None, layers=r.get("layers", 1),
                    lr=r.get("lr", PAPER_LR))
               for r in record["results"]]
    new = list({key(r): r for r in new}.values())       # the last of runs alike in new
    for r in new:
        if not r.get("steps_run") and any(key(o) == key(r) for o in old):
            print(f"keeping the earlier run of {r['task']} {r['model']} seed {r['seed']} "
                  f"({variant(r)}): the new one measured nothing (0 steps)", file=sys.stderr)
    new = [r for r in new if r.get("steps_run") or not any(key(o) == key(r) for o in old)]
    replaced = {key(r) for r in new}
    for r in old:                                       # (said, not silent)
        if key(r) in replaced:
            reached = r.get("steps_to_threshold")
            print(f"replacing the earlier run of {r['task']} {r['model']} seed {r['seed']} "
                  f"({variant(r)}: {r.get('steps_run', '?')} steps, threshold "
                  f"{f'at {reached}' if reached else 'not reached'})", file=sys.stderr)
    return [r for r in old if key(r) not in replaced] + new


# the fields of a saved run that merging, tabling and plotting read
REQUIRED = ("task", "model", "seed", "steps_to_threshold", "steps_run", "curve")


def joined(paths: list, out: pathlib.Path, error) -> list:
    """The runs saved in ``paths`` (papers.json files); a run without its own ``argv``,
    ``quick`` or ``seq_len`` (older files kept them for the whole file) takes its file's.
    ``error`` (``ArgumentParser.error``: it takes a message and exits) refuses a missing or
    malformed file, a run without the fields a table needs and check runs (``--quick``)
    bound for the measured results."""
    runs = []
    for path in paths:
        if not path.is_file():
            error(f"--join: no such file {path}")
        try:
            record = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            error(f"--join: {path} is not JSON ({exc})")
        if not isinstance(record, dict) or not isinstance(record.get("results"), list):
            error(f"--join: {path} is not a papers.json (a JSON object with a 'results' list)")
        for r in record["results"]:
            missing = [k for k in REQUIRED if not isinstance(r, dict) or k not in r]
            if missing:
                error(f"--join: {path} holds a run without {', '.join(missing)}")
            r = dict(r, argv=r.get("argv", record.get("argv")),
                     quick=r.get("quick", record.get("quick", False)))
            if "seq_len" not in r and "seq_len" in record:
                r["seq_len"] = record["seq_len"]
            if r["quick"] and cli.in_records(out):
                error(f"--join: {path} holds --quick check runs, which bench/results/ does "
                      "not take")
            runs.append(r)
    return runs


def table(results: list) -> dict:
    """The runs per (task, model, T, variant), in seed order."""
    rows = {}

    def order(names: list, name: str) -> int:            # names this script no longer knows last
        return names.index(name) if name in names else len(names)
    for r in sorted(results, key=lambda r: (order(list(PAPER), r["task"]),
                                            order(list(MODELS), r["model"]), r["seed"])):
        rows.setdefault((r["task"], r["model"], r["seq_len"], variant(r)), []).append(r)
    return rows


def plot(results: list, tasks: set, out: pathlib.Path) -> None:
    """One PNG per task: held-out metric against step for every run of that task."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for task in sorted(tasks & set(PAPER)):
        fig, ax = plt.subplots(figsize=(10, 4.5))
        runs = [r for r in results if r["task"] == task and r["curve"]]
        kinds = list(dict.fromkeys((r["model"], variant(r), r["seq_len"]) for r in runs))
        for r in runs:         # a colour per model, variant and T; a line style per seed
            steps, values = zip(*r["curve"])
            kind = kinds.index((r["model"], variant(r), r["seq_len"]))
            ax.plot(steps, values, linewidth=1, color=f"C{kind % 10}",
                    linestyle=("-", "--", ":", "-.")[r["seed"] % 4],
                    label=f"{r['model']} ({variant(r)}) seed {r['seed']}, "
                          f"T = {r['seq_len']}")
        rule = PAPER[task]
        ax.axhline(rule.get("below", rule.get("above", rule.get("at_least"))), color="grey",
                   linestyle="--", linewidth=0.8, label="the paper's threshold")
        if rule["metric"] == "loss":
            ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel(f"held-out {rule['metric']}")
        ax.set_title(f"{task}: the RDA paper's recipe\n(batch 100, 250 units, Adam 1e-3 "
                     f"unless the label gives an lr)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))   # beside the axes
        fig.tight_layout()
        cli.save_figure(fig, out / f"{task}.png", dpi=100)
        plt.close(fig)


# --record refuses a check run: below these a run is one (the smallest that a committed run
# of bench/results/papers took: the classify-length runs' 600 steps, the GPU runs' 270 s, the
# multicopy diagnosis's T = 200). Fewer tasks, models or seeds are not: a run replaces only
# the runs of its own configuration in the record (merged()).
FULL_RUN = {"max_steps": 600, "time_limit": 270.0, "seq_len": 200}


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, given: list[str]) -> None:
    """Refuse every impossible value the flags' types let through, and a record written by
    accident, before anything runs (``p.error``: one ``error:`` line, exit 2); ``given``:
    the command line's flags."""
    try:
        placement(args.device, "none")
    except ValueError as exc:
        p.error(str(exc))
    if not args.quick and not args.join:
        for task in args.tasks:
            try:
                make_task(task, args.seq_len)
            except ValueError as exc:
                p.error(f"{exc} (task {task})")
    if args.discount_timescales is not None:
        try:
            RDA(1, 2).set_discount_timescales(*args.discount_timescales)
        except ValueError as exc:
            p.error(f"--discount-timescales SHORT LONG: {exc}")
    if args.join:
        kept = ("--join", "--out", "--record")
        ignored = [f for f in given if f.startswith("--") and f.split("=")[0] not in kept]
        if ignored:
            p.error(f"--join trains nothing and takes only --out and --record; drop "
                    f"{' '.join(ignored)}")
    cli.check_out(p, args, "papers", sizes=FULL_RUN, make=False)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list]:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled
    and made, ``--quick``'s sizes applied; and the runs of ``--join``'s files."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--tasks", nargs="+", default=list(PAPER), choices=list(PAPER))
    p.add_argument("--models", nargs="+", default=list(SCAN_MODELS), choices=list(MODELS))
    p.add_argument("--seeds", nargs="+", type=cli.nonnegative_int, default=[0, 1])
    p.add_argument("--max-steps", type=cli.positive_int, default=None,
                   help="per run (default: the paper's limit for the task)")
    p.add_argument("--eval-every", type=cli.positive_int, default=10)
    p.add_argument("--seq-len", type=int, default=1000)
    p.add_argument("--time-limit", type=cli.positive_float, default=3600.0,
                   help="seconds per run")
    p.add_argument("--discount-timescales", nargs=2, type=float, metavar=("SHORT", "LONG"),
                   help="an ablation: initialise the RDA scan layers' discounts to memory "
                        "lengths from SHORT to LONG tokens (default: the paper's bias 1)")
    p.add_argument("--layers", type=cli.positive_int, default=1,
                   help="an ablation: stacked recurrent layers (default: the paper's 1)")
    p.add_argument("--lr", type=cli.positive_float, default=PAPER_LR,
                   help="an ablation: Adam's learning rate (default: the paper's 1e-3)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the models train (default cpu)")
    p.add_argument("--quick", action="store_true", help="3 steps per run at T = 20")
    p.add_argument("--join", nargs="+", type=pathlib.Path, metavar="JSON",
                   help="train nothing: add the runs saved in these papers.json files (made "
                        "elsewhere, e.g. by bash bench/gpu_run.sh papers) to --out's, then "
                        "table and plot them")
    cli.add_out(p, "papers", "papers.json and the plots")
    args = p.parse_args(argv)
    check_args(p, args, sys.argv[1:] if argv is None else list(argv))
    results = joined(args.join, args.out, p.error) if args.join else []
    cli.make_dir(p, "--out", args.out)
    if args.quick:
        args.seq_len, args.max_steps, args.eval_every, args.seeds = 20, 3, 1, [0]
    return args, results


def main(argv: list[str] | None = None) -> int:
    args, results = parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    for task in (args.tasks if not args.join else []):
        for model in args.models:
            for seed in args.seeds:
                limit = args.max_steps or PAPER[task]["limit"]
                r = run(task, model, seed, args.seq_len, limit, args.eval_every,
                        args.time_limit, timescales=args.discount_timescales,
                        layers=args.layers, lr=args.lr, progress=not args.quick,
                        device=args.device)
                results.append(dict(r, argv=given, quick=args.quick))
                print(f"{task:16} {model:15} seed {seed}: "
                      f"{r['steps_to_threshold'] or 'not reached'} "
                      f"({r['steps_run']} steps, {r['seconds']:.0f} s)", flush=True)
    path = args.out / "papers.json"
    results = merged(path, results, args.seq_len)
    record = {"argv": given, "quick": args.quick, "paper": PAPER, "results": results}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)                    # (a run killed while writing keeps the old file)
    print(f"\n{'task':16} {'model':15} {'T':>5} {'variant':>34} {'paper':>8} "
          f"{'here (median, range)':>24}")
    for (task, model, seq_len, label), runs in table(results).items():
        if task not in PAPER or model not in MODELS:
            continue                                      # kept in the file, not tabled
        paper = PAPER[task]["steps"][MODELS[model][2]]
        print(f"{task:16} {model:15} {seq_len:>5} {label:>34} {paper if paper else '> limit':>8} "
              f"{_cell(runs):>24}")
    plot(results, {r["task"] for r in results}, args.out)
    return 0


if __name__ == "__main__":
    torch.set_flush_denormal(True)    # as python -m fastrwa.train does (docs/training.md)
    sys.exit(main())
