"""Positions of the kept tokens of a ``mask`` (``True``: read, ``False``: skipped)."""

from __future__ import annotations

import torch
from torch import Tensor


def last_kept(mask: Tensor) -> Tensor:
    """``(B, T)``: the position of the last ``True`` of ``mask`` ``(B, T)`` at or before each
    ``t`` (``-1`` where there is none).

    Example:
        >>> import torch
        >>> from fastrwa.nn.masks import last_kept
        >>> last_kept(torch.tensor([[False, True, False, True]])).tolist()
        [[-1, 1, 1, 3]]
    """
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, -1).cummax(dim=1).values


def last_kept_before(mask: Tensor) -> Tensor:
    """``(B, T)``: ``1 +`` the position of the last ``True`` of ``mask`` before each ``t``
    (``0`` where there is none): indices into ``[previous, x_0, x_1, ...]``."""
    return torch.cat([mask.new_zeros((mask.shape[0], 1), dtype=torch.long),
                      last_kept(mask)[:, :-1] + 1], dim=1)
