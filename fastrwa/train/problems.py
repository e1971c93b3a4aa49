"""What ``--task`` names, behind one interface for the trainer.

A problem gives batches as a pure function of the step (``batch(step, size)``), scores model
outputs, evaluates, and says whether the recurrent state is carried from step to step
(truncated backpropagation through time on byte corpora).
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from . import data as _data
from .device import Placement
from .packing import document_starts
from .config import LM_TASKS
from .tasks import TASKS, Batch, Task, make_task

IMAGE_TASKS = ("mnist", "pmnist")
ALL_TASKS = tuple(TASKS) + LM_TASKS + IMAGE_TASKS
# What ``evaluate(..., batches=)`` takes: it wraps the iterable of an evaluation's batches (a
# progress bar, or the calibration's first few batches); ``None`` keeps it as it is.
Batches = Callable[[Iterable], Iterable] | None


def _each(batches: Batches, iterable: Iterable) -> Iterable:
    return iterable if batches is None else batches(iterable)


class SyntheticProblem:
    """A :class:`fastrwa.train.tasks.Task`; validation batches come from their own seeds."""

    stateful = False
    fingerprint = None          # generated data: nothing on disk that could change

    def __init__(self, task: Task, eval_batches: int):
        self.task, self.eval_batches = task, eval_batches
        self.input_size, self.output_size = task.input_size, task.output_size
        self.metric, self.baseline = task.metric, task.baseline
        self.higher_is_better = task.higher_is_better

    def batch(self, step: int, size: int) -> Batch:
        return self.task.batch(step, size)

    def score(self, output: Tensor, batch: Batch) -> tuple[Tensor, float]:
        return self.task.score(output, batch)

    def evaluation_batches(self, split: str, size: int) -> int:
        """How many batches :meth:`evaluate` runs."""
        return self.eval_batches

    @torch.no_grad()
    def evaluate(self, model, size: int, split: str, place: Placement,
                 batches: Batches = None) -> dict:
        """The loss and metric over ``eval_batches`` batches; with them what the report's
        verdict needs (:mod:`fastrwa.train.verdict`): ``scored``, the predictions counted
        (each batch's mean weighted alike: the batches score the same count), and ``se``,
        the standard error of the metric's mean over the batches (two or more)."""
        losses, metrics, scored = [], [], 0
        for k in _each(batches, range(self.eval_batches)):
            batch = place.to(self.task.batch(k, size, split))
            with place.autocast():
                output = model(batch.x)[0]
            loss, metric = self.score(output.float(), batch)
            losses.append(float(loss))
            metrics.append(metric)
            scored += int(batch.mask.sum())
        mean = sum(metrics) / len(metrics)
        record = {"loss": sum(losses) / len(losses), self.metric: mean, "scored": scored,
                  "batches": len(metrics)}
        if len(metrics) > 1:
            var = sum((m - mean) ** 2 for m in metrics) / (len(metrics) - 1)
            record["se"] = math.sqrt(var / len(metrics))
        return record


class ByteLMProblem:
    """Next-byte prediction on a corpus split 90/5/5 (memory-mapped); bits per byte; TBPTT
    segments of ``bptt`` bytes with the state carried across consecutive segments (detached).
    Evaluation scores every byte of a split (or its first ``eval_bytes``), batched."""

    stateful = True
    shards_evaluation = True    # evaluate(shard=(rank, world)) returns the global result
    input_size, output_size = 0, 256
    metric, higher_is_better = "bpc", False
    baseline = 8.0          # a uniform guess over 256 byte values
    eval_streams = 32       # rows of a batched evaluation (each starts from the initial state)

    def __init__(self, path: str, streams: int, bptt: int, eval_bytes: int,
                 pack: bytes | None = None):
        corpus = _data.open_corpus(path)
        # What a checkpoint records of the data, so that --resume can tell a changed corpus.
        self.fingerprint = {"size": corpus.size, "sha256": corpus.sha256}
        self.splits = _data.split_corpus(corpus.data)
        self.train = _data.ByteStreams(self.splits["train"], streams, bptt)
        self.bptt, self.eval_bytes = bptt, eval_bytes
        # --pack: documents (ending with the separator) from the initial state, nothing carried
        self.pack = pack
        self.stateful = pack is None

    def batch(self, step: int, size: int) -> Batch:
        """Segment ``step`` of the training streams. Packed (``--pack``): the positions where
        a document starts are marked (``starts``), and the target that would cross into the
        next document (the byte after a separator, predicted from the document before) is
        ignored (-100): each document's loss is its own bytes', as if trained alone."""
        x, y, new_pass = self.train.get(step)
        starts = None
        if self.pack is not None:
            begins = document_starts(self.train.data, self.train.index(step), self.pack)
            starts = begins[:, :-1]
            y = y.masked_fill(begins[:, 1:], -100)
        batch = Batch(x, y, torch.ones_like(y, dtype=torch.bool), starts)
        batch.new_pass = new_pass
        return batch

    def score(self, output: Tensor, batch: Batch) -> tuple[Tensor, float]:
        loss = torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]).float(),
                                                 batch.target.reshape(-1))
        return loss, _data.bits_per_byte(float(loss.detach()))

    def _scored(self, split: str) -> Tensor:
        """The bytes of ``split`` an evaluation reads (``eval_bytes`` of "valid")."""
        data = self.splits[split]
        return data[:self.eval_bytes + 1] if split != "test" and self.eval_bytes else data

    def evaluation_batches(self, split: str, size: int) -> int:
        """How many batches :meth:`evaluate` runs (on rank 0, which holds the first row)."""
        n = len(self._scored(split)) - 1
        per_row = -(-n // max(1, min(self.eval_streams, n)))               # (whole_split's)
        return -(-per_row // (4 * self.bptt))

    @torch.no_grad()
    def evaluate(self, model, size: int, split: str, place: Placement,
                 shard: tuple[int, int] = (0, 1), batches: Batches = None) -> dict:
        """bpc over a held-out split: the whole split for "test", the first ``eval_bytes``
        (0: all) for "valid"; ``bytes`` says how many were scored, ``whole`` whether that is
        the entire split. Under torchrun (``shard=(rank, world)``) each process scores its
        share of the rows and the sums are added up: every process returns the whole
        result. ``batches`` wraps the iterable of batches (``Batches``)."""
        data = self._scored(split)
        total, count, state = 0.0, 0, None
        for x, y in _each(batches, _data.whole_split(data, self.eval_streams, 4 * self.bptt,
                                                      shard)):
            x, y = place.to((x, y))
            with place.autocast():
                out, state = model(x, state)
            total += float(torch.nn.functional.cross_entropy(
                out.reshape(-1, out.shape[-1]).float(), y.reshape(-1), reduction="sum"))
            count += int((y >= 0).sum())
        if shard[1] > 1:
            sums = torch.tensor([total, count], dtype=torch.float64)
            dist.all_reduce(sums)
            total, count = float(sums[0]), int(sums[1])
        return {"loss": total / count, "bpc": _data.bits_per_byte(total / count),
                "bytes": count, "whole": count == len(self.splits[split]) - 1}

    def sample(self, model, step: int, place: Placement, length: int = 200) -> str | None:
        """A continuation of the validation split's first 64 bytes, or ``None`` for a model
        without ``generate``."""
        if not hasattr(model, "generate"):
            return None
        prompt = self.splits["valid"][:64].long().to(place.device)
        gen = torch.Generator(device=place.device).manual_seed(step)
        out = model.generate(prompt, length, temperature=0.8, top_k=40, generator=gen)
        return bytes(out[0, len(prompt):].tolist()).decode("utf-8", errors="replace")


class ImageProblem:
    """(Permuted) MNIST pixel by pixel: 784 steps of one pixel, the class at the last step.
    Validation and test both read the standard test set (MNIST has no separate validation)."""

    stateful = False
    input_size, output_size = 1, 10
    metric, higher_is_better, baseline = "accuracy", True, 0.1

    def __init__(self, directory: str, permuted: bool, seed: int, eval_batches: int):
        self.images, self.labels = _data.load_mnist(directory, "train")
        self.test_images, self.test_labels = _data.load_mnist(directory, "test")
        self.seed, self.eval_batches = seed, eval_batches
        tensors = (self.images, self.labels, self.test_images, self.test_labels)
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(t.contiguous().numpy().tobytes())
        self.fingerprint = {"size": sum(t.numel() * t.element_size() for t in tensors),
                            "sha256": digest.hexdigest()}
        pixels = self.images.shape[1] * self.images.shape[2]
        with torch.device("cpu"):     # the images' device, whatever the default device
            self.order = (torch.randperm(pixels, generator=torch.Generator().manual_seed(seed))
                          if permuted else torch.arange(pixels))

    def _make(self, images, labels, index) -> Batch:
        """The batch of ``images[index]``, on the CPU (the images' device)."""
        with torch.device("cpu"):
            x = images[index].reshape(len(index), -1)[:, self.order].float().div(255)[..., None]
            T = x.shape[1]
            target = torch.zeros(len(index), T, dtype=torch.long)
            target[:, -1] = labels[index]
            mask = torch.zeros(len(index), T, dtype=torch.bool)
            mask[:, -1] = True
            return Batch(x, target, mask)

    def batch(self, step: int, size: int) -> Batch:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self._make(self.images, self.labels, torch.randint(
            0, len(self.labels), (size,), generator=gen, device="cpu"))

    def score(self, output, batch):
        logits = output[batch.mask]
        loss = torch.nn.functional.cross_entropy(logits, batch.target[batch.mask])
        return loss, float((logits.argmax(-1) == batch.target[batch.mask]).float().mean())

    def _scored(self, size: int) -> int:
        """The test images an evaluation reads."""
        return min(len(self.test_labels), self.eval_batches * size)

    def evaluation_batches(self, split: str, size: int) -> int:
        """How many batches :meth:`evaluate` runs."""
        return -(-self._scored(size) // size)

    @torch.no_grad()
    def evaluate(self, model, size: int, split: str, place: Placement,
                 batches: Batches = None) -> dict:
        n = self._scored(size)
        losses, correct = [], 0
        for lo in _each(batches, range(0, n, size)):
            batch = place.to(self._make(self.test_images, self.test_labels,
                                        torch.arange(lo, min(n, lo + size), device="cpu")))
            with place.autocast():
                out = model(batch.x)[0][batch.mask].float()
            losses.append(float(torch.nn.functional.cross_entropy(
                out, batch.target[batch.mask], reduction="sum")))
            correct += int((out.argmax(-1) == batch.target[batch.mask]).sum())
        return {"loss": sum(losses) / n, "accuracy": correct / n}


def make_problem(cfg, streams: int):
    """The problem of a :class:`fastrwa.train.config.RunConfig`; ``streams`` = global batch."""
    if cfg.task not in ALL_TASKS:
        raise ValueError(f"--task must be one of {sorted(ALL_TASKS)}, got {cfg.task!r}")
    if cfg.task in LM_TASKS or cfg.task in IMAGE_TASKS:
        if not cfg.data:
            raise ValueError(f"--task {cfg.task} needs --data PATH "
                             f"({'a corpus file' if cfg.task in LM_TASKS else 'the MNIST IDX dir'})")
    if cfg.task in LM_TASKS:
        return ByteLMProblem(cfg.data, streams, cfg.bptt, cfg.eval_bytes,
                             None if cfg.pack is None else cfg.pack.encode("utf-8"))
    if cfg.task in IMAGE_TASKS:
        return ImageProblem(cfg.data, cfg.task == "pmnist", cfg.seed, cfg.eval_batches)
    return SyntheticProblem(make_task(cfg.task, cfg.seq_len, cfg.seed), cfg.eval_batches)
