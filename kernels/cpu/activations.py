"""float32 activations of the fused decode step (``decode.py``), written so that a loop over a
row vectorises: ``tanh``, ``sigmoid`` and the exact (erf) GELU, from :func:`fmath.fexp` and
polynomials, branch-free (both sides computed, one selected). NaN in gives NaN out.

Accuracy against float64 (tests/backends/numba/test_decode.py): tanh and sigmoid within 4
ulp (results below float32's smallest normal number may be 0); GELU within ``3e-7 |x|``
(the erf below has an absolute error under 1.5e-7: Abramowitz & Stegun 7.1.26).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..codes import OUT_IDENTITY, OUT_RELU, OUT_SIGMOID, OUT_TANH
from . import OPTIONS, kernel
from .fmath import F32, fexp

_ZERO, _HALF, _ONE, _TWO = F32(0.0), F32(0.5), F32(1.0), F32(2.0)
# tanh(x) = x + x^3 P(x^2) for |x| < 0.625 (Cephes tanhf), 1 - 2 / (exp(2|x|) + 1) above
_TANH_SMALL = F32(0.625)
_TANH_P = tuple(F32(c) for c in (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2,
                                 1.33314422036e-1, -3.33332819422e-1))
# erf(x) = 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-x^2), t = 1 / (1 + p x), x >= 0
_ERF_P = F32(0.3275911)
_ERF_A = tuple(F32(c) for c in (0.254829592, -0.284496736, 1.421413741, -1.453152027,
                                1.061405429))
_INV_SQRT2 = F32(0.7071067811865476)

# inlined into the loops that call them (in numba IR), so that LLVM vectorises those loops
scalar = njit(inline="always", **OPTIONS)


@scalar
def ftanh(x):
    """tanh of a float32."""
    ax = abs(x)
    z = x * x
    p0, p1, p2, p3, p4 = _TANH_P
    small = (((((p0 * z + p1) * z + p2) * z + p3) * z + p4) * z) * x + x
    big = _ONE - _TWO / (fexp(_TWO * ax) + _ONE)
    big = -big if x < _ZERO else big
    return small if ax < _TANH_SMALL else big      # (NaN: big, which is NaN)


@scalar
def fsigmoid(x):
    """1 / (1 + exp(-x)) of a float32 (0 below -88, 1 above 17)."""
    return _ONE / (_ONE + fexp(-x))


@scalar
def ferf(x):
    """erf of a float32, absolute error under 1.5e-7."""
    ax = abs(x)
    t = _ONE / (_ONE + _ERF_P * ax)
    a1, a2, a3, a4, a5 = _ERF_A
    poly = t * (a1 + t * (a2 + t * (a3 + t * (a4 + t * a5))))
    e = _ONE - poly * fexp(-ax * ax)
    return -e if x < _ZERO else e


@scalar
def fgelu(x):
    """The exact GELU ``x/2 (1 + erf(x / sqrt 2))`` (``torch.nn.GELU()``) of a float32."""
    return _HALF * x * (_ONE + ferf(x * _INV_SQRT2))


@kernel
def gelu_row(v, off, w):
    """``v[off:][:w] = gelu(v[off:][:w])`` in place."""
    o = np.uint64(off)
    for j in range(w):
        v[o + np.uint64(j)] = fgelu(v[o + np.uint64(j)])


@kernel
def output_row(code, src, s_off, dst, d_off, w):
    """``dst[d_off:][:w] = f(src[s_off:][:w])`` for output-function ``code`` (codes.py);
    ``dst`` may be ``src`` at the same offset."""
    si, di = np.uint64(s_off), np.uint64(d_off)
    if code == OUT_TANH:
        for j in range(w):
            dst[di + np.uint64(j)] = ftanh(src[si + np.uint64(j)])
    elif code == OUT_SIGMOID:
        for j in range(w):
            dst[di + np.uint64(j)] = fsigmoid(src[si + np.uint64(j)])
    elif code == OUT_RELU:
        for j in range(w):
            x = src[si + np.uint64(j)]
            dst[di + np.uint64(j)] = _ZERO if x < _ZERO else x    # (NaN stays NaN)
    elif code == OUT_IDENTITY:
        for j in range(w):
            dst[di + np.uint64(j)] = src[si + np.uint64(j)]
