"""Utilities for fastrwa's tests and benchmarks (and for users who test code built on it).

* :class:`NewStorageCounter` / :func:`storages`: count tensor allocations, e.g. to check
  that a decode step allocates nothing.
* :class:`LiveTensorMeter`: the peak bytes of live tensors created inside a block, on any
  device, e.g. to check that generation memory does not grow with length.
* :func:`poison_buffers`: every buffer a backend allocates starts as NaN, so an entry it
  forgets to write fails a test.
* :func:`backend_options`: change a backend's knobs (block sizes, chunk lengths) for a
  block, e.g. to force small blocks that cross every chunk edge.

Example:
    >>> import torch
    >>> from fastrwa.testing import NewStorageCounter, storages
    >>> x, out = torch.ones(3), torch.empty(3)
    >>> with NewStorageCounter(storages(x, out)) as counter:
    ...     _ = torch.mul(x, 2, out=out)
    ...     _ = x * 2
    >>> counter.new
    ['aten.mul.Tensor']
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .ops import buffers, dispatch


class NewStorageCounter(TorchDispatchMode):
    """Records (in ``.new``) the op of every output on a storage not seen before.

    Every op output whose storage is not among ``known`` (data pointers, see
    :func:`storages`) counts as an allocation. Views and ``out=`` results share a known
    storage and do not count.
    """

    def __init__(self, known: set[int]):
        super().__init__()
        self.known = set(known)
        self.new: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.new.append(str(func))
                self.known.add(t.untyped_storage().data_ptr())
        return out


class LiveTensorMeter(TorchDispatchMode):
    """Peak bytes (``.peak``) of live tensors created inside the block.

    Every op output is counted against its storage while any tensor that op returned on that
    storage is alive (weakref finalizers), so the peak covers what the code under test keeps
    alive, not what the allocator caches.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list] = {}   # storage pointer -> [live tensor count, bytes]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self._refs:
                    self._refs[key] = [0, storage.nbytes()]
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                self._refs[key][0] += 1
                weakref.finalize(t, self._release, key)
        return out


def storages(*objects) -> set[int]:
    """Data pointers of every tensor in ``objects`` (nested lists, tuples and dicts too)."""
    leaves = tree_flatten(list(objects))[0]
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}


@contextlib.contextmanager
def poison_buffers(enabled: bool = True) -> Iterator[None]:
    """Inside the block, every fresh buffer a backend allocates is filled with NaN.

    Example:
        >>> import torch, fastrwa
        >>> from fastrwa.testing import poison_buffers
        >>> with poison_buffers():
        ...     y, _ = fastrwa.rwa_scan(torch.randn(1, 3, 2), torch.randn(1, 3, 2))
        >>> bool(torch.isfinite(y).all())
        True
    """
    previous = buffers.poisoned()
    buffers.set_poison(enabled)
    try:
        yield
    finally:
        buffers.set_poison(previous)


@contextlib.contextmanager
def backend_options(name: str, **changes: Any) -> Iterator[Any]:
    """Inside the block, backend ``name`` runs with its options changed (fields of its
    ``Options``: "torch" ``chunk_size``; "numba" ``chunk``, ``block``; "triton"
    ``algorithm``, ``block_t``, ``block_d``, ``block_d_backward``). Yields the options in
    force.

    Example:
        >>> import torch, fastrwa
        >>> from fastrwa.testing import backend_options
        >>> with backend_options("torch", chunk_size=2), fastrwa.use_backend("torch"):
        ...     y, _ = fastrwa.rwa_scan(torch.randn(1, 5, 2), torch.randn(1, 5, 2))
    """
    backend = dispatch.load(name)
    previous = backend.set_options(**changes)
    try:
        yield backend.options()
    finally:
        backend.set_options(**dataclasses.asdict(previous))
