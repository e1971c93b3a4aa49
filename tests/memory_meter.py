"""Peak bytes of live tensors created inside a block, on any device (CPU included).

Every op output seen by a TorchDispatchMode is counted against its storage while any tensor
that op returned on that storage is alive (weakref finalizers), so the peak covers what the
code under test keeps alive, not what the allocator caches.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorMeter(TorchDispatchMode):
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

