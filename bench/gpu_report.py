"""The GPU runs' report (``bench/ops.py --device cuda``, bench/gpu_sweep.py): its rows, the JSON
file, the plot and the short table, and the loop over sections that writes it.

JSON shape (read by tools; checked by :func:`validate`)::

    {"device": str, "torch": str, "triton": str,
     "rows": [{"what": "op"|"layer"|"peer", "name": str, "dtype": str, "shape": [B, T, D],
               "algorithm": str|null, "pass": "fwd"|"fwd+bwd", "ms": float,
               "ratio_to_copy": float|null}, ...],
     "lstm_ratio": float|null}

Extra keys are allowed beside these (the run adds "sweep", "crossover", "streaming",
"training", "checks"); the keys above keep their types.

The run is split over several device calls (bench/gpu_run.sh); their reports are joined with

    python -m bench.gpu_report merge A.json B.json ... [--training lm.json] --out DIR [--record]

(``--out``: by default ``bench-results/gpu``, which git ignores; a folder under bench/results
only with ``--record``.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Iterable

from bench.cli import add_out, check_out, existing_file

WHATS = ("op", "layer", "peer")
PASSES = ("fwd", "fwd+bwd")
ROW_KEYS = ("what", "name", "dtype", "shape", "algorithm", "pass", "ms", "ratio_to_copy")


def row(what: str, name: str, dtype: str, shape: Iterable[int], algorithm: str | None,
        pass_: str, ms: float, ratio_to_copy: float | None = None, **extra: Any) -> dict:
    """One measured row; raises ValueError on a field outside the JSON shape."""
    r = dict(what=what, name=name, dtype=dtype, shape=[int(s) for s in shape],
             algorithm=algorithm, ms=float(ms), ratio_to_copy=ratio_to_copy, **extra)
    r["pass"] = pass_
    _check_row(r)
    return r


def _check_row(r: dict) -> None:
    missing = [k for k in ROW_KEYS if k not in r]
    if missing:
        raise ValueError(f"row {r.get('name')!r} lacks {missing}")
    if r["what"] not in WHATS:
        raise ValueError(f"row 'what' must be one of {WHATS}, got {r['what']!r}")
    if r["pass"] not in PASSES:
        raise ValueError(f"row 'pass' must be one of {PASSES}, got {r['pass']!r}")
    if not isinstance(r["name"], str) or not isinstance(r["dtype"], str):
        raise ValueError(f"row 'name' and 'dtype' must be strings, got {r['name']!r}, "
                         f"{r['dtype']!r}")
    if len(r["shape"]) != 3 or not all(isinstance(s, int) and s > 0 for s in r["shape"]):
        raise ValueError(f"row 'shape' must be [B, T, D] of positive ints, got {r['shape']!r}")
    if r["algorithm"] is not None and not isinstance(r["algorithm"], str):
        raise ValueError(f"row 'algorithm' must be a string or None, got {r['algorithm']!r}")
    if not (isinstance(r["ms"], float) and math.isfinite(r["ms"]) and r["ms"] > 0):
        raise ValueError(f"row 'ms' must be a positive finite float, got {r['ms']!r}")
    ratio = r["ratio_to_copy"]
    if ratio is not None and not (isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"row 'ratio_to_copy' must be a positive float or None, got {ratio!r}")


def validate(report: dict) -> None:
    """Raise ValueError unless ``report`` has the JSON shape above."""
    for key in ("device", "torch", "triton"):
        if not isinstance(report.get(key), str):
            raise ValueError(f"report {key!r} must be a string, got {report.get(key)!r}")
    if not isinstance(report.get("rows"), list):
        raise ValueError("report 'rows' must be a list")
    for r in report["rows"]:
        _check_row(r)
    lstm = report.get("lstm_ratio", "absent")
    if lstm is not None and not (isinstance(lstm, float) and math.isfinite(lstm)):
        raise ValueError(f"report 'lstm_ratio' must be a float or None, got {lstm!r}")


def device_slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (for the file name)."""
    slug = "".join(c.lower() if c.isalnum() else "-" for c in device)
    return "-".join(part for part in slug.split("-") if part)


def write_json(report: dict, out_dir: str) -> str:
    """Validate and write ``gpu-<device>.json`` under ``out_dir`` (atomically); its path."""
    validate(report)
    path = os.path.join(out_dir, f"gpu-{device_slug(report['device'])}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
    return path


def table(report: dict) -> str:
    """The short table printed last: one line per row, grouped as measured."""
    lines = [f"{report['device']} | torch {report['torch']} | triton {report['triton']}",
             f"{'what':<6}{'name':<28}{'dtype':<18}{'shape':<16}{'alg':<12}{'pass':<8}"
             f"{'ms':>10}{'x copy':>8}"]
    for r in report["rows"]:
        shape = "x".join(str(s) for s in r["shape"])
        ratio = "" if r["ratio_to_copy"] is None else f"{r['ratio_to_copy']:.2f}"
        lines.append(f"{r['what']:<6}{r['name'][:27]:<28}{r['dtype']:<18}{shape:<16}"
                     f"{(r['algorithm'] or '-'):<12}{r['pass']:<8}{r['ms']:>10.3f}{ratio:>8}")
    if report.get("lstm_ratio") is not None:
        lines.append(f"nn.RDA / cuDNN LSTM, forward+backward tokens/s: {report['lstm_ratio']:.1f}x")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Bars of each op/peer row's ratio to copy_, one panel per shape x pass."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["ratio_to_copy"] is not None]
    panels = sorted({(tuple(r["shape"]), r["pass"]) for r in rows})
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.2 + 0.9 * len(rows) / len(panels)),
                             squeeze=False, layout="constrained")
    for ax, (shape, pass_) in zip(axes[:, 0], panels):
        mine = [r for r in rows if tuple(r["shape"]) == shape and r["pass"] == pass_]
        labels = [f"{r['name']} {r['algorithm'] or ''} {r['dtype']}".replace("  ", " ")
                  for r in mine]
        colors = ["tab:blue" if r["what"] == "op" else "tab:gray" for r in mine]
        ax.barh(range(len(mine)), [r["ratio_to_copy"] for r in mine], color=colors)
        ax.set_yticks(range(len(mine)), labels, fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set_title(f"B, T, D = {shape}, {pass_}: bandwidth / copy_ (blue fastrwa, grey peers)",
                     fontsize=9)
    axes[-1, 0].set_xlabel("achieved bytes/s over copy_ of the same bytes (higher is better)")
    fig.suptitle(f"{report['device']}, torch {report['torch']}, triton {report['triton']}",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(reports: list[dict]) -> dict:
    """One report from the reports of several calls on the same device and versions: rows
    in order, ``section_seconds`` and ``section_errors`` joined, the other keys from the last
    report that has them (``lstm_ratio`` from the last that measured it). Raises ValueError
    when device or versions differ."""
    if not reports:
        raise ValueError("merge needs at least one report")
    first = reports[0]
    for r in reports:
        validate(r)
        for key in ("device", "torch", "triton"):
            if r[key] != first[key]:
                raise ValueError(f"cannot merge reports of different {key}: {first[key]!r} "
                                 f"and {r[key]!r}")
    joined = ("section_seconds", "section_errors")
    out = dict(first, rows=[], lstm_ratio=None)
    for r in reports:
        out.update({k: v for k, v in r.items() if k not in ("rows", "lstm_ratio", *joined)})
        for key in joined:
            if key in r:
                out[key] = {**out.get(key, {}), **r[key]}
        out["rows"] += r["rows"]
        if r.get("lstm_ratio") is not None:
            out["lstm_ratio"] = r["lstm_ratio"]
    return out


def empty_report(device: str, torch_version: str, triton_version: str) -> dict:
    return dict(device=device, torch=torch_version, triton=triton_version, rows=[],
                lstm_ratio=None, started=time.strftime("%Y-%m-%d %H:%M:%S"))


def log(entry: dict) -> None:
    """One measurement as it is made: a JSON line (bench/gpu_run.sh keeps them in its log)."""
    print(json.dumps(entry, default=str), flush=True)


def started(out) -> dict:
    """A GPU run's empty report (device, versions, SMs), with the folder ``out`` made."""
    import torch
    import triton

    os.makedirs(out, exist_ok=True)
    report = empty_report(torch.cuda.get_device_name(0), torch.__version__, triton.__version__)
    report["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    return report


def run_sections(report: dict, sections: list[str], out, measure) -> list[str]:
    """``measure(section)`` for each section, the report written into ``out`` after each: a
    section that raises is recorded under ``section_errors`` and the next still runs; each
    one's seconds go under ``section_seconds``. Returns the sections that failed."""
    import torch

    failed = []
    for section in sections:
        began = time.perf_counter()
        print(f"== {section}", flush=True)
        try:
            measure(section)
        except Exception as e:  # noqa: BLE001 (one broken section must not lose the others)
            failed.append(section)
            report.setdefault("section_errors", {})[section] = f"{type(e).__name__}: {e}"
            print(f"section {section} failed: {type(e).__name__}: {e}", flush=True)
        report.setdefault("section_seconds", {})[section] = time.perf_counter() - began
        torch.cuda.empty_cache()
        write_json(report, out)
    return failed


def finished(report: dict, out, failed: list[str], training=None) -> int:
    """Write the report, its plot and the table printed last (``training``: an lm.json to
    add under "training"); 1 if a section failed, else 0."""
    if training:
        with open(training) as f:
            report["training"] = json.load(f)
    path = write_json(report, out)
    plot(report, path[:-len(".json")] + ".png")
    print(table(report))
    if failed:
        print(f"sections that failed: {failed} (see section_errors in {path})")
    return 1 if failed else 0


def _load(p: argparse.ArgumentParser, flag: str, path) -> dict:
    """The JSON object in ``path``, or one ``error:`` line naming ``flag`` (exit 2)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        p.error(f"{flag} {path}: not a JSON file ({exc})")
    if not isinstance(data, dict):
        p.error(f"{flag} {path}: not a JSON object")
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Join the GPU run's reports: python "
                                            "bench/gpu_report.py merge A.json B.json --out DIR")
    p.add_argument("command", choices=["merge"])
    p.add_argument("reports", nargs="+", type=existing_file)
    add_out(p, "gpu", "gpu-<device>.json and .png", record=False)
    p.add_argument("--training", type=existing_file,
                   help="a bench/experiments/lm.py lm.json (the train step) to add")
    args = p.parse_args(argv)
    reports = [_load(p, "report", path) for path in args.reports]
    try:
        merged = merge(reports)
    except ValueError as exc:
        p.error(f"reports: {exc}")
    if args.training:
        merged["training"] = _load(p, "--training", args.training)
    check_out(p, args, "gpu", record=False)
    path = write_json(merged, args.out)
    plot(merged, path[:-len(".json")] + ".png")
    print(table(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
