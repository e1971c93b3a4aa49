"""A chunked, stabilised log-space scan on PyTorch tensors (core of the "torch" backend).

One generic scan serves the forward and the backward: per channel it carries
``(m, values..., d)`` through

    m'  = max(m + lam_t, l_t)
    v'  = v exp(m + lam_t - m') + x_t exp(l_t - m')        for every value stream x
    d'  = d exp(m + lam_t - m') +     exp(l_t - m')        (only if ``with_sum``)

The time axis is cut into ``N`` chunks of ``C`` steps and run in three phases, each a
short Python loop over whole ``(B, N, D)`` slices (no Python iteration per time step):

1. every chunk summarises itself from an empty state (``C`` steps, all chunks at once),
2. the summaries are combined across chunks (``N`` steps on ``(B, D)``) into each chunk's
   incoming state (the associative combine of docs/math.md; the chunk's log discount is ``G``),
3. every chunk re-runs from its incoming state (``C`` steps, all chunks at once) and hands
   the state after each step to ``emit``, which writes whatever the caller needs.

Steps left over when ``C`` does not divide ``T`` run last, one at a time, on ``(B, 1, D)``.
Nothing is padded and no full-size intermediate is stored by the scan itself.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from einops import reduce

State = tuple  # (m, [values...], d or None), each (B, K, D)
Emit = Callable[[slice, torch.Tensor, list, "torch.Tensor | None"], None]


def safe_average(n: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``n / d``, and ``0`` where ``d = 0`` (nothing seen); finite under autograd too. A NaN
    in ``n`` or ``d`` stays NaN."""
    empty = d == 0
    return torch.where(empty, 0, n / torch.where(empty, 1, d))


def default_chunk_size(T: int) -> int:
    """``C ~ sqrt(T)`` balances the ``2C + N`` Python steps; short sequences use one chunk."""
    if T <= 64:
        return max(T, 1)
    return int(math.isqrt(T))


# exp(x) for x below these underflows to a subnormal (float32 / float64). PyTorch's CPU exp
# takes a slow path (4-30x) on such arguments and on -inf, which a stabilised scan produces
# constantly (far-below-max weights, masks, empty states), so `exp_nonpositive` flushes them.
_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}


def exp_nonpositive_(x: torch.Tensor) -> torch.Tensor:
    """In place: ``x <- exp(x)`` for ``x <= 0``, results below the smallest normal number flushed to 0.

    Exact 0 for ``x = -inf``. A flushed weight is below ``1e-38`` (float32) of the largest
    weight in its sum, so no result changes beyond rounding; the GPU flushes them as well.
    """
    floor = _EXP_FLOOR[x.dtype]
    underflow = x < floor
    return x.clamp_(min=floor).exp_().masked_fill_(underflow, 0)


def decayed_max(m: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``m + lam``, and ``-inf`` where ``lam = -inf``: forgetting wins over ``m = +inf``
    (the limit, not ``inf - inf``)."""
    return (m + lam).masked_fill_(torch.isneginf(lam), float("-inf"))


def combine_weights(decayed: torch.Tensor, m_b: torch.Tensor,
                    exp: Callable[[torch.Tensor], torch.Tensor] = exp_nonpositive_
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stabilised combine of a state whose decayed log-max is ``decayed`` with what
    follows it, of log-max ``m_b``: ``(m_new, keep, take)``, with ``m_new = max(decayed,
    m_b)`` and every value of the combined state ``keep * v + take * x`` (docs/math.md).
    ``exp`` maps the non-positive exponents in place or not: :func:`exp_nonpositive_` (the
    scan: no autograd) or ``torch.exp`` (context parallelism, with autograd). The one
    PyTorch copy of the combine's infinite limits."""
    m_new = torch.maximum(decayed, m_b)                  # (NaN in, NaN out)
    # Shift by m_new, or by the lowest finite float where m_new = -inf (nothing seen yet),
    # so that exp(-inf - shift) = 0 instead of exp(-inf + inf) = NaN. A +inf log-weight
    # equal to m_new = +inf gets exp(0) = 1 (the limit: it dominates), not exp(inf - inf).
    shift = torch.clamp(m_new, min=torch.finfo(m_new.dtype).min)
    keep = exp(torch.sub(decayed, shift).masked_fill_(torch.isposinf(decayed), 0))
    take = exp(torch.sub(m_b, shift).masked_fill_(torch.isposinf(m_b), 0))
    return m_new, keep, take


def _combine(state: State, decay, m_b, xs_b: Sequence[torch.Tensor], d_b) -> State:
    """``state`` decayed by ``decay`` then followed by a segment ``(m_b, xs_b, d_b)``.

    A single step is the segment ``(l_t, [x_t], 1)``; ``d_b=None`` means a weight sum of 1.
    Updates the state tensors in place and returns them.
    """
    m, vals, d = state
    decayed = m if decay is None else decayed_max(m, decay)
    m_new, keep, take = combine_weights(decayed, m_b)
    for v, x in zip(vals, xs_b):
        v.mul_(keep).addcmul_(x, take)
    if d is not None:
        d.mul_(keep)
        if d_b is None:
            d.add_(take)
        else:
            d.addcmul_(d_b, take)
    return m_new, vals, d


def _empty_state(like: torch.Tensor, shape, n_values: int, with_sum: bool) -> State:
    m = torch.full(shape, float("-inf"), dtype=like.dtype, device=like.device)
    vals = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(n_values)]
    d = torch.zeros(shape, dtype=like.dtype, device=like.device) if with_sum else None
    return m, vals, d


def _copy_state(state: State) -> State:
    m, vals, d = state
    return m.clone(), [v.clone() for v in vals], None if d is None else d.clone()


def _select(state: State, index) -> State:
    m, vals, d = state
    return m[index], [v[index] for v in vals], None if d is None else d[index]


def scan(
    l: torch.Tensor,
    lam: torch.Tensor | None,
    xs: Sequence[torch.Tensor],
    init: State | None,
    with_sum: bool,
    reverse: bool,
    emit: Emit,
    chunk_size: int | None = None,
) -> State:
    """Run the stabilised weighted scan; return the final state ``(m, values, d)`` as ``(B, D)``.

    Args:
        l: ``(B, T, D)`` log-weights in the compute dtype (``-inf`` = no weight).
        lam: ``(B, T, D)`` log-decays (compute dtype) or ``None`` for no decay. In forward
            order step ``t`` decays the state of step ``t-1``; with ``reverse`` it decays the
            state of step ``t+1``.
        xs: value streams, each ``(B, T, D)``, any float dtype.
        init: incoming state, each tensor ``(B, D)`` in the compute dtype, or ``None``.
        with_sum: also carry the weight sum ``d``.
        reverse: scan from ``t = T-1`` down to 0.
        emit: ``emit(sel, m, values, d)`` receives, in scan order, the state after the
            positions ``[:, sel]`` of any ``(B, T, D)`` tensor (state tensors ``(B, K, D)``).
            They are overwritten by the next step: consume them at once.
        chunk_size: steps per chunk (default :func:`default_chunk_size`).
    """
    B, T, D = l.shape
    if init is None:
        init = _empty_state(l, (B, D), len(xs), with_sum)
    if T == 0:
        return init
    C = min(chunk_size or default_chunk_size(T), T)
    N = T // C
    rem = T - N * C
    main_lo = rem if reverse else 0          # first position of the chunked part
    main_hi = main_lo + N * C

    def sel_main(j: int) -> slice:           # the j-th step (in scan order) of every chunk
        offset = C - 1 - j if reverse else j
        return slice(main_lo + offset, main_hi, C)

    def step(state: State, sel: slice) -> State:
        decay = None if lam is None else lam[:, sel]
        return _combine(state, decay, l[:, sel], [x[:, sel] for x in xs], None)

    # Phases 1-2: incoming state of every chunk, shape (B, N, D), and the state after them all.
    if N == 1:
        carry_in = _select(init, (slice(None), None))
        carry_in = _copy_state(carry_in)
        after_main = None
    else:
        summary = _empty_state(l, (B, N, D), len(xs), with_sum)
        for j in range(C):
            summary = step(summary, sel_main(j))
        G = None
        if lam is not None:
            G = reduce(lam[:, main_lo:main_hi], "b (n c) d -> b n d", "sum", c=C)  # [B, N, D]
        carry_in = _empty_state(l, (B, N, D), len(xs), with_sum)
        cur = _copy_state(init)
        chunk_order = range(N - 1, -1, -1) if reverse else range(N)
        for k in chunk_order:
            for dst, src in zip(_flatten(carry_in), _flatten(cur)):
                dst[:, k].copy_(src)
            s_m, s_vals, s_d = _select(summary, (slice(None), k))
            cur = _combine(cur, None if G is None else G[:, k], s_m, s_vals, s_d)
        after_main = cur

    # Phase 3: every chunk from its incoming state, emitting the state after each step.
    state = carry_in
    for j in range(C):
        state = step(state, sel_main(j))
        emit(sel_main(j), *state)
    last_chunk = 0 if reverse else N - 1
    if after_main is None:
        after_main = _copy_state(_select(state, (slice(None), last_chunk)))

    if rem == 0:
        return after_main
    # Left-over steps (at the end, or at the start when reversed), one at a time.
    state = _select(after_main, (slice(None), None))
    positions = range(rem - 1, -1, -1) if reverse else range(N * C, T)
    for p in positions:
        sel = slice(p, p + 1)
        state = step(state, sel)
        emit(sel, *state)
    return _select(state, (slice(None), 0))


def _flatten(state: State) -> list:
    m, vals, d = state
    return [m, *vals] + ([] if d is None else [d])
