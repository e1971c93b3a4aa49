"""Input validation with messages that name the argument, what it is and what was expected."""

from __future__ import annotations

from typing import Sequence

import torch

from .kernels.codes import ATTENTIONS
from .ops.autograd import check_offsets
from .ops.contract import state_dtype
from .state import ScanState

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _describe(x: torch.Tensor) -> str:
    return f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"


def check_inputs(named: Sequence[tuple[str, object]], layout: str) -> torch.Tensor:
    """Check that the named tensors share rank ``len(layout)``, shape, dtype and device.

    ``layout`` is e.g. "BTD" or "BD". Returns the first tensor (the one the others match).
    """
    first_name, first = named[0]
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape ({', '.join(layout)}), "
                            f"got {type(x).__name__}")
        if x.dim() != len(layout):
            raise ValueError(f"{name} must have shape ({', '.join(layout)}) ({len(layout)} dims), "
                             f"got {_describe(x)}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a floating dtype in "
                            f"{[str(d) for d in FLOAT_DTYPES]}, got {x.dtype}")
    for name, x in named[1:]:
        if x.shape != first.shape:
            raise ValueError(f"{name} must have the same shape as {first_name} "
                             f"{tuple(first.shape)}, got {tuple(x.shape)}")
        if x.dtype != first.dtype:
            raise TypeError(f"{name} must have the same dtype as {first_name} ({first.dtype}), "
                            f"got {x.dtype}")
        if x.device != first.device:
            raise ValueError(f"{name} must be on the same device as {first_name} "
                             f"({first.device}), got {x.device}")
    return first


def check_state(state: object, name: str, like: torch.Tensor, batch: int, channels: int) -> ScanState | None:
    """Check a ``ScanState`` (or a 3-tuple of tensors) against inputs ``like`` of ``(B, ..., D)``."""
    if state is None:
        return None
    if not isinstance(state, (tuple, list)) or len(state) != 3:
        raise TypeError(f"{name} must be a fastrwa.ScanState (m, n, d) or None, "
                        f"got {type(state).__name__}")
    expected_dtype = state_dtype(like.dtype)
    for field, x in zip(ScanState._fields, state):
        where = f"{name}.{field}"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != (batch, channels):
            raise ValueError(f"{where} must have shape (B, D) = {(batch, channels)}, "
                             f"got {tuple(x.shape)}")
        if x.dtype != expected_dtype:
            raise TypeError(f"{where} must have dtype {expected_dtype} for {like.dtype} inputs, "
                            f"got {x.dtype}")
        if x.device != like.device:
            raise ValueError(f"{where} must be on the inputs' device {like.device}, got {x.device}")
    return ScanState(*state)


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """``(first byte, one past the last byte)`` that ``x`` may touch (``(0, 0)`` if empty).
    Live tensors whose spans are disjoint share no memory, whatever their storages."""
    if x.numel() == 0:
        return (0, 0)
    start = x.data_ptr()
    if x.is_contiguous():
        return (start, start + x.numel() * x.element_size())
    extent = sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1   # (strides >= 0)
    return (start, start + extent * x.element_size())


def overlaps_itself(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` may lie at one address (an ``expand``-ed tensor, a
    stride of 0 along a dimension of size > 1, or interleaved strides): conservative."""
    if x.is_contiguous():
        return False
    reach = 0                                    # furthest element offset the dims so far reach
    for stride, size in sorted((s, n) for n, s in zip(x.shape, x.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _element_bytes(x: torch.Tensor) -> torch.Tensor:
    """The first byte of every element of ``x`` (int64, sorted), for :func:`_share_bytes`."""
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(x.shape, x.stride()):
        offsets = offsets[..., None] + torch.arange(n, dtype=torch.int64) * stride
    return torch.sort(offsets.flatten() * x.element_size() + x.data_ptr()).values


def _share_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether an element of ``x`` and one of ``y`` share a byte, element by element (for
    spans that interleave, e.g. ``buf[:, ::2]`` and ``buf[:, 1::2]``, which share none)."""
    ex, ey = _element_bytes(x), _element_bytes(y)
    # the last element of y starting at or before each element of x's last byte
    i = torch.searchsorted(ey, ex + x.element_size() - 1, right=True) - 1
    hit = (i >= 0) & (ey[i.clamp_min(0)] + y.element_size() > ex)
    return bool(hit.any())


def check_no_overlap(written: Sequence[tuple[str, torch.Tensor]],
                     read: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise ``ValueError`` when a tensor that is written overlaps itself, or shares memory
    with another written tensor or with one that is read: the byte ranges they span, then,
    where two ranges intersect, their elements' bytes (interleaved views that share no
    element pass)."""
    for name, x in written:
        if overlaps_itself(x):
            raise ValueError(f"{name} overlaps itself (shape {tuple(x.shape)}, strides "
                             f"{x.stride()}: an expand()-ed tensor?); the in-place step writes "
                             f"it, so each of its elements needs its own memory (.clone() it)")
    tensors = [*written, *read]
    spans = [(name, _byte_span(x)) for name, x in tensors]
    for i, (name, (lo, hi)) in enumerate(spans[:len(written)]):
        for j, (other, (lo2, hi2)) in enumerate(spans[i + 1:], i + 1):
            if lo < hi2 and lo2 < hi and _share_bytes(tensors[i][1], tensors[j][1]):
                raise ValueError(f"{name} and {other} share memory; the in-place step writes "
                                 f"{name}, so it must be a separate tensor (e.g. .clone() it)")


def check_attention(attention: object) -> str:
    if not isinstance(attention, str) or attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    return attention


def check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_cu_seqlens(cu_seqlens: object, z: torch.Tensor, whole: bool = True) -> int:
    """Check packed-sequence offsets against ``z`` of shape ``(1, T, D)``; return the count
    ``N``. ``whole=False``: a context-parallel slice's global offsets, which end at the
    whole sequence's length (checked over the ranks), not at ``T``."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of sequence offsets, "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have shape (N + 1,) with N >= 1, "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must have dtype torch.int32 or torch.int64, "
                        f"got {cu_seqlens.dtype}")
    if cu_seqlens.device != z.device:
        raise ValueError(f"cu_seqlens must be on the inputs' device {z.device}, "
                         f"got {cu_seqlens.device}")
    if z.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the inputs must be packed into B = 1, "
                         f"got z of shape {tuple(z.shape)}")
    if not torch.compiler.is_compiling():   # (no data-dependent guard in a compiled graph:
        # the op checks them when it runs)
        check_offsets(cu_seqlens, z.shape[1] if whole else int(cu_seqlens[-1]))
    return cu_seqlens.shape[0] - 1


def check_context_group(group: object) -> None:
    """``group`` is a ``torch.distributed`` process group of an initialised default group
    (checked on each rank alone: without it no rank can tell the others anything)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_group needs torch.distributed initialised "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"context_group must be a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD or one from new_group), "
                        f"got {type(group).__name__}")
