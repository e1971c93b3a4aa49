"""Op-level GPU rows: fastrwa's scans, copy_, and the peers, at the issue's shapes.

Every timing is ``triton.testing.do_bench`` (median; it clears L2 before each run) of the op as
a user calls it. ``ratio_to_copy`` is the op's minimum bytes (bench/common.py: every input
read once, every output written once) over its time, divided by the bandwidth of a
device-to-device ``copy_`` of the same number of bytes timed in the same run; a peer's minimum
bytes are counted the same way for its own inputs and outputs.

Peers (each skipped, with the reason in the report, when it does not import):

* flash-linear-attention's ``chunk_hgrn`` and ``fused_recurrent_hgrn``: ``h_t = exp(g_t) h_{t-1}
  + x_t``, two inputs like ``rwa_scan``;
* accelerated-scan's Triton ``scan`` (``accelerated_scan.scalar``): ``h_t = f_t h_{t-1} + x_t``
  on ``(B, D, T)`` tensors (its own layout, the same sizes);
* "logcumsumexp": RDA (exp attention) written with ``torch.logcumsumexp`` as a user would
  without fastrwa (float32 inside, the sign of ``z`` split off).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

import fastrwa
from bench.common import OPS, min_bytes
from bench.gpu_report import row

# The target shapes first (a run cut short keeps the shapes it finished), then a
# B x D too small to fill the card.
SHAPES = [(16, 4096, 1024), (8, 16384, 2048), (1, 1 << 20, 256), (4, 4096, 1024)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What the op rows run: the two algorithms at the launcher's defaults.
VARIANTS = {"looped": dict(algorithm="looped"), "segments": dict(algorithm="segments")}


# Past this many steps the one-program-a-sequence kernels are not timed: torch.logcumsumexp
# takes 2-5 s a call at a million steps, fla's fused_recurrent_hgrn 0.42-0.93 s and the
# looped algorithm 0.06-0.53 s (H100, 2026-11-27), where "auto" picks segments.
LONG_T = 1 << 16


def variants(op: str, shape) -> list[str]:
    """The rows an op gets at a shape: every variant at the first shape; elsewhere the two
    algorithms of rda-exp (each kernel build compiles once per D: the run's time goes to
    compiles as much as to timings); past :data:`LONG_T` steps, segments alone."""
    names = list(VARIANTS) if tuple(shape) == SHAPES[0] else (
        ["looped", "segments"] if op == "rda-exp" else [])
    return [n for n in names if n != "looped" or shape[1] <= LONG_T]


def bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


class CopyTimer:
    """``copy_`` of ``n`` bytes (read n/2, write n/2), timed once per size and cached."""

    def __init__(self, device):
        self.device, self.cache = device, {}

    def ms(self, nbytes: int) -> float:
        if nbytes not in self.cache:
            src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            self.cache[nbytes] = bench_ms(lambda: dst.copy_(src))
            del src, dst
        return self.cache[nbytes]


def random_inputs(n: int, shape, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
            for _ in range(n)]


def timed(fn_fwd, leaves, gy, passes=("fwd", "fwd+bwd")) -> dict:
    """ms of the forward (no autograd) and of forward + the gradients of ``leaves``."""
    def fwd():
        with torch.no_grad():
            fn_fwd(*leaves)

    def fwd_bwd():
        y = fn_fwd(*leaves)
        torch.autograd.grad(y, leaves, gy)
    runs = {"fwd": fwd, "fwd+bwd": fwd_bwd}
    return {pass_: bench_ms(runs[pass_]) for pass_ in passes}


def fastrwa_fn(op: str) -> Callable:
    spec = OPS[op]
    return lambda *x: spec.run(*x, *([None] * (3 - len(x))))


def op_rows(shape, dtype_name: str, copy: CopyTimer, log) -> list[dict]:
    """rda-exp and rwa, each of :func:`variants`, fwd and fwd+bwd; each row says which
    algorithm "auto" picks at its shape."""
    from fastrwa.ops import triton_host
    from fastrwa.testing import backend_options
    dtype, rows = DTYPES[dtype_name], []
    B, T, D = shape
    auto = triton_host.choose_algorithm(B, D, T, triton_host.Options(), torch.device("cuda"))
    for op in ("rda-exp", "rwa"):
        if not variants(op, shape):
            continue
        spec = OPS[op]
        leaves = [x.requires_grad_() for x in random_inputs(spec.inputs, shape, dtype, "cuda")]
        gy = random_inputs(1, shape, dtype, "cuda", seed=1)[0]
        for variant in variants(op, shape):
            with fastrwa.use_backend("triton"), backend_options("triton", **VARIANTS[variant]):
                times = timed(fastrwa_fn(op), leaves, gy)
            for pass_, ms in times.items():
                nbytes = min_bytes(spec, leaves[0].numel(), leaves[0].element_size(),
                                   pass_ == "fwd+bwd")
                rows.append(row("op", op, dtype_name, shape, variant, pass_, ms,
                                copy.ms(nbytes) / ms, bytes=nbytes, copy_ms=copy.ms(nbytes),
                                auto=auto))
                log(rows[-1])
        del leaves, gy
    return rows


def logcumsumexp_rda(z, a, g):
    """RDA with exp attention, as a user writes it with ``torch.logcumsumexp``."""
    w = a.float() - torch.cumsum(F.logsigmoid(g.float()), dim=1)   # log weight, discount undone
    log_d = torch.logcumsumexp(w, dim=1)
    zf = z.float()
    pos = torch.logcumsumexp(w + torch.log(zf.clamp_min(0)), dim=1)
    neg = torch.logcumsumexp(w + torch.log((-zf).clamp_min(0)), dim=1)
    return (torch.exp(pos - log_d) - torch.exp(neg - log_d)).to(z.dtype)


@dataclasses.dataclass(frozen=True)
class Peer:
    fn: Callable | None              # fn(*inputs) -> y; None when it does not import
    n_in: int = 2
    layout: str = "(B, T, D)"
    domain: Callable = lambda i, x: x     # input i, standard normal -> what the peer takes
    why: str = ""


def peers() -> dict[str, Peer]:
    """The peers that import here (the others with the reason they do not). Their inputs are
    put in their own domain before timing (a log forget gate, a gate in (0, 1)), so no extra
    elementwise op is timed with them."""
    out: dict = {}
    log_gate = lambda i, x: F.logsigmoid(x) if i == 1 else x           # noqa: E731
    try:
        from fla.ops.hgrn import chunk_hgrn, fused_recurrent_hgrn
        out["fla.chunk_hgrn"] = Peer(lambda x, g: chunk_hgrn(x, g)[0], domain=log_gate)
        out["fla.fused_recurrent_hgrn"] = Peer(lambda x, g: fused_recurrent_hgrn(x, g)[0],
                                               domain=log_gate)
    except Exception as e:  # noqa: BLE001 (a missing or broken peer is reported, not fatal)
        out["fla.chunk_hgrn"] = out["fla.fused_recurrent_hgrn"] = Peer(None, why=repr(e))
    try:
        from accelerated_scan.scalar import scan
        out["accelerated_scan.scalar.scan"] = Peer(
            lambda f, x: scan(f, x), layout="(B, D, T)",
            domain=lambda i, x: torch.sigmoid(x) if i == 0 else x)
    except Exception as e:  # noqa: BLE001
        out["accelerated_scan.scalar.scan"] = Peer(None, why=repr(e))
    out["torch.logcumsumexp"] = Peer(logcumsumexp_rda, n_in=3)
    return out


def peer_rows(shape, dtype_name: str, copy: CopyTimer, log, missing: dict) -> list[dict]:
    """Each peer at ``shape`` and dtype, fwd and fwd+bwd; a failure is noted, not fatal."""
    dtype, rows = DTYPES[dtype_name], []
    B, T, D = shape
    for name, peer in peers().items():
        if peer.fn is None:
            missing[name] = peer.why
            continue
        if name in ("torch.logcumsumexp", "fla.fused_recurrent_hgrn") and T > LONG_T:
            missing[f"{name} {list(shape)}"] = "not timed past 2**16 steps (0.4-5 s a call)"
            continue
        own = (B, D, T) if peer.layout == "(B, D, T)" else shape
        leaves = gy = None
        try:
            raw = random_inputs(peer.n_in, own, torch.float32, "cuda")
            leaves = [peer.domain(i, x).to(dtype).requires_grad_() for i, x in enumerate(raw)]
            del raw
            gy = random_inputs(1, own, dtype, "cuda", seed=1)[0]
            times = timed(peer.fn, leaves, gy)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory, or a shape it refuses)
            missing[f"{name} {dtype_name} {list(shape)}"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        finally:
            del leaves, gy
            torch.cuda.empty_cache()
        spec = OPS["rda-exp" if peer.n_in == 3 else "rwa"]   # same count of inputs and outputs
        for pass_, ms in times.items():
            nbytes = min_bytes(spec, B * T * D, torch.finfo(dtype).bits // 8, pass_ == "fwd+bwd")
            rows.append(row("peer", name, dtype_name, shape, None, pass_, ms,
                            copy.ms(nbytes) / ms, bytes=nbytes, layout=peer.layout))
            log(rows[-1])
    return rows


def correctness_checks(log) -> list[dict]:
    """fastrwa's forward at the bench shapes' scale against the float64 PyTorch backend, on a
    channel slice (channels are independent), including tensors past 2**31 elements, where
    int32 offsets would wrap."""
    from fastrwa.testing import backend_options
    checks = []
    cases = [(16, 4096, 1024, "looped"), (1, 1 << 20, 256, "segments"),
             (1, (1 << 31) // 512 + 4099, 512, "looped"),
             (1, (1 << 31) // 512 + 4099, 512, "segments")]
    for B, T, D, algorithm in cases:
        z, a, g = random_inputs(3, (B, T, D), torch.float32, "cuda", seed=7)
        with torch.no_grad(), fastrwa.use_backend("triton"), \
                backend_options("triton", algorithm=algorithm):
            y, _ = fastrwa.rda_scan(z, a, g, "softplus")
        cols = slice(D - 8, D)                             # the last channels: largest offsets
        with torch.no_grad(), fastrwa.use_backend("torch"):
            ref, _ = fastrwa.rda_scan(*(x[..., cols].double() for x in (z, a, g)), "softplus")
        err = float((y[..., cols].double() - ref).abs().max() / ref.abs().max().clamp_min(1))
        checks.append(dict(check="rda_scan softplus vs float64 torch backend", shape=[B, T, D],
                           algorithm=algorithm, elements=B * T * D, max_rel_err=err,
                           ok=err < 1e-4 and bool(torch.isfinite(y[..., cols]).all())))
        log(checks[-1])
        del z, a, g, y, ref
        torch.cuda.empty_cache()
    return checks
