"""Shared pieces of the benchmarks: the ops, their minimum bytes, and interleaved timing.

Figure of merit: achieved bandwidth = the op's minimum bytes (every
input read once, every output written once, at the tensors' own dtype) / time, divided by
the bandwidth of ``dst.copy_(src)`` moving the same number of bytes, timed interleaved with
the op in the same process and threads. Since both move the same bytes, the ratio is
``time(copy) / time(op)``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import fastrwa
from fastrwa.kernels.codes import ATTENTIONS
from fastrwa.reference import rda_scan_reference, rwa_scan_reference


@dataclass(frozen=True)
class Op:
    name: str
    inputs: int                      # 2 for RWA (z, a), 3 for RDA (z, a, g)
    run: Callable                    # run(z, a, g) -> y
    reference: Callable              # the sequential loop, same signature


def _rda(attention):
    return Op(f"rda-{attention}", 3, lambda z, a, g: fastrwa.rda_scan(z, a, g, attention)[0],
              lambda z, a, g: rda_scan_reference(z, a, g, attention)[0])


OPS = {"rwa": Op("rwa", 2, lambda z, a, g: fastrwa.rwa_scan(z, a)[0],
                 lambda z, a, g: rwa_scan_reference(z, a)[0]),
       **{f"rda-{att}": _rda(att) for att in ATTENTIONS}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def min_bytes(op: Op, elements: int, itemsize: int, backward: bool) -> int:
    """Forward: inputs + y. Forward+backward adds inputs + gy read and one gradient per input."""
    n = op.inputs + 1
    if backward:
        n += (op.inputs + 1) + op.inputs
    return n * elements * itemsize


def inputs(op: Op, B: int, T: int, D: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z, a, g = (torch.randn(B, T, D, generator=gen).to(dtype) for _ in range(3))
    if op.name == "rda-relu":
        a = a + 0.5
    return z, a, (g if op.inputs == 3 else None)


def forward_fn(op: Op, z, a, g, path: str = "auto") -> Callable[[], None]:
    """The op's forward as the user calls it, without autograd, on backend ``path``."""
    fn = op.reference if path == "reference" else op.run

    def run():
        with torch.no_grad(), _backend(path):
            fn(z, a, g)
    return run


def forward_backward_fn(op: Op, z, a, g, path: str = "auto") -> Callable[[], None]:
    """Forward, then the gradients of all inputs for a random ``gy`` (``autograd.grad``)."""
    leaves = [x.detach().clone().requires_grad_() for x in (z, a, g) if x is not None]
    gy = torch.randn(z.shape, generator=torch.Generator().manual_seed(1)).to(z.dtype)
    fn = op.reference if path == "reference" else op.run

    def run():
        with _backend(path):
            y = fn(*leaves, *([None] * (3 - len(leaves))))
            torch.autograd.grad(y, leaves, gy)
    return run


def _backend(path: str):
    if path in ("reference", "auto"):
        return contextlib.nullcontext()
    return fastrwa.use_backend(path)


def seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(fn: Callable[[], None], nbytes: int, dtype: torch.dtype, repeats: int):
    """``(median seconds of fn, median seconds of copy_, median ratio)``: ``copy_`` moves
    ``nbytes`` in all and is timed right after each run of ``fn`` (best of 3), and the ratio
    is taken pair by pair, so both sides of each ratio saw the same machine (this one is
    shared, and its speed drifts within seconds)."""
    size = torch.tensor([], dtype=dtype).element_size()
    src = torch.randn(max(1, nbytes // 2 // size)).to(dtype)
    dst = torch.empty_like(src)
    for _ in range(3):      # warm-up: numba compile (cached), the allocator's steady state
        fn(), dst.copy_(src)
    t_op, t_copy = [], []
    for _ in range(repeats):
        t_op.append(seconds(fn))
        t_copy.append(min(seconds(lambda: dst.copy_(src)) for _ in range(3)))
    ratio = statistics.median(c / o for c, o in zip(t_copy, t_op))
    return statistics.median(t_op), statistics.median(t_copy), ratio


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(3):      # warm-up: numba compile (cached), the allocator's steady state
        fn()
    return statistics.median(seconds(fn) for _ in range(repeats))

