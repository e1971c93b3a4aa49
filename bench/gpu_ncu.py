"""The target of bench/gpu_run.sh's ncu step: ``rda_scan`` (exp attention) forward and
backward at 16 x 4096 x 1024 float32, at the launcher's defaults, twice: the first pass
compiles and warms up (ncu skips its two launches), the second is profiled.

    ncu -k "regex:fwd_kernel|bwd_kernel" --launch-skip 2 --launch-count 2 ... \\
        python3 -m bench.gpu_ncu
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)  # (no flags)
    import fastrwa

    if not torch.cuda.is_available():
        print("bench/gpu_ncu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    z, a, g = (torch.randn(16, 4096, 1024, device="cuda", generator=gen).requires_grad_()
               for _ in range(3))
    gy = torch.randn(16, 4096, 1024, device="cuda", generator=gen)
    with fastrwa.use_backend("triton"):
        for _ in range(2):
            y, _ = fastrwa.rda_scan(z, a, g)
            torch.autograd.grad(y, (z, a, g), gy)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
