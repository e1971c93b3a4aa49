"""Argument checks shared by the ``torch.nn`` modules (sizes, step inputs, state tensors)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import FLOAT_DTYPES


def check_size(value: object, name: str) -> int:
    """A positive int (not a bool): a layer or cell width, a window length."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_step_input(x: object, width: int, param: Tensor, name: str = "x_t") -> Tensor:
    """``x`` ``(B, width)``, floating, on the module's device, in its parameters' dtype (or any
    floating dtype under autocast, which casts at the matrix products)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (B, {width}), "
                        f"got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name} must have shape (B, input_size = {width}), "
                         f"got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.device != param.device:
        raise ValueError(f"{name} must be on the module's device {param.device}, got {x.device}")
    if x.dtype != param.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{name} must have the module's dtype {param.dtype} (or run under "
                        f"torch.autocast), got {x.dtype}")
    return x


def check_state_tensor(x: object, name: str, shape: tuple, like: Tensor) -> Tensor:
    """One tensor of a module's state: ``shape``, on ``like``'s device."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on the input's device {like.device}, got {x.device}")
    return x
