"""``--minutes M``: the number of steps that fit a time budget, from a short calibration of
the run's own model, data and batch (as bench/lm.py sizes its equal-time runs)."""

from __future__ import annotations

import time

import torch

from .config import RunConfig
from .device import placement
from .loop import build_model
from .models import detach_state
from .packing import model_inputs
from .optim import make_optimizer
from .parallel import rows
from .problems import make_problem

WARM_STEPS, TIMED_STEPS = 4, 8


def seconds_per_step(cfg: RunConfig) -> float:
    """Seconds one optimizer step of ``cfg``'s run takes here: ``TIMED_STEPS`` timed after
    ``WARM_STEPS`` (compiles, caches), on a throwaway model with the run's data and batch
    (one process). Nothing of the run is touched: the run reseeds when it starts."""
    place = placement(cfg.device, cfg.autocast)
    torch.manual_seed(cfg.seed)
    micro, accum = cfg.batch_size, cfg.accum
    problem = make_problem(cfg, micro * accum)
    model = build_model(cfg, problem).to(place.device)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
    carried = [None] * accum
    began = 0.0
    for step in range(WARM_STEPS + TIMED_STEPS):
        if step == WARM_STEPS:
            if place.device.type == "cuda":
                torch.cuda.synchronize(place.device)
            began = time.perf_counter()
        batch = problem.batch(step, micro * accum)
        optimizer.zero_grad(set_to_none=True)
        for k in range(accum):
            part = place.to(rows(batch, k * micro, (k + 1) * micro))
            with place.autocast():
                x, packed = model_inputs(part.x, part.starts)         # (--pack)
                output, state = model(x, carried[k], **packed)
            loss, _ = problem.score(output.float(), part)
            (loss / accum).backward()
            carried[k] = detach_state(state) if problem.stateful else None
        optimizer.step()
    if place.device.type == "cuda":
        torch.cuda.synchronize(place.device)
    return (time.perf_counter() - began) / TIMED_STEPS

