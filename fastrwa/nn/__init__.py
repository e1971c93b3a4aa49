"""``torch.nn`` modules built on the scan.

* Scan layers (fast path, parallel over time): :class:`RWA`, :class:`RDA` and their
  :class:`LayerState`.
* Faithful cells (as published, sequential): :class:`RWACell`, :class:`RDACell`,
  :class:`RRACell`, run over a sequence by :class:`Recurrent`.
"""

from .cells import CellState, RDACell, Recurrent, RRACell, RRAState, RWACell
from .scan_layers import RDA, RWA, LayerState

__all__ = ["RWA", "RDA", "LayerState", "RWACell", "RDACell", "RRACell", "Recurrent",
           "CellState", "RRAState"]
