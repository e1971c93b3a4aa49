"""CPU backward of the weighted scan (DESIGN.md §2), one task per (sequence, channel block).

A task walks its chunks last to first. For each chunk it (1) re-runs the forward from the
state the forward saved at the chunk's start, keeping every step's inputs, ``m_t``, ``d~_t``
and ``y_t`` in chunk buffers (``chunk x w`` floats each, cache-resident), then (2) runs the
adjoint scan backwards through the chunk and writes the gradients. Inputs and ``gy`` are read
from memory once and each gradient written once.

The adjoint state ``(M, rho, sigma)`` stands for ``dLoss/dn_t = exp(M) rho`` and
``dLoss/dd_t = -exp(M) sigma``. Step ``t`` folds in the log-weight ``-m_t`` with values
``gy_t / d~_t`` and ``gy_t y_t / d~_t`` (that is ``gy_t exp(-L_t)`` without forming a log),
after decaying by the next step's ``lam``. Then, with every exponent ``<= 0``:

    gz_t = exp(l_t + M) rho        gl_t = exp(l_t + M) (z_t rho - sigma)
    glam_t = exp(m_{t-1} + lam_t + M) d~_{t-1} (y_{t-1} rho - sigma)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_math import fexp
from .cpu_rows import (NO_DISCOUNT, attention_grad_row, decay_grad_row, load_row,
                       store_row)
from .cpu_scan import OPTS, stage_inputs, step_row, time_index

JIT = dict(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})


@njit(**JIT)
def adjoint_row(M, rho, sigma, lam_next, gy, m1, d1, y1, l, z, m0, d0, y0, lam, gz, gl, glam,
                with_decay, w, floor, zero, one):
    """One adjoint step for ``w`` channels; ``*1`` is the state after the step, ``*0`` before."""
    for j in range(w):
        seen = d1[j] > zero
        inv = one / d1[j] if seen else zero
        nl = -m1[j] if seen else floor
        md = max(M[j] + lam_next[j], floor)
        diff = nl - md
        e = fexp(-abs(diff))
        up = diff > zero
        keep = e if up else one
        gi = gy[j] * inv * (one if up else e)
        mj = nl if up else md
        M[j] = mj
        r = rho[j] * keep + gi
        s = sigma[j] * keep + gi * y1[j]
        rho[j], sigma[j] = r, s
        wt = fexp(l[j] + mj)
        gz[j] = wt * r
        gl[j] = wt * (z[j] * r - s)
    if with_decay:
        for j in range(w):
            wp = fexp(m0[j] + lam[j] + M[j]) * d0[j]
            glam[j] = wp * (y0[j] * rho[j] - sigma[j])
            lam_next[j] = lam[j]


@njit(**OPTS)
def backward(z, a, g, gy, gz, ga, gg, T, D, seq_b, seq_lo, seq_hi, state0, has_init, m_final,
             g_final, has_g_final, g_init, ck, ck_off, chunk, attention, discount, reverse,
             block, consts):
    """Gradients into ``gz, ga, gg`` (flat ``(B, T, D)``) and ``g_init`` (``(3, N, D)``).

    Arguments as :func:`kernels.cpu_scan.forward`; ``m_final`` is the forward's final ``m``
    ``(N, D)``; ``g_final`` the ``(2, N, D)`` gradients of the final ``n~, d~``; ``ck`` the
    chunk-start states the forward saved.
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
        ch = np.zeros((5 * chunk, w), consts.dtype)        # [5 C, w] z, a, l, g, lam per step
        st = np.zeros((3 * (chunk + 1), w), consts.dtype)  # [3 (C+1), w] m, d, y around steps
        rows = np.zeros((11, w), consts.dtype)             # [11, w] running rows
        m, n, d = rows[0], rows[1], rows[2]
        M, rho, sigma, lam_next = rows[3], rows[4], rows[5], rows[6]
        gyb, gzb, glb, out = rows[7], rows[8], rows[9], rows[10]
        base = np.int64(i) * D + lo
        for j in range(w):
            M[j] = floor
            if has_g_final:
                mt = m_final[base + j]
                M[j] = -mt if mt > floor else floor
                rho[j] = g_final[base + j]
                sigma[j] = -g_final[nd + base + j]
        length = seq_hi[i] - seq_lo[i]
        for k in range((length + chunk - 1) // chunk - 1, -1, -1):
            s0 = k * chunk
            cl = min(chunk, length - s0)
            row = np.int64(ck_off[i] + k) * D + lo
            for j in range(w):
                m[j] = ck[row + j]
                n[j] = ck[n_ck * D + row + j]
                d[j] = ck[2 * n_ck * D + row + j]
                st[0, j] = m[j]
                st[chunk + 1, j] = d[j]
                st[2 * (chunk + 1), j] = n[j] / d[j] if d[j] > zero else zero
            for r in range(cl):     # (1) recompute the chunk
                t = time_index(seq_lo[i], seq_hi[i], s0 + r, reverse)
                off = (np.int64(seq_b[i]) * T + t) * D + lo
                stage_inputs(z, a, g, off, ch[r], ch[2 * chunk + r], ch[chunk + r],
                             ch[4 * chunk + r], ch[3 * chunk + r], w, attention, discount)
                step_row(m, n, d, st[2 * (chunk + 1) + r + 1], ch[r], ch[2 * chunk + r],
                         ch[4 * chunk + r], w, floor, zero, one)
                for j in range(w):
                    st[r + 1, j] = m[j]
                    st[chunk + 1 + r + 1, j] = d[j]
            for r in range(cl - 1, -1, -1):     # (2) the adjoint, backwards
                t = time_index(seq_lo[i], seq_hi[i], s0 + r, reverse)
                off = (np.int64(seq_b[i]) * T + t) * D + lo
                load_row(gy, off, gyb, w)
                adjoint_row(M, rho, sigma, lam_next, gyb, st[r + 1], st[chunk + 1 + r + 1],
                            st[2 * (chunk + 1) + r + 1], ch[2 * chunk + r], ch[r], st[r],
                            st[chunk + 1 + r], st[2 * (chunk + 1) + r], ch[4 * chunk + r],
                            gzb, glb, out, with_decay, w, floor, zero, one)
                if with_decay:
                    decay_grad_row(discount, out, ch[3 * chunk + r], gyb, w)
                    store_row(gg, off, gyb, w)
                store_row(gz, off, gzb, w)
                attention_grad_row(attention, glb, ch[chunk + r], out, w)
                store_row(ga, off, out, w)
        if has_init:
            for j in range(w):
                m0, n0, d0 = state0[base + j], state0[nd + base + j], state0[2 * nd + base + j]
                scale = max(m0, floor) + lam_next[j] + M[j]
                w0 = one if length == 0 else fexp(scale)
                g_init[base + j] = w0 * (n0 * rho[j] - d0 * sigma[j])
                g_init[nd + base + j] = w0 * rho[j]
                g_init[2 * nd + base + j] = -w0 * sigma[j]
