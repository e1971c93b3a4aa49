"""The input check every language model of :mod:`fastrwa.models` makes of its token ids."""

from __future__ import annotations

import torch
from torch import Tensor


def check_tokens(tokens: object, vocab_size: int, rank: int = 2, name: str = "tokens") -> Tensor:
    """``tokens`` as int64 after checking that it is a tensor of integer ids in
    ``[0, vocab_size)`` with ``rank`` dimensions (``(B, T)`` or ``(B,)``); else a
    ``TypeError``/``ValueError`` naming ``name``, its dtype, shape or values."""
    layout = "(B, T)" if rank == 2 else "(B,)"
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer ids {layout}, "
                        f"got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.dim() != rank:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(tokens.shape)}")
    if not torch.compiler.is_compiling() and tokens.numel():
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"{name} must be ids in [0, {vocab_size}), "
                             f"got values in [{low}, {high}]")
    return tokens.long()
