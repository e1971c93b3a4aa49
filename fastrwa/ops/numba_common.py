"""What the numba launchers share (``numba_host`` for the scans, ``decode_host`` for the LM's
decode step, and ``fastrwa.models.packed`` for NumPy views of weights): the kernels'
constants, NumPy views of tensors, the thread count and the pools of plain threads, and the
notice printed while numba compiles the kernels. Neither launcher imports the other.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba.core import event as numba_event

from ..kernels import cpu as _cpu_kernels


class CompileNotice(numba_event.Listener):
    """Says once per process (a warning of the ``fastrwa`` logger, shown on standard error
    by default) that fastrwa's CPU kernels are being compiled: numba compiles a kernel on its first use for a dtype (seconds each; a
    training run's first step, or a first generation, waits for it) and then loads it from
    its on-disk cache. numba signals only real compilations ("numba:compile", not a load
    from the cache), so a later process says nothing."""

    said = False

    def on_start(self, event) -> None:
        dispatcher = event.data.get("dispatcher")
        module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
        if not CompileNotice.said and module.startswith(KERNEL_PACKAGE):
            CompileNotice.said = True
            # (a warning of the "fastrwa" logger: printed on standard error unless the
            # program configures logging otherwise)
            logging.getLogger("fastrwa").warning(
                "fastrwa: compiling CPU kernels (first run only: numba caches them on disk; "
                "seconds per kernel)")

    def on_end(self, event) -> None:
        pass


KERNEL_PACKAGE = _cpu_kernels.__name__                                  # fastrwa.kernels.cpu
numba_event.register("numba:compile", CompileNotice())


@functools.lru_cache(maxsize=None)
def kernel_consts(cdt: torch.dtype) -> np.ndarray:
    """``[0, 1, -inf, tiny]`` in the compute type: the kernels' constants (``tiny``: the
    smallest normal number; the scan flushes its decaying state and adjoint below it,
    docs/kernels.md "Subnormals")."""
    npt = torch.empty(0, dtype=cdt).numpy().dtype
    return np.array([0.0, 1.0, -np.inf, np.finfo(npt).tiny], dtype=npt)


def flat(x: torch.Tensor) -> np.ndarray:
    """A flat NumPy view of a CPU tensor's memory, from its first element to its last (all of
    it for a contiguous tensor; a strided input's rows with what lies between them);
    bfloat16 as its uint16 bits."""
    if not x.is_contiguous():
        span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride())) if x.numel() else 0
        x = x.as_strided((span,), (1,))
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    return x.numpy().reshape(-1)


def threads() -> int:
    """How many threads a call may use: PyTorch's intra-op setting."""
    return max(1, torch.get_num_threads())


@dataclasses.dataclass
class _Pool:
    """A thread pool and the process that made it (a forked child inherits the object but
    not its threads: a call from another pid makes a new pool)."""

    executor: ThreadPoolExecutor | None = None
    workers: int = 0
    pid: int = -1


_POOLS: dict[str, _Pool] = {}
_pool_lock = threading.Lock()


def pool(workers: int, role: str = "ranges") -> ThreadPoolExecutor:
    """The pool of plain threads for ``role`` with ``workers`` threads or more: "ranges"
    runs the threads that take a scan's tasks and the decode step's ranges of batch rows;
    "helpers" runs the threads that share a small batch's decode step (``decode_host.py``),
    which must not queue behind those."""
    with _pool_lock:
        p = _POOLS.setdefault(role, _Pool())
        if p.executor is None or p.pid != os.getpid() or p.workers < workers:
            p.executor = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix=f"fastrwa-{role}")
            p.workers, p.pid = workers, os.getpid()
        return p.executor
