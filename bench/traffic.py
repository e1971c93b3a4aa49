"""Global-memory traffic and launches of each Triton path, counted under the interpreter.

    python -m bench.traffic [--batch 2 --length 128 --channels 32]

Every load and store the kernels issue is counted (masked-off lanes excluded) at the
element size of the pointer, with no cache: a re-read counts again. The ratio is bytes moved
over the minimum (docs/math.md) at the tensors' own dtypes: the forward reads each input once
and writes ``y``; the backward reads each input and ``gy`` once and writes one gradient per
input. "fwd" is inference (nothing saved), "fwd+save" also writes the chunk states the
backward needs. Targets (issue): looped forward <= 1.2x and 1 launch, segments <= 2x,
backward <= 1.5x.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernels are imported

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from fastrwa.ops import triton_host as triton_backend  # noqa: E402
from fastrwa.ops.dispatch import ScanArgs  # noqa: E402

from bench.cli import positive_int  # noqa: E402

COUNTS = {"bytes": 0, "launches": 0}
_load = interpreter.InterpreterBuilder.create_masked_load
_store = interpreter.InterpreterBuilder.create_masked_store
_launch = interpreter.GridExecutor.__call__


def _bytes(ptrs, mask) -> int:
    return int(mask.data.sum()) * (ptrs.get_element_ty().primitive_bitwidth // 8)


def _counting_load(self, ptrs, mask, other, cache_policy, is_volatile):
    COUNTS["bytes"] += _bytes(ptrs, mask)
    return _load(self, ptrs, mask, other, cache_policy, is_volatile)


def _counting_store(self, ptrs, value, mask, cache_policy):
    COUNTS["bytes"] += _bytes(ptrs, mask)
    return _store(self, ptrs, value, mask, cache_policy)


def _counting_launch(self, *args, **kwargs):
    COUNTS["launches"] += 1
    return _launch(self, *args, **kwargs)


interpreter.InterpreterBuilder.create_masked_load = _counting_load
interpreter.InterpreterBuilder.create_masked_store = _counting_store
interpreter.GridExecutor.__call__ = _counting_launch


@contextlib.contextmanager
def counted():
    COUNTS.update(bytes=0, launches=0)
    yield COUNTS


TARGETS = {("looped", "fwd"): 1.2, ("looped", "bwd"): 1.5, ("segments", "fwd"): 2.0}


def measure(op: str, algorithm: str, dtype: torch.dtype, B: int, T: int, D: int):
    """Rows ``(pass, bytes, minimum, launches)`` for one op, algorithm and dtype."""
    triton_backend.set_options(algorithm=algorithm)
    torch.manual_seed(0)
    z, a, g, gy = (torch.randn(B, T, D).to(dtype) for _ in range(4))
    g = g if op == "rda" else None
    n_in = 2 if g is None else 3
    size, elems = z.element_size(), z.numel()
    args = ScanArgs(z, a, g, "exp", "sigmoid" if g is not None else None, None, False, None)
    rows = []
    with counted() as c:
        triton_backend.forward(args, output_final_state=False, save=False)
        rows.append(("fwd", c["bytes"], (n_in + 1) * elems * size, c["launches"]))
    with counted() as c:
        _, final, saved = triton_backend.forward(args, output_final_state=True, save=True)
        rows.append(("fwd+save", c["bytes"], (n_in + 1) * elems * size, c["launches"]))
    with counted() as c:
        triton_backend.backward(args, saved, final[0], gy, None)
        rows.append(("bwd", c["bytes"], (2 * n_in + 1) * elems * size, c["launches"]))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=positive_int, default=2)
    p.add_argument("--length", type=positive_int, default=128)
    p.add_argument("--channels", type=positive_int, default=32)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    B, T, D = args.batch, args.length, args.channels
    opts = triton_backend.Options()
    print(f"B={B} T={T} D={D}, BT={opts.block_t}, BD={opts.block_d} (backward "
          f"{opts.block_d_backward})")
    print(f"{'op':<5}{'algorithm':<13}{'dtype':<10}{'pass':<10}{'bytes':>12}{'minimum':>12}"
          f"{'ratio':>8}{'launches':>10}")
    misses = 0
    for op in ("rwa", "rda"):
        for algorithm in ("looped", "segments"):
            for dtype in (torch.float32, torch.bfloat16):
                for name, moved, minimum, launches in measure(op, algorithm, dtype, B, T, D):
                    ratio = moved / minimum
                    target = TARGETS.get((algorithm, name.split("+")[0]))
                    miss = target is not None and ratio > target
                    misses += miss
                    print(f"{op:<5}{algorithm:<13}{str(dtype)[6:]:<10}{name:<10}{moved:>12,}"
                          f"{minimum:>12,}{ratio:>8.3f}{launches:>10}"
                          f"{'  over target' if miss else ''}", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
