"""Attention and discount functions in log space, with their derivatives.

``log_weight(a, kind)`` gives ``l = log f_a(a)`` and ``log_decay(g, kind)`` gives
``lam = log gamma``; ``attention_grad`` and ``decay_grad`` apply ``dl/da`` and ``dlam/dg``. All are written
so that logits of +-1e4 give no inf/NaN (the softplus case uses a series where ``softplus``
underflows; the series below ``SOFTPLUS_SERIES_BELOW`` is derived in
:mod:`fastrwa.kernels.codes`). The reference keeps its own plain formulas.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.codes import ATTENTIONS, DISCOUNTS, SOFTPLUS_SERIES_BELOW as _SOFTPLUS_SERIES_BELOW


def log_weight(a: torch.Tensor, kind: str) -> torch.Tensor:
    """``log f_a(a)`` for ``kind`` in :data:`ATTENTIONS` ("exp" is the identity)."""
    if kind == "exp":
        return a
    if kind == "sigmoid":
        return F.logsigmoid(a)
    if kind == "softplus":
        u = torch.exp(torch.clamp(a, max=_SOFTPLUS_SERIES_BELOW))
        series = a - 0.5 * u + (5.0 / 24.0) * u * u
        direct = torch.log(F.softplus(torch.clamp(a, min=_SOFTPLUS_SERIES_BELOW)))
        return torch.where(a < _SOFTPLUS_SERIES_BELOW, series, direct)
    if kind == "relu":
        return torch.log(torch.relu(a))
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {kind!r}")


def attention_grad(x: torch.Tensor, take: torch.Tensor, m: torch.Tensor, a: torch.Tensor,
                   kind: str) -> torch.Tensor:
    """Chain rule ``ga = gl * dl/da`` for ``l = log_weight(a, kind)``, with the gradient of
    the log-weight given as ``gl = take * x`` (``take = exp(l - m)``, the step's weight
    against its state's running max ``m``).

    For "relu", ``gl`` carries a factor ``exp(l) = a``, so ``gl / a`` is formed by a division
    (finite even for denormal ``a``), and is 0 where ``a <= 0``. Where ``take`` underflowed
    (below the smallest normal number: :func:`.chunked.exp_nonpositive_` flushes it to 0)
    ``gl`` has lost ``x``, but ``take / a = exp(-m)``: ``ga = x exp(-m)`` there, which cannot
    overflow (``exp(-m) < tiny / a``).
    """
    gl = take * x
    if kind == "exp":
        return gl
    if kind == "sigmoid":
        return gl * torch.sigmoid(-a)
    if kind == "softplus":
        # dl/da = sigmoid(a) / softplus(a); for very negative a both underflow, so use the
        # series 1 / ((1 + u)(1 - u/2 + u^2/3)).
        u = torch.exp(torch.clamp(a, max=_SOFTPLUS_SERIES_BELOW))
        series = 1.0 / ((1.0 + u) * (1.0 - 0.5 * u + u * u / 3.0))
        a_hi = torch.clamp(a, min=_SOFTPLUS_SERIES_BELOW)
        direct = torch.sigmoid(a_hi) / F.softplus(a_hi)
        return gl * torch.where(a < _SOFTPLUS_SERIES_BELOW, series, direct)
    if kind == "relu":
        off = a <= 0                                    # (a NaN logit gives NaN)
        under = take < torch.finfo(take.dtype).tiny
        ga = torch.where(under, x * torch.exp(-m), gl / torch.where(off, 1, a))
        return torch.where(off, 0, ga)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {kind!r}")


def log_decay(g: torch.Tensor | None, kind: str | None) -> torch.Tensor | None:
    """``lam = log gamma``: ``None`` (no discount), ``g`` itself ("log"), or ``logsigmoid(g)``."""
    if kind is None:
        return None
    if kind == "log":
        return g
    if kind == "sigmoid":
        return F.logsigmoid(g)
    raise ValueError(f"discount must be one of {DISCOUNTS}, got {kind!r}")


def decay_grad(glam: torch.Tensor, g: torch.Tensor, kind: str) -> torch.Tensor:
    """Chain rule ``gg = glam * dlam/dg``."""
    if kind == "log":
        return glam
    if kind == "sigmoid":
        return glam * torch.sigmoid(-g)
    raise ValueError(f"discount must be one of {DISCOUNTS}, got {kind!r}")
