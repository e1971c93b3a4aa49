"""ByteLM against the Transformer baseline at scale on one GPU, in one command (issue 52, item 3):
``python -m bench.experiments.lm_gpu --data FILE`` (on the card: ``bash bench/gpu_run.sh lm``).

Two runs through the trainer's CLI (``python -m fastrwa.train``), one after the other, on the
same byte corpus (its 90/5/5 split: held-out bits per byte are scored on the validation split,
the test split once at the end), the same batch, BPTT, optimizer and schedule:

* ``rda-scan``: ByteLM, ``--d-model`` x ``--layers`` (default 384 x 10, 25,220,352
  parameters);
* ``transformer``: the nanoGPT-style baseline of ``fastrwa.models.TransformerLM``
  (``scaled_dot_product_attention``: FlashAttention kernels on an H100/H200 in bfloat16),
  ``--transformer-layers`` blocks (default 8) of heads ``--head-dim`` wide (default 64),
  its width solved, in multiples of the head width, to the parameter count nearest
  ByteLM's (default 512 = 8 heads, 25,326,592, +0.4%); a run more than
  ``--max-mismatch`` apart is refused. Both counts are printed.

Each run has the same wall-clock budget, ``--minutes`` (the trainer's ``--minutes``: its
calibration, the steps, the evaluations, the final checkpoint and export all inside it; its
cosine schedule decays over the steps it plans), bfloat16 autocast on CUDA (``--autocast``).
On CUDA a 2-step ByteLM run (``--warm``, default on CUDA) first fills Triton's on-disk kernel
cache, so that ByteLM's budget does not pay the one-off compile of its kernels (the
Transformer's kernels come precompiled with PyTorch).

Writes ``OUT/lm-gpu.json`` (the settings, the device as measured, each run's parameters,
steps, tokens/s, held-out curve, training curve, final and best held-out and test bits per
byte), ``OUT/lm-gpu.png`` (both learning curves in one plot: held-out bits per byte against
training seconds, the training bits dashed; and against bytes trained) and ``OUT/lm-gpu.md``
(the table, also printed). The runs' directories are under ``OUT/runs/``. The JSON is
rewritten after each run, so a run cut short keeps the first model's numbers. ``--table
JSON`` prints the table of an earlier run.

``--tiny`` checks the whole path in seconds without a GPU: two models of about 26,000
parameters, a few seconds each, on the corpus's first 100 KB (CI, bench/test_lm_gpu.py).
``--out``: by default ``bench-results/lm-gpu`` (git ignores it); the committed record,
bench/results/lm-gpu, only with ``--record``, never from a check run (``--tiny``, a budget,
batch, BPTT or model below the defaults) nor from a run that was not on a GPU.
docs/lm.md ("ByteLM against a Transformer at scale on one GPU") records a run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shutil
import signal
import sys
import time

import torch

from bench.cli import (add_out, check_out, existing_file, nonnegative_int, positive_float,
                       positive_int)
from bench.experiments.lm import RunFailed, bpc_at, run
from bench.cli import save_figure, save_json
from fastrwa.models import LMConfig, build
from fastrwa.train.config import RunConfig
from fastrwa.train.device import resolve_device
from fastrwa.train.models import LM_LAYERS as LAYER

NAME = "lm-gpu"
BYTELM, TRANSFORMER = "rda-scan", "transformer"
LABELS = {BYTELM: "ByteLM (rda-scan)", TRANSFORMER: "Transformer (SDPA)"}
TINY = dict(d_model=24, layers=2, transformer_layers=2, head_dim=4, batch_size=4, bptt=32,
            minutes=0.03, eval_bytes=2000)
TINY_BYTES = 100_000       # --tiny: the corpus's first 100 KB


def count(model: str, d_model: int, layers: int, n_heads: int | None = None) -> int:
    """Parameters of ``model`` at ``d_model`` x ``layers`` (the tied embedding once; the
    Transformer with ``n_heads`` heads, which do not change the count), counted on the meta
    device (nothing allocated)."""
    fields = {} if n_heads is None else {"n_heads": n_heads}
    config = LMConfig(layer=LAYER[model], d_model=d_model, n_layers=layers, **fields)
    with torch.device("meta"):
        return sum(p.numel() for p in dict.fromkeys(build(config).parameters()))


def transformer_width(target: int, layers: int, head_dim: int) -> int:
    """The Transformer width, a multiple of ``head_dim`` (whole heads), whose parameter count
    is nearest ``target``."""
    counts = {}
    for d in range(head_dim, 64 * 1024, head_dim):    # parameters grow with d
        counts[d] = count(TRANSFORMER, d, layers, d // head_dim)
        if counts[d] > target:
            break
    return min(counts, key=lambda d: abs(counts[d] - target))


def shapes(args: argparse.Namespace) -> dict:
    """Each model's ``d_model``, ``layers``, ``n_heads`` (the Transformer's) and parameters."""
    target = count(BYTELM, args.d_model, args.layers)
    width = transformer_width(target, args.transformer_layers, args.head_dim)
    return {BYTELM: dict(d_model=args.d_model, layers=args.layers, n_heads=None,
                         params=target),
            TRANSFORMER: dict(d_model=width, layers=args.transformer_layers,
                              n_heads=width // args.head_dim,
                              params=count(TRANSFORMER, width, args.transformer_layers,
                                           width // args.head_dim))}


def device_info(device: str) -> dict:
    """What the runs were measured on: the GPU's name (only from CUDA itself), or the CPU."""
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    sms=props.multi_processor_count, cuda=torch.version.cuda,
                    flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled())
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info["cpu"] = platform.processor() or platform.machine()
    info["measured_on_gpu"] = device == "cuda"
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace | None:
    """The flags, bad values refused (one ``error:`` line, exit 2), ``--out`` settled; ``None``
    when ``--table`` printed its table."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=existing_file, help="a byte corpus file (required)")
    p.add_argument("--minutes", type=positive_float, default=3.25,
                   help="wall-clock budget of each run, calibration and evaluations included "
                        "(default 3.25: both runs and the start-up in about 8 minutes)")
    p.add_argument("--d-model", type=positive_int, default=384, help="ByteLM's width")
    p.add_argument("--layers", type=positive_int, default=10, help="ByteLM's blocks")
    p.add_argument("--transformer-layers", type=positive_int, default=8,
                   help="the Transformer's blocks (its width is solved to ByteLM's count)")
    p.add_argument("--head-dim", type=positive_int, default=64,
                   help="the Transformer's head width (even; its width is a multiple of it)")
    p.add_argument("--max-mismatch", type=positive_float, default=0.02,
                   help="the largest relative parameter difference accepted (default 0.02)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--bptt", type=positive_int, default=512,
                   help="segment length; the Transformer's context (default 512)")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="both models' peak lr")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--autocast", choices=("none", "bf16"), default=None,
                   help="default bf16 on cuda, none on the CPU")
    p.add_argument("--eval-bytes", type=nonnegative_int, default=0,
                   help="validation bytes scored at each evaluation (default 0: the whole "
                        "split); the test split is always whole")
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=None,
                   help="fill Triton's kernel cache with a 2-step ByteLM run first "
                        "(default: on CUDA)")
    p.add_argument("--tiny", action="store_true",
                   help="a check in seconds without a GPU: tiny models, a few seconds each, "
                        "the corpus's first 100 KB")
    add_out(p, NAME, "lm-gpu.json, lm-gpu.png, lm-gpu.md and the runs")
    p.add_argument("--table", type=existing_file, metavar="LM_GPU_JSON",
                   help="print the table of an earlier run's lm-gpu.json and stop")
    args = p.parse_args(argv)
    if args.table:
        try:
            print(table(json.loads(args.table.read_text())))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            p.error(f"--table {args.table} is not an lm-gpu.json ({type(exc).__name__}: {exc})")
        return None
    if args.data is None:
        p.error("--data FILE: a byte corpus is needed")
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    if args.autocast is None:
        args.autocast = "bf16" if args.device == "cuda" else "none"
    if args.warm is None:
        args.warm = args.device == "cuda"
    if args.head_dim % 2:
        p.error(f"--head-dim must be even (rotary positions pair channels), got {args.head_dim}")
    if args.bptt % 2:
        p.error(f"--bptt must be even (the Transformer's context), got {args.bptt}")
    try:
        resolve_device(args.device)
        for model in (BYTELM, TRANSFORMER):
            RunConfig(task="text", data=str(args.data), model=model, hidden=args.d_model,
                      layers=args.layers, batch_size=args.batch_size, bptt=args.bptt,
                      lr=args.lr, seed=args.seed, eval_bytes=args.eval_bytes,
                      device=args.device, autocast=args.autocast)
    except ValueError as exc:
        p.error(str(exc))
    sizes = {"minutes": None, "d_model": None, "layers": None, "batch_size": None,
             "bptt": None}
    small = ["--tiny"] * args.tiny + ["--device cpu"] * (args.device != "cuda")
    check_out(p, args, NAME, sizes=sizes, small=small)
    return args


def curves(records: list[dict], bytes_per_step: int) -> tuple[list[dict], list[dict]]:
    """The held-out (validation) curve and the training curve of a run's records."""
    point = lambda r: {"step": r["step"], "train_s": r["train_s"],      # noqa: E731
                       "elapsed_s": r["elapsed_s"], "bytes_trained": r["step"] * bytes_per_step,
                       "bpb": r["bpc"]}
    return ([point(r) for r in records if r["split"] == "valid"],
            [point(r) for r in records if r["split"] == "train"])


def main(argv: list[str] | None = None) -> int:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return _main(argv)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args is None:
        return 0
    data = args.data
    if args.tiny:
        data = args.out / "corpus-100k.txt"
        data.write_bytes(args.data.read_bytes()[:TINY_BYTES])
    size = data.stat().st_size
    held = size // 20
    models = shapes(args)
    target = models[BYTELM]["params"]
    for m, s in models.items():
        heads = f", {s['n_heads']} heads of {args.head_dim}" if s["n_heads"] else ""
        print(f"{m}: d_model {s['d_model']} x {s['layers']} blocks{heads}: {s['params']:,} "
              f"parameters ({100 * (s['params'] / target - 1):+.2f}% of ByteLM's)", flush=True)
    mismatch = abs(models[TRANSFORMER]["params"] / target - 1)
    if mismatch > args.max_mismatch:
        print(f"error: the Transformer's nearest count is {100 * mismatch:.1f}% from ByteLM's, "
              f"over --max-mismatch {args.max_mismatch:g}: change --transformer-layers or "
              f"--head-dim", file=sys.stderr)
        return 2
    common = ["--task", "text", "--data", data, "--batch-size", args.batch_size,
              "--bptt", args.bptt, "--lr", args.lr, "--seed", args.seed,
              "--eval-bytes", args.eval_bytes, "--device", args.device,
              "--autocast", args.autocast, "--checkpoint-every", 10 ** 9]
    summary = dict(what="ByteLM against the Transformer baseline at equal parameters and "
                        "equal wall-clock minutes",
                   **device_info(args.device), minutes=args.minutes,
                   data=dict(file=args.data.name, bytes=size, train_bytes=size - 2 * held,
                             valid_bytes=held, test_bytes=held,
                             sliced=args.tiny),
                   settings={k: (str(v) if isinstance(v, pathlib.Path) else v)
                             for k, v in vars(args).items() if k not in ("out", "record",
                                                                          "table")},
                   runs=[])
    began = time.perf_counter()
    flags = {m: [*common, "--model", m, "--hidden", s["d_model"], "--layers", s["layers"],
                 *(["--lm", f"n_heads={s['n_heads']}"] if s["n_heads"] else [])]
             for m, s in models.items()}
    signal.signal(signal.SIGTERM, _on_term)
    _TERM.began, _TERM.got = time.perf_counter(), None
    cut = None
    if args.warm:        # (Triton compiles ByteLM's kernels once, into its on-disk cache)
        start = time.perf_counter()
        try:
            waiting(run, f"{BYTELM}-warm", [*flags[BYTELM], "--steps", 2, "--eval-every",
                                            1000, "--warmup", 0], args.out)
        except Cut as exc:
            cut = exc
        summary["warm_s"] = time.perf_counter() - start
    for m, s in models.items():
        if cut is not None:
            break
        start = time.perf_counter()
        shutil.rmtree(args.out / "runs" / m, ignore_errors=True)   # (no earlier run's metrics)
        try:
            records = waiting(run, m, [*flags[m], "--minutes", args.minutes], args.out)
        except (RunFailed, Cut) as exc:      # what the run wrote before it ended is kept
            records, cut = metrics(args.out / "runs" / m), exc
            if isinstance(exc, RunFailed) and not usable(records):
                raise
        if usable(records):
            summary["runs"].append(summarise(m, s, records, args, size - 2 * held,
                                             time.perf_counter() - start, cut))
        if cut is None and _TERM.got is not None:      # (a SIGTERM between two runs)
            cut = Cut(_TERM.got)
        if cut is not None:
            summary["cut"] = f"{m}: {cut}"
        summary["total_s"] = time.perf_counter() - began
        write(summary, args.out)        # (after each run: a cut run keeps the first)
    if cut is not None and len(summary["runs"]) < len(models):
        if args.warm and not summary["runs"]:       # (cut in the warm-up)
            summary.update(cut=f"warm-up: {cut}", total_s=time.perf_counter() - began)
            write(summary, args.out)
        print(f"error: cut ({cut}) before every run had finished; {args.out / 'lm-gpu.json'} "
              f"keeps what was measured", file=sys.stderr)
        return 124 if isinstance(cut, Cut) else 1
    print(table(summary))
    print(f"\n{args.out / 'lm-gpu.json'}\n{args.out / 'lm-gpu.png'}\n{args.out / 'lm-gpu.md'}")
    return 0


class Cut(Exception):
    """SIGTERM (bench/gpu_run.sh's time guard): the run in progress is summarised from what
    its ``metrics.jsonl`` holds."""


class _TERM:
    """Where a SIGTERM finds this script: raised as :class:`Cut` while it waits on a run (the
    trainer, in the same process group, stops too), else noted (``got``) and acted on once
    the files being written are written."""

    began = 0.0
    waiting = False
    got: str | None = None


def _on_term(signum, frame):
    _TERM.got = f"{signal.Signals(signum).name} after {time.perf_counter() - _TERM.began:.0f} s"
    if _TERM.waiting:
        _TERM.waiting = False
        raise Cut(_TERM.got)


def waiting(fn, *args):
    """``fn(*args)`` with a SIGTERM raised in it as :class:`Cut`."""
    if _TERM.got is not None:
        raise Cut(_TERM.got)
    _TERM.waiting = True
    try:
        return fn(*args)
    finally:
        _TERM.waiting = False


def metrics(run_dir: pathlib.Path) -> list[dict]:
    """The records a run has written so far (none when it wrote none)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def usable(records: list[dict]) -> bool:
    """Whether a run's records hold a held-out point and a training record."""
    return any(r["split"] == "valid" for r in records) and \
        any(r["split"] == "train" for r in records)


def summarise(model: str, shape: dict, records: list[dict], args: argparse.Namespace,
              train_bytes: int, process_s: float, cut: Exception | None = None) -> dict:
    """One run's entry of lm-gpu.json: its shape, throughput, curves and final numbers (the
    test split's ``None`` for a run cut before its final evaluation)."""
    bytes_per_step = args.batch_size * args.bptt
    valid, train = curves(records, bytes_per_step)
    test = [r for r in records if r["split"] == "test"]
    steps = train[-1]["step"]
    best = min(valid, key=lambda r: r["bpb"])
    return dict(model=model, label=LABELS[model], **shape, steps=steps,
                batch_size=args.batch_size, bptt=args.bptt,
                bytes_trained=steps * bytes_per_step, epochs=steps * bytes_per_step / train_bytes,
                tokens_per_s=steps * bytes_per_step / train[-1]["train_s"],
                train_s=train[-1]["train_s"], elapsed_s=valid[-1]["elapsed_s"],
                process_s=process_s, valid_bpb=valid[-1]["bpb"], best_valid_bpb=best["bpb"],
                best_at_train_s=best["train_s"], train_bpb=train[-1]["bpb"],
                test_bpb=test[-1]["bpc"] if test else None,
                test_bytes=test[-1]["bytes"] if test else None,
                cut=None if cut is None else str(cut), valid=valid, train=train)


def write(summary: dict, out: pathlib.Path) -> None:
    """lm-gpu.json, and with a run in it, lm-gpu.md and lm-gpu.png."""
    save_json(out / "lm-gpu.json", summary)
    if summary["runs"]:
        (out / "lm-gpu.md").write_text(table(summary) + "\n")
        plot(summary, out / "lm-gpu.png")


def where(summary: dict) -> str:
    """The machine the numbers come from, said so that a CPU run is never read as a GPU's."""
    if summary.get("measured_on_gpu"):
        return f"{summary['gpu']} (CUDA {summary.get('cuda')}, torch {summary['torch']})"
    return f"the CPU ({summary.get('cpu', '?')}, torch {summary['torch']}): not a GPU measurement"


def table(summary: dict) -> str:
    """The markdown table of an lm-gpu.json: each run's shape, parameters, steps, tokens/s,
    held-out bits per byte at the end of its budget, at the shorter run's training time, at
    its best, training bits per byte at the end, test bits per byte (whole split)."""
    runs = summary["runs"]
    t_min = min(r["train_s"] for r in runs)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"{summary['minutes']:g} minutes a run on {where(summary)}; "
             f"{summary['data']['file']}, held-out = its validation split "
             f"({summary['data']['valid_bytes']:,} bytes)", "",
             f"| model | d_model x blocks | params | steps | bytes trained (passes) | "
             f"tokens/s | held-out bpb, end | at {t_min:.3g} s training | best (at s) | "
             f"train bpb, end | test bpb |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        valid = [{"split": "valid", "train_s": v["train_s"], "bpc": v["bpb"]} for v in r["valid"]]
        lines.append(
            f"| {r['label']}{' (cut)' * bool(r.get('cut'))} | {r['d_model']} x {r['layers']} "
            f"| {r['params']:,} | {r['steps']} "
            f"| {r['bytes_trained'] / 1e6:,.1f} M ({r['epochs']:.2f}) | {r['tokens_per_s']:,.0f} "
            f"| {r['valid_bpb']:.3f} | {fmt(bpc_at(valid, 'train_s', t_min))} "
            f"| {r['best_valid_bpb']:.3f} ({r['best_at_train_s']:.3g}) | {r['train_bpb']:.3f} "
            f"| {fmt(r['test_bpb'])} |")
    return "\n".join(lines)


def plot(summary: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r, color in zip(summary["runs"], ("tab:blue", "tab:orange")):
        label = f"{r['label']}, {r['params'] / 1e6:.1f}M, {r['tokens_per_s']:,.0f} tokens/s"
        by_time.plot([v["train_s"] for v in r["valid"]], [v["bpb"] for v in r["valid"]],
                     marker="o", color=color, label=f"{label}: held-out")
        by_time.plot([v["train_s"] for v in r["train"]], [v["bpb"] for v in r["train"]],
                     linestyle="--", alpha=0.5, color=color, label=f"{r['label']}: training")
        by_bytes.plot([v["bytes_trained"] / 1e6 for v in r["valid"]],
                      [v["bpb"] for v in r["valid"]], marker="o", color=color,
                      label=r["label"])
    by_time.set(xlabel="training seconds (wall clock, evaluations excluded)",
                ylabel="bits per byte", title="against time")
    by_bytes.set(xlabel="bytes trained (millions)", title="held-out, against bytes trained")
    for ax in (by_time, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"ByteLM against a Transformer, {summary['minutes']:g} min each, "
                 f"{where(summary)}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
