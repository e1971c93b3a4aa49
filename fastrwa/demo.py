"""``python -m fastrwa.demo``: run every op (``rwa_scan``, ``rda_scan`` per attention,
``weighted_scan``, the gradients, prefill then ``rda_step``), check each against the
sequential float64 reference, and time the scans. Exits with status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .scan import rda_scan, rda_step, rwa_scan, weighted_scan
from .kernels.codes import ATTENTIONS
from .reference import rda_scan_reference, rwa_scan_reference, weighted_scan_reference

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item()


def _warm_up(dtype: torch.dtype) -> None:
    """Every op the demo runs, once on a tiny input: compiles (or loads) its kernels."""
    z = torch.randn(1, 2, 1, dtype=dtype)
    rwa_scan(z, z)
    weighted_scan(z, z, -z.abs())
    for attention in ATTENTIONS:
        rda_scan(z, z, z, attention)
    x = z.double().requires_grad_()
    torch.autograd.grad(rda_scan(x, x, x)[0].sum(), x)
    _, state = rda_scan(z, z, z, output_final_state=True)
    rda_step(z[:, 0], z[:, 0], z[:, 0], state)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    B, T, D = args.batch, args.length, args.channels
    z, a, g = (torch.randn(B, T, D, dtype=dtype) for _ in range(3))
    a = a * 3
    tol = TOL[dtype]
    _warm_up(dtype)     # (a first run's compile notice comes before the table, not inside it)
    print(f"fastrwa demo: B={B} T={T} D={D} {args.dtype}, tolerance {tol:g} vs float64 reference")
    failures = 0

    def report(name: str, err: float, seconds: float | None = None) -> None:
        nonlocal failures
        ok = err <= tol
        failures += not ok
        timing = "" if seconds is None else f"  {B * T * D / seconds / 1e6:8.1f} M elem/s"
        print(f"  {name:<34} max |err| {err:.2e}  {'ok' if ok else 'FAIL'}{timing}")

    cases = [("rwa_scan", lambda: rwa_scan(z, a), lambda: rwa_scan_reference(z.double(), a.double()))]
    for attention in ATTENTIONS:
        cases.append((
            f"rda_scan attention={attention}",
            lambda attention=attention: rda_scan(z, a, g, attention),
            lambda attention=attention: rda_scan_reference(z.double(), a.double(), g.double(),
                                                           attention),
        ))
    log_decay = torch.nn.functional.logsigmoid(g.double()).to(dtype)
    cases.append(("weighted_scan (log decay)", lambda: weighted_scan(z, a, log_decay),
                  lambda: weighted_scan_reference(z.double(), a.double(), log_decay.double())))
    for name, fast, ref in cases:
        fast()  # warm-up
        start = time.perf_counter()
        y, _ = fast()
        seconds = time.perf_counter() - start
        report(name, _max_err(y, ref()[0]), seconds)

    # Gradients of the analytic backward against autograd through the reference.
    zs, as_, gs = (x[:, :64].double().requires_grad_() for x in (z, a, g))
    gy = torch.randn(B, zs.shape[1], D, dtype=torch.float64)
    fast = torch.autograd.grad((rda_scan(zs, as_, gs)[0] * gy).sum(), (zs, as_, gs))
    slow = torch.autograd.grad((rda_scan_reference(zs, as_, gs)[0] * gy).sum(), (zs, as_, gs))
    report("rda_scan gradients (float64, T<=64)", max(_max_err(f, s) for f, s in zip(fast, slow)))

    # Streaming: a parallel prefill of half the sequence, then one step per token, against
    # the reference over the whole sequence.
    k = T // 2
    y_full, _ = rda_scan_reference(z.double(), a.double(), g.double())
    _, state = rda_scan(z[:, :k], a[:, :k], g[:, :k], output_final_state=True)
    err = 0.0
    for t in range(k, min(T, k + 64)):
        y_t, state = rda_step(z[:, t], a[:, t], g[:, t], state)
        err = max(err, _max_err(y_t, y_full[:, t]))
    report("prefill + 64 rda_step vs reference", err)
    print("all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
