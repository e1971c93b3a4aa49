"""Backward kernels of the weighted scan (docs/math.md §4).

Per chunk, from the chunk's saved incoming forward state, the forward is recomputed in
registers (``m_t``, ``d~_t``, ``y_t``), with each step's weights ``take_t = exp(l_t - m_t)``
and ``keep_t = exp(m_{t-1} + lam_t - m_t)``. The adjoint is back-propagation through the
stabilised recurrence: a linear recurrence in normal space (every factor ``<= 1``, no
exponent), run the other way in time:

    W_t = keep_t (W_{t+1} + gi_t)           gi_t = gy_t / d~_t
    V_t = keep_t (V_{t+1} + gi_t y_t)

``(W_t, V_t)`` is what step ``t`` passes back to the state before it (``dLoss/dn~_{t-1}``,
``-dLoss/dd~_{t-1}``), so the later steps' part of step ``t``'s own adjoint is
``(P_t, Q_t) = (W_{t+1}, V_{t+1})``, one row on (a shift in registers), and

    rho = P + gi             sigma = Q + gi y
    gz = take rho            gl = take ((z P - Q) + gi (z - y))
    glam = keep d~_{t-1} (y_{t-1} rho - sigma)
    z - y = keep d~_{t-1} (z - y_{t-1}) / d~

(the previous row's ``m``, ``d~``, ``y`` come from a shift in registers). Keeping the later
part apart from the step's own ``gi``, and forming ``z - y`` from the previous row, leaves
``gl`` without cancellation (a small logit that is, or nearly is, the only weight so far
keeps its gradient). ``+inf`` logits get the
limits the forward uses (equal infinite arguments weigh 1). The initial state's gradients
are the ``(W, V)`` of the first step. No atomics: every output element is written by exactly
one program.

A program covers a segment of a sequence for a block of channels, as in the forward
(scan_fwd.py), and walks its chunks in adjoint order carrying ``(W, V)`` in registers,
loading the next chunk's inputs and saved state while it works on this one (a register
double buffer, as the forward does; ``LOOKAHEAD``, chosen per build by the launcher):

* ``bwd_kernel`` with ``PHASE = ONE_PASS``: each sequence is one segment; from the final
  state's gradient, writes the gradients and, at the end, the initial state's.
* The "segments" algorithm: ``bwd_kernel`` with ``PHASE = SUMMARY`` (every segment's local
  adjoint ``(K, W, V)`` at its first row, from nothing entering it), ``bwd_carry_kernel``
  (per sequence, the ``(W, V)`` entering every segment after its last row, and the initial
  state's gradients), ``bwd_kernel`` with ``PHASE = OUTPUT`` (every segment's gradients from
  the adjoint entering it).

The walk over a segment's chunks is :func:`walk_adjoint`, which ``bwd_kernel``'s phases and
the "chained" backward (scan_chained.py: both walks in one launch) call.
"""

import triton
import triton.language as tl

from .common import (ONE_PASS, SUMMARY, attention_grad, average, chunk_offsets, chunk_rows,
                     decay_grad, decayed, linear_combine, load_chunk, load_state, log_weights,
                     next_rows, own_weight, plane, previous_rows,
                     reverse_linear_scan, row, scan_chunk, state_scale, step_weights,
                     store_state)
from .sequence import first_segment, segment_program, segments, sequence_program


@triton.jit
def _load_inputs(z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, bos, T_i, c, c_lo, c0, o_d, mask_d,
                 D: tl.constexpr, NCT, DISCOUNT: tl.constexpr, REVERSE: tl.constexpr,
                 BT: tl.constexpr):
    """What the adjoint of chunk ``c`` reads: ``z, a, g, gy`` ``[BT, BD]`` (float32) and the
    chunk's saved incoming state ``(m, n~, d~)`` ``[BD]``. Nothing is read for ``c < c_lo``
    (the chunk before the segment's first, which the double buffer asks for last). Inputs
    are ``i_``-named in the caller: this chunk's, whichever iteration loaded them."""
    live = c >= c_lo
    c = tl.maximum(c, c_lo)                         # in bounds even when nothing is read
    t0, o_dt, _ = chunk_rows(c, T_i, BT, REVERSE)
    # chunk_rows' mask, or no row (tl.where: the interpreter cannot AND a block with a scalar)
    mask_t = tl.arange(0, BT) < tl.where(live, T_i - c * BT, 0)               # [BT]
    o = chunk_offsets(bos, t0, o_dt, o_d, D)                                   # [BT, BD]
    mask_2 = mask_t[:, None] & mask_d[None, :]                                 # [BT, BD]
    b_z, b_a, b_g = load_chunk(z_ptr, a_ptr, g_ptr, o, mask_2, DISCOUNT)       # [BT, BD] x3
    b_gy = tl.load(gy_ptr + o, mask=mask_2, other=0.0).to(tl.float32)          # [BT, BD]
    mask_s = tl.where(live, mask_d, False)                                     # [BD]
    b_hm, b_hn, b_hd = load_state(hc_ptr, (c0 + c) * D + o_d, mask_s, NCT * D)  # [BD] x3
    return b_z, b_a, b_g, b_gy, b_hm, b_hn, b_hd


@triton.jit
def _chunk_adjoint(b_z, b_a, b_g, b_gy, b_hm, b_hn, b_hd, b_cW, b_cV, bos, T_i, c, o_d,
                   mask_d, D: tl.constexpr, ATTN: tl.constexpr, DISCOUNT: tl.constexpr,
                   NEWTON: tl.constexpr, REVERSE: tl.constexpr, BT: tl.constexpr):
    """Recompute chunk ``c`` from its inputs and saved incoming state (:func:`_load_inputs`)
    and scan its adjoint from the ``(W, V)`` ``[BD]`` entering after its last row (``b_cW``,
    ``b_cV``; zeros for the chunk's local adjoint), folded into that row: ``W_last =
    keep (cW + gi)``.

    Returns the rows' offsets and mask, the inputs and forward values the gradients need
    (``take``, ``m``, ``gi``, ``y``, ``z - y``, ``keep d~_{t-1}``, ``y_{t-1}``), and the
    adjoint
    ``(K, W, V)`` of every row, ``K`` the product of the keeps from the row to the last (the
    factor of what enters after the chunk; unused, and so never computed, unless a caller
    reads it). All ``[BT, BD]``.
    """
    t0, o_dt, mask_t = chunk_rows(c, T_i, BT, REVERSE)
    o = chunk_offsets(bos, t0, o_dt, o_d, D)                                   # [BT, BD]
    mask_2 = mask_t[:, None] & mask_d[None, :]                                 # [BT, BD]
    b_l, b_lam = log_weights(b_a, b_g, mask_2, ATTN, DISCOUNT, NEWTON)         # [BT, BD] x2
    b_m, b_n, b_d, _ = scan_chunk(b_l, b_z, b_lam, b_hm, b_hn, b_hd)           # [BT, BD] x3
    b_y = average(b_n, b_d, NEWTON)                                            # [BT, BD]
    b_take = own_weight(b_l, b_m)                                              # [BT, BD]
    b_mp, b_dp, b_yp = previous_rows(b_m, b_hm, b_d, b_hd, b_y,
                                     average(b_hn, b_hd, NEWTON))             # [BT, BD] x3
    _, b_keep, _ = step_weights(decayed(b_mp, b_lam), b_l)                     # [BT, BD]
    b_keep = tl.where(mask_2, b_keep, 1.0)          # rows past the end pass the adjoint on
    b_kd = b_keep * b_dp                            # the previous rows' weight, kept
    b_zy = average(b_kd * (b_z - b_yp), b_d, NEWTON)    # z - y, no cancellation  # [BT, BD]
    b_gi = average(b_gy, b_d, NEWTON)                                          # [BT, BD]
    b_last = (tl.arange(0, BT) == BT - 1)[:, None]                             # [BT, 1]
    b_K, b_W, b_V = reverse_linear_scan(
        b_keep, b_keep * (b_gi + tl.where(b_last, b_cW[None, :], 0.0)),
        b_keep * (b_gi * b_y + tl.where(b_last, b_cV[None, :], 0.0)))        # [BT, BD] x3
    return o, mask_2, b_z, b_a, b_g, b_take, b_m, b_gi, b_y, b_zy, b_kd, b_yp, b_K, b_W, b_V


@triton.jit
def _store_grads(gz_ptr, ga_ptr, gg_ptr, o, mask_2, b_z, b_a, b_g, b_take, b_m, b_gi, b_y, b_zy,
                 b_kd, b_yp, b_P, b_Q, ATTN: tl.constexpr, DISCOUNT: tl.constexpr,
                 NEWTON: tl.constexpr):
    """Gradients of a chunk from the later steps' adjoint ``(P, Q)`` ``[BT, BD]``."""
    b_rho = b_P + b_gi                                                         # [BT, BD]
    b_x = (b_z * b_P - b_Q) + b_gi * b_zy                                      # [BT, BD]
    b_gl = b_take * b_x                                                        # [BT, BD]
    tl.store(gz_ptr + o, (b_take * b_rho).to(gz_ptr.dtype.element_ty), mask=mask_2)
    b_ga = attention_grad(b_gl, b_a, ATTN, NEWTON, b_x, b_take, b_m)           # [BT, BD]
    tl.store(ga_ptr + o, b_ga.to(ga_ptr.dtype.element_ty), mask=mask_2)
    if DISCOUNT != 0:
        b_glam = b_kd * (b_yp * b_rho - (b_Q + b_gi * b_y))                    # [BT, BD]
        b_gg = decay_grad(b_glam, b_g, DISCOUNT, NEWTON)                       # [BT, BD]
        tl.store(gg_ptr + o, b_gg.to(gg_ptr.dtype.element_ty), mask=mask_2)


@triton.jit
def _chunk_grads(gz_ptr, ga_ptr, gg_ptr, o, mask_2, b_z, b_a, b_g, b_take, b_m, b_gi, b_y, b_zy,
                 b_kd, b_yp, b_W, b_V, b_cW, b_cV, ATTN: tl.constexpr, DISCOUNT: tl.constexpr,
                 NEWTON: tl.constexpr, BT: tl.constexpr):
    """Gradients of a chunk from its adjoint ``(W, V)`` ``[BT, BD]`` and the ``(W, V)``
    ``[BD]`` entering after its last row; returns the ``(W, V)`` ``[BD]`` of its first row
    (passed to the state before it)."""
    b_P, b_Q = next_rows(b_W, b_cW, b_V, b_cV)                                # [BT, BD] x2
    _store_grads(gz_ptr, ga_ptr, gg_ptr, o, mask_2, b_z, b_a, b_g, b_take, b_m, b_gi, b_y, b_zy,
                 b_kd, b_yp, b_P, b_Q, ATTN, DISCOUNT, NEWTON)
    o_r = tl.arange(0, BT)
    return row(b_W, o_r, 0), row(b_V, o_r, 0)


@triton.jit
def final_adjoint(i, dht_ptr, o_d, mask_d, D: tl.constexpr, NS, HAS_FINAL_GRAD: tl.constexpr,
                  BD: tl.constexpr):
    """The adjoint entering after the last step: ``(W, V) = (gn~, -gd~)`` of the final state."""
    if HAS_FINAL_GRAD:
        o_s = i.to(tl.int64) * D + o_d                                         # [BD]
        b_W = tl.load(plane(dht_ptr, 1, NS * D) + o_s, mask=mask_d, other=0.0)    # [BD]
        b_V = -tl.load(plane(dht_ptr, 2, NS * D) + o_s, mask=mask_d, other=0.0)   # [BD]
    else:
        b_W = tl.zeros([BD], tl.float32)
        b_V = tl.zeros([BD], tl.float32)
    return b_W, b_V


@triton.jit
def initial_state_grads(i, h0_ptr, dh0_ptr, o_d, mask_d, D: tl.constexpr, NS, b_W, b_V):
    """``dn0 = W``, ``dd0 = -V`` (what the first step passes back), ``dm0 = n0 dn0 + d0 dd0``;
    ``W`` and ``V`` times :func:`state_scale` where the forward took the state scaled
    (:func:`initial_state`)."""
    o_s = i.to(tl.int64) * D + o_d                                             # [BD]
    _, b_n0, b_d0 = load_state(h0_ptr, o_s, mask_d, NS * D)                      # [BD] x2
    b_s = state_scale(b_d0)                                                    # [BD]
    # (dm0 from the state as the forward took it: finite where s W overflows)
    b_dm = (b_n0 * b_s) * b_W - (b_d0 * b_s) * b_V                             # [BD]
    store_state(dh0_ptr, o_s, mask_d, NS * D, b_dm, b_W * b_s, -(b_V * b_s))


@triton.jit
def walk_adjoint(z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, hc_ptr, b_W, b_V, bos,
                 T_i, c0, c_lo, c_hi, o_d, mask_d, NCT, D: tl.constexpr, ATTN: tl.constexpr,
                 DISCOUNT: tl.constexpr, SUMMARISE: tl.constexpr, REVERSE: tl.constexpr,
                 LOOKAHEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Walk chunks ``[c_lo, c_hi)`` of a sequence (row ``bos``, length ``T_i``, saved states
    from row ``c0`` of ``hc``) in adjoint order, last first. ``SUMMARISE``: from nothing
    entering (``b_W``, ``b_V`` unused), returns the segment's local adjoint ``(K, W, V)``
    ``[BD]`` at its first row; otherwise from the ``(W, V)`` ``[BD]`` entering after its last
    row, stores the gradients and returns ``(1, W, V)`` at its first row (what passes to the
    state before it). ``LOOKAHEAD``: :func:`bwd_kernel`."""
    NEWTON: tl.constexpr = z_ptr.dtype.element_ty == tl.float32     # (common.reciprocal)
    b_sK = tl.full([BD], 1.0, tl.float32)                                      # [BD]
    if SUMMARISE:
        b_W = tl.zeros([BD], tl.float32)                                       # [BD]
        b_V = tl.zeros([BD], tl.float32)                                       # [BD]
    if LOOKAHEAD == 1:      # the last chunk's inputs, before the loop
        b_z, b_a, b_g, b_gy, b_hm, b_hn, b_hd = _load_inputs(
            z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, bos, T_i, c_hi - 1, c_lo, c0, o_d, mask_d, D,
            NCT, DISCOUNT, REVERSE, BT)                              # [BT, BD] x4, [BD] x3
    for k in range(0, c_hi - c_lo):
        c = c_hi - 1 - k
        if LOOKAHEAD == 1:
            # the next chunk's loads are issued before this chunk's recompute waits on its own
            n_z, n_a, n_g, n_gy, n_hm, n_hn, n_hd = _load_inputs(
                z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, bos, T_i, c - 1, c_lo, c0, o_d, mask_d, D,
                NCT, DISCOUNT, REVERSE, BT)                          # [BT, BD] x4, [BD] x3
            i_z, i_a, i_g, i_gy, i_hm, i_hn, i_hd = b_z, b_a, b_g, b_gy, b_hm, b_hn, b_hd
            b_z, b_a, b_g, b_gy, b_hm, b_hn, b_hd = n_z, n_a, n_g, n_gy, n_hm, n_hn, n_hd
        else:
            i_z, i_a, i_g, i_gy, i_hm, i_hn, i_hd = _load_inputs(
                z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, bos, T_i, c, c, c0, o_d, mask_d, D,
                NCT, DISCOUNT, REVERSE, BT)      # (always read)     # [BT, BD] x4, [BD] x3
        if SUMMARISE:
            b_cW = tl.zeros([BD], tl.float32)       # the chunk's local adjoint
            b_cV = tl.zeros([BD], tl.float32)
        else:
            b_cW, b_cV = b_W, b_V                   # the adjoint entering after the chunk
        (o, mask_2, i_z, i_a, i_g, b_take, b_m, b_gi, b_y, b_zy, b_kd, b_yp, b_K, b_AW,
         b_AV) = _chunk_adjoint(i_z, i_a, i_g, i_gy, i_hm, i_hn, i_hd, b_cW, b_cV, bos, T_i, c,
                                o_d, mask_d, D, ATTN, DISCOUNT, NEWTON, REVERSE, BT)
        if SUMMARISE:
            o_r = tl.arange(0, BT)
            b_cK = row(b_K, o_r, 0)                                            # [BD]
            b_sK, b_W, b_V = linear_combine(b_sK, b_W, b_V, b_cK, row(b_AW, o_r, 0),
                                            row(b_AV, o_r, 0))                # [BD] x3
        else:
            b_W, b_V = _chunk_grads(gz_ptr, ga_ptr, gg_ptr, o, mask_2, i_z, i_a, i_g, b_take,
                                    b_m, b_gi, b_y, b_zy, b_kd, b_yp, b_AW, b_AV, b_W, b_V,
                                    ATTN, DISCOUNT, NEWTON, BT)               # [BD] x2
    return b_sK, b_W, b_V


@triton.jit
def bwd_kernel(
    z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, h0_ptr, dh0_ptr, dht_ptr,
    hc_ptr, s_ptr, cu_ptr, co_ptr, so_ptr, ss_ptr,
    T, CPS, NS, NCT, NSEG, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, PHASE: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
    LOOKAHEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """One segment: ``ONE_PASS`` from the final state's gradient ``dht`` (initial state's into
    ``dh0``), ``SUMMARY`` from nothing entering it (its ``(K, W, V)`` into ``s``,
    ``(3, NSEG, D)``), ``OUTPUT`` from the ``(W, V)`` entering it in ``s`` (``(2, NSEG, D)``,
    the carry kernel's). ``LOOKAHEAD`` 1 loads each chunk's inputs one chunk ahead (a
    register double buffer), 0 where it is used (for the builds whose registers do not hold
    two chunks' inputs without spilling)."""
    pid, i, o_d, mask_d, bos, T_i, c0, c_lo, c_hi = segment_program(
        cu_ptr, co_ptr, so_ptr, ss_ptr, T, CPS, D, BT, BD, IS_VARLEN, PHASE == ONE_PASS)
    o_seg = pid * D + o_d                                                      # [BD]
    if PHASE == ONE_PASS:
        b_W, b_V = final_adjoint(i, dht_ptr, o_d, mask_d, D, NS, HAS_FINAL_GRAD, BD)  # [BD] x2
    elif PHASE == SUMMARY:
        b_W, b_V = final_adjoint(i, dht_ptr, o_d, mask_d, D, NS, False, BD)  # [BD] x2
    else:
        b_W = tl.load(s_ptr + o_seg, mask=mask_d, other=0.0)                   # [BD]
        b_V = tl.load(s_ptr + NSEG * D + o_seg, mask=mask_d, other=0.0)        # [BD]
    b_sK, b_W, b_V = walk_adjoint(
        z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, hc_ptr, b_W, b_V, bos, T_i, c0,
        c_lo, c_hi, o_d, mask_d, NCT, D, ATTN, DISCOUNT, PHASE == SUMMARY, REVERSE,
        LOOKAHEAD, BT, BD)                                                     # [BD] x3
    if PHASE == SUMMARY:
        store_state(s_ptr, o_seg, mask_d, NSEG * D, b_sK, b_W, b_V)
    elif PHASE == ONE_PASS and HAS_INIT:
        initial_state_grads(i, h0_ptr, dh0_ptr, o_d, mask_d, D, NS, b_W, b_V)


@triton.jit
def bwd_carry_kernel(
    s_ptr, ac_ptr, h0_ptr, dh0_ptr, dht_ptr, cu_ptr, co_ptr, so_ptr,
    T, CPS, NS, NSEG, D: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr, IS_VARLEN: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, KT: tl.constexpr,
):
    """Phase 2: per sequence, the ``(W, V)`` entering every segment after its last row (into
    ``ac``, ``(2, NSEG, D)``) from the summaries ``s`` (``(3, NSEG, D)``), then the initial
    state's gradients. ``KT`` segments at a time, last first: their summaries loaded
    together, the carried ``(W, V)`` folded into the last, the tile scanned back in time in
    registers."""
    i, o_d, mask_d, bos, T_i, c0 = sequence_program(cu_ptr, co_ptr, T, D, BT, BD, IS_VARLEN)
    s0 = first_segment(i, so_ptr, T, CPS, BT, IS_VARLEN)
    b_W, b_V = final_adjoint(i, dht_ptr, o_d, mask_d, D, NS, HAS_FINAL_GRAD, BD)   # [BD] x2
    n_seg = segments(T_i, CPS, BT)
    o_r = tl.arange(0, KT)                                                     # [KT]
    b_last = (o_r == KT - 1)[:, None]                                          # [KT, 1]
    for k in range(0, tl.cdiv(n_seg, KT)):
        o_j = n_seg - (k + 1) * KT + o_r                                       # [KT]
        mask = (o_j >= 0)[:, None] & mask_d[None, :]                           # [KT, BD]
        o_k = (s0 + o_j)[:, None] * D + o_d[None, :]                           # [KT, BD]
        # (rows before the first segment pass the adjoint through: K = 1, W = V = 0)
        b_sK = tl.load(s_ptr + o_k, mask=mask, other=1.0)                      # [KT, BD]
        b_sW = tl.load(plane(s_ptr, 1, NSEG * D) + o_k, mask=mask, other=0.0)  # [KT, BD]
        b_sV = tl.load(plane(s_ptr, 2, NSEG * D) + o_k, mask=mask, other=0.0)  # [KT, BD]
        _, f_W, f_V = linear_combine(1.0, b_W[None, :], b_V[None, :], b_sK, b_sW,
                                     b_sV)                                     # [KT, BD] x2
        b_sW = tl.where(b_last, f_W, b_sW)                                     # [KT, BD]
        b_sV = tl.where(b_last, f_V, b_sV)                                     # [KT, BD]
        # (W, V) before each segment, then each one's entering: the next row's
        _, b_PW, b_PV = reverse_linear_scan(b_sK, b_sW, b_sV)                  # [KT, BD] x3
        b_eW, b_eV = next_rows(b_PW, b_W, b_PV, b_V)                           # [KT, BD] x2
        tl.store(ac_ptr + o_k, b_eW, mask=mask)
        tl.store(plane(ac_ptr, 1, NSEG * D) + o_k, b_eV, mask=mask)
        b_W, b_V = row(b_PW, o_r, 0), row(b_PV, o_r, 0)                        # [BD] x2
    if HAS_INIT:
        initial_state_grads(i, h0_ptr, dh0_ptr, o_d, mask_d, D, NS, b_W, b_V)
