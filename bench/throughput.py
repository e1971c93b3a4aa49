"""CPU throughput of the torch backend beside ``copy_`` of the same bytes, in one run.

    python bench/throughput.py [--batch 16 --length 4096 --channels 256 --dtype float32]

Minimum bytes (DESIGN.md §2, at the tensors' own dtype): the forward reads every input once
and writes ``y``; forward+backward adds reading every input and ``gy`` once and writing one
gradient per input. The ratio is (minimum bytes / op time) / (copy bandwidth), where copy
bandwidth is ``2 * nbytes / time`` of ``dst.copy_(src)`` on buffers of half those bytes
(so the copy moves the same number of bytes), timed interleaved with the op.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastrwa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    B, T, D = args.batch, args.length, args.channels
    dtype = DTYPES[args.dtype]
    elem = B * T * D
    size = torch.tensor([], dtype=dtype).element_size()
    print(f"B={B} T={T} D={D} {args.dtype}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print(f"{'op':<22}{'pass':<10}{'M elem/s':>10}{'GB/s':>8}{'copy GB/s':>11}{'ratio':>8}")
    ops = {
        "rwa_scan": (2, lambda z, a, g: fastrwa.rwa_scan(z, a)[0]),
        "rda_scan exp": (3, lambda z, a, g: fastrwa.rda_scan(z, a, g, "exp")[0]),
        "rda_scan sigmoid": (3, lambda z, a, g: fastrwa.rda_scan(z, a, g, "sigmoid")[0]),
    }
    for name, (n_in, op) in ops.items():
        inputs = [torch.randn(B, T, D, dtype=dtype) for _ in range(3)]
        gy = torch.randn(B, T, D, dtype=dtype)
        leaves = [x.clone().requires_grad_() for x in inputs]
        used = leaves[:n_in]

        def forward():
            with torch.no_grad():
                op(*inputs)

        def forward_backward():
            y = op(*leaves)
            torch.autograd.grad(y, used, gy)

        passes = {
            "fwd": (forward, (n_in + 1) * elem * size),
            "fwd+bwd": (forward_backward, ((n_in + 1) + (n_in + 1) + n_in) * elem * size),
        }
        for pass_name, (fn, min_bytes) in passes.items():
            src = torch.randn(min_bytes // 2 // size, dtype=dtype)
            dst = torch.empty_like(src)
            fn(), dst.copy_(src)  # warm-up
            t_op, t_copy = [], []
            for _ in range(args.repeats):   # interleaved
                t_op.append(_time(fn, 1))
                t_copy.append(_time(lambda: dst.copy_(src), 3))
            t_op, t_copy = statistics.median(t_op), statistics.median(t_copy)
            op_bw, copy_bw = min_bytes / t_op / 1e9, 2 * src.nbytes / t_copy / 1e9
            print(f"{name:<22}{pass_name:<10}{elem / t_op / 1e6:>10.1f}{op_bw:>8.2f}"
                  f"{copy_bw:>11.2f}{op_bw / copy_bw:>8.3f}")


if __name__ == "__main__":
    main()
