"""The GPU run in one call: correctness at scale, the kernels against copy_ and their peers,
layers, streaming, and the launch-knob sweep; JSON, a plot, and a short table printed last.

    python bench/gpu.py --out DIR [--only checks,ops,peers,layers,streaming,sweep,crossover]
                        [--training LM_JSON]

Sections (all by default):

* checks: rda_scan against the float64 PyTorch backend at the bench shapes' scale, and past
  2**31 elements (bench/gpu_ops.py);
* ops: rwa_scan and rda_scan, both forward algorithms (bench/gpu_ops.py VARIANTS), float32
  and bfloat16, forward and forward+backward, at B/T/D = 16/4096/1024, 8/16K/2048, 1/1M/256
  and 4/4096/1024, against copy_;
* peers: flash-linear-attention's HGRN kernels, accelerated-scan, a torch.logcumsumexp
  formulation, at the same shapes (each skipped, with the reason, when it does not import);
* kernels: ops and peers shape by shape (the JSON is written after each shape and dtype, so
  a run cut short keeps every shape it finished);
* layers: fastrwa.nn.RDA against cuDNN LSTM and GRU (bench/gpu_layers.py);
* streaming: ByteLM ms per token at batch 1 and 64, eager and from a CUDA graph;
* sweep, crossover: launch knobs and the algorithm heuristic (bench/gpu_sweep.py).

``--training`` adds a bench/lm.py result (a GPU training run) to the report. Writes
``DIR/gpu-<device>.json`` (the shape in bench/gpu_report.py) after every section, so a run cut
short keeps what it measured, and ``DIR/gpu-<device>.png`` (``--out DIR``: by default
``bench-results/gpu``, which git ignores; a folder under bench/results only with
``--record``). Exits 2 when no CUDA GPU is
visible (nothing is measured on a CPU). bench/gpu_run.sh is the whole device command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_report  # noqa: E402
from cli import add_out, check_out, choices_list, existing_file  # noqa: E402

SECTIONS = ("checks", "ops", "peers", "kernels", "layers", "streaming", "sweep", "crossover")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "gpu", "the JSON and the PNG", record=False)
    p.add_argument("--only", type=choices_list(SECTIONS), default=list(SECTIONS),
                   help=f"comma-separated sections, of {', '.join(SECTIONS)}")
    p.add_argument("--training", type=existing_file,
                   help="a bench/lm.py lm.json to add under 'training'")
    args = p.parse_args(argv)
    args.sections = args.only
    check_out(p, args, "gpu", record=False, make=False)    # (made once a GPU is seen)
    return args


def empty_report(device: str, torch_version: str, triton_version: str) -> dict:
    return dict(device=device, torch=torch_version, triton=triton_version, rows=[],
                lstm_ratio=None, started=time.strftime("%Y-%m-%d %H:%M:%S"))


def log(entry: dict) -> None:
    print(json.dumps(entry, default=str), flush=True)


def run(args: argparse.Namespace) -> int:
    import triton

    import gpu_layers
    import gpu_ops
    import gpu_sweep

    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name(0)
    report = empty_report(device, torch.__version__, triton.__version__)
    report["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    missing: dict = {}
    copy = gpu_ops.CopyTimer("cuda")
    failed = []
    for section in args.sections:
        began = time.perf_counter()
        print(f"== {section}", flush=True)
        try:
            if section == "checks":
                report["checks"] = gpu_ops.correctness_checks(log)
            elif section in ("ops", "peers", "kernels"):
                for shape in gpu_ops.SHAPES:
                    for dtype_name in gpu_ops.DTYPES:
                        if section in ("ops", "kernels"):
                            report["rows"] += gpu_ops.op_rows(shape, dtype_name, copy, log)
                        if section in ("peers", "kernels"):
                            report["rows"] += gpu_ops.peer_rows(shape, dtype_name, copy, log,
                                                                missing)
                        report["peers_missing"] = missing
                        torch.cuda.empty_cache()
                        gpu_report.write_json(report, args.out)
            elif section == "layers":
                rows, report["lstm_ratio"] = gpu_layers.layer_rows(log)
                report["rows"] += rows
            elif section == "streaming":
                report["streaming"] = gpu_layers.streaming(log)
            elif section == "sweep":
                report["sweep"] = gpu_sweep.sweep(log)
            elif section == "crossover":
                report["crossover"] = gpu_sweep.crossover(log)
        except Exception as e:  # noqa: BLE001 (one broken section must not lose the others)
            failed.append(section)
            report.setdefault("section_errors", {})[section] = f"{type(e).__name__}: {e}"
            print(f"section {section} failed: {type(e).__name__}: {e}", flush=True)
        report.setdefault("section_seconds", {})[section] = time.perf_counter() - began
        torch.cuda.empty_cache()
        gpu_report.write_json(report, args.out)
    report["copy_gb_per_s"] = {str(n): n / ms / 1e6 for n, ms in copy.cache.items()}
    if args.training:
        with open(args.training) as f:
            report["training"] = json.load(f)
    path = gpu_report.write_json(report, args.out)
    gpu_report.plot(report, path[:-len(".json")] + ".png")
    print(gpu_report.table(report))
    if failed:
        print(f"sections that failed: {failed} (see section_errors in {path})")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU, and torch sees none here; nothing was measured.",
              file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
