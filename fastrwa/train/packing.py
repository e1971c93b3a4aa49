"""``--pack SEP``: a byte corpus read as documents that end with ``SEP``, packed back to back
into the batch's rows without padding; the model runs every document (and every piece of one
cut at a row's end) from the initial state, through ``cu_seqlens`` (docs/training.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from .data import bits_per_byte


def document_starts(data: Tensor, index: Tensor, separator: bytes) -> Tensor:
    """``index``'s positions in ``data`` (``uint8``) where a document starts: right after
    every occurrence of ``separator`` (overlapping ones too: with ``b"\\n\\n"``, three
    newlines end two documents, the second of one byte), and position 0. Bool, the shape of
    ``index``."""
    m = len(separator)
    sep = torch.tensor(list(separator), dtype=data.dtype, device=data.device)
    before = index[..., None] - m + torch.arange(m, device=index.device)  # (..., m)
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


def packed_slice(x: Tensor, target: Tensor, starts: Tensor, context_rank: int = 0,
                 context_world: int = 1) -> tuple[Tensor, Tensor, dict, int]:
    """A micro-batch of packed rows as the model reads it on this process: ``(tokens,
    targets, {"cu_seqlens": ...}, scored)``, the rows flattened into one sequence (1, B * L)
    (:func:`model_inputs`) and, with context parallelism, this rank's contiguous slice of it
    (``cu_seqlens`` stay the whole sequence's); ``scored``: the targets of the whole
    micro-batch that count (not -100)."""
    tokens, packed = model_inputs(x, starts)
    targets = target.reshape(1, -1)
    scored = int((targets >= 0).sum())
    if context_world > 1:
        tokens = torch.tensor_split(tokens, context_world, dim=1)[context_rank]
        targets = torch.tensor_split(targets, context_world, dim=1)[context_rank]
    return tokens, targets, packed, scored


def packed_loss(logits: Tensor, targets: Tensor, scored: int,
                context_world: int = 1) -> tuple[Tensor, float]:
    """``(loss, bpc)`` of this rank's slice: the summed next-byte cross-entropy over the
    micro-batch's ``scored`` targets, times ``context_world``, so that the average over
    the context group's ranks (as data parallelism averages gradients) is the micro-batch's
    mean; bpc from it likewise."""
    loss = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
        reduction="sum") * (context_world / max(scored, 1))
    return loss, bits_per_byte(float(loss.detach()))
