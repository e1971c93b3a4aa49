"""The backend contract: what every backend of the weighted scan takes and returns.

A backend is a module (``fastrwa/ops/backends/<name>/host.py``) that satisfies
:class:`Backend`; it is registered by a :class:`BackendEntry` in its package's
``__init__.py`` and listed once in :mod:`fastrwa.ops.registry`. The custom op
(:mod:`fastrwa.ops.autograd`) is the only caller. docs/architecture.md has the checklist for
adding a backend.

Shapes: ``B`` batch, ``T`` time, ``D`` channels, ``N`` sequences (``B``, or
``len(cu_seqlens) - 1`` for packed sequences, which come as ``B = 1``). "state dtype" is
:func:`fastrwa.ops.vocab.state_dtype` of the inputs' dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch
from torch import Tensor

State = tuple  # (m, n, d): three (N, D) tensors in the state dtype


class ScanArgs(NamedTuple):
    """One call of the weighted scan, as every backend receives it (already validated).

    Attributes:
        z: ``(B, T, D)`` values, float16/bfloat16/float32/float64. May be strided (a gate
            slice of a projection); a backend copies what its kernels cannot read.
        a: ``(B, T, D)`` attention logits, ``z``'s dtype and device.
        g: ``(B, T, D)`` discount input, or ``None`` (then ``discount`` is ``None``).
        attention: a name in :data:`fastrwa.ops.vocab.ATTENTIONS`.
        discount: a name in :data:`fastrwa.ops.vocab.DISCOUNTS`.
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
    """What a backend module provides. Every function receives validated arguments."""

    Options: type   # a frozen dataclass of the backend's knobs (block sizes, chunk length)

    def options(self) -> Any:
        """The :attr:`Options` in force."""

    def set_options(self, **changes: Any) -> Any:
        """Change knobs (tests and benchmarks); returns the previous options. Unknown names
        or values raise ``TypeError``/``ValueError``."""

    def forward(self, args: ScanArgs, *, output_final_state: bool, save: bool) -> ForwardResult:
        """The scan. With ``save``, ``saved`` holds what :meth:`backward` needs."""

    def saved_like(self, args: ScanArgs) -> list:
        """Empty tensors of the shapes, dtypes and device that ``forward(args, save=True)``
        saves (``torch.compile`` traces with them; a packed call's sizes may be dynamic)."""

    def backward(self, args: ScanArgs, saved: list, m_final: Tensor, gy: Optional[Tensor],
                 g_final: Optional[tuple]) -> Gradients:
        """Gradients of the scan. ``saved``: this backend's ``forward(save=True)`` list, or
        ``[]`` (then the backward recomputes it). ``m_final``: ``(N, D)`` final ``m``.
        ``gy``: ``(B, T, D)`` or ``None`` (zero). ``g_final``: ``(gn, gd)`` for the final
        state's ``n`` and ``d`` (either may be ``None``) or ``None``."""

    def step_(self, args: ScanArgs, state: State, out: Tensor) -> bool:
        """Optional fast path of one streaming step without allocation: ``args`` holds
        ``(B, 1, D)`` inputs, ``state`` three ``(B, D)`` tensors updated in place, ``out`` a
        ``(B, D)`` tensor that receives ``y``. Returns ``False``, doing nothing, where it
        does not apply (the caller then runs :meth:`forward` and copies)."""

    def prepare_step_(self, args: ScanArgs, state: State, out: Tensor
                      ) -> Optional[Callable[[], None]]:
        """Optional: :meth:`step_` bound to these tensors, as a function of no arguments that
        runs one step on what they hold when it is called (their memory stays put), with
        the per-call work (dtype and layout tests, views) done once here. ``None`` where
        :meth:`step_` would decline (the caller then calls :meth:`step_` each time)."""


class Knobs:
    """A backend's options in force: ``Knobs(Options)``; a backend exposes ``knobs.get`` as
    ``options`` and ``knobs.set`` as ``set_options``. ``check(options)`` may raise on values
    the backend cannot take (the previous options then stay in force)."""

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


@dataclasses.dataclass(frozen=True)
class BackendEntry:
    """A backend as the registry knows it, before its (heavy) module is imported.

    Attributes:
        name: the name ``use_backend`` takes.
        refusal: ``refusal(device, dtype)`` is ``None`` where the backend can run, else the
            exception to raise when a user asks for it there (it names the backend, what it
            got and what to use instead).
        auto: ``auto(device, dtype)``: whether "auto" may pick it (it is tried in the
            registry's order; one that fails to import is skipped with a warning).
        load: imports and returns the :class:`Backend` module.
    """

    name: str
    refusal: Callable[[torch.device, torch.dtype], Optional[Exception]]
    auto: Callable[[torch.device, torch.dtype], bool]
    load: Callable[[], Backend]
