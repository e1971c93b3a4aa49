"""Launch defaults against the sweep's candidates, timed as a user calls the ops.

Before ``Options``' defaults move, this times ``rwa_scan`` and ``rda_scan`` (exp attention)
with ``algorithm="auto"`` at every ops shape (bench/gpu_ops.py ``SHAPES``), float32 and
bfloat16, forward and forward+backward, under each candidate knob set (longer chunks, wider
channel blocks, two columns a thread, the old layout), side by side in one run. Each line printed is one JSON object, and the
measurements are appended to DIR/defaults.jsonl; the last lines printed are each candidate's
time over the defaults' per (shape, dtype, op), forward and forward+backward (``ratios``).
Results: docs/benchmarks.md, "GPU".

    python bench/gpu_defaults.py [--out DIR] [--shapes 0 2] [--candidates bt32 ...]

``--out``: by default ``$OUT`` where set, else ``bench-results/gpu``, which git ignores; a
folder under bench/results only with ``--record``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import fastrwa
from cli import add_out, check_out, out_dir
from common import OPS
from fastrwa.testing import backend_options
from gpu_ops import DTYPES, SHAPES, fastrwa_fn, random_inputs, timed

CANDIDATES = {
    "default": {},
    "bt32": dict(block_t=32),
    "bt8": dict(block_t=8),
    "bd128-w4": dict(block_d=128, warps=4, block_d_backward=128, warps_backward=4),
    "bd64-w1": dict(block_d=64, block_d_backward=64),
    "old-layout": dict(block_t=32, block_d=32, block_d_backward=16, warps=4, warps_backward=4),
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out(p, "gpu", "defaults.jsonl ($OUT where set)", record=False)
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES),
                   help="knob sets to time beside the defaults")
    p.add_argument("--shapes", nargs="+", type=int, default=list(range(len(SHAPES))),
                   choices=range(len(SHAPES)), help="indices into gpu_ops.SHAPES")
    args = p.parse_args(argv)
    if args.out is None and os.environ.get("OUT"):     # (the device tool's output folder)
        try:
            args.out = out_dir(os.environ["OUT"])
        except argparse.ArgumentTypeError as exc:
            p.error(f"$OUT: {exc}")
    check_out(p, args, "gpu", record=False, make=False)    # (made once a GPU is seen)
    if not torch.cuda.is_available():
        print("bench/gpu_defaults.py needs a CUDA GPU, and torch sees none here; nothing was "
              "measured.", file=sys.stderr)
        return 2
    from fastrwa.ops import triton_host  # imports Triton: only here, where a GPU is
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "defaults.jsonl")
    entries = []

    def log(entry: dict) -> None:
        entries.append(entry)
        line = json.dumps(entry)
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    log(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
             defaults=dict(vars(triton_host.Options()))))
    candidates = {name: CANDIDATES[name] for name in ["default", *args.candidates]}
    for shape in [SHAPES[i] for i in args.shapes]:
        for dtype_name, dtype in DTYPES.items():
            for op in ("rwa", "rda-exp"):
                spec = OPS[op]
                leaves = [x.requires_grad_()
                          for x in random_inputs(spec.inputs, shape, dtype, "cuda")]
                gy = random_inputs(1, shape, dtype, "cuda", seed=1)[0]
                B, T, D = shape
                for name, knobs in candidates.items():
                    opts = triton_host.Options(**knobs)
                    algorithm = triton_host.choose_algorithm(B, D, T, opts, leaves[0].device)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
