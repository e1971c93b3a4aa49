"""A small run of every Triton launch path, for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck --error-exitcode 1 python -m bench.gpu_memcheck

Forward and backward of rwa_scan and rda_scan (every attention), both forward algorithms,
reversed, with initial and final states, packed sequences (varlen), and the step kernel, at
shapes with partial chunks and channel blocks. Exits 2 without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)  # (no flags)
    if not torch.cuda.is_available():
        print("bench/gpu_memcheck.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import fastrwa
    from fastrwa.kernels.codes import ATTENTIONS
    from fastrwa.testing import backend_options

    torch.manual_seed(0)
    B, T, D = 2, 77, 45
    runs = 0
    for algorithm in ("looped", "segments"):
        for attention in ("rwa", *ATTENTIONS):
            for reverse in (False, True):
                z, a, g = (torch.randn(B, T, D, device="cuda", requires_grad=True)
                           for _ in range(3))
                state = fastrwa.ScanState.empty(B, D, device="cuda")
                with fastrwa.use_backend("triton"), backend_options("triton", algorithm=algorithm):
                    if attention == "rwa":
                        y, final = fastrwa.rwa_scan(z, a, state, True, reverse)
                        leaves = (z, a)
                    else:
                        y, final = fastrwa.rda_scan(z, a, g, attention, state, True, reverse)
                        leaves = (z, a, g)
                    torch.autograd.grad((y.sum() + final.n.sum()), leaves)
                runs += 1
        cu = torch.tensor([0, 5, 40, 40, 2 * T], device="cuda")
        z, a, g = (torch.randn(1, 2 * T, D, device="cuda", requires_grad=True) for _ in range(3))
        with fastrwa.use_backend("triton"), backend_options("triton", algorithm=algorithm):
            y, _ = fastrwa.rda_scan(z, a, g, cu_seqlens=cu)
            y.sum().backward()
        runs += 1
    state = fastrwa.ScanState.empty(B, D, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            y, state = fastrwa.rda_step(*(torch.randn(B, D, device="cuda") for _ in range(3)),
                                        state)
    torch.cuda.synchronize()
    print(f"memcheck case: {runs} scans forward+backward and 3 steps ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
