"""How fast is each op against ``copy_`` of the same bytes, and against its peers?

    python -m bench.ops --device cpu [--quick] [--only throughput,rnn] [--paths numba]
    python -m bench.ops --device cuda [--only kernels] [--training LM_JSON]

(``python bench/ops.py ...`` runs the same: it re-executes itself as the module.)

**--device cpu** prints five tables and writes ``DIR/results.json`` and
``DIR/throughput_vs_length.png`` (``--out DIR``: by default ``bench-results``, which git
ignores; a folder under bench/results only with ``--record``, never from ``--quick``); the
sections are bench/cpu_ops.py's:

1. throughput: each path (sequential reference, "torch" chunked, "numba" compiled CPU, and
   "triton" on a GPU) x op x forward / forward+backward x dtype: elements/s and the ratio
   to ``copy_`` of the same bytes (bench/common.py); the reference runs at a shorter length.
2. triton_interpreter: the Triton kernels run under TRITON_INTERPRET=1, as a correctness
   note (max error against the reference; interpreter speed means nothing).
3. rnn: an RDA scan layer (projection + scan + output) forward+backward tokens/s beside
   ``torch.nn.LSTM`` and ``torch.nn.GRU`` of the same hidden size, batch and length.
4. scaling: ns per token of the forward for B=1, D=256 from T=1K to 1M, per path.
5. streaming: a ByteLM's single-token step latency, allocations per step, state bytes.

``--quick`` shrinks every shape so the whole run takes well under a minute (CI runs it).
No timing here is asserted anywhere; docs/benchmarks.md records a full run.

Allocator: every op returns fresh outputs. With glibc's defaults a tensor of 64 MB is
mmap'ed anew on every call and each of its pages faults on first write, which on this
project's machine costs about as much as the whole forward scan (the "allocator" line of
the report measures it). As PyTorch's CPU performance guide advises (a caching allocator
such as jemalloc or tcmalloc), the CPU run re-executes itself with glibc told to keep freed
memory (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``); ``--system-allocator`` keeps
the defaults. ``copy_``, the baseline, writes into a buffer it reuses either way.

**--device cuda**, the GPU run: correctness at scale, the kernels against ``copy_`` and
their peers, layers and streaming; JSON, a plot, and a short table printed last. Sections
(all by default):

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
* streaming: ByteLM ms per token at batch 1 and 64, eager and from a CUDA graph.

``--training`` adds a bench/experiments/lm.py result (a GPU training run) to the report.
Writes ``DIR/gpu-<device>.json`` (the shape in bench/gpu_report.py) after every section, so a
run cut short keeps what it measured, and ``DIR/gpu-<device>.png`` (``--out DIR``: by default
``bench-results/gpu``, which git ignores; a folder under bench/results only with
``--record``). Exits 2 when no CUDA GPU is visible (nothing is measured on a CPU). The
launch-knob sweep is bench/gpu_sweep.py; bench/gpu_run.sh is the whole device command.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

# Run as a script (python bench/ops.py), it runs itself again as the module: bench's modules
# import one another as bench.*, from the repository root.
if __name__ == "__main__" and not __package__:
    _root = str(pathlib.Path(__file__).resolve().parents[1])
    os.execve(sys.executable, [sys.executable, "-m", "bench.ops", *sys.argv[1:]],
              {**os.environ, "PYTHONPATH": os.pathsep.join(
                  filter(None, (_root, os.environ.get("PYTHONPATH"))))})

import torch  # noqa: E402

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # the Triton correctness note: interpreted

from bench import cpu_ops, gpu_report  # noqa: E402
from bench.cli import add_out, check_out, choices_list, existing_file  # noqa: E402
from bench.cli import save_json  # noqa: E402

ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
SECTIONS = {"cpu": tuple(cpu_ops.NAMES),
            "cuda": ("checks", "ops", "peers", "kernels", "layers", "streaming")}
PATHS = ("reference", "torch", "numba", "triton")
# each device's own flags: (dest, flag)
ONLY_FOR = {"cpu": (("quick", "--quick"), ("paths", "--paths"),
                    ("system_allocator", "--system-allocator")),
            "cuda": (("training", "--training"),)}

FULL = dict(B=16, T=4096, D=256, T_reference=256, repeats=9, rnn=dict(B=16, T=1024, H=256),
            lengths=[1 << k for k in range(10, 21, 2)], lm=dict(d_model=256, n_layers=4),
            ops=["rwa", "rda-exp", "rda-sigmoid", "rda-softplus", "rda-relu"],
            dtypes=["float32", "bfloat16"], paths=["reference", "torch", "numba"],
            reference_max_T=4096, torch_max_T=1 << 16)
QUICK = dict(B=2, T=512, D=64, T_reference=64, repeats=2, rnn=dict(B=4, T=64, H=32),
             lengths=[1024, 4096], lm=dict(d_model=32, n_layers=2),
             ops=["rwa", "rda-sigmoid"], dtypes=["float32", "bfloat16"],
             paths=["reference", "torch", "numba"], reference_max_T=1024, torch_max_T=4096,
             scaling_rounds=2)


def machine() -> dict:
    return dict(python=platform.python_version(), torch=torch.__version__,
                cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                threads=torch.get_num_threads(),
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                allocator={k: os.environ.get(k) for k in ALLOCATOR_ENV},
                fresh_64mb_first_write_ms=_first_write_ms())


def _first_write_ms() -> float:
    """Time to fill a freshly allocated 64 MB tensor (page faults included), in the steady
    state: the median of the last 5 of 12 (glibc takes a few rounds to start reusing)."""
    times = []
    for _ in range(12):
        x = torch.empty(1 << 24)
        start = time.perf_counter()
        x.fill_(1.0)
        times.append((time.perf_counter() - start) * 1e3)
        del x
    return sorted(times[-5:])[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled,
    ``args.sections`` (the device's, or ``--only``'s) and, for the CPU run, ``args.cfg`` (the
    shapes and paths measured) made."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", required=True, choices=list(SECTIONS),
                   help="cpu: the CPU tables (a triton path too where torch sees a GPU); "
                        "cuda: the GPU run")
    add_out(p, "", "results.json and the PNG (--device cuda: gpu-<device>.json and .png, "
                   "by default in bench-results/gpu)", record=False)
    p.add_argument("--only", metavar="SECTION,...",
                   help="comma-separated sections: cpu: " + ", ".join(SECTIONS["cpu"])
                        + "; cuda: " + ", ".join(SECTIONS["cuda"]))
    p.add_argument("--quick", action="store_true",
                   help="(cpu) tiny shapes (CI: keeps it from rotting)")
    p.add_argument("--paths", type=choices_list(PATHS),
                   help="(cpu) measure only these comma-separated paths (triton: on a CUDA GPU)")
    p.add_argument("--system-allocator", action="store_true",
                   help="(cpu) keep glibc's allocator defaults (see the module docstring)")
    p.add_argument("--training", type=existing_file,
                   help="(cuda) a bench/experiments/lm.py lm.json to add under 'training'")
    args = p.parse_args(argv)
    other = "cuda" if args.device == "cpu" else "cpu"
    for dest, flag in ONLY_FOR[other]:
        if getattr(args, dest):
            p.error(f"{flag} is for --device {other}, not --device {args.device}")
    args.sections = list(SECTIONS[args.device])
    if args.only is not None:
        try:
            args.sections = choices_list(SECTIONS[args.device])(args.only)
        except argparse.ArgumentTypeError as exc:
            p.error(f"argument --only: {exc}")
    if args.device == "cuda":
        check_out(p, args, "gpu", record=False, make=False)    # (made once a GPU is seen)
        return args
    if args.paths and "triton" in args.paths and not torch.cuda.is_available():
        p.error("--paths triton: the Triton path runs on a CUDA GPU, and torch sees none here")
    check_out(p, args, "", record=False)
    cfg = dict(QUICK if args.quick else FULL)
    if torch.cuda.is_available():
        cfg["paths"] = cfg["paths"] + ["triton"]
    if args.paths:
        cfg["paths"] = list(args.paths)
    args.cfg = cfg
    return args


def keep_freed_memory(args: argparse.Namespace) -> None:
    """Re-execute this command with ALLOCATOR_ENV (Linux, the CPU run, unless
    ``--system-allocator`` or the environment has it already)."""
    if (platform.system() == "Linux" and not args.system_allocator
            and any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items())):
        os.execve(sys.executable, [sys.executable, "-m", "bench.ops", *sys.argv[1:]],
                  {**os.environ, **ALLOCATOR_ENV})


def run_cpu(args: argparse.Namespace) -> dict:
    cfg = args.cfg
    results = dict(machine=machine(), config=cfg, quick=args.quick)
    print(f"fastrwa benchmarks ({'quick' if args.quick else 'full'}): {results['machine']}")
    for name in args.sections:
        results[name] = getattr(cpu_ops, name)(cfg)
    out = args.out
    save_json(out / "results.json", results)
    if "scaling" in results:
        cpu_ops.plot_scaling(results["scaling"], out / "throughput_vs_length.png")
    print(f"\nwrote {out / 'results.json'}" + (f" and {out / 'throughput_vs_length.png'}"
                                               if "scaling" in results else ""))
    return results


def run_cuda(args: argparse.Namespace) -> int:
    from bench import gpu_layers, gpu_ops

    log = gpu_report.log
    report = gpu_report.started(args.out)
    missing: dict = {}
    copy = gpu_ops.CopyTimer("cuda")

    def measure(section: str) -> None:
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

    failed = gpu_report.run_sections(report, args.sections, args.out, measure)
    report["copy_gb_per_s"] = {str(n): n / ms / 1e6 for n, ms in copy.cache.items()}
    return gpu_report.finished(report, args.out, failed, args.training)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        if argv is None:                # (a command, not a call from Python: it may re-exec)
            keep_freed_memory(args)
        run_cpu(args)
        return 0
    if not torch.cuda.is_available():
        print("bench/ops.py --device cuda needs a CUDA GPU, and torch sees none here; nothing "
              "was measured.", file=sys.stderr)
        return 2
    return run_cuda(args)


if __name__ == "__main__":
    sys.exit(main())
