"""CPU streaming step, in place: one token for every (batch, channel), no allocation.

The state ``(m, n~, d~)`` of ``B x D`` channels is updated where it lies and ``y`` written
into a caller's buffer, so a decode loop allocates nothing per token. All ``B * D`` channels
form one row of :func:`.scan_fwd.step_row`; the scratch rows come from the caller.
"""

from __future__ import annotations

from .jit import kernel
from ...vocab import EXP, NO_DISCOUNT
from .rows import log_decay_row, log_weight_row
from .scan_fwd import step_row


@kernel
def step_inplace(z, a, g, m, n, d, y, attention, discount, consts, scratch):
    """``z, a, g, y``: flat ``(B * D,)`` (``uint16`` holds bfloat16); ``m, n, d``: the state,
    flat, compute type, updated in place (``-inf`` in ``m`` for nothing seen, as stored).
    ``scratch``: ``(5, B * D)`` in the compute type (``l``, ``lam`` and three rows the step
    could save)."""
    floor, zero, ninf = consts[0], consts[1], consts[3]
    w = m.shape[0]
    tb, d1, take, keep = scratch[0:2].reshape(-1), scratch[2], scratch[3], scratch[4]
    for j in range(w):
        tb[w + j] = zero
        m[j] = floor if m[j] < floor else m[j]
    if discount != NO_DISCOUNT:
        log_decay_row(discount, g, 0, tb, w, w)
    if attention == EXP:
        step_row(m, n, d, tb, w, z, 0, a, 0, y, 0, d1, 0, take, 0, keep, 0, True, w, floor,
                 zero, consts[2])
    else:
        log_weight_row(attention, a, 0, tb, 0, w)
        step_row(m, n, d, tb, w, z, 0, tb, 0, y, 0, d1, 0, take, 0, keep, 0, True, w, floor,
                 zero, consts[2])
    for j in range(w):
        m[j] = ninf if m[j] <= floor else m[j]
