"""CPU backward of the weighted scan (DESIGN.md §2), one task per (sequence, channel block).

A task walks its chunks last to first. For each chunk it (1) re-runs the forward from the
state the forward saved at the chunk's start, keeping every step's ``z``, ``a``, ``g``,
``d~_t``, ``y_t`` and the step's weights ``take_t = exp(l_t - m_t)`` and
``keep_t = exp(m_{t-1} + lam_t - m_t)`` in chunk buffers (cache-resident), then (2) runs the
adjoint backwards through the chunk and writes the gradients. Inputs and ``gy`` are read from
memory once and each gradient written once.

The adjoint is back-propagation through the stabilised recurrence itself. With
``rho_t = dLoss/dn~_t`` and ``sigma_t = -dLoss/dd~_t`` (gradients of the normalised state):

    rho_t   = keep_{t+1} rho_{t+1}   + gy_t / d~_t
    sigma_t = keep_{t+1} sigma_{t+1} + gy_t y_t / d~_t
    gz_t = take_t rho_t     gl_t = take_t (z_t rho_t - sigma_t)
    glam_t = keep_t d~_{t-1} (y_{t-1} rho_t - sigma_t)

This is the log-space adjoint of DESIGN.md §2 with its scale ``M_t`` equal to ``-m_t``
(it always is: ``m`` is the running maximum of the decayed log-weights), so every exponential
it needs was already computed by the forward step: the adjoint needs no ``exp`` at all, and
every factor is at most 1. ``gm`` of the final state is not used (docs/math.md §4).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_math import load, store
from .cpu_rows import (EXP, NO_DISCOUNT, attention_grad_row, decay_grad_row, load_row,
                       log_decay_row, log_weight_row)
from .cpu_scan import D_, M, N, OPTS, step_row, time_index

JIT = dict(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
# Scratch of a task (step_row's docstring has the rule behind the split): ``run`` holds the
# running rows; the chunk buffers are slot-major (slot r = step r of the chunk): ``ib`` the
# inputs as loaded, ``tb`` their transforms, ``wb`` the step weights, and ``sb`` the state
# *before* each step (slot r; step r writes slot r + 1, so ``sb`` has C + 1 slots).
RHO, SIGMA, KEEP_NEXT, GL, GLAM, RUNNING = range(M + 3, M + 9)   # after the M, N, D_ rows
Z_, A_, G_ = 0, 1, 2        # ib rows
L_, LAM_ = 0, 1             # tb rows
D_S, Y_S = 0, 1             # sb rows
TAKE, KEEP = 0, 1           # wb rows


@njit(**JIT, inline="always")
def adjoint_row(run, ib, tb, sb, wb, r, gy, gy_off, gz, gz_off, with_decay, w, zero):
    """One adjoint step for ``w`` channels at step ``r`` of the chunk."""
    go, zo = np.uint64(gy_off), np.uint64(gz_off)
    rh, sg, kn = np.uint64(RHO * w), np.uint64(SIGMA * w), np.uint64(KEEP_NEXT * w)
    gl, gm = np.uint64(GL * w), np.uint64(GLAM * w)
    i0, w0, s0, s1 = np.uint64(r * 3 * w), np.uint64(r * 2 * w), np.uint64(r * 2 * w), \
        np.uint64((r + 1) * 2 * w)
    zz, tk, kp = i0 + np.uint64(Z_ * w), w0 + np.uint64(TAKE * w), w0 + np.uint64(KEEP * w)
    d0, y0 = s0 + np.uint64(D_S * w), s0 + np.uint64(Y_S * w)
    d1, y1 = s1 + np.uint64(D_S * w), s1 + np.uint64(Y_S * w)
    for j in range(w):
        u = np.uint64(j)
        d_j = sb[d1 + u]
        gi = load(gy, go + u, zero) / d_j if d_j > zero else zero
        r_j = run[rh + u] * run[kn + u] + gi
        s_j = run[sg + u] * run[kn + u] + gi * sb[y1 + u]
        run[rh + u] = r_j
        run[sg + u] = s_j
        store(gz, zo + u, wb[tk + u] * r_j)
        run[gl + u] = wb[tk + u] * (ib[zz + u] * r_j - s_j)
        if with_decay:
            run[gm + u] = wb[kp + u] * sb[d0 + u] * (sb[y0 + u] * r_j - s_j)
        run[kn + u] = wb[kp + u]


@njit(**OPTS)
def backward(z, a, g, gy, gz, ga, gg, T, D, seq_b, seq_lo, seq_hi, state0, has_init,
             g_final, has_g_final, g_init, ck, ck_off, chunk, attention, discount, reverse,
             block, consts):
    """Gradients into ``gz, ga, gg`` (flat ``(B, T, D)``) and ``g_init`` (``(3, N, D)``).

    Arguments as :func:`kernels.cpu_scan.forward`; ``g_final`` holds the ``(2, N, D)``
    gradients of the final ``n~, d~``; ``ck`` the chunk-start states the forward saved.
    """
    floor, zero, one = consts[0], consts[1], consts[2]
    n_seq = seq_b.shape[0]
    nd = n_seq * D
    n_blk = (D + block - 1) // block
    n_ck = ck.shape[0] // (3 * D)
    with_decay = discount != NO_DISCOUNT
    for task in prange(n_seq * n_blk):
        i, lo = task // n_blk, (task % n_blk) * block
        w = min(block, D - lo)
        run = np.zeros(RUNNING * w, consts.dtype)           # [RUNNING * w]
        ib = np.zeros(chunk * 3 * w, consts.dtype)          # [C, 3, w] z, a, g
        tb = np.zeros(chunk * 2 * w, consts.dtype)          # [C, 2, w] l, lam
        wb = np.zeros(chunk * 2 * w, consts.dtype)          # [C, 2, w] take, keep
        sb = np.zeros((chunk + 1) * 2 * w, consts.dtype)    # [C + 1, 2, w] d~, y before step
        rho, sigma = run[RHO * w:(RHO + 1) * w], run[SIGMA * w:(SIGMA + 1) * w]
        keep_next = run[KEEP_NEXT * w:(KEEP_NEXT + 1) * w]
        base = np.int64(i) * D + lo
        for j in range(w):
            keep_next[j] = one          # the final state is the state after the last step
            if has_g_final:
                rho[j] = g_final[base + j]
                sigma[j] = -g_final[nd + base + j]
        length = seq_hi[i] - seq_lo[i]
        for k in range((length + chunk - 1) // chunk - 1, -1, -1):
            s0 = k * chunk
            cl = min(chunk, length - s0)
            row = np.int64(ck_off[i] + k) * D + lo
            for j in range(w):
                n_j, d_j = ck[n_ck * D + row + j], ck[2 * n_ck * D + row + j]
                run[M * w + j] = ck[row + j]
                run[N * w + j] = n_j
                run[D_ * w + j] = d_j
                sb[D_S * w + j] = d_j
                sb[Y_S * w + j] = n_j / d_j if d_j > zero else zero
            for r in range(cl):     # (1) recompute the chunk
                off = (np.int64(seq_b[i]) * T + time_index(seq_lo[i], seq_hi[i], s0 + r,
                                                             reverse)) * D + lo
                io, to = r * 3 * w, r * 2 * w
                load_row(z, off, ib, io + Z_ * w, w)
                load_row(a, off, ib, io + A_ * w, w)
                l_buf, l_off = ib, io + A_ * w
                if attention != EXP:
                    log_weight_row(attention, ib, io + A_ * w, tb, to + L_ * w, w)
                    l_buf, l_off = tb, to + L_ * w
                if with_decay:
                    load_row(g, off, ib, io + G_ * w, w)
                    log_decay_row(discount, ib, io + G_ * w, tb, to + LAM_ * w, w)
                so = (r + 1) * 2 * w
                step_row(run, tb, to + LAM_ * w, ib, io + Z_ * w, l_buf, l_off, sb, so + Y_S * w,
                         sb, so + D_S * w, wb, to + TAKE * w, to + KEEP * w, True, w, floor,
                         zero, one)
            for r in range(cl - 1, -1, -1):     # (2) the adjoint, backwards
                off = (np.int64(seq_b[i]) * T + time_index(seq_lo[i], seq_hi[i], s0 + r,
                                                             reverse)) * D + lo
                adjoint_row(run, ib, tb, sb, wb, r, gy, off, gz, off, with_decay, w, zero)
                attention_grad_row(attention, run, GL * w, ib, r * 3 * w + A_ * w, ga, off, w)
                if with_decay:
                    decay_grad_row(discount, run, GLAM * w, ib, r * 3 * w + G_ * w, gg, off, w)
        if has_init:
            for j in range(w):
                m0, n0, d0 = state0[base + j], state0[nd + base + j], state0[2 * nd + base + j]
                # dLoss/dn~_0 = keep_1 rho_1: keep_next now holds keep of the first step.
                w0 = keep_next[j] if m0 > floor or length == 0 else zero
                g_init[base + j] = w0 * (n0 * rho[j] - d0 * sigma[j])
                g_init[nd + base + j] = w0 * rho[j]
                g_init[2 * nd + base + j] = -w0 * sigma[j]
