"""The training loop: one process or many (torchrun), atomic checkpoints, exact resume."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..models import save_pretrained
from .checkpoints import (check_checkpoint, check_provenance, load_checkpoint, provenance,
                          record_resumable_changes, save_checkpoint, truncate_metrics,
                          truncate_samples)
from .config import RunConfig
from .device import Placement, placement
from .parallel import from_the_last_slice, layout, rows, share_of_the_loss, time_slice
from .models import build_model, detach_state
from .packing import packed_loss, packed_slice
from .optim import lr_factor, make_optimizer, set_lr
from .problems import make_problem
from .rundir import BEST, CHECKPOINT, EXPORT, METRICS, SAMPLES, RunDirError, run_id
from .stop import stop_requests

if TYPE_CHECKING:
    from .budget import Deadline

CPU = Placement(torch.device("cpu"), None)   # where checkpointed states go


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mean_over_ranks(value: float, world: int, device: torch.device) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)   # (NCCL: on the GPU)
    dist.all_reduce(t)
    return float(t) / world


def _trained(cfg: RunConfig, steps: int) -> dict:
    """How a model was trained, for its model card: the run's settings that were set (the
    data file by name), and the steps taken."""
    fields = {k: repr(v) if isinstance(v, str) else v
              for k, v in dataclasses.asdict(cfg).items()
              if not (v is None or v is False or (isinstance(v, dict) and not v))
              and k not in ("progress", "device", "log_every")
              and not (cfg.is_lm and k == "seq_len")}
    if cfg.data:
        fields["data"] = Path(cfg.data).name
    return {**fields, "steps taken": steps}


def _part(cfg: RunConfig) -> str:
    """How much of the validation split an LM run evaluates, for its model card."""
    return f" (the first {cfg.eval_bytes:,} bytes)" if cfg.is_lm and cfg.eval_bytes else ""


def _better(value: float, best, higher_is_better: bool) -> bool:
    return best is None or (value > best if higher_is_better else value < best)


class _Writes:
    """``with writes:`` a file write that a signal does not cut short
    (``stops.uninterrupted()``), its time added to :attr:`seconds` (what a step spent
    writing: ``--minutes``' deadline counts it)."""

    def __init__(self, stops):
        self.stops, self.seconds = stops, 0.0

    @contextlib.contextmanager
    def __call__(self):
        began = time.perf_counter()
        try:
            with self.stops.uninterrupted():
                yield
        finally:
            self.seconds += time.perf_counter() - began


def _evaluation_bar(problem, split: str, micro: int, disable: bool):
    """What ``evaluate(batches=)`` takes to show an evaluation's progress (a bar that goes
    when the evaluation is done), or ``None`` without a progress bar."""
    if disable:
        return None
    total = problem.evaluation_batches(split, micro)
    return lambda batches: tqdm(batches, total=total, desc=f"{split} evaluation", leave=False,
                                dynamic_ncols=True)


def train(cfg: RunConfig, run_dir: Path, resume: bool = False,
          deadline: Deadline | None = None) -> dict:
    """Train as configured; return the latest record per split ("train", "valid", "test").
    Rank 0 writes the run directory. The test split is evaluated once, after the last step:
    step ``cfg.steps``, or the step after which ``deadline`` (``--minutes``) leaves no time
    for another. SIGINT or SIGTERM before the step loop ends the run at once
    (:class:`fastrwa.train.stop.Interrupted`); in it, they stop the run at the next step
    boundary with a checkpoint there (:class:`fastrwa.train.stop.Stopped` is raised), or
    after the last step once its evaluation and checkpoint are written; a second SIGINT
    exits at once, never in the middle of a file (:mod:`fastrwa.train.stop`)."""
    with contextlib.ExitStack() as stack:
        return _train(cfg, run_dir, resume, deadline, stack)


def _train(cfg: RunConfig, run_dir: Path, resume: bool, deadline: Deadline | None,
           stack: contextlib.ExitStack) -> dict:
    stops = stack.enter_context(stop_requests())
    stops.enter("preparation of the run")
    rank, world = _world()
    lay = layout(cfg.context_parallel)
    place = placement(cfg.device, cfg.autocast)
    torch.manual_seed(cfg.seed)
    micro, accum = cfg.batch_size, cfg.accum
    problem = make_problem(cfg, micro * accum * lay.data_world)
    model = build_model(cfg, problem).to(place.device)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
    start, carried, clock, train_clock, best = 0, [None] * accum, 0.0, 0.0, None
    identity = run_id(run_dir)
    if resume and (run_dir / CHECKPOINT).is_file():
        # Everything is checked before anything in the run directory is touched.
        ckpt = load_checkpoint(run_dir / CHECKPOINT)
        check_checkpoint(ckpt, run_dir / CHECKPOINT)
        if ckpt.get("world_size", 1) != world:
            raise RunDirError(f"--resume {run_dir}: the run used {ckpt.get('world_size', 1)} "
                              f"process(es), this resume has {world}; the global batch and the "
                              f"carried states are per process, so use the same count")
        check_provenance(ckpt.get("run"), cfg, identity, problem.fingerprint, run_dir)
        if ckpt["step"] >= cfg.steps:
            raise RunDirError(
                f"--resume {run_dir}: nothing to train: the checkpoint is at step "
                f"{ckpt['step']} and --steps {cfg.steps} "
                + ("is where the run ended" if ckpt["step"] == cfg.steps else "is below it")
                + f"; pass --steps above {ckpt['step']} to train on")
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            start, best = ckpt["step"], ckpt.get("best")
            stops.checkpoint = start
            clock, train_clock = ckpt.get("elapsed", 0.0), ckpt.get("train_elapsed", 0.0)
            if ckpt["carried"]:
                carried = place.to(list(ckpt["carried"][rank]))
            torch.set_rng_state(ckpt["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            raise RunDirError(f"checkpoint {run_dir / CHECKPOINT} does not fit this run "
                              f"(written for another model or damaged: {type(exc).__name__}: "
                              f"{str(exc)[:300]}); remove it to restart the run") from exc
        if len(carried) != accum:
            raise RunDirError(f"checkpoint {run_dir / CHECKPOINT} carries {len(carried)} "
                              f"states, this run accumulates {accum} micro-batches")
    if rank == 0:
        with stops.uninterrupted():
            truncate_metrics(run_dir / METRICS, start)
            truncate_samples(run_dir / SAMPLES, start)
            if resume:
                record_resumable_changes(run_dir, cfg, identity)
        if resume:
            print(f"resuming from step {start}" + ("" if start else " (no checkpoint: the "
                                                   "run starts over)"), file=sys.stderr)
        count = sum(p.numel() for p in dict.fromkeys(model.parameters()))
        print(f"model: {type(model).__name__} ({cfg.model}), {count:,} parameters, on "
              f"{place.device}" + (f", autocast {cfg.autocast}" if cfg.autocast != "none" else ""),
              file=sys.stderr)
    # On a stateful task the carried state replaces a layer's learned initial state after the
    # first segment of a pass, so those parameters get no gradient then: DDP must look for
    # unused parameters or it waits for their gradients forever (a crash at the next step).
    # (It then prints a C++ warning once, at the first step whose parameters are all used.
    # Touching them with a zero instead would silence it, but without the search DDP
    # rebuilds its gradient buckets after the first step in the order gradients arrive, which
    # differs between a fresh start and a resume: the all-reduce's sums, and so a resume,
    # would no longer be bit-identical; tests/context_parallel/test_training.py.)
    net = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[place.device.index] if place.device.type == "cuda" else None,
        find_unused_parameters=problem.stateful) if world > 1 else model
    forward = torch.compile(net) if cfg.compile else net
    context = {} if lay.context_group is None else {"context_group": lay.context_group}
    last = {}   # the latest record per split
    tokens, train_time = 0, 0.0   # since the last train record
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, dynamic_ncols=True,
               disable=rank != 0 or not cfg.progress, desc=f"{cfg.task} {cfg.model}")
    stops.enter("training")          # (from here on a signal stops the run at a boundary)
    if not bar.disable:       # (a log line, e.g. the CPU kernels' compile notice, on a line
        # of its own, not glued to the bar's)
        stack.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger("fastrwa")]))
    for step in bar:
        began = time.perf_counter()
        stops.step = step + 1
        model.train()
        lr = cfg.lr * lr_factor(step, cfg.warmup, cfg.decay_steps, cfg.schedule)
        set_lr(optimizer, lr)
        batch = problem.batch(step, micro * accum * lay.data_world)
        tokens += batch.x.shape[0] * batch.x.shape[1]
        segment = batch.x.shape[1]
        batch = rows(batch, lay.data_rank * micro * accum, (lay.data_rank + 1) * micro * accum)
        if batch.starts is None:       # (packed rows are sliced once flattened: packed_slice)
            batch = time_slice(batch, lay)
        share = share_of_the_loss(batch.x.shape[1], segment, lay)
        if problem.stateful and getattr(batch, "new_pass", False):
            carried = [None] * accum
        optimizer.zero_grad(set_to_none=True)
        loss_sum = metric_sum = 0.0
        for k in range(accum):
            part = place.to(rows(batch, k * micro, (k + 1) * micro))
            # Gradients are averaged across processes once, after the last micro-batch.
            sync = world == 1 or k == accum - 1
            with contextlib.nullcontext() if sync else net.no_sync():
                with place.autocast():
                    if part.starts is None:
                        # (with context parallelism the state enters at the first slice)
                        output, state = forward(part.x, carried[k] if lay.context_rank == 0
                                                else None, **context)
                    else:                      # --pack: documents from the initial state
                        x, target, packed, scored = packed_slice(
                            part.x, part.target, part.starts, lay.context_rank,
                            lay.context_world)
                        output, state = forward(x, None, **context, **packed)
                if part.starts is None:
                    loss, metric = problem.score(output.float(), part)
                    loss, metric = loss * share, metric * share
                else:
                    loss, metric = packed_loss(output, target, scored, lay.context_world)
                (loss / accum).backward()
            # (a Transformer trains each window from nothing: nothing is carried)
            carried[k] = from_the_last_slice(detach_state(state), lay) \
                if problem.stateful and getattr(model, "carries_state_in_training", True) \
                else None
            loss_sum, metric_sum = loss_sum + float(loss.detach()), metric_sum + metric
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optimizer.step()
        step_time = time.perf_counter() - began
        train_time += step_time
        train_clock += step_time
        done = step + 1
        final = done == cfg.steps
        writing = _Writes(stops)  # (what this step spends writing files: --minutes)
        if deadline is not None and not final and deadline.after_step(
                step_time, evaluates=done % cfg.eval_every == 0,
                writes=done % cfg.checkpoint_every == 0 or done % cfg.eval_every == 0):
            final = True
            if rank == 0:
                bar.write(deadline.line(done, cfg.steps), file=sys.stderr)
        if final:
            stops.enter("final evaluation")
        records = []
        if done % cfg.log_every == 0 or final:
            records.append({"step": done, "split": "train",
                            "loss": _mean_over_ranks(loss_sum / accum, world, place.device),
                            problem.metric: _mean_over_ranks(metric_sum / accum, world,
                                                             place.device),
                            "lr": lr, "tokens_per_s": tokens / max(train_time, 1e-9)})
            tokens, train_time = 0, 0.0
        splits = (["valid"] if done % cfg.eval_every == 0 or final else []) + \
            (["test"] if final else [])
        for split in splits:
            model.eval()
            shown = _evaluation_bar(problem, split, micro, bar.disable)
            if getattr(problem, "shards_evaluation", False):
                result = problem.evaluate(model, micro, split, place, shard=(rank, world),
                                          batches=shown)
            else:       # (every process evaluates the same batches)
                result = problem.evaluate(model, micro, split, place, batches=shown)
                for key in ("loss", problem.metric):
                    result[key] = _mean_over_ranks(result[key], world, place.device)
            records.append({"step": done, "split": split, **result})
            if split != "valid" or rank != 0:
                continue
            if hasattr(model, "config") and _better(result[problem.metric], best,
                                                    problem.higher_is_better):
                best = result[problem.metric]
                with writing():
                    save_pretrained(model, run_dir / BEST, _trained(cfg, done),
                                    {f"valid {problem.metric}{_part(cfg)}": best,
                                     "at step": done})
            text = problem.sample(model, done, place) if hasattr(problem, "sample") else None
            if text is not None:
                with open(run_dir / SAMPLES, "a", encoding="utf-8") as f:
                    f.write(f"--- step {done} ---\n{text}\n")
        clock += time.perf_counter() - began
        if records:
            for r in records:       # wall-clock, and the part of it spent on training steps
                r["elapsed_s"], r["train_s"] = clock, train_clock
            last.update({r["split"]: r for r in records})
            shown = {k: f"{v:.4g}" for k, v in records[0].items()
                     if k in ("loss", problem.metric, "tokens_per_s")}
            bar.set_postfix({**shown, "baseline": f"{problem.baseline:.4g}"})
            if rank == 0:
                with open(run_dir / METRICS, "a") as f:
                    for r in records:
                        f.write(json.dumps(r) + "\n")
        # The final export goes before the final checkpoint: a run killed between the two
        # resumes from the checkpoint before and exports again (the other way round, the
        # checkpoint would say the run is done while model/ is missing).
        if final and rank == 0 and hasattr(model, "config"):
            with writing():
                save_pretrained(model, run_dir / EXPORT, _trained(cfg, done),
                                {f"{split} {problem.metric}"
                                 f"{_part(cfg) if split == 'valid' else ''}":
                                 last[split][problem.metric]
                                 for split in ("valid", "test") if split in last})
        stop = stops.pending(world, place.device)
        if done % cfg.checkpoint_every == 0 or final or stop:
            states = [None] * world
            if world > 1:
                dist.all_gather_object(states, CPU.to(carried))
            else:
                states = [CPU.to(carried)]
            if rank == 0:
                with writing():
                    save_checkpoint(run_dir / CHECKPOINT, {
                        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": done, "rng": torch.get_rng_state(), "world_size": world,
                        "elapsed": clock, "train_elapsed": train_clock, "best": best,
                        "carried": states if problem.stateful else None,
                        "run": provenance(cfg, identity, problem.fingerprint)})
                    stops.checkpoint = done
        if deadline is not None and writing.seconds:
            deadline.wrote(writing.seconds)
        if stop and not final:
            if world > 1:         # (no rank leaves before rank 0's checkpoint is written)
                dist.barrier()
            bar.close()
            raise stops.stopped(done)
        if final and done < cfg.steps:        # (--minutes: the time is up)
            bar.n = done
            break
    bar.close()
    return last

