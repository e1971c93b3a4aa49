"""Where the CPU forward's time goes: ``python -m bench.cpu_cycles``.

The numba backend's forward of ``rwa_scan``, ``weighted_scan`` (a log decay), ``rda_scan``
(exp and sigmoid attention) and, for scale, ``torch.addcmul`` (three inputs read, one output
written: the fair reference of bench/cpu_fair.py), float32, one thread, interleaved round by
round, at two sizes (``--sizes``): by default inputs that fit in the cache (4 x 1024 x 256,
12 MB) and inputs that do not (16 x 4096 x 256, 268 MB). Nanoseconds per element, median of
``--rounds``. In cache the numbers are the kernels' arithmetic; out of it they add the
memory's time. Prints a table and writes ``OUT/cpu_cycles.json`` (``--out``: by default
``bench-results/cpu_cycles``, which git ignores; the committed record, bench/results/cpu_cycles,
only with ``--record``, and only at full size: no smaller ``--sizes``, no fewer
``--rounds``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fastrwa
from bench.cli import add_out, check_out, positive_int, shapes
from bench.common import seconds
from bench.cli import save_json

SIZES = ("in cache", "out of cache")


def calls(B: int, T: int, D: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    z, a, g = (torch.randn(B, T, D, generator=gen) for _ in range(3))
    log_decay = F.logsigmoid(g)
    return {"rwa": lambda: fastrwa.rwa_scan(z, a),
            "weighted (log decay)": lambda: fastrwa.weighted_scan(z, a, log_decay),
            "rda exp": lambda: fastrwa.rda_scan(z, a, g, "exp"),
            "rda sigmoid": lambda: fastrwa.rda_scan(z, a, g, "sigmoid"),
            "torch.addcmul": lambda: torch.addcmul(z, a, g)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=positive_int, default=15)
    p.add_argument("--sizes", type=shapes(len(SIZES)), default=[(4, 1024, 256), (16, 4096, 256)],
                   help="B,T,D of the in-cache and the out-of-cache inputs, separated by ';'")
    add_out(p, "cpu_cycles", "cpu_cycles.json")
    args = p.parse_args(argv)
    check_out(p, args, "cpu_cycles", sizes=["sizes", "rounds"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = dict(threads=1, torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), ns_per_element={})
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fastrwa.use_backend("numba"), torch.no_grad():
            for size, shape in zip(SIZES, args.sizes):
                fns = calls(*shape)
                for fn in fns.values():                      # (compiles, caches)
                    fn()
                times = {name: [] for name in fns}
                for _ in range(args.rounds):                 # (interleaved)
                    for name, fn in fns.items():
                        times[name].append(seconds(fn))
                n = shape[0] * shape[1] * shape[2]
                result["ns_per_element"][size] = {
                    "shape": list(shape),
                    **{name: 1e9 * statistics.median(t) / n for name, t in times.items()}}
    finally:
        torch.set_num_threads(previous)
    save_json(args.out / "cpu_cycles.json", result)
    print(f"float32 forward, numba backend, 1 thread, ns per element, median of {args.rounds}")
    sizes = list(result["ns_per_element"])
    print(f"{'':<22}" + "".join(f"{s:>14}" for s in sizes))
    for name in next(iter(result["ns_per_element"].values())):
        if name == "shape":
            continue
        print(f"{name:<22}" + "".join(f"{result['ns_per_element'][s][name]:>14.2f}"
                                      for s in sizes))
    print(args.out / "cpu_cycles.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
