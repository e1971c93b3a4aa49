"""Output allocation for the backends, with NaN poisoning for tests.

Backends allocate with :func:`empty` (never ``torch.zeros``) for buffers they fully write.
Tests switch on :func:`set_poison` (through :func:`fastrwa.testing.poison_buffers`), so an
entry a backend forgets to write shows up as NaN.
"""

from __future__ import annotations

import torch

_POISON = False


def set_poison(enabled: bool) -> None:
    """Fill every fresh buffer with NaN (tests only)."""
    global _POISON
    _POISON = bool(enabled)


def poisoned() -> bool:
    """Whether fresh buffers are filled with NaN."""
    return _POISON


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        out.fill_(float("nan"))
    return out


def empty_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(x.shape, dtype or x.dtype, x.device)
