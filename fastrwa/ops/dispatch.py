"""Which backend runs the weighted scan, and what a backend takes and returns.

Three backends, each one module of host code that launches its kernels:

* "triton": ``fastrwa/ops/triton_host.py`` -> ``kernels/triton/`` (CUDA tensors, or CPU
  tensors under ``TRITON_INTERPRET=1``; float16/bfloat16/float32);
* "numba": ``fastrwa/ops/numba_host.py`` -> ``kernels/cpu/`` (CPU tensors, every float dtype);
* "torch": ``fastrwa/ops/torch_host.py`` (PyTorch ops; any device and dtype).

"auto" takes the first of :data:`BACKENDS` that claims the tensors' device and dtype and
imports: Triton for CUDA tensors (not float64), numba for CPU tensors, torch otherwise. A
backend that fails to import is skipped, once, with a warning that says why.
``use_backend(name)`` (per thread) and ``FASTRWA_BACKEND`` choose one by name. The
public functions resolve the name once per call (:func:`resolve`) and hand it to the custom
op (``fastrwa/ops/autograd.py``), which runs that backend's forward and, later, backward.
Under ``torch.compile`` the name is resolved when the graph is traced, and the graph is
traced again when ``use_backend`` chooses another one (``FASTRWA_BACKEND`` is read at
tracing only).

What a backend takes and returns (``ScanArgs``, ``ForwardResult``, ``Gradients``,
``Backend``, ``Knobs``, ``state_dtype``) is :mod:`fastrwa.ops.contract`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from typing import Iterator

import torch

# The contract lives in its own module, which the backends import (they do not import this
# registry); its names are here too for the code that has always found them here.
from .contract import (Backend, ForwardResult, Gradients, Knobs, ScanArgs,  # noqa: F401
                       State, state_dtype)

BACKENDS = ("triton", "numba", "torch")     # also the order "auto" tries them in
CHOICES = (*BACKENDS, "auto")
ENV = "FASTRWA_BACKEND"


# The innermost use_backend of each thread (a thread-local, not a ContextVar: torch.compile
# traces reads of a thread-local and guards on their value, so a compiled graph runs the
# backend chosen when it runs; it cannot trace a ContextVar).
class _Choice(threading.local):
    name: str | None = None         # (a class default: reading it never raises)


_chosen = _Choice()


def _check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or name not in CHOICES:
        raise ValueError(f"{where} must be one of {CHOICES}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed fastrwa ops on backend ``name``: "torch", "triton", "numba" or "auto".

    "auto" (the default) picks Triton for CUDA tensors, the compiled "numba" CPU kernels for
    CPU tensors (when numba imports), and the PyTorch implementation otherwise ("torch" runs
    on any device). Overrides ``FASTRWA_BACKEND`` inside the block. A gradient is computed
    by the backend that ran the forward, wherever ``.backward()`` is called. It holds in
    code compiled with ``torch.compile`` too (a change of backend traces the graph again).
    The choice is per thread.

    Example:
        >>> import torch, fastrwa
        >>> with fastrwa.use_backend("torch"):
        ...     y, _ = fastrwa.rwa_scan(torch.randn(1, 4, 2), torch.randn(1, 4, 2))
    """
    previous = _chosen.name
    _chosen.name = _check_name(name, "backend")
    try:
        yield
    finally:
        _chosen.name = previous


def get_backend() -> str:
    """The backend name in force: the innermost ``use_backend``, else ``FASTRWA_BACKEND``, else "auto".

    Example:
        >>> import fastrwa
        >>> with fastrwa.use_backend("torch"):
        ...     fastrwa.get_backend()
        'torch'
    """
    chosen = _chosen.name
    if chosen is not None:
        return chosen
    return _check_name(os.environ.get(ENV, "auto"), f"the environment variable {ENV}")


def refusal(name: str, device: torch.device, dtype: torch.dtype) -> Exception | None:
    """``None`` where backend ``name`` runs ``dtype`` tensors on ``device``, else the error to
    raise when a user asks for it there (naming what it got and what to use instead)."""
    if name == "numba" and device.type != "cpu":
        return RuntimeError(f"fastrwa backend 'numba' runs on CPU tensors, got tensors on "
                            f"{device}; use fastrwa.use_backend('triton'), 'torch' or 'auto'")
    if name == "triton":
        interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpreted:
            return RuntimeError(
                f"fastrwa backend 'triton' needs CUDA tensors (or CPU tensors with "
                f"TRITON_INTERPRET=1 set before import), got tensors on {device}; "
                f"use fastrwa.use_backend('torch') or 'auto'")
        if dtype == torch.float64:
            return TypeError("fastrwa backend 'triton' takes float32, bfloat16 or float16 "
                             "inputs (it computes in float32), got torch.float64; use the "
                             "'torch' backend")
    return None


def _auto_takes(name: str, device: torch.device) -> bool:
    """Whether "auto" may pick backend ``name`` (once it runs there and imports)."""
    if name == "triton":
        return device.type == "cuda"
    return device.type == "cpu" if name == "numba" else True


TRITON_MISSING = (
    "fastrwa backend 'triton' needs the triton package, which is not installed: CUDA builds "
    "of PyTorch bring it, or run `pip install triton` (`pip install -e '.[dev]'` in a fastrwa "
    "clone brings it for the interpreter tests); the 'numba' and 'torch' backends run "
    "without it")


# What the three functions below remember, in plain dicts rather than functools.lru_cache:
# torch.compile traces through them (a call inside a compiled model), and Dynamo warns at
# every lru_cache it meets that it ignores the cache.
_MODULES: dict[str, Backend] = {}
_IMPORTS: dict[str, bool] = {}
_AUTO: dict[tuple[str, torch.dtype], str] = {}


def load(name: str) -> Backend:
    """The module of backend ``name`` (imported on first use: triton and numba are heavy)."""
    module = _MODULES.get(name)
    if module is None:
        module = _MODULES[name] = _import(name)
    return module


def _import(name: str) -> Backend:
    if name == "triton":
        try:
            from . import triton_host as module
        except ModuleNotFoundError as error:
            if error.name != "triton":
                raise
            raise ModuleNotFoundError(TRITON_MISSING, name="triton") from error
    elif name == "numba":
        from . import numba_host as module
    elif name == "torch":
        from . import torch_host as module
    else:
        raise ValueError(f"no fastrwa backend named {name!r}; the backends are {BACKENDS}")
    return module


def _loads(name: str) -> bool:
    """Whether backend ``name`` imports; warns once, naming the error, when it does not."""
    if name in _IMPORTS:
        return _IMPORTS[name]
    try:
        load(name)
    except Exception as error:  # noqa: BLE001 (any failure means: not usable here)
        warnings.warn(f"fastrwa: backend '{name}' is unavailable ({type(error).__name__}: "
                      f"{error}); 'auto' uses the next one of {BACKENDS}", RuntimeWarning,
                      stacklevel=4)
        _IMPORTS[name] = False
        return False
    _IMPORTS[name] = True
    return True


def resolve(device: torch.device, dtype: torch.dtype) -> str:
    """The name of the backend that runs an op on ``dtype`` tensors on ``device`` now; raises
    the backend's own error when the one asked for cannot run there."""
    name = get_backend()
    if name != "auto":
        error = refusal(name, device, dtype)
        if error is not None:
            raise error
        return name
    return _auto(device.type, dtype)


def _auto(device_type: str, dtype: torch.dtype) -> str:
    """What "auto" picks on ``device_type`` for ``dtype`` (remembered: it depends on nothing
    else once the backends' imports were tried)."""
    picked = _AUTO.get((device_type, dtype))
    if picked is not None:
        return picked
    device = torch.device(device_type)
    for candidate in BACKENDS:
        if (_auto_takes(candidate, device) and refusal(candidate, device, dtype) is None
                and _loads(candidate)):
            _AUTO[device_type, dtype] = candidate
            return candidate
    raise RuntimeError(f"fastrwa: no backend runs {dtype} tensors on {device_type}")


def clear_cache() -> None:
    """Forget which backends imported (tests that make an import fail call it)."""
    for memo in (_MODULES, _IMPORTS, _AUTO):
        memo.clear()
