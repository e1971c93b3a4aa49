"""Which backend runs an op: the registry, ``use_backend(...)`` and ``FASTRWA_BACKEND``.

Every backend is one entry of :data:`REGISTRY` (a :class:`~fastrwa.ops.contract.BackendEntry`
from its package). "auto" walks :data:`AUTO_ORDER` and takes the first backend that claims
the tensors' device and dtype and imports: Triton for CUDA tensors (not float64), the
compiled numba kernels for CPU tensors, and the PyTorch implementation for everything else.
A backend that fails to import (numba on an odd platform, or with nowhere to cache) is
skipped, once, with a warning that says why.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings
from typing import Iterator

import torch

from .backends import numba as _numba, torch as _torch, triton as _triton
from .contract import Backend, BackendEntry

REGISTRY: dict[str, BackendEntry] = {e.name: e for e in (_triton.ENTRY, _numba.ENTRY, _torch.ENTRY)}
AUTO_ORDER = ("triton", "numba", "torch")
BACKENDS = (*REGISTRY, "auto")
ENV = "FASTRWA_BACKEND"
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
    on any device). Overrides ``FASTRWA_BACKEND`` inside the block. A gradient is computed
    by the backend that ran the forward, wherever ``.backward()`` is called.

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
    """The backend name in force: the innermost ``use_backend``, else ``FASTRWA_BACKEND``, else "auto".

    Example:
        >>> import fastrwa
        >>> with fastrwa.use_backend("torch"):
        ...     fastrwa.get_backend()
        'torch'
    """
    chosen = _chosen.get()
    if chosen is not None:
        return chosen
    return _check(os.environ.get(ENV, "auto"), f"the environment variable {ENV}")


@functools.lru_cache(maxsize=None)
def load(name: str) -> Backend:
    """The backend module registered as ``name`` (imported on first use)."""
    return REGISTRY[name].load()


@functools.lru_cache(maxsize=None)
def _loads(name: str) -> bool:
    """Whether backend ``name`` imports; warns once, naming the error, when it does not."""
    try:
        load(name)
    except Exception as error:  # noqa: BLE001 (any failure means: not usable here)
        warnings.warn(f"fastrwa: backend '{name}' is unavailable ({type(error).__name__}: "
                      f"{error}); 'auto' uses the next one of {AUTO_ORDER}", RuntimeWarning,
                      stacklevel=4)
        return False
    return True


def resolve_name(device: torch.device, dtype: torch.dtype) -> str:
    """The name of the backend that runs an op on ``dtype`` tensors on ``device`` now; raises
    the backend's own error when the one asked for cannot run there."""
    name = get_backend()
    if name != "auto":
        refusal = REGISTRY[name].refusal(device, dtype)
        if refusal is not None:
            raise refusal
        return name
    for candidate in AUTO_ORDER:
        entry = REGISTRY[candidate]
        if entry.refusal(device, dtype) is None and entry.auto(device, dtype) and _loads(candidate):
            return candidate
    raise RuntimeError(f"fastrwa: no backend runs {dtype} tensors on {device}")


def resolve(device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend module that runs an op on ``dtype`` tensors on ``device`` now."""
    return load(resolve_name(device, dtype))


def clear_cache() -> None:
    """Forget which backends imported (tests that make an import fail call it)."""
    load.cache_clear()
    _loads.cache_clear()
