"""Backend selection: ``use_backend(...)``, the ``FASTRWA_BACKEND`` variable, and dispatch."""

from __future__ import annotations

import contextlib
import contextvars
import os
from types import ModuleType
from typing import Iterator

import torch

BACKENDS = ("torch", "triton", "auto")
_ENV = "FASTRWA_BACKEND"
_chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastrwa_backend", default=None)


def _check(name: object, where: str) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{where} must be one of {BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed fastrwa ops on backend ``name``: "torch", "triton" or "auto".

    "auto" (the default) picks Triton for CUDA tensors when the Triton backend is available
    and the PyTorch implementation otherwise. Overrides ``FASTRWA_BACKEND`` inside the block.

    Example:
        >>> import torch, fastrwa
        >>> with fastrwa.use_backend("torch"):
        ...     y, _ = fastrwa.rwa_scan(torch.randn(1, 4, 2), torch.randn(1, 4, 2))
    """
    token = _chosen.set(_check(name, "backend"))
    try:
        yield
    finally:
        _chosen.reset(token)


def get_backend() -> str:
    """The backend name in force: the innermost ``use_backend``, else ``FASTRWA_BACKEND``, else "auto"."""
    chosen = _chosen.get()
    if chosen is not None:
        return chosen
    return _check(os.environ.get(_ENV, "auto"), f"the environment variable {_ENV}")


def _triton_backend() -> ModuleType | None:
    """The Triton backend module, or ``None`` while it does not exist."""
    return None


def resolve(device: torch.device) -> ModuleType:
    """The backend module that runs an op on tensors on ``device``."""
    name = get_backend()
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        triton_backend = _triton_backend()
        if triton_backend is not None:
            return triton_backend
        if name == "triton":
            raise NotImplementedError(
                "fastrwa backend 'triton' is not available yet in this version; "
                "use fastrwa.use_backend('torch') or FASTRWA_BACKEND=torch (or 'auto')"
            )
    from . import torch_backend

    return torch_backend
