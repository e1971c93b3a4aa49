"""``--pack SEP``: a byte corpus read as documents that end with ``SEP``, packed back to back
into the batch's rows without padding; the model runs every document (and every piece of one
cut at a row's end) from the initial state, through ``cu_seqlens`` (docs/training.md)."""

from __future__ import annotations

import torch
from torch import Tensor


def document_starts(data: Tensor, index: Tensor, separator: bytes) -> Tensor:
    """``index``'s positions in ``data`` (``uint8``) where a document starts: right after
    every occurrence of ``separator`` (overlapping ones too: with ``b"\\n\\n"``, three
    newlines end two documents, the second of one byte), and position 0. Bool, the shape of
    ``index``."""
    m = len(separator)
    sep = torch.tensor(list(separator), dtype=data.dtype)
    before = index[..., None] - m + torch.arange(m)                     # (..., m)
    inside = before[..., 0] >= 0
    ends = (data[before.clamp(min=0)] == sep).all(-1) & inside
    return ends | (index == 0)


def model_inputs(x: Tensor, starts: Tensor | None) -> tuple[Tensor, dict]:
    """What the model reads for rows ``x`` ``(B, L)``: ``x`` itself, or with document
    ``starts`` ``(B, L)`` (bool) the rows as one packed sequence ``(1, B * L)`` and its
    ``cu_seqlens`` (every row starts a piece too: a document is cut at a row's end)."""
    if starts is None:
        return x, {}
    flat = starts.clone()
    flat[:, 0] = True
    flat = flat.reshape(-1)
    total = torch.tensor([flat.numel()], device=flat.device)
    cu_seqlens = torch.cat([flat.nonzero()[:, 0], total])
    return x.reshape(1, -1), {"cu_seqlens": cu_seqlens}
