"""Launch-knob sweep and the looped/segments crossover, measured on a GPU.

* :func:`sweep`: for each algorithm and pass (forward; forward+backward) of ``rda_scan`` at
  B=16, T=4096, D=1024, every (block_t, block_d or block_d_backward, warps) of a small grid
  in float32 (``block_d >= 32 x warps``: each thread owns whole channel columns), then pipelining stages for the best, and the best few again in bfloat16. Each
  entry is the median ms; the best per (algorithm, pass, dtype) is what the launcher's
  defaults (``Options`` in fastrwa/ops/triton_host.py) should become.
* :func:`crossover`: looped against segments, forward and forward+backward, as the count of
  programs (``B * ceil(D / block_d)``) grows at T=16384, to place the heuristic's threshold
  (``PROGRAMS_PER_SM`` in fastrwa/ops/triton_host.py).
"""

from __future__ import annotations

import itertools

import torch

import fastrwa
from fastrwa.ops import triton_host
from fastrwa.testing import backend_options
from gpu_ops import DTYPES, fastrwa_fn, random_inputs, timed

GRID_T = (8, 16, 32)
GRID_D = (32, 64, 128)
GRID_WARPS = (1, 2, 4)
GRID_STAGES = (1, 2, 3, 4)
KNOBS = ("block_t", "block_d", "block_d_backward", "warps", "warps_backward", "stages")


def _time(shape, dtype, pass_: str, knobs: dict) -> float:
    leaves = [x.requires_grad_() for x in random_inputs(3, shape, dtype, "cuda")]
    gy = random_inputs(1, shape, dtype, "cuda", seed=1)[0]
    with fastrwa.use_backend("triton"), backend_options("triton", **knobs):
        return timed(fastrwa_fn("rda-exp"), leaves, gy, passes=(pass_,))[pass_]


def _try(shape, dtype_name, algorithm, pass_, knobs, log=None) -> dict:
    entry = dict(dtype=dtype_name, algorithm=algorithm, pass_=pass_, **knobs)
    try:
        entry["ms"] = _time(shape, DTYPES[dtype_name], pass_, dict(algorithm=algorithm, **knobs))
    except Exception as e:  # noqa: BLE001 (a config that does not compile or run is a result)
        entry["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    if log is not None:  # each point as it is measured, so a run cut short keeps what it had
        log(dict(sweep=entry))
    return entry


def sweep(log, shape=(16, 4096, 1024), keep: int = 5) -> list[dict]:
    """float32: every (block_t, block_d, warps) of the grid, then pipelining stages for the
    best; bfloat16: the ``keep`` best float32 points. The forward's knobs vary for "fwd"; for
    "fwd+bwd" the forward keeps its defaults and the backward's vary. Failures are recorded."""
    out = []
    for algorithm, pass_ in itertools.product(("looped", "segments"), ("fwd", "fwd+bwd")):
        grid = []
        for bt, bd, warps in itertools.product(GRID_T, GRID_D, GRID_WARPS):
            if bd < 32 * warps:          # a thread would share a channel's column: not swept
                continue
            grid.append(dict(block_t=bt, **(dict(block_d=bd, warps=warps) if pass_ == "fwd"
                                            else dict(block_d_backward=bd, warps_backward=warps))))
        mine = [_try(shape, "float32", algorithm, pass_, knobs, log) for knobs in grid]
        ranked = sorted((e for e in mine if "ms" in e), key=lambda e: e["ms"])
        if ranked:
            knobs = {k: v for k, v in ranked[0].items() if k in KNOBS}
            mine += [_try(shape, "float32", algorithm, pass_, dict(knobs, stages=st), log)
                     for st in GRID_STAGES]
        for best in ranked[:keep]:
            knobs = {k: v for k, v in best.items() if k in KNOBS}
            mine.append(_try(shape, "bfloat16", algorithm, pass_, knobs, log))
        for dtype_name in DTYPES:
            timed = [e for e in mine if e["dtype"] == dtype_name and "ms" in e]
            if timed:
                log(dict(best=min(timed, key=lambda e: e["ms"]), tried=len(timed)))
        out += mine
    return out


def crossover(log, T: int = 16384, widths=(256, 1024), batches=(1, 2, 4, 8, 16, 32, 64)):
    """ms of both algorithms as programs grow; the smallest program count where looped wins."""
    props = torch.cuda.get_device_properties(0)
    bd = triton_host.Options().block_d
    out = []
    for D, B in itertools.product(widths, batches):
        if B * T * D * 4 * 8 > props.total_memory // 2:
            continue
        for pass_ in ("fwd", "fwd+bwd"):
            ms = {alg: _time((B, T, D), torch.float32, pass_, dict(algorithm=alg))
                  for alg in ("looped", "segments")}
            programs = B * -(-D // bd)
            out.append(dict(B=B, T=T, D=D, pass_=pass_, programs=programs,
                            programs_per_sm=programs / props.multi_processor_count,
                            **{f"{k}_ms": v for k, v in ms.items()},
                            looped_wins=ms["looped"] <= ms["segments"]))
            log(out[-1])
    return out
