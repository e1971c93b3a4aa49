"""Row operations of the CPU kernels: one loop over a channel block per call, vectorised.

A "row" is ``w`` consecutive channels of one time step. Every row argument is a flat array
and an offset (``x, x_off``): a row of a flattened ``(B, T, D)`` input or output (inputs are
widened on load, so ``uint16`` bfloat16 bits work too), or a row of a kernel's flat scratch
buffer. Passing offsets rather than views keeps the hot loops free of
array-view construction (numba reference-counts every view). Indices are unsigned, so numba
emits no wrap-around test and LLVM vectorises the loop.

Each function picks its formula once per row (``kind`` is a run-time integer, a code of
:mod:`fastrwa.kernels.codes`) and then runs a branch-free loop, so the four attention and two
discount functions cost one compiled kernel, not eight. The compute type is that of the
scratch buffer: float32 (float32 and bfloat16 inputs) or float64. Formulas are those of the
torch backend's ``transforms``, which documents them.
"""

from __future__ import annotations

import numpy as np
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from ..codes import (EXP, LOG_DISCOUNT as LOG, RELU, SIGMOID, SOFTPLUS,
                      SOFTPLUS_SERIES_BELOW as _SERIES_BELOW)
from .fmath import fexp, flog, load, log1p_small, log_sigmoid, store


def _consts(numba_type):
    ft = as_dtype(numba_type).type
    return ft(0.0), ft(1.0), ft(0.5), ft(_SERIES_BELOW), ft(5.0 / 24.0), ft(-np.inf), ft(3.0)


def softplus_log_finish(a, a_off, out, out_off, w):
    """The softplus log-weight's second loop: ``out`` holds ``exp(a)`` where ``a`` is below
    the series' switch point, else softplus(a); it ends holding ``log softplus(a)``."""
    raise NotImplementedError


@overload(softplus_log_finish)
def _softplus_log_finish(a, a_off, out, out_off, w):
    zero, _, half, below, c524, _, _ = _consts(out.dtype)

    def impl(a, a_off, out, out_off, w):
        ai, oi = np.uint64(a_off), np.uint64(out_off)
        for j in range(w):
            x = load(a, ai + np.uint64(j), zero)
            v = out[oi + np.uint64(j)]
            out[oi + np.uint64(j)] = x - half * v + c524 * v * v if x < below else flog(v)
    return impl


def log_weight_row(kind, a, a_off, out, out_off, w):
    """``out[out_off:][:w] = log f_a(a[a_off:][:w])`` for attention code ``kind``."""
    raise NotImplementedError


@overload(log_weight_row)
def _log_weight_row(kind, a, a_off, out, out_off, w):
    zero, one, half, below, c524, ninf, _ = _consts(out.dtype)

    def impl(kind, a, a_off, out, out_off, w):
        ai, oi = np.uint64(a_off), np.uint64(out_off)
        if kind == EXP:
            for j in range(w):
                out[oi + np.uint64(j)] = load(a, ai + np.uint64(j), zero)
        elif kind == SIGMOID:
            for j in range(w):
                out[oi + np.uint64(j)] = log_sigmoid(load(a, ai + np.uint64(j), zero))
        elif kind == SOFTPLUS:
            # Two passes, one polynomial call each (a loop calling two does not vectorise).
            # e = exp(-|x|) serves both branches: below the switch point it is exp(x).
            for j in range(w):      # the log's argument, or e where the series is used
                x = load(a, ai + np.uint64(j), zero)
                e = fexp(-abs(x))
                out[oi + np.uint64(j)] = e if x < below else max(x, zero) + log1p_small(e)
            softplus_log_finish(a, a_off, out, out_off, w)
        else:
            for j in range(w):
                x = load(a, ai + np.uint64(j), zero)
                out[oi + np.uint64(j)] = ninf if x <= zero else flog(x)     # (NaN: NaN)
    return impl


def log_weight_grad_rows(kind, a, a_off, out, out_off, dl, dl_off, w):
    """:func:`log_weight_row` (the same values, bit for bit) and, for the sigmoid and softplus
    attentions, ``dl[dl_off:][:w] = dl/da`` from the same ``exp(-|a|)``: the backward keeps it
    so that its chain rule needs no second ``exp`` (exp and relu need no stored derivative)."""
    raise NotImplementedError


@overload(log_weight_grad_rows)
def _log_weight_grad_rows(kind, a, a_off, out, out_off, dl, dl_off, w):
    zero, one, half, below, c524, _, three = _consts(out.dtype)

    def impl(kind, a, a_off, out, out_off, dl, dl_off, w):
        ai, oi, di = np.uint64(a_off), np.uint64(out_off), np.uint64(dl_off)
        if kind == SIGMOID:
            for j in range(w):
                u = np.uint64(j)
                x = load(a, ai + u, zero)
                e = fexp(-abs(x))
                out[oi + u] = min(x, zero) - log1p_small(e)            # = log_sigmoid(x)
                dl[di + u] = (e if x > zero else one) / (one + e)      # = sigmoid(-x)
        elif kind == SOFTPLUS:      # as log_weight_row, and d log softplus(x) / dx
            for j in range(w):
                u = np.uint64(j)
                x = load(a, ai + u, zero)
                e = fexp(-abs(x))
                v = max(x, zero) + log1p_small(e)
                out[oi + u] = e if x < below else v
                series = one / ((one + e) * (one - half * e + e * e / three))
                dl[di + u] = series if x < below else (one if x >= zero else e) / (one + e) / v
            softplus_log_finish(a, a_off, out, out_off, w)
        else:
            log_weight_row(kind, a, a_off, out, out_off, w)
    return impl


def attention_grad_row(kind, gl, dl, take, tiny, a, a_base, a_st, out, base, st, times, steps,
                       w):
    """For ``steps`` rows ``q``: ``out[base + times[q] * st:][:w] = gl * dl/da`` for
    attention code ``kind``, stored in ``out``'s type, with ``gl`` read at ``q * w`` and ``a``
    at ``a_base + times[q] * a_st`` (the rows of one chunk's adjoint, ``scan_bwd.py``);
    ``dl/da`` is read from ``dl[q * w:]`` (:func:`log_weight_grad_rows`) for the sigmoid
    and softplus attentions, and is 1 for exp. For relu it is ``1 / a`` (0 where ``a <=
    0``), except where the step's weight ``take`` (read at ``q * w``) is below ``tiny``:
    there the adjoint formed ``gl`` with ``exp(-m)`` in place of ``take``
    (``scan_bwd.relu_grad_factor_row``), which is ``ga`` already."""
    raise NotImplementedError


@overload(attention_grad_row)
def _attention_grad_row(kind, gl, dl, take, tiny, a, a_base, a_st, out, base, st, times, steps,
                        w):
    zero = _consts(gl.dtype)[0]

    def impl(kind, gl, dl, take, tiny, a, a_base, a_st, out, base, st, times, steps, w):
        for q in range(steps):
            gi, oi = np.uint64(q * w), np.uint64(base + times[q] * st)
            ai = np.uint64(a_base + times[q] * a_st)
            if kind == EXP:
                for j in range(w):
                    store(out, oi + np.uint64(j), gl[gi + np.uint64(j)])
            elif kind == RELU:
                for j in range(w):
                    u = np.uint64(j)
                    x = load(a, ai + u, zero)
                    ga = gl[gi + u] if take[gi + u] < tiny else gl[gi + u] / x
                    store(out, oi + u, zero if x <= zero else ga)
            else:
                for j in range(w):
                    u = np.uint64(j)
                    store(out, oi + u, gl[gi + u] * dl[gi + u])
    return impl


def log_decay_row(kind, g, g_off, out, out_off, w):
    """``out[out_off:][:w] = log gamma`` for discount ``kind`` (LOG: ``g``; SIGMOID: logsigmoid)."""
    raise NotImplementedError


@overload(log_decay_row)
def _log_decay_row(kind, g, g_off, out, out_off, w):
    zero = _consts(out.dtype)[0]

    def impl(kind, g, g_off, out, out_off, w):
        gi, oi = np.uint64(g_off), np.uint64(out_off)
        if kind == LOG:
            for j in range(w):
                out[oi + np.uint64(j)] = load(g, gi + np.uint64(j), zero)
        else:
            for j in range(w):
                out[oi + np.uint64(j)] = log_sigmoid(load(g, gi + np.uint64(j), zero))
    return impl


def log_decay_grad_rows(kind, g, g_off, out, out_off, dlam, dlam_off, w):
    """:func:`log_decay_row` (bit for bit) and, for the sigmoid discount,
    ``dlam[dlam_off:][:w] = sigmoid(-g)``, its derivative, from the same ``exp(-|g|)``."""
    raise NotImplementedError


@overload(log_decay_grad_rows)
def _log_decay_grad_rows(kind, g, g_off, out, out_off, dlam, dlam_off, w):
    def impl(kind, g, g_off, out, out_off, dlam, dlam_off, w):
        if kind == LOG:
            log_decay_row(kind, g, g_off, out, out_off, w)
        else:       # log sigmoid(g): the sigmoid attention's log-weight and its derivative
            log_weight_grad_rows(SIGMOID, g, g_off, out, out_off, dlam, dlam_off, w)
    return impl


def decay_grad_row(kind, glam, dlam, out, base, st, times, steps, w):
    """For ``steps`` rows ``q``: ``out[base + times[q] * st:][:w] = glam * dlam/dg`` for
    discount code ``kind``, in ``out``'s type, with ``glam`` read at ``q * w``; the sigmoid
    discount's derivative is read from ``dlam[q * w:]``."""
    raise NotImplementedError


@overload(decay_grad_row)
def _decay_grad_row(kind, glam, dlam, out, base, st, times, steps, w):
    def impl(kind, glam, dlam, out, base, st, times, steps, w):
        for q in range(steps):
            li, oi = np.uint64(q * w), np.uint64(base + times[q] * st)
            if kind == LOG:
                for j in range(w):
                    store(out, oi + np.uint64(j), glam[li + np.uint64(j)])
            else:
                for j in range(w):
                    u = np.uint64(j)
                    store(out, oi + u, glam[li + u] * dlam[li + u])
    return impl
