"""Backend selection: ``use_backend(...)``, the ``FASTRWA_BACKEND`` variable, and dispatch."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings
from types import ModuleType
from typing import Iterator

import torch

BACKENDS = ("torch", "triton", "numba", "auto")
_ENV = "FASTRWA_BACKEND"
_chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastrwa_backend", default=None)


def _check(name: object, where: str) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{where} must be one of {BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed fastrwa ops on backend ``name``: "torch", "triton", "numba" or "auto".

    "auto" (the default) picks Triton for CUDA tensors, the compiled "numba" CPU kernels for
    CPU tensors (when numba imports), and the PyTorch implementation otherwise ("torch" runs
    on any device). Overrides ``FASTRWA_BACKEND`` inside the block.

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


def _triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _numba_usable() -> bool:
    """Whether the numba kernels import. numba is a dependency; this guards odd platforms
    and installs where numba can neither import nor cache (it raises at decoration time when
    no cache directory is writable). "auto" then falls back to the torch backend, once, with
    a warning that says why; ``use_backend("numba")`` raises the error itself."""
    try:
        from . import cpu_backend  # noqa: F401
    except Exception as error:  # noqa: BLE001 (any failure means: not usable here)
        warnings.warn(f"fastrwa: the compiled CPU kernels (numba) are unavailable "
                      f"({type(error).__name__}: {error}); CPU ops use the slower 'torch' "
                      f"backend", RuntimeWarning, stacklevel=3)
        return False
    return True


def resolve(device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The backend module that runs an op on ``dtype`` tensors on ``device``."""
    name = get_backend()
    if name == "triton":
        if not _triton_usable(device):
            raise RuntimeError(
                f"fastrwa backend 'triton' needs CUDA tensors (or CPU tensors with "
                f"TRITON_INTERPRET=1 set before import), got tensors on {device}; "
                f"use fastrwa.use_backend('torch') or 'auto'")
        if dtype == torch.float64:
            raise TypeError("fastrwa backend 'triton' takes float32, bfloat16 or float16 inputs "
                            "(it computes in float32), got torch.float64; use the 'torch' backend")
    if name == "triton" or (name == "auto" and device.type == "cuda" and dtype != torch.float64):
        from . import triton_backend

        return triton_backend
    if name == "numba" and device.type != "cpu":
        raise RuntimeError(f"fastrwa backend 'numba' runs on CPU tensors, got tensors on {device}; "
                           f"use fastrwa.use_backend('triton'), 'torch' or 'auto'")
    if name == "numba" or (name == "auto" and device.type == "cpu" and _numba_usable()):
        from . import cpu_backend

        return cpu_backend
    from . import torch_backend

    return torch_backend
