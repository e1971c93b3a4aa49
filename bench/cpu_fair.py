"""The CPU op against its fair limit: ``python -m bench.cpu_fair``.

``rda_scan`` (exp attention) and ``rwa_scan`` on the numba backend, float32, ``B x T x D`` =
16 x 4096 x 256 by default, against PyTorch elementwise ops that read the same inputs and
write outputs of the same size, as a user calls both (outputs allocated by the call), in
one process, interleaved round by round (the machine drifts: only ratios within a run are
compared):

* forward: the op reads ``z, a, g`` and writes ``y``; the reference is
  ``torch.addcmul(z, a, g)`` (3 reads, 1 write);
* forward + backward: the op reads ``z, a, g`` and writes ``y``, then reads them and ``gy``
  and writes ``gz, ga, gg``; the reference adds ``torch.addcmul(z, a, g)``,
  ``torch.mul(gy, 0.5)`` and ``torch.zeros_like(g)`` (4 reads, 3 writes) to the forward's.
  (rwa has no ``g``: ``torch.mul(z, a)`` forward, 2 reads and 1 write; backward
  ``torch.addcmul(z, a, gy)`` and ``torch.zeros_like(a)``, 3 reads and 2 writes.)

The ratio is the reference's time over the op's (1.0: the op moves its bytes as fast as
PyTorch's own elementwise ops move theirs). Median of ``--rounds`` rounds per cell. Prints a
table and writes ``OUT/cpu_fair.json`` (``--out``: by default ``bench-results/cpu_fair``,
which git ignores; the committed record, bench/results/cpu_fair, only with ``--record``, and
only at full size: no smaller ``--shape``, no fewer ``--rounds``). Issue 44's target: >= 0.8
forward and forward + backward.

A third call per cell, timed in the same rounds, splits the reference's time: the same ops
writing into outputs allocated once before the rounds (``out=``, ``zero_()``). Its time is
that of the bytes; what the reference takes beyond it is the first write of every page of
its fresh outputs (page faults: the kernel maps and zeroes each 4 KiB page). The op pays the
same faults for its own fresh outputs, in the thread that computes, so
``op - reference`` is about the op's arithmetic that the bytes and faults did not hide.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import fastrwa
from bench.cli import add_out, check_out, positive_int, shape
from bench.common import seconds
from bench.cli import save_json


def cells(op: str, B: int, T: int, D: int) -> dict:
    """The timed calls of ``op`` per cell: op, reference, and the reference writing into
    outputs allocated once (forward; forward + backward)."""
    gen = torch.Generator().manual_seed(0)
    z, a, g, gy = (torch.randn(B, T, D, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (z, a, g)]
    kept = [torch.zeros_like(z) for _ in range(4)]      # [B, T, D] each, written before timing

    def op_fwd():
        with torch.no_grad():
            if op == "rwa":
                fastrwa.rwa_scan(z, a)
            else:
                fastrwa.rda_scan(z, a, g, "exp")

    def op_fwd_bwd():
        zl, al, gl = leaves
        y, _ = fastrwa.rwa_scan(zl, al) if op == "rwa" else fastrwa.rda_scan(zl, al, gl, "exp")
        grads = torch.autograd.grad(y, [zl, al] if op == "rwa" else [zl, al, gl], gy)
        return grads

    def ref_fwd(out=None):
        if op == "rwa":
            return torch.mul(z, a, out=None if out is None else out[0])
        return torch.addcmul(z, a, g, out=None if out is None else out[0])

    def ref_fwd_bwd(out=None):
        o = [None] * 4 if out is None else out
        ref_fwd(out)

        def zeros(like, dst):
            return torch.zeros_like(like) if dst is None else dst.zero_()
        if op == "rwa":
            return torch.addcmul(z, a, gy, out=o[1]), zeros(a, o[2])
        return torch.addcmul(z, a, g, out=o[1]), torch.mul(gy, 0.5, out=o[2]), zeros(g, o[3])

    return {"forward": (op_fwd, ref_fwd, lambda: ref_fwd(kept)),
            "forward+backward": (op_fwd_bwd, ref_fwd_bwd, lambda: ref_fwd_bwd(kept))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=shape, default=(16, 4096, 256), help="B,T,D")
    p.add_argument("--rounds", type=positive_int, default=15)
    p.add_argument("--threads", type=positive_int, default=None, help="default: torch's")
    add_out(p, "cpu_fair", "cpu_fair.json")
    args = p.parse_args(argv)
    check_out(p, args, "cpu_fair", sizes=["shape", "rounds"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T, D = args.shape
    result = dict(shape=[B, T, D], threads=torch.get_num_threads(), torch=torch.__version__,
                  cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                               time.gmtime()), cells={})
    with fastrwa.use_backend("numba"):
        for op in ("rda", "rwa"):
            timed = cells(op, B, T, D)
            for fns in timed.values():                       # (compiles, caches, pools)
                for fn in fns:
                    fn()
            times = {k: ([], [], []) for k in timed}
            for _ in range(args.rounds):                     # (interleaved)
                for name, fns in timed.items():
                    for t, fn in zip(times[name], fns):
                        t.append(seconds(fn))
            for name, ts in times.items():
                o, r, k = (statistics.median(t) for t in ts)
                result["cells"][f"{op} {name}"] = dict(op_ms=1e3 * o, reference_ms=1e3 * r,
                                                       reference_kept_ms=1e3 * k, ratio=r / o)
    save_json(args.out / "cpu_fair.json", result)
    print(f"{B} x {T} x {D} float32, numba backend, {result['threads']} threads, median of "
          f"{args.rounds} interleaved rounds")
    print(f"{'':<24}{'op ms':>10}{'reference ms':>14}{'ratio':>8}"
          f"{'reference, outputs kept, ms':>30}")
    for name, c in result["cells"].items():
        print(f"{name:<24}{c['op_ms']:>10.2f}{c['reference_ms']:>14.2f}{c['ratio']:>8.2f}"
              f"{c['reference_kept_ms']:>30.2f}")
    print(args.out / "cpu_fair.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
