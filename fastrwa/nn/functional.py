"""Activation functions selectable by name for the layers and cells (``f_h``, ``f_o``)."""

from __future__ import annotations

from typing import Callable

import torch

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "identity": lambda x: x,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
}

# The published RDA variants (DESIGN.md §1): f_a, and the composition f_o(f_h(.)).
RDA_PRESETS = {
    "exp-tanh": dict(attention="exp", f_h="identity", f_o="tanh"),
    "sigmoid-id": dict(attention="sigmoid", f_h="identity", f_o="identity"),
}


def activation(name: str, argument: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"{argument} must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]
