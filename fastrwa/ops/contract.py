"""What a backend of the weighted scan takes and returns: the contract between the registry
(:mod:`fastrwa.ops.dispatch`), the custom ops (:mod:`fastrwa.ops.autograd`) and the backends'
host code (``numba_host``, ``torch_host``, ``triton_host``), which all import it; it imports
none of them.

Shapes: ``B`` batch, ``T`` time, ``D`` channels, ``N`` sequences (``B``, or
``len(cu_seqlens) - 1`` for packed sequences, which come as ``B = 1``). "state dtype" is
:func:`state_dtype` of the inputs' dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch
from torch import Tensor

State = tuple  # (m, n, d): three (N, D) tensors in the state dtype


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a ``ScanState`` and of every backend's arithmetic for inputs of
    ``dtype``: ``torch.float64`` for float64 inputs, else ``torch.float32``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ScanArgs(NamedTuple):
    """One call of the weighted scan, as every backend receives it (already validated).

    Attributes:
        z: ``(B, T, D)`` values, float16/bfloat16/float32/float64. May be strided (a gate
            slice of a projection); a backend copies what its kernels cannot read.
        a: ``(B, T, D)`` attention logits, ``z``'s dtype and device.
        g: ``(B, T, D)`` discount input, or ``None`` (then ``discount`` is ``None``).
        attention: a name in :data:`fastrwa.kernels.codes.ATTENTIONS`.
        discount: a name in :data:`fastrwa.kernels.codes.DISCOUNTS`.
        initial_state: ``(m, n, d)``, each ``(N, D)`` in the state dtype, or ``None``.
        reverse: scan from the last step to the first.
        cu_seqlens: ``(N + 1,)`` int32/int64 offsets of packed sequences, or ``None``.
    """

    z: Tensor
    a: Tensor
    g: Optional[Tensor]
    attention: str
    discount: Optional[str]
    initial_state: Optional[State]
    reverse: bool
    cu_seqlens: Optional[Tensor]

    @property
    def n_sequences(self) -> int:
        return self.z.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1


class ForwardResult(NamedTuple):
    """``y``: ``(B, T, D)`` in the inputs' dtype. ``final_state``: ``(m, n, d)``, three
    separate ``(N, D)`` tensors in the state dtype (a custom op's outputs may not alias), or
    ``None`` when not asked for. ``saved``: what :meth:`Backend.backward` needs, ``[]``
    unless ``save``."""

    y: Tensor
    final_state: Optional[State]
    saved: list


class Gradients(NamedTuple):
    """Gradients of the loss with respect to ``z``, ``a``, ``g`` (``None`` without a
    discount) and the initial state (``(gm, gn, gd)``, or ``None`` without one), each in
    its input's dtype and shape. State gradients follow docs/math.md §4: ``gm = n gn + d gd``."""

    z: Tensor
    a: Tensor
    g: Optional[Tensor]
    initial_state: Optional[State]


class Backend(Protocol):
    """What a backend module provides: three functions and one optional one. Every function
    receives validated arguments."""

    def forward(self, args: ScanArgs, *, output_final_state: bool, save: bool) -> ForwardResult:
        """The scan. With ``save``, ``saved`` holds what :meth:`backward` needs."""

    def saved_like(self, args: ScanArgs) -> list:
        """Empty tensors of the shapes, dtypes and device that ``forward(args, save=True)``
        saves (``torch.compile`` traces with them; a packed call's sizes may be dynamic)."""

    def backward(self, args: ScanArgs, saved: list, m_final: Tensor, gy: Optional[Tensor],
                 g_final: Optional[tuple]) -> Gradients:
        """Gradients of the scan. ``saved``: this backend's ``forward(save=True)`` list, or
        anything else, e.g. ``[]`` (then the backward recomputes it). ``m_final``: ``(N, D)``
        final ``m``. ``gy``: ``(B, T, D)`` or ``None`` (zero). ``g_final``: ``(gn, gd)`` for
        the final state's ``n`` and ``d`` (either may be ``None``) or ``None``."""

    def step_(self, z: Tensor, a: Tensor, g: Optional[Tensor], attention: str,
              discount: Optional[str], state: State, out: Tensor) -> bool:
        """Optional: one streaming step without allocation. ``z, a, g``: ``(B, D)`` inputs of
        one step (``g`` may be ``None``), ``attention`` and ``discount`` as in
        :class:`ScanArgs`, ``state`` three ``(B, D)`` tensors updated in place, ``out`` a
        ``(B, D)`` tensor that receives ``y``. Returns ``False``, doing nothing, where it
        does not apply (the caller then runs :meth:`forward` on a length-1 scan and copies);
        a backend without it gets the same. It may keep what it binds to these tensors
        (views) for the next call."""


class Knobs:
    """A backend's launch options (not part of the contract): ``Knobs(Options)``; the backend
    exposes ``knobs.get`` as ``options`` and ``knobs.set`` as ``set_options`` (tests and
    benchmarks set them through :func:`fastrwa.testing.backend_options`). ``check(options)``
    may raise on values the backend cannot take (the previous options then stay in force)."""

    def __init__(self, options_type: type, check: Optional[Callable[[Any], None]] = None):
        self._value = options_type()
        self._check = check

    def get(self) -> Any:
        """The options in force."""
        return self._value

    def set(self, **changes: Any) -> Any:
        """Change the options; returns the previous ones."""
        previous = self._value
        value = dataclasses.replace(previous, **changes)
        if self._check is not None:
            self._check(value)
        self._value = value
        return previous
