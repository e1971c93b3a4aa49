"""Where a run computes: the device (``--device``), its process group, and autocast."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from typing import NamedTuple

import torch


def resolve_device(name: str) -> torch.device:
    """``--device``: "auto" is CUDA when present, else the CPU; under torchrun on CUDA, the
    GPU of this process (``LOCAL_RANK``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available here (PyTorch "
                             f"{torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA)")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """nccl for CUDA tensors, gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


class Placement(NamedTuple):
    """The device and the autocast dtype (or ``None``) of a run."""

    device: torch.device
    autocast_dtype: torch.dtype | None

    def to(self, x):
        """``x`` (a tensor, a pytree of them, or a dataclass of tensors such as a batch) on
        the run's device."""
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            moved = copy.copy(x)          # (keeps attributes set on the instance)
            for field in dataclasses.fields(x):
                setattr(moved, field.name, self.to(getattr(x, field.name)))
            return moved
        return torch.utils._pytree.tree_map(
            lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, x)

    def autocast(self):
        """The autocast context of the forward pass (a no-op without ``--autocast``)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def placement(device: str, autocast: str) -> Placement:
    return Placement(resolve_device(device), torch.bfloat16 if autocast == "bf16" else None)
