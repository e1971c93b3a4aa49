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


def check_groups(groups: object, name: str, width: int | None, width_name: str) -> None:
    """``None``, or a positive int (not a bool) that divides ``width`` (if given) into
    groups of channels, each sharing one discount."""
    if groups is None:
        return
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{name} must be None or a positive int, got {groups!r}")
    if width is not None and width % groups:
        raise ValueError(f"{name} ({groups}) must divide {width_name} ({width}): each group "
                         f"shares one discount")


def check_count(value: object, name: str) -> int:
    """An int >= 0 (not a bool): a batch size, which may be empty."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value}")
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
    check_input_dtype(x, name, param, "module")
    return x


def check_input_dtype(x: Tensor, name: str, param: Tensor, owner: str,
                      autocast: bool = True) -> None:
    """``x`` floating, on ``param``'s device and in its dtype; another floating dtype only
    under ``torch.autocast`` when ``autocast`` (it casts at the matrix products, float64
    excepted: autocast leaves it as it is). ``owner`` names what ``param`` belongs to in the
    message ("layer", "module")."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype (the {owner}'s is {param.dtype}), "
                        f"got {x.dtype}")
    if x.device != param.device:
        raise ValueError(f"{name} must be on the {owner}'s device {param.device}, "
                         f"got {x.device}")
    if x.dtype != param.dtype and not (autocast and torch.float64 not in (x.dtype, param.dtype)
                                       and torch.is_autocast_enabled(x.device.type)):
        hint = " (or run under torch.autocast)" if autocast else ""
        raise TypeError(f"{name} must have the {owner}'s dtype {param.dtype}{hint}, "
                        f"got {x.dtype}")


def check_buffer(x: object, name: str, shape: tuple, dtype: torch.dtype,
                 device: torch.device, layout: str = "") -> None:
    """A tensor an in-place step reads or writes: exactly ``shape`` (no broadcasting),
    ``dtype`` and ``device``. ``layout`` names the dimensions, e.g. "(B, hidden_size) = "."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}{shape}, dtype {dtype}, "
                        f"got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {layout}{shape}, got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")


def check_state_tensor(x: object, name: str, shape: tuple, like: Tensor,
                       dtypes: tuple = ()) -> Tensor:
    """One tensor of a module's state: ``shape``, on ``like``'s device, of one of ``dtypes``
    (any dtype when empty)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtypes and x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(sorted(map(str, set(dtypes))))}, "
                        f"got {x.dtype}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on the input's device {like.device}, got {x.device}")
    return x


def check_mask(mask: object, x: Tensor, batch_first: bool, name: str = "mask") -> None:
    """A bool tensor of ``x``'s first two sizes (``(B, T)``, or ``(T, B)`` time-first) on its
    device: ``True`` at the tokens a layer reads, ``False`` at those it skips."""
    layout = "(B, T)" if batch_first else "(T, B)"
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor {layout}, got "
                        f"{type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True at the tokens to read), got "
                        f"dtype {mask.dtype}")
    if tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{name} must have shape {layout} = {tuple(x.shape[:2])} (x's), got "
                         f"{tuple(mask.shape)}")
    if mask.device != x.device:
        raise ValueError(f"{name} must be on x's device ({x.device}), got {mask.device}")
