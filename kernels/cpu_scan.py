"""CPU forward of the weighted scan: a compiled loop over time, vectorised over channels.

numba kernels (``parallel=True``): one task per (sequence, channel block), spread over the
threads with ``prange``. A task walks its sequence one step at a time with the state
``(m, n~, d~)`` of its ``w`` channels in three small arrays (L1-resident), reading each input
once and writing ``y`` once: the minimum traffic of DESIGN.md §2. With ``save`` it also
writes the state entering every chunk of ``chunk`` steps (``3 * w`` floats per chunk), which
is all the backward (:mod:`kernels.cpu_scan_bwd`) needs to recompute the rest.

The step is written without branches so the channel loop vectorises: ``-inf`` (nothing seen
yet) is held as the finite ``floor`` (``consts[0]``), so ``l - m`` is never ``inf - inf``;
``keep``/``take`` are chosen by the sign of ``l - (m + lam)``; ``y = 0`` where ``d~ = 0``.
Flat arrays; ``off = ((b * T + t) * D + lo)`` in int64.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_math import fexp
from .cpu_rows import NO_DISCOUNT, load_row, log_decay_row, log_weight_row, store_row

OPTS = dict(parallel=True, nogil=True, cache=True, error_model="numpy", fastmath={"contract"})


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def step_row(m, n, d, y, z, l, lam, w, floor, zero, one):
    """One step for ``w`` channels: update ``(m, n, d)`` in place and write ``y = n / d``."""
    for j in range(w):
        md = max(m[j] + lam[j], floor)         # decayed running max, never -inf
        diff = l[j] - md
        e = fexp(-abs(diff))
        up = diff > zero
        keep = e if up else one
        take = one if up else e
        m[j] = l[j] if up else md
        n[j] = n[j] * keep + z[j] * take
        d[j] = d[j] * keep + take
        y[j] = n[j] / d[j] if d[j] > zero else zero


@njit(nogil=True, cache=True, error_model="numpy")
def time_index(lo, hi, s, reverse):
    """The time index of scan step ``s`` of a sequence spanning ``[lo, hi)``."""
    return hi - 1 - s if reverse else lo + s


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def stage_inputs(z, a, g, off, zb, lb, ab, lamb, gb, w, attention, discount):
    """Load one row of ``z``, ``a`` (and ``g``) and form ``l`` (and ``lam``) from them."""
    load_row(z, off, zb, w)
    load_row(a, off, ab, w)
    log_weight_row(attention, ab, lb, w)
    if discount != NO_DISCOUNT:
        load_row(g, off, gb, w)
        log_decay_row(discount, gb, lamb, w)


@njit(**OPTS)
def forward(z, a, g, y, T, D, seq_b, seq_lo, seq_hi, state0, has_init, final, ck, ck_off,
            chunk, save, attention, discount, reverse, block, consts):
    """Forward over every (sequence, channel block).

    ``z, a, g, y``: flat ``(B, T, D)`` (``g`` unused without a discount; ``uint16`` holds
    bfloat16). Sequence ``i`` is batch row ``seq_b[i]``, steps ``[seq_lo[i], seq_hi[i])``.
    ``state0``/``final``: ``(3, N, D)`` ``(m, n~, d~)`` in the compute type. ``ck``:
    ``(3, chunks, D)``, chunk ``k`` of sequence ``i`` at row ``ck_off[i] + k``.
    """
    floor, zero, one, ninf = consts[0], consts[1], consts[2], consts[3]
    n_seq = seq_b.shape[0]
    n_blk = (D + block - 1) // block
    n_ck = ck.shape[0] // (3 * D) if save else 0
    for task in prange(n_seq * n_blk):
        i, lo = task // n_blk, (task % n_blk) * block
        w = min(block, D - lo)
        rows = np.zeros((9, w), consts.dtype)   # [9, w]
        m, n, d, y_row, zb, lb, ab, lamb, gb = rows[0], rows[1], rows[2], rows[3], rows[4], \
            rows[5], rows[6], rows[7], rows[8]
        base = np.int64(i) * D + lo
        for j in range(w):
            m[j] = floor
            if has_init:
                m[j] = max(state0[base + j], floor)
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
            t = time_index(seq_lo[i], seq_hi[i], s, reverse)
            off = (np.int64(seq_b[i]) * T + t) * D + lo
            stage_inputs(z, a, g, off, zb, lb, ab, lamb, gb, w, attention, discount)
            step_row(m, n, d, y_row, zb, lb, lamb, w, floor, zero, one)
            store_row(y, off, y_row, w)
        for j in range(w):
            final[base + j] = m[j] if m[j] > floor else ninf
            final[n_seq * D + base + j] = n[j]
            final[2 * n_seq * D + base + j] = d[j]
