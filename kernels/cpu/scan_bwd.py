"""CPU backward of the weighted scan, one task per (sequence, channel block).

A task walks its chunks last to first. For each chunk it (1) re-runs the forward from the
state the forward saved at the chunk's start, keeping every step's transforms ``l_t``,
``lam_t`` (and, for the sigmoid/softplus transforms, their derivatives, from the same
``exp(-|x|)``, so the chain rule afterwards needs no ``exp``), ``d~_t``, ``y_t`` and the
step's weights ``take_t = exp(l_t - m_t)`` and ``keep_t = exp(m_{t-1} + lam_t - m_t)`` in
chunk buffers (cache-resident), then (2) runs the
adjoint backwards through the chunk and writes the gradients, reading the chunk's ``z``,
``a``, ``g`` a second time from cache and prefetching each ``gy``/``gz`` row one step ahead
(the walk is backwards through memory). The adjoint walks the whole chunk in one call of
each row kernel (``adjoint_row``, then ``rows.attention_grad_row`` and
``rows.decay_grad_row``), through buffers laid out in its own order (below), so that LLVM
checks its rows for overlap once per chunk instead of once per step. Inputs and ``gy`` are
read from memory once and each gradient written once; for large inputs (``ahead``) step (1)
also prefetches, into L2, the inputs and ``gy`` of the chunk walked next.

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

from .fmath import fexp, load, prefetch_read, prefetch_row, prefetch_write, store
from . import kernel
from ..codes import EXP, NO_DISCOUNT, RELU
from .rows import (attention_grad_row, decay_grad_row, log_decay_grad_rows,
                   log_weight_grad_rows)
from .scan_fwd import input_row, step_row, task_channels, time_index
from .sync import next_task

# Scratch of a task (step_row's docstring has the rule behind so many arrays): running rows
# of w channels, and chunk buffers of w-channel slots in the order the adjoint walks the
# chunk, its last step first: slot ``q`` is the chunk's step ``r = cl - 1 - q``. Per step:
# ``tb`` [C, 2, w] the transforms of the inputs (``dl``, ``dlam`` [C, w] their
# derivatives), ``take`` [C, w], ``gl``, ``glam`` [C, w] the gradients of the transforms.
# Around steps, [C + 1, w]: ``keep`` slot q + 1 the step's weight (slot 0: that of the step
# after the chunk), ``sd``/``sy`` slot q + 1 d~ and y before the step, slot q after it.
# Why this order: LLVM checks the rows a vectorised loop reads and writes for overlap. Where
# their addresses grow with an enclosing loop it checks once for the whole walk; where they
# fall it finds a conflict there and runs scalar code (measured: 3.5x slower), and where
# they come from a load it checks step by step. So the adjoint walks up through these
# buffers and reaches the rows of the (B, T, D) tensors through the time table ``times``
# (whichever way time runs); the recompute, which fills the buffers from the top down,
# takes each step's slot from the table ``order``.
L_, LAM_ = 0, 1             # tb rows


@kernel
def relu_grad_factor_row(a, a_off, take, take_off, m, out, out_off, w, zero, tiny):
    """The relu attention's factor of ``gl = factor x`` (``adjoint_row``): the step's weight
    ``take = exp(l - m)`` (``m`` the running max after the step), except where ``take``
    underflowed (below ``tiny``: ``fexp`` flushes it to 0) and ``a > 0``: there ``exp(-m)``,
    which is ``take / a`` (``a = exp(l)``), so that ``gl`` is ``ga`` itself and a tiny logit
    keeps its gradient (``rows.attention_grad_row`` divides the others by ``a``; no
    overflow: ``exp(-m) < tiny / a`` there). ``out[out_off:][:w]``."""
    ai, ti, oi = np.uint64(a_off), np.uint64(take_off), np.uint64(out_off)
    for j in range(w):
        u = np.uint64(j)
        x = load(a, ai + u, zero)
        t = take[ti + u]
        out[oi + u] = fexp(-m[j]) if (t < tiny and x > zero) else t


@kernel
def adjoint_row(rho, sigma, gl, glam, z, z_base, z_st, sd, sy, take, gfac, keep, gy, base, gz,
                times, with_decay, steps, w, D, zero, one, tiny):
    """The adjoint through one chunk of ``steps`` steps, ``w`` channels, last step first:
    walk step ``q`` is at time ``times[q]``, its chunk buffers at slot ``q`` (layout above).
    ``z`` is read at ``z_base + t * z_st``, ``gy`` read and ``gz`` written at ``base + t *
    D`` (rows of ``(B, T, D)``); ``gl``, ``glam`` are written at slot ``q`` (``gl`` with the
    factor ``gfac``: ``take``, or for relu :func:`relu_grad_factor_row`'s); ``rho``,
    ``sigma`` carry the adjoint from walk step to walk step."""
    line = 64 // gy.itemsize            # elements per cache line
    for q in range(steps):
        go, zo = np.uint64(base + times[q] * D), np.uint64(z_base + times[q] * z_st)
        s_q, s_in = np.uint64(q * w), np.uint64((q + 1) * w)   # after / before the step
        if q + 1 < steps:       # the walk goes back in time: prefetchers would not follow
            nxt = np.uint64(base + times[q + 1] * D)
            for k in range(0, w, line):
                prefetch_read(gy, nxt + np.uint64(k))
                prefetch_write(gz, nxt + np.uint64(k))
        for j in range(w):
            u = np.uint64(j)
            d_j = sd[s_q + u]
            inv_d = zero if d_j == zero else one / d_j
            gi = load(gy, go + u, zero) * inv_d          # (an L2 hit)
            z_j = load(z, zo + u, zero)
            r_later = rho[j] * keep[s_q + u]              # the later steps' part of rho,
            s_later = sigma[j] * keep[s_q + u]            # sigma, flushed below tiny
            r_later = zero if abs(r_later) < tiny else r_later      # (module docstring)
            s_later = zero if abs(s_later) < tiny else s_later
            # z - y of this step as keep d~_prev (z - y_prev) / d~: no cancellation (0
            # exactly when this step is the only weight so far; docs/math.md §4)
            z_y = keep[s_in + u] * sd[s_in + u] * (z_j - sy[s_in + u]) * inv_d
            r_j = r_later + gi
            s_j = s_later + gi * sy[s_q + u]
            rho[j] = r_j
            sigma[j] = s_j
            store(gz, go + u, take[s_q + u] * r_j)
            gl[s_q + u] = gfac[s_q + u] * ((z_j * r_later - s_later) + gi * z_y)
            if with_decay:
                glam[s_q + u] = keep[s_in + u] * sd[s_in + u] * (sy[s_in + u] * r_j - s_j)


@kernel
def backward(claim, tasks, z, a, g, gy, gz, ga, gg, state0, g_final, g_init, ck, consts,
             strides, seq_b, seq_lo, seq_hi, ck_off, T, D, chunk, block, attention, discount,
             reverse, has_init, has_g_final, ahead):
    """Gradients into ``gz, ga, gg`` (flat ``(B, T, D)``) and ``g_init`` (``(3, N, D)``),
    of the tasks of ``tasks``, taken from the counter ``claim`` as :func:`.scan_fwd.forward`
    takes them.

    Arguments as :func:`.scan_fwd.forward` reads them (``gy`` and the gradients contiguous,
    the inputs' rows possibly strided); ``g_final`` holds the ``(2, N, D)`` gradients of the
    final ``n~, d~`` (used with ``has_g_final``); ``ck`` the chunk-start states the forward
    saved. With ``ahead`` (non-zero) the recompute of each chunk prefetches, row by row,
    the inputs and ``gy`` of the chunk walked next (the one before it), into L2.
    """
    zero, one, ninf, tiny = consts[0], consts[1], consts[2], consts[3]
    n_seq = seq_b.shape[0]
    nd = n_seq * D
    n_ck = ck.shape[0] // (3 * D)
    with_decay = discount != NO_DISCOUNT
    dt = consts.dtype
    taken = next_task(claim)                  # the index in ``tasks`` of this thread's task
    while taken < tasks.shape[0]:
        i, lo, w = task_channels(tasks[taken], D, block)
        m, n, d = np.zeros(w, dt), np.zeros(w, dt), np.zeros(w, dt)
        rho, sigma = np.zeros(w, dt), np.zeros(w, dt)
        gl, glam = np.zeros(chunk * w, dt), np.zeros(chunk * w, dt)
        times = np.zeros(chunk, np.int64)       # the adjoint's walk: time of walk step q
        order = np.zeros(chunk, np.int64)       # the recompute's: slot of step r
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
        n_chunks = (length + chunk - 1) // chunk
        b = np.int64(seq_b[i])
        later = 0           # steps of the chunk after this one (0: none)
        for k in range(n_chunks - 1, -1, -1):
            s0 = k * chunk
            cl = min(chunk, length - s0)
            row = np.int64(ck_off[i] + k) * D + lo
            for j in range(w):
                # keep of the step after this chunk: 1 after the last step (the final state
                # is the state after it), else that of the later chunk's first step (its
                # slot ``later``, overwritten below).
                keep[j] = one if later == 0 else keep[later * w + j]
                m[j] = ck[row + j]
                n[j] = ck[n_ck * D + row + j]
                d[j] = ck[2 * n_ck * D + row + j]
                sd[cl * w + j] = d[j]
                sy[cl * w + j] = zero if d[j] == zero else n[j] / d[j]
            for r in range(cl):
                order[r] = cl - 1 - r
                times[cl - 1 - r] = time_index(seq_lo[i], seq_hi[i], s0 + r, reverse)
            for r in range(cl):     # (1) recompute the chunk, step r into slot q = cl - 1 - r
                q = order[r]        # (a load: see the layout above)
                t = times[q]
                oz, oa = input_row(strides, 0, b, t, lo), input_row(strides, 1, b, t, lo)
                if ahead and k > 0:     # the same row of the chunk walked next
                    tp = np.int64(time_index(seq_lo[i], seq_hi[i], s0 - chunk + r, reverse))
                    prefetch_row(z, input_row(strides, 0, b, tp, lo), w, False, True)
                    prefetch_row(a, input_row(strides, 1, b, tp, lo), w, False, True)
                    prefetch_row(gy, (b * T + tp) * D + lo, w, False, True)
                    if with_decay:
                        prefetch_row(g, input_row(strides, 2, b, tp, lo), w, False, True)
                to = q * 2 * w
                if with_decay:
                    log_decay_grad_rows(discount, g, input_row(strides, 2, b, t, lo), tb,
                                        to + LAM_ * w, dlam, q * w, w)
                if attention == EXP:        # l = a, read from the input
                    step_row(m, n, d, tb, to + LAM_ * w, z, oz, a, oa, sy, q * w, sd, q * w,
                             take, q * w, keep, (q + 1) * w, True, w, ninf, zero, one, tiny)
                else:
                    log_weight_grad_rows(attention, a, oa, tb, to + L_ * w, dl, q * w, w)
                    step_row(m, n, d, tb, to + LAM_ * w, z, oz, tb, to + L_ * w, sy, q * w, sd,
                             q * w, take, q * w, keep, (q + 1) * w, True, w, ninf, zero, one,
                             tiny)
                    if attention == RELU:       # (dl/da is not read for relu)
                        relu_grad_factor_row(a, oa, take, q * w, m, dl, q * w, w, zero, tiny)
            # (2) the adjoint, last step first; the chunk's inputs are read a second time,
            # from cache (they were read just above)
            grad0 = b * T * D + lo      # the gradients' (and gy's) row at time 0
            adjoint_row(rho, sigma, gl, glam, z, b * strides[0] + lo, strides[1], sd, sy, take,
                        dl if attention == RELU else take, keep, gy, grad0, gz, times,
                        with_decay, cl, w, D, zero, one, tiny)
            attention_grad_row(attention, gl, dl, take, tiny, a, b * strides[2] + lo, strides[3],
                               ga, grad0, D, times, cl, w)
            if with_decay:
                decay_grad_row(discount, glam, dlam, gg, grad0, D, times, cl, w)
            later = cl
        if has_init:
            for j in range(w):
                m0, n0, d0 = state0[base + j], state0[nd + base + j], state0[2 * nd + base + j]
                # dLoss/dn~_0 = keep_1 rho_1; the first chunk's slot ``later`` holds the
                # first step's keep.
                w0 = one if length == 0 else (zero if m0 == ninf else keep[later * w + j])
                g_init[base + j] = w0 * (n0 * rho[j] - d0 * sigma[j])
                g_init[nd + base + j] = w0 * rho[j]
                g_init[2 * nd + base + j] = -w0 * sigma[j]
        taken = next_task(claim)
