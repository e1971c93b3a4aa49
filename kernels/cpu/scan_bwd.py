"""CPU backward of the weighted scan, one task per (sequence, channel block).

A task walks its chunks last to first. For each chunk it (1) re-runs the forward from the
state the forward saved at the chunk's start, keeping every step's transforms ``l_t``,
``lam_t`` (and, for the sigmoid/softplus transforms, their derivatives, from the same
``exp(-|x|)``, so the chain rule afterwards needs no ``exp``), ``d~_t``, ``y_t`` and the
step's weights ``take_t = exp(l_t - m_t)`` and ``keep_t = exp(m_{t-1} + lam_t - m_t)`` in
chunk buffers (cache-resident), then (2) runs the
adjoint backwards through the chunk and writes the gradients, reading the chunk's ``z``,
``a``, ``g`` a second time from cache and prefetching each ``gy``/gradient row one step
ahead (the walk is backwards through memory). Inputs and ``gy`` are read from memory once
and each gradient written once; for large inputs (``ahead``) step (1) also prefetches, into
L2, the inputs and ``gy`` of the chunk walked next.

The adjoint is back-propagation through the stabilised recurrence itself (docs/math.md §4).
With ``rho_t = dLoss/dn~_t`` and ``sigma_t = -dLoss/dd~_t`` (gradients of the normalised state)
and ``(P_t, Q_t) = keep_{t+1} (rho_{t+1}, sigma_{t+1})``, the later steps' part:

    rho_t   = P_t + gy_t / d~_t
    sigma_t = Q_t + gy_t y_t / d~_t
    gz_t = take_t rho_t
    gl_t = take_t ((z_t P_t - Q_t) + gy_t / d~_t (z_t - y_t))
    glam_t = keep_t d~_{t-1} (y_{t-1} rho_t - sigma_t)

with ``z_t - y_t = keep_t d~_{t-1} (z_t - y_{t-1}) / d~_t``: ``gl`` has no cancellation (a
small relu logit that is the only weight so far keeps its gradient). Every exponential it
needs was already computed by the forward step: the adjoint needs no ``exp`` at all, and every
factor is at most 1. ``gm`` of the final state is not used (docs/math.md §4).

The later steps' part ``(P_t, Q_t)`` is flushed to 0 below the dtype's smallest normal
number ``tiny``. Unflushed, it would never reach 0: ``keep * x`` rounds back to ``x`` for
the smallest subnormals ``x`` (for any ``keep > 1/2``), so an adjoint that has decayed
below 1e-38 (float32) would stay subnormal for the rest of the sequence and fill ``gz``,
``ga`` and ``gg`` with subnormals, which make x86 matrix products on them (the input
projections' backward) about 20x slower. Each flush changes ``rho``, ``sigma`` by less
than ``tiny``.
"""

from __future__ import annotations

import numpy as np

from .fmath import load, prefetch_row, store
from . import kernel
from ..codes import EXP, NO_DISCOUNT
from .rows import (attention_grad_row, decay_grad_row, log_decay_grad_rows,
                   log_weight_grad_rows)
from .scan_fwd import input_row, step_row, time_index

# Scratch of a task (step_row's docstring has the rule behind so many arrays): running rows
# of w channels, and chunk buffers indexed by the step r in the chunk: ``tb`` [C, 2, w] the
# transforms of the inputs, ``take`` [C, w] and ``keep`` [C + 1, w]
# the step weights, ``sd``/``sy`` [C + 1, w] d~ and y *before* step r (step r writes slot r + 1).
L_, LAM_ = 0, 1             # tb rows


@kernel
def adjoint_row(rho, sigma, gl, glam, z, z_off, sd, sy, take, keep, r, gy, off, gz, with_decay,
                w, zero, one, tiny):
    """One adjoint step for ``w`` channels at step ``r`` of the chunk (``keep`` slot r + 1
    holds the next step's weight; the caller fills slot ``C`` across chunk edges). ``z`` is
    read at ``z_off``, ``gy`` read and ``gz`` written at ``off``: rows of ``(B, T, D)``."""
    go, zo = np.uint64(off), np.uint64(z_off)
    s0, s1 = np.uint64(r * w), np.uint64((r + 1) * w)
    for j in range(w):
        u = np.uint64(j)
        d_j = sd[s1 + u]
        inv_d = zero if d_j == zero else one / d_j
        gi = load(gy, go + u, zero) * inv_d          # (an L2 hit)
        z_j = load(z, zo + u, zero)
        r_later = rho[j] * keep[s1 + u]               # the later steps' part of rho, sigma,
        s_later = sigma[j] * keep[s1 + u]             # flushed below tiny (docstring above)
        r_later = zero if abs(r_later) < tiny else r_later
        s_later = zero if abs(s_later) < tiny else s_later
        # z - y of this step as keep d~_prev (z - y_prev) / d~: no cancellation (0 exactly
        # when this step is the only weight so far; docs/math.md §4)
        z_y = keep[s0 + u] * sd[s0 + u] * (z_j - sy[s0 + u]) * inv_d
        r_j = r_later + gi
        s_j = s_later + gi * sy[s1 + u]
        rho[j] = r_j
        sigma[j] = s_j
        store(gz, go + u, take[s0 + u] * r_j)
        gl[j] = take[s0 + u] * ((z_j * r_later - s_later) + gi * z_y)
        if with_decay:
            glam[j] = keep[s0 + u] * sd[s0 + u] * (sy[s0 + u] * r_j - s_j)


@kernel
def backward(task_lo, task_hi, z, a, g, gy, gz, ga, gg, state0, g_final, g_init, ck, consts,
             strides, seq_b, seq_lo, seq_hi, ck_off, T, D, chunk, block, attention, discount,
             reverse, has_init, has_g_final, ahead):
    """Gradients into ``gz, ga, gg`` (flat ``(B, T, D)``) and ``g_init`` (``(3, N, D)``),
    for tasks ``[task_lo, task_hi)``.

    Arguments as :func:`.scan_fwd.forward` reads them (``gy`` and the gradients contiguous,
    the inputs' rows possibly strided); ``g_final`` holds the ``(2, N, D)`` gradients of the
    final ``n~, d~`` (used with ``has_g_final``); ``ck`` the chunk-start states the forward
    saved. With ``ahead`` (non-zero) the recompute of each chunk prefetches, row by row,
    the inputs and ``gy`` of the chunk walked next (the one before it), into L2.
    """
    zero, one, ninf, tiny = consts[0], consts[1], consts[2], consts[3]
    n_seq = seq_b.shape[0]
    nd = n_seq * D
    n_blk = (D + block - 1) // block
    n_ck = ck.shape[0] // (3 * D)
    with_decay = discount != NO_DISCOUNT
    dt = consts.dtype
    for task in range(task_lo, task_hi):
        i, lo = task // n_blk, (task % n_blk) * block
        w = min(block, D - lo)
        m, n, d = np.zeros(w, dt), np.zeros(w, dt), np.zeros(w, dt)
        rho, sigma = np.zeros(w, dt), np.zeros(w, dt)
        gl, glam = np.zeros(w, dt), np.zeros(w, dt)
        tb = np.zeros(chunk * 2 * w, dt)
        dl, dlam = np.zeros(chunk * w, dt), np.zeros(chunk * w, dt)   # dl/da, dlam/dg
        take, keep = np.zeros(chunk * w, dt), np.ones((chunk + 1) * w, dt)
        sd, sy = np.zeros((chunk + 1) * w, dt), np.zeros((chunk + 1) * w, dt)
        base = np.int64(i) * D + lo
        if has_g_final:
            for j in range(w):
                rho[j] = g_final[base + j]
                sigma[j] = -g_final[nd + base + j]
        length = seq_hi[i] - seq_lo[i]
        for k in range((length + chunk - 1) // chunk - 1, -1, -1):
            s0 = k * chunk
            cl = min(chunk, length - s0)
            row = np.int64(ck_off[i] + k) * D + lo
            for j in range(w):
                # keep of the step after this chunk: 1 after the last step (the final state
                # is the state after it), else slot 0 of the chunk done before this one.
                keep[cl * w + j] = one if k == (length + chunk - 1) // chunk - 1 else keep[j]
                m[j] = ck[row + j]
                n[j] = ck[n_ck * D + row + j]
                d[j] = ck[2 * n_ck * D + row + j]
                sd[j] = d[j]
                sy[j] = zero if d[j] == zero else n[j] / d[j]
            b = np.int64(seq_b[i])
            for r in range(cl):     # (1) recompute the chunk
                t = np.int64(time_index(seq_lo[i], seq_hi[i], s0 + r, reverse))
                oz, oa = input_row(strides, 0, b, t, lo), input_row(strides, 1, b, t, lo)
                if ahead and k > 0:     # the same row of the chunk walked next
                    tp = np.int64(time_index(seq_lo[i], seq_hi[i], s0 - chunk + r, reverse))
                    prefetch_row(z, input_row(strides, 0, b, tp, lo), w, False, True)
                    prefetch_row(a, input_row(strides, 1, b, tp, lo), w, False, True)
                    prefetch_row(gy, (b * T + tp) * D + lo, w, False, True)
                    if with_decay:
                        prefetch_row(g, input_row(strides, 2, b, tp, lo), w, False, True)
                to = r * 2 * w
                if with_decay:
                    log_decay_grad_rows(discount, g, input_row(strides, 2, b, t, lo), tb,
                                        to + LAM_ * w, dlam, r * w, w)
                if attention == EXP:        # l = a, read from the input
                    step_row(m, n, d, tb, to + LAM_ * w, z, oz, a, oa, sy, (r + 1) * w, sd,
                             (r + 1) * w, take, r * w, keep, r * w, True, w, ninf, zero, one,
                             tiny)
                else:
                    log_weight_grad_rows(attention, a, oa, tb, to + L_ * w, dl, r * w, w)
                    step_row(m, n, d, tb, to + LAM_ * w, z, oz, tb, to + L_ * w, sy,
                             (r + 1) * w, sd, (r + 1) * w, take, r * w, keep, r * w, True, w,
                             ninf, zero, one, tiny)
            for r in range(cl - 1, -1, -1):     # (2) the adjoint, backwards; the chunk's
                # inputs are read a second time, from cache (they were read just above)
                t = np.int64(time_index(seq_lo[i], seq_hi[i], s0 + r, reverse))
                off = (b * T + t) * D + lo
                if r > 0:   # the adjoint walks rows backwards: prefetchers would not follow
                    prev = (np.int64(seq_b[i]) * T + time_index(seq_lo[i], seq_hi[i],
                                                                  s0 + r - 1, reverse)) * D + lo
                    prefetch_row(gy, prev, w, False, False)
                    prefetch_row(gz, prev, w, True, False)
                    prefetch_row(ga, prev, w, True, False)
                    if with_decay:
                        prefetch_row(gg, prev, w, True, False)
                adjoint_row(rho, sigma, gl, glam, z, input_row(strides, 0, b, t, lo), sd, sy,
                            take, keep, r, gy, off, gz, with_decay, w, zero, one, tiny)
                attention_grad_row(attention, gl, 0, dl, r * w, a,
                                   input_row(strides, 1, b, t, lo), ga, off, w)
                if with_decay:
                    decay_grad_row(discount, glam, 0, dlam, r * w, gg, off, w)
        if has_init:
            for j in range(w):
                m0, n0, d0 = state0[base + j], state0[nd + base + j], state0[2 * nd + base + j]
                # dLoss/dn~_0 = keep_1 rho_1; keep slot 0 holds the first step's keep.
                w0 = one if length == 0 else (zero if m0 == ninf else keep[j])
                g_init[base + j] = w0 * (n0 * rho[j] - d0 * sigma[j])
                g_init[nd + base + j] = w0 * rho[j]
                g_init[2 * nd + base + j] = -w0 * sigma[j]
