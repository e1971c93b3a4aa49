"""Count tensor allocations: how tests and benchmarks check that a decode step allocates nothing.

``NewStorageCounter(known)`` is a ``TorchDispatchMode``: every op output whose storage is not
among ``known`` (data pointers, see :func:`storages`) counts as an allocation. Views and
``out=`` results share a known storage and do not count.

Example:
    >>> import torch
    >>> from fastrwa.allocations import NewStorageCounter, storages
    >>> x, out = torch.ones(3), torch.empty(3)
    >>> with NewStorageCounter(storages(x, out)) as counter:
    ...     _ = torch.mul(x, 2, out=out)
    ...     _ = x * 2
    >>> counter.new
    ['aten.mul.Tensor']
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class NewStorageCounter(TorchDispatchMode):
    """Records (in ``.new``) the op of every output on a storage not seen before."""

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


def storages(*objects) -> set[int]:
    """Data pointers of every tensor in ``objects`` (nested lists, tuples and dicts too)."""
    leaves = tree_flatten(list(objects))[0]
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
