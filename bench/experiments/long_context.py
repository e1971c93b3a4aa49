"""Where a carried state pays: bits per byte as a function of the position in a long stretch
of text, ``python -m bench.experiments.long_context --data CORPUS --models RUN_DIR [RUN_DIR ...]``.

Each model reads ``--docs`` stretches of ``--length`` bytes of the corpus's test split (evenly
spaced; a stretch may cross the boundary between two of the corpus's documents) in windows
of ``--window`` bytes (a training run's BPTT), two ways:

* **carried**: each window starts from the state the previous one left (ByteLM, minGRU,
  LSTM, GRU: their recurrent state; the Transformer: its sliding windows, so every byte sees
  at least half a context of the bytes before it);
* **reset**: each window starts from nothing, as in training without a carried state.

The loss of every byte is bucketed by its position in the stretch (``[0, W)``, ``[W, 2W)``,
``[2W, 4W)``, ... for ``W = --window``) and reported as bits per byte per bucket: a table
(markdown), ``OUT/long_context.json`` and ``OUT/long_context.png`` (``--out``: by default
``bench-results/long_context``, which git ignores; the committed record,
bench/results/long_context, only with ``--record``, and only at full size). A byte far into the
stretch predicted better "carried" than "reset" is where the state beyond a window pays;
the Transformer's "carried" row is its context's limit. ``--quick`` checks the script with
tiny untrained models (CI).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

from bench.cli import (add_out, below_defaults, check_out, existing_dir,
                       existing_file, positive_int)
from bench.cli import save_figure, save_json
from fastrwa.models import LMConfig, build, load_pretrained, run_model_dir
from fastrwa.train.data import open_corpus, split_corpus

MODES = ("carried", "reset")


def stretches(path: pathlib.Path, docs: int, length: int) -> torch.Tensor:
    """``(docs, length + 1)`` int64 bytes of the test split, evenly spaced; ``ValueError``
    when the test split is shorter than a stretch."""
    test = split_corpus(open_corpus(path).data)["test"]
    if len(test) < length + 1:
        raise ValueError(f"--length {length}: the test split of {path} has {len(test):,} bytes")
    starts = torch.linspace(0, len(test) - length - 1, docs).long()
    return torch.stack([test[int(s):int(s) + length + 1] for s in starts]).long()


@torch.no_grad()
def bits_per_position(model, data: torch.Tensor, window: int, mode: str) -> torch.Tensor:
    """``(length,)``: the mean over the rows of ``data`` of each next byte's loss in bits,
    reading ``window`` bytes at a time, the state carried or reset between windows."""
    x, y = data[:, :-1], data[:, 1:]
    losses, state = [], None
    for lo in range(0, x.shape[1], window):
        logits, state = model(x[:, lo:lo + window], state if mode == "carried" else None)
        nats = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(),
                                                 y[:, lo:lo + window], reduction="none")
        losses.append(nats / math.log(2))
    return torch.cat(losses, dim=1).mean(0)


def buckets(length: int, window: int) -> list[tuple[int, int]]:
    """``[0, W), [W, 2W), [2W, 4W), ...`` up to ``length``."""
    edges = [0, window]
    while edges[-1] < length:
        edges.append(min(length, 2 * edges[-1]))
    return list(zip(edges, edges[1:]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2) before any scoring:
    ``args.models`` loaded (name -> model), ``args.stretches`` read, ``--out`` settled."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=existing_file, required=True, help="a byte corpus file")
    p.add_argument("--models", nargs="+", type=existing_dir, default=[],
                   help="training runs (their model/ export) or saved model directories")
    p.add_argument("--length", type=positive_int, default=8192, help="bytes per stretch")
    p.add_argument("--docs", type=positive_int, default=16, help="stretches")
    p.add_argument("--window", type=positive_int, default=128,
                   help="bytes per window (the BPTT)")
    add_out(p, "long_context", "long_context.json and long_context.png")
    p.add_argument("--quick", action="store_true", help="tiny untrained models (CI)")
    args = p.parse_args(argv)
    if args.window > args.length:
        p.error(f"--window ({args.window}) must not be longer than --length ({args.length})")
    small = below_defaults(p, args, ["length", "docs"])
    if args.quick:
        args.length, args.docs, args.window = 256, 2, 32
        torch.manual_seed(0)
        models = {layer: build(LMConfig(layer=layer, d_model=16, n_layers=1, n_heads=2,
                                        context=args.window)).eval()
                  for layer in ("rda", "transformer")}
    else:
        if not args.models:
            p.error("--models RUN_DIR ... is required (or --quick)")
        models = {}
        for path in args.models:
            try:
                model = load_pretrained(run_model_dir(path)).eval()
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                p.error(f"--models {path}: {exc}")
            models[f"{model.config.layer} ({path.name})"] = model
    try:
        args.stretches = stretches(args.data, args.docs, args.length)
    except (OSError, ValueError) as exc:
        p.error(f"--data {args.data}: {exc}")
    check_out(p, args, "long_context", small=small)
    args.models = models
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models, data = args.models, args.stretches
    for name, model in models.items():
        context = getattr(model.config, "context", None)
        if model.config.layer == "transformer" and context != args.window:
            print(f"note: {name} has a context of {context} bytes, read in windows of "
                  f"{args.window}", file=sys.stderr)
    spans = buckets(args.length, args.window)
    rows = []
    for name, model in models.items():
        for mode in MODES:
            bits = bits_per_position(model, data, args.window, mode)
            rows.append(dict(model=name, mode=mode,
                             bpc=[float(bits[lo:hi].mean()) for lo, hi in spans]))
            print(f"{name:28} {mode:8} " + " ".join(f"{b:.3f}" for b in rows[-1]["bpc"]),
                  flush=True)
    summary = dict(data=str(args.data.name), length=args.length, docs=args.docs,
                   window=args.window, buckets=spans, rows=rows, torch=torch.__version__)
    save_json(args.out / "long_context.json", summary)
    print(table(summary))
    _plot(summary, args.out / "long_context.png")
    return 0


def table(summary: dict) -> str:
    """Bits per byte per position bucket, a row per model and mode."""
    head = " | ".join(f"{lo:,}-{hi:,}" for lo, hi in summary["buckets"])
    lines = [f"| model | windows | {head} |", "|---|---|" + "---|" * len(summary["buckets"])]
    for r in summary["rows"]:
        lines.append(f"| {r['model']} | {r['mode']} | "
                     + " | ".join(f"{b:.3f}" for b in r["bpc"]) + " |")
    return "\n".join(lines)


def _plot(summary: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    centres = [math.sqrt(max(lo, 1) * hi) for lo, hi in summary["buckets"]]
    names = list(dict.fromkeys(r["model"] for r in summary["rows"]))
    for r in summary["rows"]:
        ax.plot(centres, r["bpc"], marker=".", color=f"C{names.index(r['model']) % 10}",
                linestyle="-" if r["mode"] == "carried" else "--",
                label=f"{r['model']}, {r['mode']}")
    ax.set_xscale("log")
    ax.set(xlabel="position in the stretch (bytes; bucket centres)", ylabel="bits per byte",
           title=f"{summary['docs']} stretches of {summary['length']:,} bytes, windows of "
                 f"{summary['window']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
