"""Synthetic sequence tasks from the RWA and RDA papers, generated on the fly.

Every batch is a pure function of ``(seed, step)``: training is reproducible, resuming needs
no data-generator state, and distributed ranks take slices of the same global batch.

A task gives ``x`` ``(B, T, input_size)`` float, ``target`` and ``mask`` (which outputs
count), a loss ("mse", "ce" per position), a metric and the naive baseline the papers quote.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor


@dataclasses.dataclass
class Batch:
    x: Tensor        # (B, T, input_size) float32
    target: Tensor   # (B, T) float (mse) or long (ce)
    mask: Tensor     # (B, T) bool: positions whose output is scored
    # (B, T) bool, packed documents (--pack): True where a document starts (each row's first
    # position too); the model runs each from the initial state. None: rows are sequences.
    starts: Optional[Tensor] = None


class Task:
    """Base: ``batch(step, size)``; subclasses set the fields below."""

    name: str = ""
    input_size: int = 1
    output_size: int = 1
    loss: str = "mse"                 # "mse" or "ce"
    metric: str = "mse"               # what the progress bar and metrics.jsonl report
    baseline: float = 0.0             # the naive metric the papers compare against
    higher_is_better: bool = False

    def __init__(self, seq_len: int, seed: int = 0):
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"--seq-len must be an int >= 2, got {seq_len!r}")
        self.seq_len, self.seed = seq_len, seed

    def generator(self, step: int, split: str = "train") -> torch.Generator:
        offset = {"train": 0, "valid": 1, "test": 2}[split]
        return torch.Generator().manual_seed((self.seed * 3 + offset) * 1_000_003 + step)

    def batch(self, step: int, size: int, split: str = "train") -> Batch:
        """Batch ``step`` of ``split``, made on the CPU whatever the default device (its
        generator is a CPU one; the trainer moves batches where the model is)."""
        with torch.device("cpu"):
            return self.make(self.generator(step, split), size)

    def make(self, gen: torch.Generator, size: int) -> Batch:
        raise NotImplementedError

    def score(self, output: Tensor, batch: Batch) -> tuple[Tensor, float]:
        """``(loss, metric)`` of model outputs ``(B, T, output_size)`` on the masked positions."""
        m = batch.mask
        if self.loss == "mse":
            err = (output[..., 0] - batch.target) ** 2
            loss = err[m].mean()
            return loss, float(loss.detach())
        logits = output[m]
        loss = torch.nn.functional.cross_entropy(logits, batch.target[m])
        if self.metric == "accuracy":
            return loss, float((logits.argmax(-1) == batch.target[m]).float().mean())
        return loss, float(loss.detach())


class Adding(Task):
    """Two marked numbers in [0, 1] among ``T``; predict their sum at the end (RWA §3.5,
    Hochreiter & Schmidhuber). Predicting 1 always gives MSE 1/6 ~ 0.167."""

    name, input_size, output_size, loss, metric, baseline = "adding", 2, 1, "mse", "mse", 1 / 6

    def make(self, gen, size):
        T = self.seq_len
        values = torch.rand(size, T, generator=gen)
        first = torch.randint(0, T // 2, (size,), generator=gen)
        second = torch.randint(T // 2, T, (size,), generator=gen)
        marks = torch.zeros(size, T)
        rows = torch.arange(size)
        marks[rows, first] = 1.0
        marks[rows, second] = 1.0
        target = torch.zeros(size, T)
        target[:, -1] = values[rows, first] + values[rows, second]
        mask = torch.zeros(size, T, dtype=torch.bool)
        mask[:, -1] = True
        return Batch(torch.stack([values, marks], dim=-1), target, mask)


class ClassifyLength(Task):
    """A sequence of random length ``L ~ U{0..T}`` (ones, then zeros); is ``L > T/2``?
    (RWA §3.3). Guessing gives 50% accuracy."""

    name, input_size, output_size, loss, metric = "classify-length", 1, 2, "ce", "accuracy"
    baseline, higher_is_better = 0.5, True

    def make(self, gen, size):
        T = self.seq_len
        length = torch.randint(0, T + 1, (size,), generator=gen)
        x = (torch.arange(T)[None] < length[:, None]).float()[..., None]
        target = torch.zeros(size, T, dtype=torch.long)
        target[:, -1] = (length > T // 2).long()
        mask = torch.zeros(size, T, dtype=torch.bool)
        mask[:, -1] = True
        return Batch(x, target, mask)


class Copy(Task):
    """Copy ``S = 10`` symbols from an alphabet of ``K = 8`` after a blank stretch of ``T``
    (Henaff et al. 2016). Symbols 0..7, blank 8, delimiter 9 (one-hot inputs). Outputs are
    scored after the delimiter; the memoryless baseline is ``S log K / (T + 2S)`` nats of
    cross-entropy per step over the whole sequence, i.e. ``log K`` per scored step."""

    name, input_size, output_size, loss, metric = "copy", 10, 9, "ce", "ce"
    K, S = 8, 10
    variable = False

    def __init__(self, seq_len, seed=0):
        super().__init__(seq_len, seed)
        self.baseline = math.log(self.K)      # per scored (recall) step

    def _layout(self, gen, size):
        """Per row: blank-stretch length (fixed ``T``, or ``U{0..T}`` for variable copy)."""
        if self.variable:
            return torch.randint(0, self.seq_len + 1, (size,), generator=gen)
        return torch.full((size,), self.seq_len)

    def make(self, gen, size):
        K, S, T = self.K, self.S, self.seq_len
        total = T + 2 * S + 1
        symbols = torch.randint(0, K, (size, S), generator=gen)
        blanks = self._layout(gen, size)
        tokens = torch.full((size, total), K)                       # blank everywhere
        tokens[:, :S] = symbols
        target = torch.full((size, total), K)
        mask = torch.zeros(size, total, dtype=torch.bool)
        for i in range(size):
            start = S + int(blanks[i])
            tokens[i, start] = K + 1                                 # delimiter: recall now
            target[i, start + 1:start + 1 + S] = symbols[i]
            mask[i, start + 1:start + 1 + S] = True
        x = torch.nn.functional.one_hot(tokens, K + 2).float()
        return Batch(x, target, mask)


class VariableCopy(Copy):
    """Copy with a blank stretch of random length ``U{0..T}``: the delimiter says when."""

    name = "variable-copy"
    variable = True


class MultiCopy(Task):
    """Many consecutive copy tasks in one long sequence (RDA §6.4): segments of ``S = 5``
    symbols, a blank gap of 9, a delimiter and the recall (20 steps), repeated to fill ``T``
    (1000 gives 50 tasks). The model must forget each finished task. Baseline: ``log K`` per
    recall step."""

    name, input_size, output_size, loss, metric = "multicopy", 10, 9, "ce", "ce"
    K, S, GAP = 8, 5, 9

    def __init__(self, seq_len, seed=0):
        super().__init__(seq_len, seed)
        self.baseline = math.log(self.K)
        self.segment = 2 * self.S + self.GAP + 1
        if seq_len < self.segment:
            raise ValueError(f"--seq-len must be >= {self.segment} for multicopy, got {seq_len}")

    def make(self, gen, size):
        K, S, G, L = self.K, self.S, self.GAP, self.segment
        n = self.seq_len // L
        T = n * L
        symbols = torch.randint(0, K, (size, n, S), generator=gen)
        tokens = torch.full((size, n, L), K)
        tokens[:, :, :S] = symbols
        tokens[:, :, S + G] = K + 1
        target = torch.full((size, n, L), K)
        target[:, :, S + G + 1:] = symbols
        mask = torch.zeros(size, n, L, dtype=torch.bool)
        mask[:, :, S + G + 1:] = True
        x = torch.nn.functional.one_hot(tokens.view(size, T), K + 2).float()
        return Batch(x, target.view(size, T), mask.view(size, T))


class Parity(Task):
    """Running parity of random bits: predict ``x_1 xor ... xor x_t`` at every step
    (the RDA paper's §4 case for a discount that can flip). Guessing gives 50%."""

    name, input_size, output_size, loss, metric = "parity", 1, 2, "ce", "accuracy"
    baseline, higher_is_better = 0.5, True

    def make(self, gen, size):
        bits = torch.randint(0, 2, (size, self.seq_len), generator=gen)
        target = torch.cumsum(bits, dim=1) % 2
        mask = torch.ones(size, self.seq_len, dtype=torch.bool)
        return Batch(bits.float()[..., None], target, mask)


TASKS = {cls.name: cls for cls in (Adding, ClassifyLength, Copy, VariableCopy, MultiCopy, Parity)}


def make_task(name: str, seq_len: int, seed: int = 0) -> Task:
    if name not in TASKS:
        raise ValueError(f"--task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](seq_len, seed)
