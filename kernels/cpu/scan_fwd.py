"""CPU forward of the weighted scan and its streaming step: a compiled loop over time,
vectorised over channels.

One task per (sequence, channel block); the threads running a call of :func:`forward` (the
launcher, ``fastrwa/ops/numba_host.py``, starts them) take its tasks one at a time. A task
walks its sequence one step at a time with the state ``(m, n~, d~)`` of its ``w`` channels
in three small arrays (L1-resident), reading each input once and writing ``y`` once: the
minimum traffic (docs/math.md). For large inputs (``ahead``) each step prefetches, into L2,
the input rows of a later step, so that loads overlap the arithmetic. With ``save`` it also writes the state entering every chunk
of ``chunk`` steps (``3 * w`` floats per chunk), which is all the backward (``scan_bwd.py``)
needs to recompute the rest. :func:`step_inplace` is one step for every channel of a batch,
in place, for decoding.

The step is written without branches so the channel loop vectorises: ``keep``/``take`` are
chosen by the sign of ``l - (m + lam)``, with the limits spelled out: equal infinite
arguments (``l = m + lam = +inf`` or both ``-inf``) count as a difference of 0 (equal weights),
and a ``-inf`` argument has weight 0 (a masked step, nothing seen yet, or ``lam = -inf``), so
every finite logit counts, however negative; ``y = 0`` where ``d~ = 0``.
``n~`` is flushed to 0 where ``|y| = |n~| / d~`` is below the dtype's smallest normal number
``tiny``: a numerator that decays by ``keep`` per step (a discounted past with ``z = 0``
since) would otherwise stop at a few ulps of the smallest subnormal (``x * keep`` rounds
back to ``x`` there) and stay, keeping ``y`` subnormal for the rest of the sequence, and
subnormal operands make x86 matrix products downstream about 20x slower. Each flush
changes ``y`` by less than ``tiny``.
Flat arrays; ``off = ((b * T + t) * D + lo)`` in int64.
"""

from __future__ import annotations

import numpy as np

from ..codes import EXP, NO_DISCOUNT
from . import kernel
from .fmath import fexp, load, prefetch_row, store
from .rows import log_decay_row, log_weight_row
from .sync import next_task


@kernel
def step_row(m, n, d, lam, lam_off, z, z_off, l, l_off, y, y_off, d_out, d_off, take, take_off,
             keep, keep_off, save, w, ninf, zero, one, tiny):
    """One step for ``w`` channels: update the state rows ``m, n, d`` (``(m, n~, d~)``) in
    place and write ``y = n~ / d~`` at ``y[y_off:]``.

    ``lam``, ``z``, ``l`` are read at their offsets (rows of the ``(B, T, D)`` inputs,
    converted on the fly, or of a buffer). With ``save`` the step also stores ``d~`` at
    ``d_out[d_off:]`` and its weights ``take = exp(l - m)``, ``keep = exp(m_in + lam - m)``
    at ``take[take_off:]``, ``keep[keep_off:]``: all the backward needs.

    Vectorisation rule followed by every loop of these kernels: each array a loop stores
    into is its own array, indexed the same way by every access in the loop (in place, or
    store-only). LLVM cannot prove two rows of one array disjoint when their offsets are
    run-time values; it then emits scalar code, about 20x slower.
    """
    lao, zo, lo, yo = np.uint64(lam_off), np.uint64(z_off), np.uint64(l_off), np.uint64(y_off)
    do, tko, kpo = np.uint64(d_off), np.uint64(take_off), np.uint64(keep_off)
    for j in range(w):
        u = np.uint64(j)
        l_j = load(l, lo + u, zero)
        lam_j = lam[lao + u]
        dec = ninf if lam_j == ninf else m[j] + lam_j  # decayed running max (lam = -inf
                                                       # forgets, m = +inf included)
        diff = zero if l_j == dec else l_j - dec      # (equal infinities: the limit, 0)
        e = fexp(-abs(diff))
        up = diff > zero
        keep_j = e if up else (zero if dec == ninf else one)   # lam = -inf keeps nothing
        take_j = one if up else (zero if l_j == ninf else e)   # -inf: no weight
        m[j] = l_j if up else dec
        d_j = d[j] * keep_j + take_j
        n_j = n[j] * keep_j + load(z, zo + u, zero) * take_j
        n_j = zero if abs(n_j) < tiny * d_j else n_j    # (|y| < tiny: module docstring)
        n[j] = n_j
        d[j] = d_j
        store(y, yo + u, zero if d_j == zero else n_j / d_j)      # (NaN stays NaN)
        if save:
            d_out[do + u] = d_j
            take[tko + u] = take_j
            keep[kpo + u] = keep_j


@kernel
def time_index(lo, hi, s, reverse):
    """The time index of scan step ``s`` of a sequence spanning ``[lo, hi)``."""
    return hi - 1 - s if reverse else lo + s


@kernel
def task_channels(task, D, block):
    """What task ``task`` of a scan call covers, ``(i, lo, w)``: sequence ``i = task //
    n_blk`` and its channels ``[lo, lo + w)`` of channel block ``task % n_blk``, ``block``
    wide (the last one narrower), of the ``n_blk = ceil(D / block)`` blocks."""
    n_blk = (D + block - 1) // block
    lo = (task % n_blk) * block
    return task // n_blk, lo, min(block, D - lo)


@kernel
def input_row(strides, k, b, t, lo):
    """Offset of channel ``lo`` of row ``(b, t)`` of input ``k`` (0: z, 1: a, 2: g), whose
    element strides along B and T are ``strides[2k]``, ``strides[2k + 1]`` (channels: 1)."""
    return b * strides[2 * k] + t * strides[2 * k + 1] + lo


@kernel
def forward(claim, tasks, z, a, g, y, state0, final, ck, consts, strides, seq_b, seq_lo,
            seq_hi, ck_off, T, D, chunk, block, attention, discount, reverse, has_init, save,
            ahead):
    """Forward of the (sequence, channel block) pairs: task ``tasks[k]`` for each ``k``
    taken from the counter ``claim`` (``int64 [1]``, shared by every thread running the
    call, 0 at the start: ``sync.next_task``) until none is left; task ``t`` is sequence
    ``t // n_blk``, channel block ``t % n_blk`` (:func:`task_channels`), and ``tasks``
    (``int64``) lists every task once (the launcher puts the longest first).

    Data: ``z, a, g, y`` flat ``(B, T, D)`` in the inputs' type (``uint16`` holds
    bfloat16; ``g`` unused without a discount); ``y`` is contiguous, the inputs' rows may be
    strided (``strides``: the B and T element strides of z, a, g; see :func:`input_row`),
    e.g. gate slices of a projection. State, in the compute type: ``state0`` and ``final``
    ``(3, N, D)`` ``(m, n~, d~)``; with ``save``, ``ck`` ``(3, chunks, D)`` receives the
    state entering every chunk of ``chunk`` steps; ``consts`` ``[0, 1, -inf, tiny]``
    (:func:`fastrwa.ops.numba_host.kernel_consts`).
    Index: sequence ``i`` is batch row ``seq_b[i]``, steps ``[seq_lo[i], seq_hi[i])``; its
    chunk ``k``'s state is row ``ck_off[i] + k`` of ``ck``. Scalars: ``block`` channels per
    task; ``attention``, ``discount``: codes of :mod:`fastrwa.kernels.codes`; ``ahead``: at
    each step, prefetch the input rows of the step that many later (0: none).
    """
    zero, one, ninf, tiny = consts[0], consts[1], consts[2], consts[3]
    n_seq = seq_b.shape[0]
    n_ck = ck.shape[0] // (3 * D) if save else 0
    taken = next_task(claim)                  # the index in ``tasks`` of this thread's task
    while taken < tasks.shape[0]:
        i, lo, w = task_channels(tasks[taken], D, block)
        m, n, d = np.zeros(w, consts.dtype), np.zeros(w, consts.dtype), np.zeros(w, consts.dtype)
        tb = np.zeros(2 * w, consts.dtype)      # [2 * w] l, lam (lam = 0 without discount)
        # What step_row can save for a backward goes to three distinct scratch rows: cheaper
        # than a branch, which would keep LLVM from vectorising the step (step_row).
        d1, take1, keep1 = np.zeros(w, consts.dtype), np.zeros(w, consts.dtype), \
            np.zeros(w, consts.dtype)
        base = np.int64(i) * D + lo
        for j in range(w):
            m[j] = ninf
            if has_init:
                m[j] = state0[base + j]
                n[j] = state0[n_seq * D + base + j]
                d[j] = state0[2 * n_seq * D + base + j]
        length = seq_hi[i] - seq_lo[i]
        for s in range(length):
            if save and s % chunk == 0:
                row = np.int64(ck_off[i] + s // chunk) * D + lo
                for j in range(w):
                    ck[row + j] = m[j]
                    ck[n_ck * D + row + j] = n[j]
                    ck[2 * n_ck * D + row + j] = d[j]
            t = np.int64(time_index(seq_lo[i], seq_hi[i], s, reverse))
            b = np.int64(seq_b[i])
            off = (b * T + t) * D + lo
            oz, oa = input_row(strides, 0, b, t, lo), input_row(strides, 1, b, t, lo)
            if ahead and s + ahead < length:    # a later step's input rows, into L2
                ta = np.int64(time_index(seq_lo[i], seq_hi[i], s + ahead, reverse))
                prefetch_row(z, input_row(strides, 0, b, ta, lo), w, False, True)
                prefetch_row(a, input_row(strides, 1, b, ta, lo), w, False, True)
                if discount != NO_DISCOUNT:
                    prefetch_row(g, input_row(strides, 2, b, ta, lo), w, False, True)
            if discount != NO_DISCOUNT:
                log_decay_row(discount, g, input_row(strides, 2, b, t, lo), tb, w, w)
            if attention == EXP:        # l = a: read straight from the input
                step_row(m, n, d, tb, w, z, oz, a, oa, y, off, d1, 0, take1, 0, keep1, 0,
                         False, w, ninf, zero, one, tiny)
            else:
                log_weight_row(attention, a, oa, tb, 0, w)
                step_row(m, n, d, tb, w, z, oz, tb, 0, y, off, d1, 0, take1, 0, keep1, 0,
                         False, w, ninf, zero, one, tiny)
        for j in range(w):
            final[base + j] = m[j]
            final[n_seq * D + base + j] = n[j]
            final[2 * n_seq * D + base + j] = d[j]
        taken = next_task(claim)


@kernel
def step_inplace(z, a, g, m, n, d, y, attention, discount, consts, scratch):
    """``z, a, g, y``: flat ``(B * D,)`` (``uint16`` holds bfloat16); ``m, n, d``: the state,
    flat, compute type, updated in place (``-inf`` in ``m`` for nothing seen, as stored).
    ``scratch``: ``(5, B * D)`` in the compute type (``l``, ``lam`` and three rows the step
    could save)."""
    zero, one, ninf, tiny = consts[0], consts[1], consts[2], consts[3]
    w = m.shape[0]
    tb, d1, take, keep = scratch[0:2].reshape(-1), scratch[2], scratch[3], scratch[4]
    for j in range(w):
        tb[w + j] = zero
    if discount != NO_DISCOUNT:
        log_decay_row(discount, g, 0, tb, w, w)
    if attention == EXP:
        step_row(m, n, d, tb, w, z, 0, a, 0, y, 0, d1, 0, take, 0, keep, 0, True, w, ninf,
                 zero, one, tiny)
    else:
        log_weight_row(attention, a, 0, tb, 0, w)
        step_row(m, n, d, tb, w, z, 0, tb, 0, y, 0, d1, 0, take, 0, keep, 0, True, w, ninf,
                 zero, one, tiny)
