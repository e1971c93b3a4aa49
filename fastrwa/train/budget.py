"""``--minutes M``: a run that fits a time budget.

A short calibration of the run's own model, data and batch (as bench/experiments/lm.py sizes its
equal-time runs) times a training step, an evaluation batch and a checkpoint's
serialization; the plan gives the steps that fill what is left of M minutes after the
calibration, with the evaluations and the final one and the checkpoint each comes with, and
scales the warm-up and the evaluation, checkpoint and log intervals to them (the flags given
keep their values). The schedule decays over the planned steps. The run then
keeps to the wall clock (:class:`Deadline`): when steps run slower than calibrated (another
process on the machine), it ends early, at the step after which its final evaluation and
checkpoint would no longer fit, and says so.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import time
from typing import NamedTuple

import torch

from .config import DEFAULTS, RunConfig
from .device import placement
from ..models.storage import save_with_crcs
from .models import build_model, detach_state
from .packing import model_inputs
from .optim import make_optimizer
from .parallel import rows
from .problems import make_problem

WARM_STEPS, TIMED_STEPS = 4, 8
WARM_EVAL_BATCHES, TIMED_EVAL_BATCHES = 1, 2
EVAL_POINTS = 10      # validation points of a budgeted run's learning curve (at most)
EVAL_SHARE = 0.25     # the most of the budget its evaluations may take (then fewer points)
LOG_POINTS = 100      # train records of a budgeted run (at most one every default log_every)


class Calibration(NamedTuple):
    """Seconds a step of the run takes here, and its evaluations."""

    step_s: float           # one optimizer step
    valid_s: float          # one validation evaluation (with its sample)
    test_s: float           # the test evaluation (after the last step)
    write_s: float = 0.0    # a checkpoint's serialization (to memory: the disk's part is
    #                         not in it; the run's first checkpoint times the whole write)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(cfg: RunConfig) -> Calibration:
    """Time ``TIMED_STEPS`` optimizer steps of ``cfg``'s run after ``WARM_STEPS`` (compiles,
    caches), on a throwaway model with the run's data and batch (one process), then
    ``TIMED_EVAL_BATCHES`` batches of an evaluation, scaled to each split's batches (and a
    language model's sample, which each validation writes), then a checkpoint of the model
    and optimizer serialized to memory. Nothing of the run is touched: the run reseeds when
    it starts."""
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
            _sync(place.device)
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
    _sync(place.device)
    step_s = (time.perf_counter() - began) / TIMED_STEPS
    model.eval()
    problem.evaluate(model, micro, "valid", place,
                     batches=lambda it: itertools.islice(it, WARM_EVAL_BATCHES))
    timed = min(TIMED_EVAL_BATCHES, problem.evaluation_batches("valid", micro))
    began = time.perf_counter()
    problem.evaluate(model, micro, "valid", place, batches=lambda it: itertools.islice(it, timed))
    _sync(place.device)
    batch_s = (time.perf_counter() - began) / max(1, timed)
    began = time.perf_counter()
    if hasattr(problem, "sample"):          # (a language model's sample at each evaluation)
        problem.sample(model, 0, place)
    _sync(place.device)
    sample_s = time.perf_counter() - began
    began = time.perf_counter()
    save_with_crcs({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   io.BytesIO())
    write_s = time.perf_counter() - began
    return Calibration(step_s, batch_s * problem.evaluation_batches("valid", micro) + sample_s,
                       batch_s * problem.evaluation_batches("test", micro), write_s)


def plan(cfg: RunConfig, given: dict, seconds: float, cal: Calibration) -> RunConfig:
    """``cfg`` with the steps that fill ``seconds`` at ``cal``'s speed, evaluations (each
    with its checkpoint) included, and the intervals (the flags in ``given`` kept) scaled to
    them: about ``EVAL_POINTS`` evaluations (fewer when they would take more than
    ``EVAL_SHARE`` of the time), a checkpoint at each, the warm-up the same share of the
    steps as in the defaults, at most ``LOG_POINTS`` train records."""
    each = cal.valid_s + cal.write_s        # an evaluation and the checkpoint after it
    room = max(0.0, seconds - cal.test_s - each)        # (the final evaluation)
    if "eval_every" in given:
        every = given["eval_every"]
        steps = max(1, int(room / (cal.step_s + each / every)))
    else:       # (evaluations before the final one, then the steps that fill the rest)
        before = max(0, min(EVAL_POINTS, int(EVAL_SHARE * seconds / max(each, 1e-9))) - 1)
        steps = max(1, int((room - before * each) / cal.step_s))
        every = max(1, math.ceil(steps / (before + 1)))
    kind = DEFAULTS["lm" if cfg.is_lm else "sequence"]
    scaled = {"steps": steps, "decay_steps": given.get("decay_steps", steps),
              "eval_every": every,
              "checkpoint_every": given.get("checkpoint_every", every),
              "warmup": given.get("warmup", round(kind["warmup"] * steps / kind["steps"])),
              "log_every": given.get("log_every",
                                     max(1, min(RunConfig.log_every, steps // LOG_POINTS)))}
    return dataclasses.replace(cfg, **scaled)


class Deadline:
    """The wall-clock end of a budgeted run (``time.monotonic()``), and the test the loop
    makes after each step: would what is still due at this step (its evaluation, its
    checkpoint), one more step, and the final evaluation and checkpoint end after it? The
    steps' pace is followed (a moving average, from the run's second step on: the first
    may compile); the evaluations' calibrated times are scaled by how much slower than
    calibrated the steps run; a checkpoint takes what the latest step's writes took
    (:meth:`wrote`; until the first, the calibration's estimate)."""

    SMOOTHING = 0.2       # weight of the latest step in the moving average

    def __init__(self, at: float, minutes: float, cal: Calibration):
        self.at, self.minutes, self.cal = at, minutes, cal
        self.step_s, self.steps = cal.step_s, 0
        self.write_s = cal.write_s

    def after_step(self, seconds: float, evaluates: bool = False, writes: bool = False) -> bool:
        """Record a step of ``seconds``; whether the run must end with it, given that, if it
        does not, this step still has a validation evaluation (``evaluates``) and a
        checkpoint (``writes``) to make."""
        self.steps += 1
        if self.steps > 1:
            self.step_s += self.SMOOTHING * (seconds - self.step_s)
        slow = max(1.0, self.slowdown)
        due = self.cal.valid_s * slow * evaluates + self.write_s * writes
        final = (self.cal.valid_s + self.cal.test_s) * slow + self.write_s
        return time.monotonic() + due + self.step_s + final > self.at

    def wrote(self, seconds: float) -> None:
        """Record what a step's files (its checkpoint, ``best/``, ``model/``) took to write:
        the next checkpoints are expected to take as long."""
        self.write_s = seconds

    @property
    def slowdown(self) -> float:
        """How many times slower than calibrated the steps run now."""
        return self.step_s / max(self.cal.step_s, 1e-12)

    def line(self, step: int, steps: int) -> str:
        """What a run that ends early says (one line)."""
        return (f"--minutes {self.minutes:g}: the time is up after step {step} of {steps} "
                f"(steps took {self.step_s:.3g} s, {self.slowdown:.2g}x the calibrated "
                f"{self.cal.step_s:.3g} s); the run ends here, with its final evaluation")
