"""Context parallelism on this machine: ``python -m bench.context_parallel``.

Two measurements, each process a fresh one (gloo over local TCP, CPU tensors):

* **Bytes per layer per step against T.** For an RDA layer as the byte LM uses it
  (``fastrwa.nn.RDA(256, 256, token_shift=True)``, B = 1) split over 2 processes, the bytes
  each process hands to collectives in one forward+backward (every ``all_gather``'s input
  and ``all_reduce``'s tensor, counted by wrapping ``torch.distributed``'s functions in the
  worker), and how many collectives, for T = 2^10 ... 2^16: constant in T.
* **One long sequence.** ``fastrwa.rda_scan`` forward+backward (f_a = sigmoid, the LM's
  default) at T = 2^20, B = 1, D = 256, float32: tokens/s (best of 3 after a warm-up call)
  and peak resident memory of each process, for one process with 1 and with 2 threads and
  for 2 processes of 1 thread each (the sequence split in halves). The two cores are shared
  by the processes, so the 2-process rate shows the overhead of the split (combine,
  second local scan, collectives), not a speed-up a second machine would bring.
* **The layer.** The same three layouts for ``fastrwa.nn.RDA(256, 256, token_shift=True)``
  (f_a = sigmoid, f_h = identity) forward+backward at T = 2^18: the projection splits
  without overhead, the scan as above.

Prints a table and writes ``OUT/context_parallel.json`` (``--out``: by default
``bench-results/context_parallel``, which git ignores; the committed record,
bench/results/context_parallel, only with ``--record``, and only at full size).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

from bench.cli import ROOT, add_out, check_out, int_at_least
from bench.cli import save_json


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # (KiB on Linux)


def _count_collectives(dist, counts: dict) -> None:
    """Wrap the collectives fastrwa calls so that ``counts`` adds up what this rank sends."""
    for name in ("all_gather", "all_reduce", "broadcast"):
        real = getattr(dist, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            tensor = args[1] if _name == "all_gather" else args[0]
            counts["bytes"] += tensor.numel() * tensor.element_size()
            counts["calls"] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)


def worker(mode: str, rank: int, world: int, store: str, T: int, D: int) -> dict:
    import torch
    import torch.distributed as dist

    import fastrwa

    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        group = dist.group.WORLD
    lo, hi = rank * T // world, (rank + 1) * T // world
    result = {"rank": rank}
    if mode == "bytes":
        torch.manual_seed(0)
        layer = fastrwa.nn.RDA(D, D, token_shift=True)
        x = torch.randn(1, hi - lo, D, requires_grad=True)
        counts = {"bytes": 0, "calls": 0}
        _count_collectives(dist, counts)
        y, _ = layer(x, context_group=group)
        forward = dict(counts)
        y.sum().backward()
        result.update(forward_bytes=forward["bytes"], forward_calls=forward["calls"],
                      backward_bytes=counts["bytes"] - forward["bytes"],
                      backward_calls=counts["calls"] - forward["calls"])
    else:
        torch.manual_seed(0)
        layer = fastrwa.nn.RDA(D, D, attention="sigmoid", f_h="identity", token_shift=True)

        def step(length):
            gen = torch.Generator().manual_seed(rank)
            if mode == "layer":
                inputs = [torch.randn(1, length, D, generator=gen).requires_grad_()]
            else:
                inputs = [torch.randn(1, length, D, generator=gen).requires_grad_()
                          for _ in range(3)]
            if group is not None:
                dist.barrier(group)
            began = time.perf_counter()
            if mode == "layer":
                y, _ = layer(inputs[0], context_group=group)
            else:
                y, _ = fastrwa.rda_scan(*inputs, "sigmoid", context_group=group)
            y.sum().backward()
            if group is not None:
                dist.barrier(group)           # (the slowest rank's time)
            return time.perf_counter() - began

        step(256)                             # (warm: kernels loaded, pools made)
        result["rss_before_mib"] = _peak_rss_mib()
        times = [step(hi - lo) for _ in range(3)]
        result.update(seconds=min(times), peak_rss_mib=_peak_rss_mib())
    if world > 1:
        dist.destroy_process_group()
    return result


def launch(mode: str, world: int, threads: int, T: int, D: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        store = str(pathlib.Path(tmp) / "store")
        procs = [subprocess.Popen([sys.executable, "-m", "bench.context_parallel", "--worker",
                                   mode, str(rank), str(world), store, str(T), str(D)], env=env,
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
                 for rank in range(world)]
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mode} T={T} world={world}: a worker failed")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled
    (not for a ``--worker``, which writes nothing)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", nargs=6, metavar=("MODE", "RANK", "WORLD", "STORE", "T", "D"),
                   help=argparse.SUPPRESS)                 # (launch's: one process's part)
    p.add_argument("--T-log2", type=int_at_least(1), default=20,
                   help="the long sequence's log2 T (20)")
    p.add_argument("--layer-T-log2", type=int_at_least(1), default=18,
                   help="the layer's log2 T (18)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (seconds), to check that the script runs")
    add_out(p, "context_parallel", "context_parallel.json")
    args = p.parse_args(argv)
    if not args.worker:
        check_out(p, args, "context_parallel", sizes=["T_log2", "layer_T_log2"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        mode, rank, world, store, T, D = args.worker
        print(json.dumps(worker(mode, int(rank), int(world), store, int(T), int(D))),
              flush=True)
        os._exit(0)     # (done: gloo's threads can abort a process in the teardown)
    D = 256
    if args.quick:
        args.T_log2 = args.layer_T_log2 = 10
    record = {"D": D, "quick": args.quick, "bytes": [], "long": []}
    print("bytes each process sends per RDA layer (token shift), forward+backward, 2 processes")
    print(f"{'T':>8} {'fwd bytes':>10} {'fwd calls':>9} {'bwd bytes':>10} {'bwd calls':>9}")
    for log2 in (8, 10) if args.quick else (10, 13, 16):
        ranks = launch("bytes", 2, 1, 2 ** log2, D)
        record["bytes"].append({"T": 2 ** log2, "ranks": ranks})
        r = ranks[0]
        print(f"{2 ** log2:>8} {r['forward_bytes']:>10} {r['forward_calls']:>9} "
              f"{r['backward_bytes']:>10} {r['backward_calls']:>9}")
    modes = (("long", args.T_log2, "rda_scan"),
             ("layer", args.layer_T_log2, "nn.RDA(256, 256, token_shift)"))
    for mode, log2, what in modes[:1] if args.quick else modes:
        T = 2 ** log2
        print(f"\n{what} forward+backward, T = 2^{log2}, B = 1, D = {D}, float32")
        print(f"{'layout':>26} {'tokens/s':>10} {'peak RSS MiB (each)':>22} "
              f"{'of which the step':>18}")
        for world, threads in ((1, 1), (1, 2), (2, 1)):
            ranks = launch(mode, world, threads, T, D)
            seconds = max(r["seconds"] for r in ranks)
            row = {"what": what, "processes": world, "threads_each": threads, "T": T,
                   "seconds": seconds, "tokens_per_s": T / seconds, "ranks": ranks}
            record["long"].append(row)
            label = (f"{world} process{'es' if world > 1 else ''} x {threads} "
                     f"thread{'s' * (threads > 1)}")
            peaks = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in ranks)
            steps = ", ".join(f"{r['peak_rss_mib'] - r['rss_before_mib']:.0f}" for r in ranks)
            print(f"{label:>26} {T / seconds:>10,.0f} {peaks:>22} {steps:>18}")
    save_json(args.out / "context_parallel.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
