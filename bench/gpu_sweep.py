"""Which launch knobs should the Triton backend default to? Measured on a GPU:

    python -m bench.gpu_sweep [--only sweep,crossover,defaults] [--out DIR]
                              [--shapes 0 2] [--candidates bt32 ...]

Sections (``--only``; sweep and crossover by default, bench/gpu_run.sh's ``tune`` step):

* sweep: for each algorithm and pass (forward; forward+backward) of ``rda_scan`` at B=16,
  T=4096, D=1024, every (block_t, block_d or block_d_backward, warps) of a small grid in
  float32 (``block_d >= 32 x warps``: each thread owns whole channel columns), then
  pipelining stages for the best, and the best few again in bfloat16. Each entry is the
  median ms; the best per (algorithm, pass, dtype) is what the launcher's defaults
  (``Options`` in fastrwa/ops/triton_host.py) should become.
* crossover: looped against segments, forward and forward+backward, as the count of
  programs (``B * ceil(D / block_d)``) grows at T=16384, to place the heuristic's threshold
  (``PROGRAMS_PER_SM`` in fastrwa/ops/triton_host.py).
* defaults: before ``Options``' defaults move, ``rwa_scan`` and ``rda_scan`` (exp attention)
  with ``algorithm="auto"`` at every ops shape (bench/gpu_ops.py ``SHAPES``; ``--shapes``
  picks some), float32 and bfloat16, forward and forward+backward, under each candidate knob
  set (``--candidates``: longer chunks, wider channel blocks, two columns a thread, the old
  layout, the forward loading two chunks ahead, the carry kernels taking 8 or 16 segments
  at a time), side by side in one run; the last lines printed are each candidate's time over
  the defaults' per (shape, dtype, op), forward and forward+backward (:func:`ratios`).

* streams: the cost model's bandwidth probe (bench/stream_probe.py: three inputs read as
  the scan kernels read them, nothing computed) in the looped and the segments layouts at
  ``--shapes``, float32 and bfloat16, beside a ``copy_`` of the same bytes: the bandwidth
  those streams reach, for the model's DRAM term (docs/kernels.md, "Cost model"); appended
  to ``DIR/streams.jsonl``.

sweep and crossover write ``DIR/gpu-<device>.json`` (bench/gpu_report.py's shape, joined
with the other calls' by ``python -m bench.gpu_report merge``) after each section; defaults
appends its measurements to ``DIR/defaults.jsonl``. With both, streams runs before
defaults (it takes seconds; defaults compiles a set of builds a candidate, and a time limit
cuts it last). Each line printed is one JSON object.
``--out``: by default ``$OUT`` where set (the device tool's output folder), else
``bench-results/gpu``, which git ignores; a folder under bench/results only with
``--record``. Exits 2 when no CUDA GPU is visible. Results: docs/benchmarks.md, "GPU".
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch

import fastrwa
from bench import gpu_report
from bench.cli import add_out, check_out, choices_list, out_dir
from bench.common import OPS
from bench.gpu_ops import (DTYPES, LONG_T, SHAPES, CopyTimer, bench_ms, fastrwa_fn,
                           random_inputs, timed)
from fastrwa.testing import backend_options

SECTIONS = ("sweep", "crossover", "defaults", "streams")
IN_REPORT = ("sweep", "crossover")          # (defaults and streams write .jsonl files)

GRID_T = (8, 16, 32)
GRID_D = (32, 64, 128)
GRID_WARPS = (1, 2, 4)
GRID_STAGES = (1, 2, 3, 4)
KNOBS = ("block_t", "block_d", "block_d_backward", "warps", "warps_backward", "stages")


def _time(shape, dtype, pass_: str, knobs: dict) -> float:
    leaves = [x.requires_grad_() for x in random_inputs(3, shape, dtype, "cuda")]
    gy = random_inputs(1, shape, dtype, "cuda", seed=1)[0]
    with fastrwa.use_backend("triton"), backend_options("triton", **knobs):
        return timed(fastrwa_fn("rda-exp"), leaves, gy, passes=(pass_,))[pass_]


def _try(shape, dtype_name, algorithm, pass_, knobs, log=None) -> dict:
    entry = dict(dtype=dtype_name, algorithm=algorithm, pass_=pass_, **knobs)
    try:
        entry["ms"] = _time(shape, DTYPES[dtype_name], pass_, dict(algorithm=algorithm, **knobs))
    except Exception as e:  # noqa: BLE001 (a config that does not compile or run is a result)
        entry["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    if log is not None:  # each point as it is measured, so a run cut short keeps what it had
        log(dict(sweep=entry))
    return entry


def sweep(log, shape=(16, 4096, 1024), keep: int = 5) -> list[dict]:
    """float32: every (block_t, block_d, warps) of the grid, then pipelining stages for the
    best; bfloat16: the ``keep`` best float32 points. The forward's knobs vary for "fwd"; for
    "fwd+bwd" the forward keeps its defaults and the backward's vary. Failures are recorded."""
    out = []
    for algorithm, pass_ in itertools.product(("looped", "segments"), ("fwd", "fwd+bwd")):
        grid = []
        for bt, bd, warps in itertools.product(GRID_T, GRID_D, GRID_WARPS):
            if bd < 32 * warps:          # a thread would share a channel's column: not swept
                continue
            grid.append(dict(block_t=bt, **(dict(block_d=bd, warps=warps) if pass_ == "fwd"
                                            else dict(block_d_backward=bd, warps_backward=warps))))
        mine = [_try(shape, "float32", algorithm, pass_, knobs, log) for knobs in grid]
        ranked = sorted((e for e in mine if "ms" in e), key=lambda e: e["ms"])
        if ranked:
            knobs = {k: v for k, v in ranked[0].items() if k in KNOBS}
            mine += [_try(shape, "float32", algorithm, pass_, dict(knobs, stages=st), log)
                     for st in GRID_STAGES]
        for best in ranked[:keep]:
            knobs = {k: v for k, v in best.items() if k in KNOBS}
            mine.append(_try(shape, "bfloat16", algorithm, pass_, knobs, log))
        for dtype_name in DTYPES:
            timed = [e for e in mine if e["dtype"] == dtype_name and "ms" in e]
            if timed:
                log(dict(best=min(timed, key=lambda e: e["ms"]), tried=len(timed)))
        out += mine
    return out


def crossover(log, T: int = 16384, widths=(256, 1024), batches=(1, 2, 4, 8, 16, 32, 64)):
    """ms of both algorithms as programs grow; the smallest program count where looped wins."""
    from fastrwa.ops import triton_host  # imports Triton: only where a GPU is

    props = torch.cuda.get_device_properties(0)
    bd = triton_host.Options().block_d
    out = []
    for D, B in itertools.product(widths, batches):
        if B * T * D * 4 * 8 > props.total_memory // 2:
            continue
        for pass_ in ("fwd", "fwd+bwd"):
            ms = {alg: _time((B, T, D), torch.float32, pass_, dict(algorithm=alg))
                  for alg in ("looped", "segments")}
            programs = B * -(-D // bd)
            out.append(dict(B=B, T=T, D=D, pass_=pass_, programs=programs,
                            programs_per_sm=programs / props.multi_processor_count,
                            **{f"{k}_ms": v for k, v in ms.items()},
                            looped_wins=ms["looped"] <= ms["segments"]))
            log(out[-1])
    return out


CANDIDATES = {
    "default": {},
    "bt32": dict(block_t=32),
    "bt8": dict(block_t=8),
    "bd128-w4": dict(block_d=128, warps=4, block_d_backward=128, warps_backward=4),
    "bd64-w1": dict(block_d=64, block_d_backward=64),
    "old-layout": dict(block_t=32, block_d=32, block_d_backward=16, warps=4, warps_backward=4),
    "fwd-la2": dict(forward_lookahead=2),
    "carry8": dict(carry_tile=8),
    "carry16": dict(carry_tile=16),
    "fwd-bt32": dict(forward_block_t=32),
    "bt32-carry8": dict(block_t=32, carry_tile=8),
    "chained": dict(algorithm="chained"),
    "chained-bt32-2": dict(algorithm="chained", block_t=32, chained_chunks=2),
    "chained-fwd-bt32-carry8-3": dict(algorithm="chained", chained_backward=False, block_t=32,
                                      carry_tile=8, chained_chunks=3),
    "chained-cap6-5": dict(algorithm="chained", chained_programs_per_sm=6,
                           chained_programs_per_sm_backward=5),
    "chained-cap4": dict(algorithm="chained", chained_programs_per_sm=4,
                         chained_programs_per_sm_backward=4),
    "chained-bt32-2-cap6-5": dict(algorithm="chained", block_t=32, chained_chunks=2,
                                  chained_programs_per_sm=6, chained_programs_per_sm_backward=5),
}


def ratios(entries: list[dict]) -> list[dict]:
    """Each candidate's time over the defaults' at the same (shape, dtype, op), forward and
    forward+backward, from the logged entries: the latest defaults' entry before it at that
    key (one that failed leaves its candidates without a ratio)."""
    base, out = {}, []
    for e in entries:
        if "candidate" not in e:
            continue
        key = (tuple(e["shape"]), e["dtype"], e["op"])
        if e["candidate"] == "default":
            base[key] = e if "fwd" in e else None
        elif "fwd" in e and base.get(key) is not None:
            ref = base[key]
            out.append(dict(shape=e["shape"], dtype=e["dtype"], op=e["op"],
                            candidate=e["candidate"], algorithm=e["algorithm"],
                            fwd=round(e["fwd"] / ref["fwd"], 3),
                            fwd_bwd=round(e["fwd+bwd"] / ref["fwd+bwd"], 3)))
    return out


def defaults(out, candidates: list[str], shapes: list[int]) -> None:
    """The defaults section: each of ``candidates`` (names in :data:`CANDIDATES`) beside the
    defaults at ``shapes`` (indices into bench/gpu_ops.py ``SHAPES``), appended to
    ``out/defaults.jsonl``; then the ratios printed."""
    from fastrwa.ops import triton_host  # imports Triton: only where a GPU is

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "defaults.jsonl")
    entries = []

    def log(entry: dict) -> None:
        entries.append(entry)
        line = json.dumps(entry)
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    log(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
             defaults=dict(vars(triton_host.Options()))))
    knob_sets = {name: CANDIDATES[name] for name in ["default", *candidates]}
    for shape in [SHAPES[i] for i in shapes]:
        for dtype_name, dtype in DTYPES.items():
            for op in ("rwa", "rda-exp"):
                spec = OPS[op]
                leaves = [x.requires_grad_()
                          for x in random_inputs(spec.inputs, shape, dtype, "cuda")]
                gy = random_inputs(1, shape, dtype, "cuda", seed=1)[0]
                B, T, D = shape
                for name, knobs in knob_sets.items():
                    opts = triton_host.Options(**knobs)
                    # (the forward's choice, at its own chunk: forward_block_t)
                    algorithm = triton_host.choose_algorithm(B, D, T, opts.forward(),
                                                             leaves[0].device)
                    entry = dict(shape=list(shape), dtype=dtype_name, op=op, candidate=name,
                                 algorithm=algorithm)
                    try:
                        with fastrwa.use_backend("triton"), backend_options("triton", **knobs):
                            entry.update(timed(fastrwa_fn(op), leaves, gy))
                    except Exception as e:  # noqa: BLE001 (a failure is a result)
                        entry["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                    log(entry)
                del leaves, gy
                torch.cuda.empty_cache()
    for r in ratios(entries):
        print(json.dumps(dict(ratio_to_default=r)))


def streams(out, shapes: list[int]) -> None:
    """The streams section (module doc): one line a (shape, dtype, layout), appended to
    ``out/streams.jsonl``; the looped layout only up to ``LONG_T`` steps (past it a program
    walks 65,536 chunks alone: seconds a call)."""
    import triton

    from bench.stream_probe import BT, BD, read
    from fastrwa.ops import triton_host

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "streams.jsonl")
    copy, device = CopyTimer("cuda"), torch.device("cuda")
    for shape in [SHAPES[i] for i in shapes]:
        B, T, D = shape
        layouts = {"segments": triton_host.segment_chunks(B, D, T, triton_host.Options(),
                                                          device)}
        if T <= LONG_T:
            layouts["looped"] = triton.cdiv(T, BT)
        for dtype_name, dtype in DTYPES.items():
            inputs = random_inputs(3, shape, dtype, "cuda")
            nbytes = 3 * inputs[0].numel() * inputs[0].element_size()
            for layout, cps in layouts.items():
                ms = bench_ms(functools.partial(read, *inputs, cps))
                programs = B * triton.cdiv(triton.cdiv(T, BT), cps) * triton.cdiv(D, BD)
                entry = dict(device=torch.cuda.get_device_name(), shape=list(shape),
                             dtype=dtype_name, layout=layout, chunks_per_program=cps,
                             programs=programs, bytes=nbytes, ms=ms, copy_ms=copy.ms(nbytes),
                             read_gb_per_s=nbytes / ms / 1e6,
                             ratio_to_copy=copy.ms(nbytes) / ms)
                line = json.dumps(entry)
                print(line, flush=True)
                with open(path, "a") as f:
                    f.write(line + "\n")
            del inputs
            torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled
    (``$OUT`` where set and no ``--out``)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "gpu", "gpu-<device>.json and defaults.jsonl ($OUT where set)", record=False)
    p.add_argument("--only", type=choices_list(SECTIONS), default=list(IN_REPORT),
                   help=f"comma-separated sections, of {', '.join(SECTIONS)} (default "
                        f"{','.join(IN_REPORT)})")
    p.add_argument("--candidates", nargs="+", choices=list(CANDIDATES),
                   help="(defaults) knob sets to time beside the defaults (default: all)")
    p.add_argument("--shapes", nargs="+", type=int, choices=range(len(SHAPES)),
                   help="(defaults, streams) indices into gpu_ops.SHAPES (default: all)")
    args = p.parse_args(argv)
    if args.candidates is not None and "defaults" not in args.only:
        p.error("--candidates is for the defaults section: add --only defaults")
    if args.shapes is not None and not {"defaults", "streams"} & set(args.only):
        p.error("--shapes is for the defaults and streams sections: add --only defaults "
                "or streams")
    args.candidates = args.candidates or list(CANDIDATES)
    args.shapes = args.shapes if args.shapes is not None else list(range(len(SHAPES)))
    if args.out is None and os.environ.get("OUT"):     # (the device tool's output folder)
        try:
            args.out = out_dir(os.environ["OUT"])
        except argparse.ArgumentTypeError as exc:
            p.error(f"$OUT: {exc}")
    check_out(p, args, "gpu", record=False, make=False)    # (made once a GPU is seen)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_sweep.py needs a CUDA GPU, and torch sees none here; nothing was "
              "measured.", file=sys.stderr)
        return 2
    status = 0
    reported = [s for s in args.only if s in IN_REPORT]
    if reported:
        report = gpu_report.started(args.out)
        runs = {"sweep": sweep, "crossover": crossover}

        def measure(section: str) -> None:
            report[section] = runs[section](gpu_report.log)
        failed = gpu_report.run_sections(report, reported, args.out, measure)
        report["copy_gb_per_s"] = {}
        status = gpu_report.finished(report, args.out, failed)
    # (streams first: seconds, and the cost model's measurement; the defaults section's
    # compiles, a set of builds a candidate, are what a step's time limit may cut short)
    if "streams" in args.only:
        streams(args.out, args.shapes)
    if "defaults" in args.only:
        defaults(args.out, args.candidates, args.shapes)
    return status


if __name__ == "__main__":
    sys.exit(main())
