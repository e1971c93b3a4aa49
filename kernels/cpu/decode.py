"""The fused decode step of the byte LM (``fastrwa.models.ByteLM``) on CPU: one compiled call
advances rows ``[lo, hi)`` of a batch through every block and the head, reading each weight
matrix once per call (the bound of a step at batch 1: docs/lm.md, "Generation").

Per block, as ``ByteLM.step_`` computes it (``fastrwa/models/lm.py``)::

    normed = rms_norm(x) * norm1                       inp = [normed, last]  (token shift)
    u, g, a[, c] = W_proj inp + b_proj                 last = normed
    z = u * tanh(g);  scan step (m, n~, d~) with z, a (and the discount logit c);  y = n~ / d~
    h = f_o(f_h(y)) [* sigmoid(W_gate normed + b_gate)];   x = x + h
    x = x + W_down gelu(W_up (rms_norm(x) * norm2) + b_up) + b_down

and then ``logits = W_head (rms_norm(x) * norm_f)``. The scan step is ``scan_fwd.step_row``,
the function of the in-place streaming step, so the state advances bit for bit as the eager
step's does from the same gates. Weights are stacked per kind across blocks, flat, in
``nn.Linear``'s ``(out, in)`` layout: float32, bfloat16 (``uint16`` bits) or int8, with a
float32 scale per output row; the arithmetic is float32 (:func:`linear`).

``T > 1`` runs a prompt: layer by layer, each product on every position at once (a weight
row serves four positions, as in the parallel forward), the scan along each row's positions
in order, and the head after the last position only; ``T = 1`` is one decode step. All
buffers are flat and row-major; batch rows outside ``[lo, hi)`` are not touched, so threads
may run disjoint ranges of rows of one batch at once.
"""

from __future__ import annotations

import numpy as np

from ..codes import EXP, NO_DISCOUNT
from . import kernel, reducing_kernel
from .activations import fsigmoid, ftanh, gelu_row, output_row
from .fmath import F32, load
from .rows import log_decay_row, log_weight_row
from .scan_fwd import step_row
from .sync import (GO, READY, ROSTER, atomic_load, atomic_store, barrier, join,
                   keep_or_give_up, park, share, wait_for, wait_posted)



@reducing_kernel
def rescaled(w, row, s, x, xr, I):
    """``sum_i (w[row + i] s) x[xr + i]``: an output's sum with the weights scaled first,
    for a row whose sum in the weights' own units overflowed (int8: ``|q|`` up to 127 times
    the weights over their scale), as the dequantized weights' product computes it."""
    acc = F32(0.0)
    for i in range(I):
        acc += (load(w, row + np.uint64(i), F32(0.0)) * s) * x[xr + np.uint64(i)]
    return acc


@reducing_kernel
def linear(w, w_off, scale, bias, v_off, x, x_off, x_stride, y, y_off, y_stride, O, I, rows):
    """``y[r, o] = scale[o] * sum_i w[o, i] x[r, i] + bias[o]`` for ``rows`` rows ``r``.

    ``w`` ``(O, I)`` at ``w_off`` (float32, ``uint16`` bfloat16 bits or int8, widened on
    load), ``scale`` and ``bias`` at ``v_off``; row ``r`` of ``x`` at ``x_off + r *
    x_stride``, of ``y`` likewise. A weight row is read once for four input rows (its
    products with them share the load); the sums are reordered to vectorise. A sum that
    overflows before its scale is taken again with the weights scaled (:func:`rescaled`),
    so that int8 weights give what their dequantized float32 values give."""
    zero = F32(0.0)
    wo, vo = np.uint64(w_off), np.uint64(v_off)
    r = 0
    while r + 4 <= rows:
        x0 = np.uint64(x_off + r * x_stride)
        x1, x2, x3 = x0 + np.uint64(x_stride), x0 + np.uint64(2 * x_stride), \
            x0 + np.uint64(3 * x_stride)
        y0 = np.uint64(y_off + r * y_stride)
        for o in range(O):
            row = wo + np.uint64(o * I)
            a0 = a1 = a2 = a3 = zero
            for i in range(I):
                u = np.uint64(i)
                wi = load(w, row + u, zero)
                a0 += wi * x[x0 + u]
                a1 += wi * x[x1 + u]
                a2 += wi * x[x2 + u]
                a3 += wi * x[x3 + u]
            s, b, k = scale[vo + np.uint64(o)], bias[vo + np.uint64(o)], y0 + np.uint64(o)
            if not (np.isfinite(a0) and np.isfinite(a1) and np.isfinite(a2)
                    and np.isfinite(a3)) and s != F32(1.0):
                a0, a1, a2, a3 = rescaled(w, row, s, x, x0, I), rescaled(w, row, s, x, x1, I), \
                    rescaled(w, row, s, x, x2, I), rescaled(w, row, s, x, x3, I)
                s = F32(1.0)
            y[k] = a0 * s + b
            y[k + np.uint64(y_stride)] = a1 * s + b
            y[k + np.uint64(2 * y_stride)] = a2 * s + b
            y[k + np.uint64(3 * y_stride)] = a3 * s + b
        r += 4
    while r < rows:
        xr = np.uint64(x_off + r * x_stride)
        yr = np.uint64(y_off + r * y_stride)
        for o in range(O):
            row = wo + np.uint64(o * I)
            acc = zero
            for i in range(I):
                acc += load(w, row + np.uint64(i), zero) * x[xr + np.uint64(i)]
            s = scale[vo + np.uint64(o)]
            if not np.isfinite(acc) and s != F32(1.0):
                acc, s = rescaled(w, row, s, x, xr, I), F32(1.0)
            y[yr + np.uint64(o)] = acc * s + bias[vo + np.uint64(o)]
        r += 1


@reducing_kernel
def rms_norm_row(x, x_off, weight, w_off, eps, out, o_off, w, lo, hi):
    """``out[o_off:][lo:hi] = (x / sqrt(mean(x^2) + eps) * weight)[lo:hi]`` for the row of
    ``w`` values of ``x`` at ``x_off`` (``torch.nn.RMSNorm``); the mean is over the whole
    row, whatever the part written."""
    xo, wo, oo = np.uint64(x_off), np.uint64(w_off), np.uint64(o_off)
    ss = F32(0.0)
    for j in range(w):
        v = x[xo + np.uint64(j)]
        ss += v * v
    rstd = F32(1.0) / np.sqrt(ss / F32(w) + eps)
    for j in range(lo, hi):
        out[oo + np.uint64(j)] = x[xo + np.uint64(j)] * rstd * weight[wo + np.uint64(j)]


@kernel
def check_tokens(tokens, t_stride, steps, lo, hi, vocab):
    """The first row in ``[lo, hi)`` holding an id outside ``[0, vocab)`` in its first
    ``steps`` positions, or -1."""
    for b in range(lo, hi):
        for t in range(steps):
            v = tokens[b * t_stride + t]
            if v < 0 or v >= vocab:
                return b
    return -1


@kernel
def norm_input(x, norms, eps, normed, inp, last, layer, lo, hi, T, B, D, F, token_shift,
               c_lo, c_hi):
    """Channels ``[c_lo, c_hi)`` of block ``layer``'s first norm of rows ``[lo, hi)`` and of
    the projection's input ``[normed_t, normed_{t-1}]`` (token shift: before ``t = 0`` the
    state's ``last``, which takes the last position's)."""
    for r in range(lo * T, hi * T):
        rms_norm_row(x, r * D, norms, 2 * layer * D, eps[2 * layer], normed, r * D, D, c_lo,
                     c_hi)
        io, no = np.uint64(r * F), np.uint64(r * D)
        for j in range(c_lo, c_hi):
            inp[io + np.uint64(j)] = normed[no + np.uint64(j)]
    if token_shift:
        for b in range(lo, hi):
            so = np.uint64((layer * B + b) * D)
            for t in range(T):
                io = np.uint64((b * T + t) * F + D)
                if t == 0:
                    for j in range(c_lo, c_hi):
                        inp[io + np.uint64(j)] = last[so + np.uint64(j)]
                else:
                    po = np.uint64((b * T + t - 1) * D)
                    for j in range(c_lo, c_hi):
                        inp[io + np.uint64(j)] = normed[po + np.uint64(j)]
            no = np.uint64((b * T + T - 1) * D)
            for j in range(c_lo, c_hi):
                last[so + np.uint64(j)] = normed[no + np.uint64(j)]


@kernel
def decode(tokens, t_stride, T, lo, hi, L, B, D, G, R, V, F, token_shift, gated,
           attention, discount, f_h, f_o, embed, norms, eps, proj_w, proj_s, proj_b,
           gate_w, gate_s, gate_b, up_w, up_s, up_b, down_w, down_s, down_b, head_w, head_s,
           head_b, m, n, d, last, x, normed, inp, proj, z, y, h, gate, hidden, tb, logits,
           consts, part, parts, sync):
    """Advance batch rows ``[lo, hi)`` by ``T`` tokens each and write their logits after the
    last (module doc), as part ``part`` of ``parts`` calls sharing the work (``parts == 1``:
    alone).

    ``tokens``: flat int64, row ``b``'s ids at ``b * t_stride``, checked in range by the
    caller (:func:`check_tokens`). ``L`` blocks of width ``D`` (the scan's ``H = D``), ``G``
    gates (3: RWA, 4: RDA), MLP width ``R``, vocabulary ``V``, projection input ``F`` (``2D``
    with ``token_shift``). ``attention``/``discount``/``f_h``/``f_o``: codes.py. Weights as
    :func:`linear` reads them, stacked ``(L, out, in)``; ``norms`` ``(2L + 1, D)`` (each
    block's two, then the final one) with ``eps`` ``(2L + 1,)``. State (updated in place):
    ``m, n, d`` ``(L, B, D)``, ``last`` ``(L, B, D)``. Work, one row per (batch row,
    position), ``r = b * T + t``: ``x, normed, h, gate, z, y`` ``(B T, D)``, ``inp``
    ``(B T, F)``, ``proj`` ``(B T, G D)``, ``hidden`` ``(B T, R)``, ``tb`` ``(B T, 2 D)``;
    ``logits`` ``(B, V)``. ``consts``: ``[0, 1, -inf, tiny]`` float32. ``sync``:
    ``sync.SYNC_SIZE`` zeros shared by the parts (``sync.py``).

    Layer by layer: every position's products at once (a weight row serves four positions),
    the scan along the positions of each row in order. Shared, each part takes its share of
    every product's outputs and of the channels of everything between products (the
    norms' sums are over whole rows in every part), and the parts meet at a barrier where
    one reads what others wrote; the caller does the embedding and the first norm alone
    while the helpers start (``sync.py`` has the protocol)."""
    zero, one, ninf, tiny = consts[0], consts[1], consts[2], consts[3]
    GD = G * D
    r_lo, r_hi = lo * T, hi * T
    rows = r_hi - r_lo
    if part > 0:
        if not join(sync, part):
            return              # given up: the caller did this part's share
        if wait_for(sync, READY) < 0:
            return              # cancelled before the caller's part began (sync.cancel)
    else:
        for b in range(lo, hi):
            for t in range(T):
                e, xo = np.uint64(tokens[b * t_stride + t] * D), np.uint64((b * T + t) * D)
                for j in range(D):
                    x[xo + np.uint64(j)] = embed[e + np.uint64(j)]
        norm_input(x, norms, eps, normed, inp, last, 0, lo, hi, T, B, D, F, token_shift, 0,
                   D)
        if parts > 1:
            atomic_store(sync, np.uint64(READY), np.int64(1))
    o_lo, o_hi = share(GD, part, parts)         # block 0's projection, shared as started
    linear(proj_w, o_lo * F, proj_s, proj_b, o_lo, inp, r_lo * F, F, proj, r_lo * GD + o_lo,
           GD, o_hi - o_lo, F, rows)
    me = 0
    if parts > 1:
        if part == 0:           # keep the helpers that have started, do the others' shares
            joined = 1
            for p in range(1, parts):
                if keep_or_give_up(sync, p):
                    atomic_store(sync, np.uint64(ROSTER + p), np.int64(joined))
                    joined += 1
                else:
                    o_lo, o_hi = share(GD, p, parts)
                    linear(proj_w, o_lo * F, proj_s, proj_b, o_lo, inp, r_lo * F, F, proj,
                           r_lo * GD + o_lo, GD, o_hi - o_lo, F, rows)
            atomic_store(sync, np.uint64(GO), np.int64(joined))
            parts = joined
        else:
            parts = wait_for(sync, GO)
            me = atomic_load(sync, np.uint64(ROSTER + part))
    k = barrier(sync, parts, 1)
    c_lo, c_hi = share(D, me, parts)            # this part's channels
    cw = c_hi - c_lo
    for layer in range(L):
        if layer > 0:
            norm_input(x, norms, eps, normed, inp, last, layer, lo, hi, T, B, D, F,
                       token_shift, c_lo, c_hi)
            k = barrier(sync, parts, k)
            o_lo, o_hi = share(GD, me, parts)
            linear(proj_w, (layer * GD + o_lo) * F, proj_s, proj_b, layer * GD + o_lo, inp,
                   r_lo * F, F, proj, r_lo * GD + o_lo, GD, o_hi - o_lo, F, rows)
            k = barrier(sync, parts, k)
        for r in range(r_lo, r_hi):
            po, zo = np.uint64(r * GD), np.uint64(r * D)
            for j in range(c_lo, c_hi):
                u = np.uint64(j)
                z[zo + u] = ftanh(proj[po + np.uint64(D) + u]) * proj[po + u]
            # log weights l in tb's first D, log discounts lam in its second
            if discount == NO_DISCOUNT:
                for j in range(c_lo, c_hi):
                    tb[np.uint64(r * 2 * D + D + j)] = zero
            else:
                log_decay_row(discount, proj, r * GD + 3 * D + c_lo, tb, r * 2 * D + D + c_lo,
                              cw)
            if attention != EXP:
                log_weight_row(attention, proj, r * GD + 2 * D + c_lo, tb, r * 2 * D + c_lo,
                               cw)
        for b in range(lo, hi):
            so = (layer * B + b) * D + c_lo
            ms, ns, ds = m[so:so + cw], n[so:so + cw], d[so:so + cw]
            for t in range(T):
                r = b * T + t
                if attention == EXP:           # (l = a, read where it lies)
                    step_row(ms, ns, ds, tb, r * 2 * D + D + c_lo, z, r * D + c_lo, proj,
                             r * GD + 2 * D + c_lo, y, r * D + c_lo, tb, 0, tb, 0, tb, 0,
                             False, cw, ninf, zero, one, tiny)
                else:
                    step_row(ms, ns, ds, tb, r * 2 * D + D + c_lo, z, r * D + c_lo, tb,
                             r * 2 * D + c_lo, y, r * D + c_lo, tb, 0, tb, 0, tb, 0, False,
                             cw, ninf, zero, one, tiny)
        for r in range(r_lo, r_hi):
            output_row(f_h, y, r * D + c_lo, h, r * D + c_lo, cw)
            output_row(f_o, h, r * D + c_lo, h, r * D + c_lo, cw)
        if gated:       # the gate's outputs of this part's channels (normed is complete)
            linear(gate_w, (layer * D + c_lo) * D, gate_s, gate_b, layer * D + c_lo, normed,
                   r_lo * D, D, gate, r_lo * D + c_lo, D, cw, D, rows)
            for r in range(r_lo, r_hi):
                ho = np.uint64(r * D)
                for j in range(c_lo, c_hi):
                    h[ho + np.uint64(j)] *= fsigmoid(gate[ho + np.uint64(j)])
        for r in range(r_lo, r_hi):
            xo = np.uint64(r * D)
            for j in range(c_lo, c_hi):
                x[xo + np.uint64(j)] += h[xo + np.uint64(j)]
        k = barrier(sync, parts, k)
        for r in range(r_lo, r_hi):
            rms_norm_row(x, r * D, norms, (2 * layer + 1) * D, eps[2 * layer + 1], normed,
                         r * D, D, c_lo, c_hi)
        k = barrier(sync, parts, k)
        o_lo, o_hi = share(R, me, parts)
        linear(up_w, (layer * R + o_lo) * D, up_s, up_b, layer * R + o_lo, normed, r_lo * D,
               D, hidden, r_lo * R + o_lo, R, o_hi - o_lo, D, rows)
        for r in range(r_lo, r_hi):
            gelu_row(hidden, r * R + o_lo, o_hi - o_lo)
        k = barrier(sync, parts, k)
        linear(down_w, (layer * D + c_lo) * R, down_s, down_b, layer * D + c_lo, hidden,
               r_lo * R, R, h, r_lo * D + c_lo, D, cw, R, rows)
        for r in range(r_lo, r_hi):
            xo = np.uint64(r * D)
            for j in range(c_lo, c_hi):
                x[xo + np.uint64(j)] += h[xo + np.uint64(j)]
        k = barrier(sync, parts, k)
    for b in range(lo, hi):                # the head on each row's last position only
        r = b * T + T - 1
        rms_norm_row(x, r * D, norms, 2 * L * D, eps[2 * L], normed, r * D, D, c_lo, c_hi)
    k = barrier(sync, parts, k)
    o_lo, o_hi = share(V, me, parts)
    linear(head_w, o_lo * D, head_s, head_b, o_lo, normed, (lo * T + T - 1) * D, T * D, logits,
           lo * V + o_lo, V, o_hi - o_lo, D, hi - lo)
    barrier(sync, parts, k)         # every part's logits are written when the caller returns


@kernel
def serve(tokens, t_stride, T, lo, hi, L, B, D, G, R, V, F, token_shift, gated,
          attention, discount, f_h, f_o, embed, norms, eps, proj_w, proj_s, proj_b,
          gate_w, gate_s, gate_b, up_w, up_s, up_b, down_w, down_s, down_b, head_w, head_s,
          head_b, m, n, d, last, x, normed, inp, proj, z, y, h, gate, hidden, tb, logits,
          consts, part, parts, sync, control):
    """Part ``part`` of every call of :func:`decode` posted on ``control`` with these
    arguments (the caller rewrites ``tokens`` and zeroes ``sync`` before each), parked
    between calls, until none comes for a while (``sync.py``). Returns the calls served."""
    served = 0
    while wait_posted(control, served):
        served += 1
        decode(tokens, t_stride, T, lo, hi, L, B, D, G, R, V, F, token_shift, gated,
               attention, discount, f_h, f_o, embed, norms, eps, proj_w, proj_s, proj_b,
               gate_w, gate_s, gate_b, up_w, up_s, up_b, down_w, down_s, down_b, head_w,
               head_s, head_b, m, n, d, last, x, normed, inp, proj, z, y, h, gate, hidden, tb,
               logits, consts, part, parts, sync)
        park(control)
    return served
