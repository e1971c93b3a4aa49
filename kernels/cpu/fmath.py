"""Scalar math for the CPU kernels, written so that LLVM vectorises the loops that call it.

numba's own ``math.exp``/``math.log`` call the C library one element at a time (llvmlite's
wheels carry no vector math library), which would make the CPU scan compute-bound. Here
``exp``/``log``/``log1p`` for float32 are Cephes-style polynomials with the exponent handled
by bit casts (an ``@intrinsic`` that emits an LLVM ``bitcast``), so a loop over a row of
channels becomes AVX2/AVX-512 code. float64 keeps the C library (it exists for exactness, not
speed). Accuracy of the float32 functions: within 2 ulp of the C library over their domain
(tests/backends/numba/test_numba.py checks it).

Every function is overloaded on the numba type: ``fexp(x)`` for a float32 ``x`` is the
polynomial, for a float64 ``x`` it is ``math.exp``. bfloat16 data travels as ``uint16`` and is
widened by :func:`load` and narrowed (round to nearest even) by :func:`store`.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype

F32 = np.float32
_LOG2E, _LN2_HI, _LN2_LO = F32(1.44269504088896341), F32(0.693359375), F32(-2.12194440e-4)
_EXP_P = tuple(F32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_LOG_P = tuple(F32(c) for c in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1,
                                -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
                                2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1))
# log1p(e) / e on [0, 1], a degree-8 Chebyshev fit: |error of e * Q(e)| < 1.6e-7 (absolute,
# relative near e = 0), i.e. a relative error of 1.6e-7 in a weight exp(l) or a discount.
_LOG1P_Q = tuple(F32(c) for c in (0.9999999403953552, -0.4999925494194031, 0.3331601023674011,
                                  -0.24825648963451385, 0.19055955111980438,
                                  -0.13583941757678986, 0.07754038274288177,
                                  -0.029210267588496208, 0.005186003632843494))
_SQRTHF = F32(0.707106781186547524)
_EXP_LO, _EXP_HI = F32(-87.33654), F32(88.37626)
_ZERO, _HALF, _ONE = F32(0.0), F32(0.5), F32(1.0)
_INF = F32(np.inf)


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bits of a float32 as a uint32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, x):
    """The float32 whose IEEE bits are the uint32 ``x``."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


# The intrinsic's name carries its pointer type: opaque "p0" from LLVM 15 on.
_PREFETCH = "llvm.prefetch.p0" if llvm_version_info >= (15,) else "llvm.prefetch.p0i8"


def _prefetch_intrinsic(write: int, locality: int = 3):
    @intrinsic
    def prefetch(typingctx, arr, idx):
        """Hint the cache to fetch ``arr[idx]`` (an LLVM ``prefetch``; no fault if out of range;
        locality 3: into every level, 2: into L2 and below)."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH)
            builder.call(fn, [ptr, i32(write), i32(locality), i32(1)])
            return context.get_dummy_value()
        return types.none(arr, types.uint64), codegen
    return prefetch


prefetch_read, prefetch_write = _prefetch_intrinsic(0), _prefetch_intrinsic(1)
prefetch_read_l2 = _prefetch_intrinsic(0, 2)


def prefetch_row(arr, off, w, write, l2):
    """Prefetch the cache lines of ``arr[off:off + w]``: for writing, or for reading, into
    every cache level or, with ``l2``, into L2 and below (what the scans ask for a later
    step's rows of three inputs: more lines than L1's miss buffers hold; docs/kernels.md)."""
    raise NotImplementedError


@overload(prefetch_row)
def _prefetch_row(arr, off, w, write, l2):
    step = max(1, 64 * 8 // arr.dtype.bitwidth)       # elements per 64-byte line

    def impl(arr, off, w, write, l2):
        base = np.uint64(off)
        for k in range(0, w, step):
            if write:
                prefetch_write(arr, base + np.uint64(k))
            elif l2:
                prefetch_read_l2(arr, base + np.uint64(k))
            else:
                prefetch_read(arr, base + np.uint64(k))
    return impl


def _expf(x):
    """exp for float32; 0 below -87.34 (no subnormal results), +inf above 88.38, NaN kept."""
    c = min(max(x, _EXP_LO), _EXP_HI)
    fx = np.floor(c * _LOG2E + _HALF)
    r = c - fx * _LN2_HI - fx * _LN2_LO
    e0, e1, e2, e3, e4, e5 = _EXP_P
    r2 = r * r                  # Estrin's scheme: short dependency chains (the loops using
    r4 = r2 * r2                # these are latency-bound with Horner's)
    p = (e0 * r + e1) * r4 + (e2 * r + e3) * r2 + (e4 * r + e5)
    p = p * r2 + r + _ONE
    scale = _bits_f32(np.uint32(np.int32(fx) + np.int32(127)) << np.uint32(23))
    out = p * scale
    out = _ZERO if x < _EXP_LO else out
    out = _INF if x > _EXP_HI else out
    return x if x != x else out


def _logf(x):
    """log for float32: -inf at 0, NaN below 0, +inf at +inf; normal and subnormal inputs."""
    tiny = x < F32(1.17549435e-38)
    xs = x * F32(16777216.0) if tiny else x       # lift subnormals by 2^24
    bits = _f32_bits(xs)
    e = F32(np.int32((bits >> np.uint32(23)) & np.uint32(0xFF)) - np.int32(126))
    e = e - F32(24.0) if tiny else e
    mant = _bits_f32((bits & np.uint32(0x807FFFFF)) | np.uint32(0x3F000000))  # [0.5, 1)
    low = mant < _SQRTHF
    e = e - _ONE if low else e
    f = (mant + mant - _ONE) if low else (mant - _ONE)
    z = f * f
    c0, c1, c2, c3, c4, c5, c6, c7, c8 = _LOG_P
    p = (((((((c0 * f + c1) * f + c2) * f + c3) * f + c4) * f + c5) * f + c6) * f + c7) * f + c8
    y = p * f * z + e * _LN2_LO - _HALF * z
    out = f + y + e * _LN2_HI
    out = -_INF if x == _ZERO else out
    out = F32(np.nan) if x < _ZERO else out
    out = _INF if x == _INF else out
    return x if x != x else out


def _log1pf(x):
    """log(1 + x) for float32 x >= 0, accurate for small x."""
    w = _ONE + x
    return x if w == _ONE else flog(w) * (x / (w - _ONE))


def fexp(x):
    return math.exp(x)


def flog(x):
    return math.log(x)


def flog1p(x):
    return math.log1p(x)


def _float_overload(fast, slow):
    def typer(x):
        if x == types.float32:
            return fast
        if isinstance(x, types.Float):
            return slow
        return None
    return typer


overload(fexp)(_float_overload(_expf, lambda x: math.exp(x)))
overload(flog)(_float_overload(_logf, lambda x: math.log(x)))
overload(flog1p)(_float_overload(_log1pf, lambda x: math.log1p(x)))


def log_sigmoid(x):
    """``log sigmoid(x) = min(x, 0) - log(1 + exp(-|x|))``."""
    raise NotImplementedError


def log1p_small(e):
    """``log(1 + e)`` for ``0 <= e <= 1``: a polynomial for float32, ``log1p`` for float64."""
    raise NotImplementedError


@overload(log1p_small, inline="always")   # inlined in numba IR: LLVM would not inline it
def _log1p_small(e):
    if e == types.float32:
        q0, q1, q2, q3, q4, q5, q6, q7, q8 = _LOG1P_Q

        def fast(e):   # a polynomial instead of log1p: about half the cost
            e2 = e * e          # Estrin's scheme, as in _expf
            e4 = e2 * e2
            lo = (q1 * e + q0) + (q3 * e + q2) * e2
            hi = (q5 * e + q4) + (q7 * e + q6) * e2
            return e * (lo + (hi + q8 * e4) * e4)
        return fast
    return lambda e: flog1p(e)


@overload(log_sigmoid, inline="always")
def _log_sigmoid(x):
    zero = as_dtype(x).type(0.0)
    return lambda x: min(x, zero) - log1p_small(fexp(-abs(x)))


def load(src, i, like):
    """``src[i]`` widened to the compute type, that of ``like`` (uint16 holds bfloat16 bits; int8
    is widened to float32)."""
    raise NotImplementedError


@overload(load)
def _load(src, i, like):
    if src.dtype == types.uint16:
        def widen(src, i, like):
            return _bits_f32(np.uint32(src[i]) << np.uint32(16))
        return widen
    if src.dtype == types.int8:          # (int8 weights of the decode step: float32 of them)
        return lambda src, i, like: np.float32(src[i])
    if src.dtype == like:
        return lambda src, i, like: src[i]
    return None


def store(dst, i, value):
    """``dst[i] = value`` narrowed to ``dst``'s type (uint16: bfloat16, round to nearest even)."""
    raise NotImplementedError


@overload(store)
def _store(dst, i, value):
    if dst.dtype == types.uint16:
        def narrow(dst, i, value):
            bits = _f32_bits(value)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) \
                >> np.uint32(16)
            dst[i] = np.uint16(0x7FC0) if value != value else np.uint16(rounded)
        return narrow
    if dst.dtype == value:
        def plain(dst, i, value):
            dst[i] = value
        return plain
    return None
