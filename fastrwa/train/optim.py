"""The optimizer and its learning-rate schedule: AdamW without weight decay on norms,
biases and embeddings; linear warmup, then constant or cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

MIN_LR_RATIO = 0.1      # cosine decays to this fraction of --lr


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices of linear maps and RNN weights decay; norms' scales, biases,
    learned initial states and embeddings (also a tied head) do not."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, keep = [], []
    for p in dict.fromkeys(model.parameters()):          # (a tied weight once)
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": keep, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr)


def lr_factor(step: int, warmup: int, steps: int, schedule: str) -> float:
    """The multiplier of ``--lr`` at optimizer step ``step`` (0-based): ``(step + 1) /
    warmup`` during warmup, then 1 ("constant") or a cosine from 1 to ``MIN_LR_RATIO`` at
    the last step ("cosine"). A pure function of the step: a resumed run follows it exactly."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, steps - warmup - 1))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
