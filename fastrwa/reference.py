"""The sequential reference: the single source of truth for every fast path.

One token of the recurrence of docs/math.md §1-2 (:func:`weighted_step_reference`), and a
plain loop of it over time (:func:`weighted_scan_reference`). It is slow on purpose and meant
to be read in one sitting. It is differentiable by autograd (the ``torch.where`` guards keep
``-inf`` from turning into NaN, forward and backward), so tests can compare gradients too.
The step is written in operations both of ``torch.onnx``'s exporters translate (a comparison
with ``-inf``, not ``isneginf``): :mod:`fastrwa.export.steps` exports it as it is.

Shapes: ``z, log_w, log_decay`` are ``(B, T, D)``; the state is ``(m, n, d)``, each ``(B, D)``.
Arithmetic runs in float32, or float64 for float64 inputs; ``y`` comes back in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops.contract import state_dtype as _compute_dtype
from .state import ScanState

NEG_INF = float("-inf")


def reference_log_weight(a: torch.Tensor, attention: str) -> torch.Tensor:
    """``log f_a(a)`` for the four attention functions, in the plainest stable form."""
    if attention == "exp":
        return a
    if attention == "sigmoid":
        return F.logsigmoid(a)
    if attention == "softplus":
        # log(softplus(a)) ~= a once softplus underflows; the guard keeps autograd finite.
        small = a < -30
        return torch.where(small, a, torch.log(F.softplus(torch.where(small, 0, a))))
    if attention == "relu":
        positive = a > 0
        return torch.where(positive, torch.log(torch.where(positive, a, 1)),
                           torch.where(a <= 0, float("-inf"), a))     # (NaN stays NaN)
    raise ValueError(f"unknown attention {attention!r}")


def _weight(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``exp(x - m)`` for ``x <= m = max(...)``, with the limits spelled out: ``0`` for
    ``x = -inf`` (no weight; also when ``m = -inf``, nothing seen), ``1`` for ``x = m = +inf``
    (an infinite logit dominates, and equal infinite logits share the weight). NaN stays NaN.
    Only an infinite tie is replaced by its limit: a finite ``x == m`` keeps ``x - m`` in the
    graph, whose gradient (``1``, ``-1``) the gauge invariance needs where logits tie."""
    shift = torch.where(m == NEG_INF, 0, m)
    diff = torch.where((x == m) & torch.isinf(m), 0, x - shift)
    return torch.where(x == NEG_INF, 0, torch.exp(diff))


def _average(n: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``n / d``, and ``0`` where ``d = 0`` (nothing seen). NaN stays NaN."""
    empty = d == 0
    return torch.where(empty, 0, n / torch.where(empty, 1, d))


def weighted_step_reference(
    z_t: torch.Tensor,
    log_w_t: torch.Tensor,
    log_decay_t: torch.Tensor | None,
    state: ScanState,
) -> tuple[torch.Tensor, ScanState]:
    """One token of the weighted scan: ``(y_t, state')`` from this token's value ``z_t``,
    log-weight ``log_w_t`` and log-decay ``log_decay_t`` (``None``: no discount, RWA) and the
    state ``(m, n, d)`` before it, all ``(B, D)`` in one floating dtype, computed in it
    (:func:`weighted_scan_reference` converts first). ``m' = max(m + lam, l)``, ``n' = n
    exp(m + lam - m') + z exp(l - m')``, ``d'`` alike, ``y_t = n' / d'`` (0 for an empty
    state); ``lam = -inf`` forgets the past, even a max of ``+inf``.

    Example:
        >>> import torch
        >>> from fastrwa.state import ScanState
        >>> empty = ScanState.empty(2, 4, dtype=torch.float64)
        >>> y, state = weighted_step_reference(torch.ones(2, 4, dtype=torch.float64),
        ...                                    torch.zeros(2, 4, dtype=torch.float64), None, empty)
        >>> y[0, 0].item(), state.d[0, 0].item()
        (1.0, 1.0)
    """
    m, n, d = state
    decayed = m
    if log_decay_t is not None:
        decayed = torch.where(log_decay_t == NEG_INF, NEG_INF, m + log_decay_t)
    m = torch.maximum(decayed, log_w_t)                 # (NaN in, NaN out)
    keep = _weight(decayed, m)
    take = _weight(log_w_t, m)
    n = n * keep + z_t * take
    d = d * keep + take
    return _average(n, d), ScanState(m, n, d)


def weighted_scan_reference(
    z: torch.Tensor,
    log_w: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    initial_state: ScanState | None = None,
    reverse: bool = False,
) -> tuple[torch.Tensor, ScanState]:
    """``y_t = n_t / d_t`` with ``n_t = exp(lam_t) n_{t-1} + exp(l_t) z_t`` (and ``d`` alike):
    :func:`weighted_step_reference` token after token.

    Returns ``(y, final_state)``. With ``reverse=True`` the scan runs from the last step to
    the first (``y_t`` summarises steps ``t..T-1``).
    """
    cdt = _compute_dtype(z.dtype)
    B, T, D = z.shape
    if initial_state is None:
        initial_state = ScanState.empty(B, D, dtype=cdt, device=z.device)
    state = ScanState(*(s.to(cdt) for s in initial_state))
    ys = [None] * T
    order = range(T - 1, -1, -1) if reverse else range(T)
    for t in order:
        lam_t = None if log_decay is None else log_decay[:, t].to(cdt)
        ys[t], state = weighted_step_reference(z[:, t].to(cdt), log_w[:, t].to(cdt), lam_t,
                                               state)
    y = torch.stack(ys, dim=1) if T else z.new_zeros((B, 0, D), dtype=cdt)
    return y.to(z.dtype), state


def rwa_scan_reference(z, a, initial_state=None, reverse=False):
    """RWA: exp attention, no discount (see :func:`weighted_scan_reference`)."""
    return weighted_scan_reference(z, a, None, initial_state, reverse)


def rda_scan_reference(z, a, g, attention="exp", initial_state=None, reverse=False):
    """RDA: attention ``f_a`` and discount ``gamma = sigmoid(g)``."""
    cdt = _compute_dtype(z.dtype)
    log_w = reference_log_weight(a.to(cdt), attention)
    log_decay = F.logsigmoid(g.to(cdt))
    return weighted_scan_reference(z, log_w, log_decay, initial_state, reverse)
