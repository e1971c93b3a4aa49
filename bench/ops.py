"""Where fastrwa stands, in one run: ``python bench/run.py [--quick] [--out DIR]``.

Prints five tables and writes ``DIR/results.json`` and ``DIR/throughput_vs_length.png``
(``--out DIR``: by default ``bench-results``, which git ignores; a folder under
bench/results only with ``--record``, never from ``--quick``):

1. throughput: each path (sequential reference, "torch" chunked, "numba" compiled CPU, and
   "triton" on a GPU) x op x forward / forward+backward x dtype: elements/s and the ratio
   to ``copy_`` of the same bytes (bench/common.py); the reference runs at a shorter length.
2. triton-interpreter: the Triton kernels run under TRITON_INTERPRET=1, as a correctness note
   (max error against the reference; interpreter speed means nothing).
3. rnn: an RDA scan layer (projection + scan + output) forward+backward tokens/s beside
   ``torch.nn.LSTM`` and ``torch.nn.GRU`` of the same hidden size, batch and length.
4. scaling: ns per token of the forward for B=1, D=256 from T=1K to 1M, per path.
5. streaming: a ByteLM's single-token step latency, allocations per step, state bytes.

``--quick`` shrinks every shape so the whole script takes well under a minute (CI runs it).
No timing here is asserted anywhere; docs/benchmarks.md records a full run.

Allocator: every op returns fresh outputs. With glibc's defaults a tensor of 64 MB is
mmap'ed anew on every call and each of its pages faults on first write, which on this
project's machine costs about as much as the whole forward scan (the "allocator" line of
the report measures it). As PyTorch's CPU performance guide advises (a caching allocator
such as jemalloc or tcmalloc), the script re-executes itself with glibc told to keep freed
memory (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``); ``--system-allocator`` keeps
the defaults. ``copy_``, the baseline, writes into a buffer it reuses either way.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
if (__name__ == "__main__" and platform.system() == "Linux" and "--system-allocator" not in sys.argv
        and any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items())):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})

import torch  # noqa: E402

if not torch.cuda.is_available():       # the Triton correctness note runs in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sections  # noqa: E402  (bench/sections.py)
from cli import add_out, check_out  # noqa: E402  (bench/cli.py)

FULL = dict(B=16, T=4096, D=256, T_reference=256, repeats=9, rnn=dict(B=16, T=1024, H=256),
            lengths=[1 << k for k in range(10, 21, 2)], lm=dict(d_model=256, n_layers=4),
            ops=["rwa", "rda-exp", "rda-sigmoid", "rda-softplus", "rda-relu"],
            dtypes=["float32", "bfloat16"], paths=["reference", "torch", "numba"],
            reference_max_T=4096, torch_max_T=1 << 16)
QUICK = dict(B=2, T=512, D=64, T_reference=64, repeats=2, rnn=dict(B=4, T=64, H=32),
             lengths=[1024, 4096], lm=dict(d_model=32, n_layers=2),
             ops=["rwa", "rda-sigmoid"], dtypes=["float32", "bfloat16"],
             paths=["reference", "torch", "numba"], reference_max_T=1024, torch_max_T=4096)


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
    ``args.cfg`` (the shapes and paths measured) made."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CI: keeps it from rotting)")
    add_out(p, "", "results.json and the PNG", record=False)
    p.add_argument("--only", nargs="+", choices=sections.NAMES, help="run only these sections")
    p.add_argument("--paths", nargs="+", choices=["reference", "torch", "numba", "triton"],
                   help="measure only these paths (triton: on a CUDA GPU)")
    p.add_argument("--system-allocator", action="store_true",
                   help="keep glibc's allocator defaults (see the module docstring)")
    args = p.parse_args(argv)
    if args.paths and "triton" in args.paths and not torch.cuda.is_available():
        p.error("--paths triton: the Triton path runs on a CUDA GPU, and torch sees none here")
    check_out(p, args, "", record=False)
    cfg = dict(QUICK if args.quick else FULL)
    if torch.cuda.is_available():
        cfg["paths"] = cfg["paths"] + ["triton"]
    if args.paths:
        cfg["paths"] = list(dict.fromkeys(args.paths))
    args.cfg = cfg
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = args.cfg
    results = dict(machine=machine(), config=cfg, quick=args.quick)
    print(f"fastrwa benchmarks ({'quick' if args.quick else 'full'}): {results['machine']}")
    for name in args.only or sections.NAMES:
        results[name] = getattr(sections, name)(cfg)
    out = args.out
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if "scaling" in results:
        sections.plot_scaling(results["scaling"], out / "throughput_vs_length.png")
    print(f"\nwrote {out / 'results.json'}" + (f" and {out / 'throughput_vs_length.png'}"
                                               if "scaling" in results else ""))
    return results


if __name__ == "__main__":
    main()
