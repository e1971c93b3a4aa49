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
def rms_norm_row(x, x_off, weight, w_off, eps, out, o_off, w):
    """``out[o_off:][:w] = x / sqrt(mean(x^2) + eps) * weight`` for the row of ``x`` at
    ``x_off`` (``torch.nn.RMSNorm``)."""
    xo, wo, oo = np.uint64(x_off), np.uint64(w_off), np.uint64(o_off)
    ss = F32(0.0)
    for j in range(w):
        v = x[xo + np.uint64(j)]
        ss += v * v
    rstd = F32(1.0) / np.sqrt(ss / F32(w) + eps)
    for j in range(w):
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
def decode(tokens, t_stride, T, lo, hi, L, B, D, G, R, V, F, token_shift, gated,
           attention, discount, f_h, f_o, embed, norms, eps, proj_w, proj_s, proj_b,
           gate_w, gate_s, gate_b, up_w, up_s, up_b, down_w, down_s, down_b, head_w, head_s,
           head_b, m, n, d, last, x, normed, inp, proj, z, y, h, gate, hidden, tb, logits,
           consts):
    """Advance batch rows ``[lo, hi)`` by ``T`` tokens each and write their logits after the
    last (module doc).

    ``tokens``: flat int64, row ``b``'s ids at ``b * t_stride``, checked in range by the
    caller (:func:`check_tokens`). ``L`` blocks of width ``D`` (the scan's ``H = D``), ``G``
    gates (3: RWA, 4: RDA), MLP width ``R``, vocabulary ``V``, projection input ``F`` (``2D``
    with ``token_shift``). ``attention``/``discount``/``f_h``/``f_o``: codes.py. Weights as
    :func:`linear` reads them, stacked ``(L, out, in)``; ``norms`` ``(2L + 1, D)`` (each
    block's two, then the final one) with ``eps`` ``(2L + 1,)``. State (updated in place):
    ``m, n, d`` ``(L, B, D)``, ``last`` ``(L, B, D)``. Work, one row per (batch row,
    position), ``r = b * T + t``: ``x, normed, h, gate, z, y`` ``(B T, D)``, ``inp``
    ``(B T, F)``, ``proj`` ``(B T, G D)``, ``hidden`` ``(B T, R)``, ``tb`` ``(B T, 2 D)``;
    ``logits`` ``(B, V)``. ``consts``: ``[0, 1, -inf, tiny]`` float32.

    Layer by layer: every position's products at once (a weight row serves four positions),
    the scan along the positions of each row in order."""
    zero, one, ninf, tiny = consts[0], consts[1], consts[2], consts[3]
    GD = G * D
    r_lo, r_hi = lo * T, hi * T
    rows = r_hi - r_lo
    for b in range(lo, hi):
        for t in range(T):
            e, xo = np.uint64(tokens[b * t_stride + t] * D), np.uint64((b * T + t) * D)
            for j in range(D):
                x[xo + np.uint64(j)] = embed[e + np.uint64(j)]
    for layer in range(L):
        for r in range(r_lo, r_hi):
            rms_norm_row(x, r * D, norms, 2 * layer * D, eps[2 * layer], normed, r * D, D)
            io, no = np.uint64(r * F), np.uint64(r * D)
            for j in range(D):
                inp[io + np.uint64(j)] = normed[no + np.uint64(j)]
        if token_shift:          # [normed_t, normed_{t-1}], the state's last input before t = 0
            for b in range(lo, hi):
                so = np.uint64((layer * B + b) * D)
                for t in range(T):
                    io = np.uint64((b * T + t) * F + D)
                    if t == 0:
                        for j in range(D):
                            inp[io + np.uint64(j)] = last[so + np.uint64(j)]
                    else:
                        po = np.uint64((b * T + t - 1) * D)
                        for j in range(D):
                            inp[io + np.uint64(j)] = normed[po + np.uint64(j)]
                no = np.uint64((b * T + T - 1) * D)
                for j in range(D):
                    last[so + np.uint64(j)] = normed[no + np.uint64(j)]
        linear(proj_w, layer * GD * F, proj_s, proj_b, layer * GD, inp, r_lo * F, F, proj,
               r_lo * GD, GD, GD, F, rows)
        for r in range(r_lo, r_hi):
            po, zo = np.uint64(r * GD), np.uint64(r * D)
            for j in range(D):
                u = np.uint64(j)
                z[zo + u] = ftanh(proj[po + np.uint64(D) + u]) * proj[po + u]
            # log weights l in tb's first D, log discounts lam in its second
            if discount == NO_DISCOUNT:
                for j in range(D):
                    tb[np.uint64(r * 2 * D + D + j)] = zero
            else:
                log_decay_row(discount, proj, r * GD + 3 * D, tb, r * 2 * D + D, D)
            if attention != EXP:
                log_weight_row(attention, proj, r * GD + 2 * D, tb, r * 2 * D, D)
        for b in range(lo, hi):
            so = (layer * B + b) * D
            ms, ns, ds = m[so:so + D], n[so:so + D], d[so:so + D]
            for t in range(T):
                r = b * T + t
                if attention == EXP:           # (l = a, read where it lies)
                    step_row(ms, ns, ds, tb, r * 2 * D + D, z, r * D, proj, r * GD + 2 * D, y,
                             r * D, tb, 0, tb, 0, tb, 0, False, D, ninf, zero, one, tiny)
                else:
                    step_row(ms, ns, ds, tb, r * 2 * D + D, z, r * D, tb, r * 2 * D, y, r * D,
                             tb, 0, tb, 0, tb, 0, False, D, ninf, zero, one, tiny)
        for r in range(r_lo, r_hi):
            output_row(f_h, y, r * D, h, r * D, D)
            output_row(f_o, h, r * D, h, r * D, D)
        if gated:
            linear(gate_w, layer * D * D, gate_s, gate_b, layer * D, normed, r_lo * D, D, gate,
                   r_lo * D, D, D, D, rows)
            for r in range(r_lo, r_hi):
                ho = np.uint64(r * D)
                for j in range(D):
                    h[ho + np.uint64(j)] *= fsigmoid(gate[ho + np.uint64(j)])
        for r in range(r_lo, r_hi):
            xo = np.uint64(r * D)
            for j in range(D):
                x[xo + np.uint64(j)] += h[xo + np.uint64(j)]
            rms_norm_row(x, r * D, norms, (2 * layer + 1) * D, eps[2 * layer + 1], normed,
                         r * D, D)
        linear(up_w, layer * R * D, up_s, up_b, layer * R, normed, r_lo * D, D, hidden,
               r_lo * R, R, R, D, rows)
        for r in range(r_lo, r_hi):
            gelu_row(hidden, r * R, R)
        linear(down_w, layer * D * R, down_s, down_b, layer * D, hidden, r_lo * R, R, h,
               r_lo * D, D, D, R, rows)
        for r in range(r_lo, r_hi):
            xo = np.uint64(r * D)
            for j in range(D):
                x[xo + np.uint64(j)] += h[xo + np.uint64(j)]
    for b in range(lo, hi):                # the head on each row's last position only
        r = b * T + T - 1
        rms_norm_row(x, r * D, norms, 2 * L * D, eps[2 * L], normed, r * D, D)
    linear(head_w, 0, head_s, head_b, 0, normed, (lo * T + T - 1) * D, T * D, logits, lo * V,
           V, V, D, hi - lo)
