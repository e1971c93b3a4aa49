"""Row operations of the CPU kernels: one loop over a channel block per call, vectorised.

A "row" is ``w`` consecutive channels of one time step, ``src[off:off + w]`` of a flattened
``(B, T, D)`` array. Each function picks its formula once per row (``kind`` is a run-time
integer, the same codes as the Triton kernels) and then runs a branch-free loop, so the
formulas of the four attention and two discount functions cost one compiled kernel, not
eight. The compute type is that of the ``out``/``like`` buffer: float32 (float32, bfloat16
inputs) or float64. Formulas are those of ``fastrwa.transforms`` (which documents them).
"""

from __future__ import annotations

import numpy as np
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from .cpu_math import fexp, flog, flog1p, load, log_sigmoid, sigmoid_neg, store

EXP, SIGMOID, SOFTPLUS, RELU = 0, 1, 2, 3       # attention codes
NO_DISCOUNT, LOG, SIGMOID_DISCOUNT = 0, 1, 2    # discount codes
_SERIES_BELOW = -9.0   # softplus switches to its series below this logit (transforms.py)


def _consts(numba_type):
    ft = as_dtype(numba_type).type
    return ft(0.0), ft(1.0), ft(0.5), ft(_SERIES_BELOW), ft(5.0 / 24.0), ft(-np.inf), ft(3.0)


def load_row(src, off, out, w):
    """``out[:w] = src[off:off + w]`` widened to the compute type."""
    raise NotImplementedError


@overload(load_row)
def _load_row(src, off, out, w):
    zero = _consts(out.dtype)[0]

    def impl(src, off, out, w):
        base = np.uint64(off)           # unsigned indices: no wrap-around test, no view
        for j in range(w):
            out[j] = load(src, base + np.uint64(j), zero)
    return impl


def store_row(dst, off, row, w):
    """``dst[off:off + w] = row[:w]`` narrowed to ``dst``'s type."""
    raise NotImplementedError


@overload(store_row)
def _store_row(dst, off, row, w):
    def impl(dst, off, row, w):
        base = np.uint64(off)
        for j in range(w):
            store(dst, base + np.uint64(j), row[j])
    return impl


def log_weight_row(kind, a, out, w):
    """``out[:w] = log f_a(a[:w])`` for attention code ``kind``."""
    raise NotImplementedError


@overload(log_weight_row)
def _log_weight_row(kind, a, out, w):
    zero, one, half, below, c524, ninf, _ = _consts(out.dtype)

    def impl(kind, a, out, w):
        if kind == EXP:
            for j in range(w):
                out[j] = a[j]
        elif kind == SIGMOID:
            for j in range(w):
                x = a[j]
                out[j] = log_sigmoid(x)
        elif kind == SOFTPLUS:
            for j in range(w):
                x = a[j]
                u = fexp(min(x, below))
                series = x - half * u + c524 * u * u
                xc = max(x, below)
                direct = flog(max(xc, zero) + flog1p(fexp(-abs(xc))))
                out[j] = series if x < below else direct
        else:
            for j in range(w):
                x = a[j]
                out[j] = flog(x) if x > zero else ninf
    return impl


def attention_grad_row(kind, gl, a, out, w):
    """``out[:w] = gl * dl/da`` for attention code ``kind`` (``l = log f_a(a)``)."""
    raise NotImplementedError


@overload(attention_grad_row)
def _attention_grad_row(kind, gl, a, out, w):
    zero, one, half, below, _, _, three = _consts(out.dtype)

    def impl(kind, gl, a, out, w):
        if kind == EXP:
            for j in range(w):
                out[j] = gl[j]
        elif kind == SIGMOID:
            for j in range(w):
                out[j] = gl[j] * sigmoid_neg(a[j])
        elif kind == SOFTPLUS:
            for j in range(w):
                x = a[j]
                u = fexp(min(x, below))
                series = one / ((one + u) * (one - half * u + u * u / three))
                xc = max(x, below)
                e = fexp(-abs(xc))
                sig = (one if xc >= zero else e) / (one + e)
                direct = sig / (max(xc, zero) + flog1p(e))
                out[j] = gl[j] * (series if x < below else direct)
        else:
            for j in range(w):
                x = a[j]
                out[j] = gl[j] / x if x > zero else zero
    return impl


def log_decay_row(kind, g, out, w):
    """``out[:w] = log gamma`` for discount code ``kind`` (LOG: ``g``; SIGMOID: logsigmoid)."""
    raise NotImplementedError


@overload(log_decay_row)
def _log_decay_row(kind, g, out, w):
    def impl(kind, g, out, w):
        if kind == LOG:
            for j in range(w):
                out[j] = g[j]
        else:
            for j in range(w):
                x = g[j]
                out[j] = log_sigmoid(x)
    return impl


def decay_grad_row(kind, glam, g, out, w):
    """``out[:w] = glam * dlam/dg`` for discount code ``kind``."""
    raise NotImplementedError


@overload(decay_grad_row)
def _decay_grad_row(kind, glam, g, out, w):
    zero, one = _consts(out.dtype)[:2]

    def impl(kind, glam, g, out, w):
        if kind == LOG:
            for j in range(w):
                out[j] = glam[j]
        else:
            for j in range(w):
                out[j] = glam[j] * sigmoid_neg(g[j])
    return impl
