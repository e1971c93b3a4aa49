"""Activation functions selectable by name for the layers and cells (``f_h``, ``f_o``)."""

from __future__ import annotations

from typing import Callable

import torch

from ..kernels.codes import OUTPUT_FUNCTIONS


def identity(x: torch.Tensor) -> torch.Tensor:
    """``f(x) = x`` (a named function, not a lambda: it pickles)."""
    return x


# (named in kernels/codes.py, whose codes the fused decode step branches on)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = dict(zip(
    OUTPUT_FUNCTIONS, (torch.tanh, identity, torch.sigmoid, torch.relu)))

# The same functions writing into ``out`` (``out`` may be ``x``): for allocation-free steps.
ACTIVATIONS_OUT: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "tanh": lambda x, out: torch.tanh(x, out=out),
    "identity": lambda x, out: out if out is x else out.copy_(x),
    "sigmoid": lambda x, out: torch.sigmoid(x, out=out),
    "relu": lambda x, out: torch.clamp(x, min=0, out=out),
}


class NamedActivations:
    """``_f_h`` and ``_f_o`` of a module from the names it keeps (``f_h_name``, ``f_o_name``,
    keys of :data:`ACTIVATIONS`): names, not functions, so the module holds only data and
    pickles whole."""

    @property
    def _f_h(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return ACTIVATIONS[self.f_h_name]

    @property
    def _f_o(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return ACTIVATIONS[self.f_o_name]


def rms_norm_into(x: torch.Tensor, norm: torch.nn.RMSNorm, out: torch.Tensor,
                  rstd: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """``out = norm(x)`` for a ``(B, D)`` ``x`` without allocating, with the numerics of
    ``torch.nn.RMSNorm``: for bfloat16/float16 ``x`` the statistics, the default ``eps``
    (float32's) and the product with the weight are float32, rounded once into ``out``.
    ``rstd`` ``(B, 1)`` and ``wide`` ``(B, D)`` are buffers in that precision (float32, or
    float64 for float64 ``x``); ``wide`` is only used when ``out`` is in a lower one."""
    eps = norm.eps if norm.eps is not None else torch.finfo(rstd.dtype).eps
    # (a dtype argument makes vector_norm copy its input, even to the dtype it has)
    wider = {} if x.dtype == rstd.dtype else dict(dtype=rstd.dtype)
    torch.linalg.vector_norm(x, dim=-1, keepdim=True, out=rstd, **wider)
    rstd.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    target = out if out.dtype == rstd.dtype else wide     # float32/float64: no rounding step
    torch.mul(x, rstd, out=target)
    if norm.weight is not None:
        target.mul_(norm.weight)
    return out if target is out else out.copy_(wide)


# The published RDA variants (docs/api.md, "fastrwa.nn.RDA"): f_a, and the composition f_o(f_h(.)).
RDA_PRESETS = {
    "exp-tanh": dict(attention="exp", f_h="identity", f_o="tanh"),
    "sigmoid-id": dict(attention="sigmoid", f_h="identity", f_o="identity"),
}


def activation(name: str, argument: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"{argument} must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def rda_functions(attention: str, f_h: str, f_o: str, preset: str | None):
    """Resolve an RDA configuration: a preset overrides ``attention, f_h, f_o``.

    Returns ``(attention, f_h, f_o)`` names, checked, and the ``f_h``, ``f_o`` callables.
    """
    from ..checks import check_attention  # (deferred: fastrwa.nn imports before fastrwa.checks)

    if preset is not None:
        if preset not in RDA_PRESETS:
            raise ValueError(f"preset must be one of {sorted(RDA_PRESETS)}, got {preset!r}")
        attention, f_h, f_o = (RDA_PRESETS[preset][k] for k in ("attention", "f_h", "f_o"))
    return check_attention(attention), f_h, f_o, activation(f_h, "f_h"), activation(f_o, "f_o")
