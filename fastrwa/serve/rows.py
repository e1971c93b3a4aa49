"""The rows of a batch the engine steps: a capacity-``N`` :class:`InferenceCache` whose rows
``[0, n)`` hold the ``n`` streams in flight (kept compact: a stream that leaves is replaced
by the last one), with each stream's prompt prefilled alone at batch 1, exactly as
``ByteLM.generate`` prefills it, and its state copied into a free row.

Two kinds:

* :class:`PackedRows` (a float32 ``ByteLM`` on CPU: what ``generate`` runs there by
  default): one call of the fused decode kernel (``kernels/cpu/decode.py``) over rows
  ``[0, n)`` only, and each row's id drawn by the kernel's sampler from one float64 uniform
  of the stream's own generator, as ``PackedLM.sample_steps`` draws at batch 1. The kernel
  computes each row on its own (a weight row is read once for four batch rows, but each
  row's sums are its own, in the same order): a row's logits are the same bits at batch 1
  and inside any batch (checked by tests/serve/test_engine.py), so a stream's bytes are
  ``generate``'s for the same prompt, settings and seed, whatever else is in the batch.
* :class:`StepRows` (any other decoder of ``ByteLM.decoder``: the eager step, the CUDA graph
  on a GPU): the decoder's ``step_`` over all ``N`` rows (a CUDA graph has a fixed batch;
  rows past ``n`` hold stale state whose logits are ignored), each row drawn with
  ``fastrwa.models.sampling.sample`` from its own generator, on the model's device as
  ``generate`` draws there: on CUDA the logits stay on the GPU and each stream's generator
  is a CUDA generator (``torch.Generator("cuda")``; a CPU generator cannot draw from CUDA
  logits), so a stream's bytes are ``generate(..., generator=torch.Generator("cuda")
  .manual_seed(seed))``'s on that device. The matrix products may pick other kernels at
  another batch size: bytes are ``generate``'s within float rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Union

import numpy as np
import torch
from torch import Tensor

from ..models import ByteLM, PackedLM
from ..models.sampling import refuse_logits, sample
from ..ops import decode_host
from ..ops.numba_common import flat

# What temperature 0 (greedy) is sampled with: float32's smallest normal number. Every id
# below the maximum gets weight 0 (the quotient overflows), the maximum 1: the greedy choice
# (among tied maxima, one drawn by the stream's generator), as generate(temperature=GREEDY).
GREEDY_TEMPERATURE = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass
class Sampling:
    """One stream's sampling settings and generator."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    generator: torch.Generator


class Rows(Protocol):
    """What the engine (:class:`fastrwa.serve.batcher.Engine`) steps: :class:`PackedRows`,
    :class:`StepRows` (or the tests' scripted rows). ``tokens[i]`` is row ``i``'s next input;
    ``device``, where the draws are made (its streams' generators are made there), is
    optional (CPU)."""

    capacity: int
    kind: str
    tokens: np.ndarray

    def prefill(self, context: Tensor) -> None: ...
    def draw_staged(self, sampling: Sampling) -> int: ...
    def place(self, row: int) -> None: ...
    def move(self, src: int, dst: int) -> None: ...
    def step(self, n: int) -> None: ...
    def draw(self, row: int, sampling: Sampling) -> int: ...


class _CacheRows:
    """What both kinds of rows do on their caches: ``cache`` (``capacity`` rows), ``staging``
    (one row, where a prompt is prefilled), ``tokens`` and their ``_staged`` logits."""

    def draw_staged(self, sampling: Sampling) -> int:
        """The first id of the stream just prefilled, drawn from its prompt's logits."""
        return self._draw(self._staged, sampling)

    def place(self, row: int) -> None:
        """Copy the staging cache's state into ``row``."""
        for buf, one in zip(self.cache.stacked, self.staging.stacked):
            buf[:, row].copy_(one[:, 0])

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s state (and next input) into row ``dst``."""
        for buf in self.cache.stacked:
            buf[:, dst].copy_(buf[:, src])
        self.tokens[dst] = self.tokens[src]


class PackedRows(_CacheRows):
    """Rows of a :class:`PackedLM`'s cache stepped by the fused CPU kernel (module doc)."""

    kind = "fused CPU decode (PackedLM)"
    device = torch.device("cpu")

    def __init__(self, packed: PackedLM, capacity: int):
        self.packed, self.capacity = packed, capacity
        self.V = packed.shapes.V
        self.forbidden = packed.model.config.bos_token
        self.cache = packed.allocate_cache(capacity)
        self.staging = packed.allocate_cache(1)          # each prompt's prefill, at batch 1
        _, _, _, self._bound = packed._buffers(self.cache)
        self._bounds: dict[int, decode_host.Bound] = {}
        self.logits = self._bound.logits                  # flat (N, V): rows [0, n) written
        self.tokens = np.zeros(capacity, dtype=np.int64)  # each row's next input
        self._out = np.empty(1, dtype=np.int64)
        self._scratch = np.empty(self.V, dtype=np.float32)
        self._staged: Optional[np.ndarray] = None

    def prefill(self, context: Tensor) -> None:
        """Run ``context`` ``(1, P)`` into the staging cache (as ``generate`` at batch 1)."""
        logits = self.packed.prefill(context, self.staging)
        self._staged = flat(logits)

    def step(self, n: int) -> None:
        """Advance rows ``[0, n)`` by their ``tokens`` (one kernel call over those rows)."""
        bound = self._bounds.get(n)
        if bound is None:       # (the cache's arguments, with the rows of the call cut to n)
            bound = self._bounds[n] = dataclasses.replace(self._bound, batch=n,
                                                          choice=decode_host.Choice())
        bad = decode_host.run(bound, self.tokens[:n])
        if bad >= 0:            # (drawn ids are in [0, forbidden): never)
            raise RuntimeError(f"row {bad}: an id outside the vocabulary was drawn")

    def draw(self, row: int, sampling: Sampling) -> int:
        """Row ``row``'s next id, from the logits of the last step."""
        V = self.V
        return self._draw(self.logits[row * V:(row + 1) * V], sampling)

    def _draw(self, logits: np.ndarray, s: Sampling) -> int:
        uniform = torch.rand(1, generator=s.generator, dtype=torch.float64)
        if decode_host.draw(logits, 1, self.V, s.temperature, s.top_k, s.top_p,
                            uniform.numpy(), self.forbidden, self._out, self._scratch) >= 0:
            refuse_logits(torch.from_numpy(logits).view(1, self.V), self.forbidden)
        return int(self._out[0])


class StepRows(_CacheRows):
    """Rows stepped by a decoder's ``step_`` over the whole cache (module doc)."""

    def __init__(self, model: ByteLM, decoder: object, capacity: int):
        """``decoder``: ``model.decoder(weights)`` other than a :class:`PackedLM` (``model``
        itself, the eager step, or a CUDA graph of it)."""
        self.model, self.decoder, self.capacity = model, decoder, capacity
        self.kind = ("CUDA graph" if type(decoder).__name__ == "CUDAGraphDecoder"
                     else "eager ByteLM.step_")
        self.forbidden = model.config.bos_token
        self.cache = model.allocate_cache(capacity)
        self.staging = model.allocate_cache(1)
        self.device = model.embed.weight.device
        self.tokens = np.zeros(capacity, dtype=np.int64)
        self._staged: Optional[Tensor] = None
        self._logits: Optional[Tensor] = None
        self._token = torch.zeros(capacity, dtype=torch.int64, device=self.device)

    def prefill(self, context: Tensor) -> None:
        """Run ``context`` ``(1, P)`` (on any device) into the staging cache at batch 1, as
        ``generate`` does; its last logits are kept for :meth:`draw_staged`."""
        self._staged = self.decoder.prefill(context.to(self.device), self.staging).clone()

    def step(self, n: int) -> None:
        """Advance every row by its ``tokens`` (all ``capacity`` rows: a CUDA graph has a
        fixed batch; only rows ``[0, n)`` are drawn from)."""
        self._token.copy_(torch.from_numpy(self.tokens))
        self._logits = self.decoder.step_(self._token, self.cache)

    def draw(self, row: int, sampling: Sampling) -> int:
        """Row ``row``'s next id, from the logits of the last step."""
        return self._draw(self._logits[row:row + 1], sampling)

    def _draw(self, logits: Tensor, s: Sampling) -> int:
        # (on the logits' device, with the stream's generator made there: generate's draw)
        return int(sample(logits, s.temperature, s.top_k, s.top_p, s.generator,
                          self.forbidden)[0])


def make_rows(model: ByteLM, weights: object, capacity: int) -> Union[PackedRows, StepRows]:
    """The rows for ``model`` with ``weights`` as ``ByteLM.generate`` takes it:
    :class:`PackedRows` for a fused decoder (a :class:`PackedLM`), else :class:`StepRows`."""
    decoder = model.decoder(weights)
    if isinstance(decoder, PackedLM):
        return PackedRows(decoder, capacity)
    return StepRows(model, decoder, capacity)
