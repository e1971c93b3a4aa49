"""Backward kernels of the weighted scan (docs/math.md §4).

Per chunk, from the chunk's saved incoming forward state, the forward is recomputed in
registers (``y_t``, ``L_t = log d_t``), then the adjoint scan runs the other way in time:
elements ``(-L_t, gy_t, gy_t y_t)`` whose carried state decays by ``lam_{t+1}``, giving
``(M, rho, sigma)`` per row, and

    gz = exp(l + M) rho              gl = exp(l + M) (z rho - sigma)
    glam = exp(L + M) (y rho - sigma) - gl          (= exp(lam) (n_{t-1} nu_t + d_{t-1} delta_t))

with every exponent a log-probability <= 0. No atomics: every output element is written by
exactly one program.

* ``bwd_looped_kernel``: one program per (sequence, channel block) walks the chunks in
  adjoint order, carrying ``(M, rho, sigma)`` in registers; initial-state gradients at the end.
* ``bwd_summary_kernel`` / ``bwd_carry_kernel`` / ``bwd_grads_kernel``: the three phases.
"""

import triton
import triton.language as tl

from .common import (NEG_INF, NO_DISCOUNT, attention_grad, average, chunk_rows, combine,
                     decay_grad, load_chunk, load_state, load_summary, log_decay, log_total,
                     scan_chunk, state_row, store_state, store_summary)
from .sequence import chunk_program, sequence_program


@triton.jit
def _chunk_adjoint(z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, bos, T_i, c, cidx, o_d, mask_d, D, NCT,
                   ATTN: tl.constexpr, DISCOUNT: tl.constexpr, REVERSE: tl.constexpr,
                   BT: tl.constexpr, BD: tl.constexpr):
    """Recompute chunk ``c`` (global index ``cidx``) and scan its adjoint from an empty state.

    Returns the rows' positions and mask, the inputs and forward values the gradients need,
    and the local adjoint ``(M, rho, sigma, G)``, all ``[BT, BD]``.
    """
    o_t, mask_t = chunk_rows(c, T_i, BT, REVERSE)
    mask_2 = mask_t[:, None] & mask_d[None, :]                                         # [BT, BD]
    b_z, b_a, b_g, b_l, b_lam = load_chunk(z_ptr, a_ptr, g_ptr, bos, o_t, mask_t, o_d, mask_d, D,
                                           ATTN, DISCOUNT)                    # [BT, BD] x5
    b_hm, b_hn, b_hd = load_state(hc_ptr, cidx * D + o_d, mask_d, NCT * D)       # [BD] x3
    b_m, b_n, b_d = scan_chunk(b_l, b_z, b_lam, b_hm, b_hn, b_hd)     # [BT, BD] x3
    b_y = average(b_n, b_d)                                                    # [BT, BD]
    b_L = tl.where(mask_2, log_total(b_m, b_d), NEG_INF)                          # [BT, BD]
    o = (bos + o_t).to(tl.int64)[:, None] * D + o_d[None, :]                  # [BT, BD]
    b_gy = tl.load(gy_ptr + o, mask=mask_2, other=0.0).to(tl.float32)           # [BT, BD]
    # The adjoint carried into row t decays by lam of the next row in scan order.
    if DISCOUNT == NO_DISCOUNT:
        b_lam_next = tl.zeros([BT, BD], tl.float32)                           # [BT, BD]
    else:
        if REVERSE:
            o_n = o_t - 1
        else:
            o_n = o_t + 1
        mask_n = ((o_n >= 0) & (o_n < T_i))[:, None] & mask_d[None, :]              # [BT, BD]
        p_n = g_ptr + (bos + o_n).to(tl.int64)[:, None] * D + o_d[None, :]    # [BT, BD]
        b_gn = tl.load(p_n, mask=mask_n, other=0.0).to(tl.float32)               # [BT, BD]
        b_lam_next = tl.where(mask_n, log_decay(b_gn, DISCOUNT), 0.0)             # [BT, BD]
    b_w = tl.where(b_L == NEG_INF, NEG_INF, -b_L)                             # [BT, BD]
    b_AM, b_AR, b_AS, b_AG = tl.associative_scan(
        (b_w, b_gy, b_gy * b_y, b_lam_next), 0, combine, reverse=True)  # [BT, BD] x4
    return o_t, mask_2, b_z, b_a, b_g, b_l, b_y, b_L, b_AM, b_AR, b_AS, b_AG


@triton.jit
def _store_grads(gz_ptr, ga_ptr, gg_ptr, bos, o_t, mask_2, o_d, D, b_z, b_a, b_g, b_l, b_y, b_L,
                 b_M, b_R, b_S, ATTN: tl.constexpr, DISCOUNT: tl.constexpr):
    """Gradients of a chunk from its full adjoint state ``(M, rho, sigma)`` ``[BT, BD]``."""
    b_w = tl.exp(b_l + b_M)                                                    # [BT, BD]
    b_gz = b_w * b_R                                                           # [BT, BD]
    b_gl = b_w * (b_z * b_R - b_S)                                             # [BT, BD]
    o = (bos + o_t).to(tl.int64)[:, None] * D + o_d[None, :]                  # [BT, BD]
    tl.store(gz_ptr + o, b_gz.to(gz_ptr.dtype.element_ty), mask=mask_2)
    b_ga = attention_grad(b_gl, b_a, ATTN)                                     # [BT, BD]
    tl.store(ga_ptr + o, b_ga.to(ga_ptr.dtype.element_ty), mask=mask_2)
    if DISCOUNT != 0:
        b_glam = tl.exp(b_L + b_M) * (b_y * b_R - b_S) - b_gl                  # [BT, BD]
        b_gg = decay_grad(b_glam, b_g, DISCOUNT)                               # [BT, BD]
        tl.store(gg_ptr + o, b_gg.to(gg_ptr.dtype.element_ty), mask=mask_2)


@triton.jit
def _final_adjoint(i, ht_ptr, dht_ptr, o_d, mask_d, D, NS, HAS_FINAL_GRAD: tl.constexpr,
                   BD: tl.constexpr):
    """The adjoint entering at the end: ``(-m_T, gn~, -gd~)`` from the final state's gradient."""
    if HAS_FINAL_GRAD:
        o_s = i.to(tl.int64) * D + o_d                                         # [BD]
        b_mT = tl.load(ht_ptr + o_s, mask=mask_d, other=NEG_INF)                  # [BD]
        b_M = tl.where(b_mT == NEG_INF, NEG_INF, -b_mT)                        # [BD]
        b_M = tl.where(mask_d, b_M, NEG_INF)
        b_R = tl.load(dht_ptr + NS * D + o_s, mask=mask_d, other=0.0)             # [BD]
        b_S = -tl.load(dht_ptr + 2 * NS * D + o_s, mask=mask_d, other=0.0)        # [BD]
    else:
        b_M = tl.full([BD], NEG_INF, tl.float32)
        b_R = tl.zeros([BD], tl.float32)
        b_S = tl.zeros([BD], tl.float32)
    return b_M, b_R, b_S


@triton.jit
def _initial_state_grads(i, g_ptr, h0_ptr, dh0_ptr, bos, T_i, o_d, mask_d, D, NS, b_M, b_R, b_S,
                         DISCOUNT: tl.constexpr, REVERSE: tl.constexpr):
    """``w0 = exp(m0 + lam_first + M)``; ``dm0 = w0 (n0 rho - d0 sigma)``, ``dn0 = w0 rho``, ``dd0 = -w0 sigma``."""
    o_s = i.to(tl.int64) * D + o_d                                             # [BD]
    b_m0, b_n0, b_d0 = load_state(h0_ptr, o_s, mask_d, NS * D)                   # [BD] x3
    if DISCOUNT == NO_DISCOUNT:
        b_lam0 = tl.zeros_like(b_m0)                                           # [BD]
    else:
        if REVERSE:
            first = T_i - 1
        else:
            first = 0
        mask_0 = mask_d & (tl.zeros_like(o_d) < T_i)                                   # [BD]
        b_g0 = tl.load(g_ptr + (bos + first) * D + o_d, mask=mask_0, other=0.0).to(tl.float32)
        b_lam0 = tl.where(mask_0, log_decay(b_g0, DISCOUNT), 0.0)                 # [BD]
    b_w0 = tl.exp(b_m0 + b_lam0 + b_M)                                         # [BD]
    store_state(dh0_ptr, o_s, mask_d, NS * D, b_w0 * (b_n0 * b_R - b_d0 * b_S), b_w0 * b_R,
                -b_w0 * b_S)


@triton.jit
def bwd_looped_kernel(
    z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, h0_ptr, dh0_ptr, ht_ptr, dht_ptr,
    hc_ptr, cu_ptr, co_ptr,
    T, D, NS, NCT,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
):
    i, o_d, mask_d, bos, T_i, c0 = sequence_program(cu_ptr, co_ptr, T, D, BT, BD, IS_VARLEN)
    b_M, b_R, b_S = _final_adjoint(i, ht_ptr, dht_ptr, o_d, mask_d, D, NS, HAS_FINAL_GRAD, BD)
    nc = tl.cdiv(T_i, BT)
    for k in range(0, nc):
        c = nc - 1 - k
        o_t, mask_2, b_z, b_a, b_g, b_l, b_y, b_L, b_AM, b_AR, b_AS, b_AG = _chunk_adjoint(
            z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, bos, T_i, c, c0 + c, o_d, mask_d, D, NCT,
            ATTN, DISCOUNT, REVERSE, BT, BD)
        b_AM, b_AR, b_AS, _ = combine(b_M[None, :], b_R[None, :], b_S[None, :], 0.0,
                                      b_AM, b_AR, b_AS, b_AG)                  # [BT, BD] x3
        _store_grads(gz_ptr, ga_ptr, gg_ptr, bos, o_t, mask_2, o_d, D, b_z, b_a, b_g, b_l, b_y,
                     b_L, b_AM, b_AR, b_AS, ATTN, DISCOUNT)
        b_M, b_R, b_S = state_row(b_AM, b_AR, b_AS, 0, BT)                     # [BD] x3
    if HAS_INIT:
        _initial_state_grads(i, g_ptr, h0_ptr, dh0_ptr, bos, T_i, o_d, mask_d, D, NS, b_M, b_R,
                             b_S, DISCOUNT, REVERSE)


@triton.jit
def bwd_summary_kernel(
    z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, s_ptr, cu_ptr, co_ptr, cs_ptr,
    T, D, NCT,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """Phase 1: every chunk's adjoint ``(M, rho, sigma, G)`` from an empty adjoint state."""
    pid, o_d, mask_d, bos, T_i, c = chunk_program(cu_ptr, co_ptr, cs_ptr, T, D, BT, BD, IS_VARLEN)
    _, _, _, _, _, _, _, _, b_AM, b_AR, b_AS, b_AG = _chunk_adjoint(
        z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, bos, T_i, c, pid, o_d, mask_d, D, NCT,
        ATTN, DISCOUNT, REVERSE, BT, BD)
    store_summary(s_ptr, pid * D + o_d, mask_d, NCT * D, b_AM, b_AR, b_AS, b_AG, 0, BT)


@triton.jit
def bwd_carry_kernel(
    g_ptr, s_ptr, ac_ptr, h0_ptr, dh0_ptr, ht_ptr, dht_ptr, cu_ptr, co_ptr,
    T, D, NS, NCT,
    DISCOUNT: tl.constexpr, HAS_INIT: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """Phase 2: every chunk's incoming adjoint (into ``ac``), then the initial-state gradients."""
    i, o_d, mask_d, bos, T_i, c0 = sequence_program(cu_ptr, co_ptr, T, D, BT, BD, IS_VARLEN)
    b_M, b_R, b_S = _final_adjoint(i, ht_ptr, dht_ptr, o_d, mask_d, D, NS, HAS_FINAL_GRAD, BD)
    nc = tl.cdiv(T_i, BT)
    for k in range(0, nc):
        o_c = (c0 + nc - 1 - k) * D + o_d                                      # [BD]
        store_state(ac_ptr, o_c, mask_d, NCT * D, b_M, b_R, b_S)
        b_sM, b_sR, b_sS, b_sG = load_summary(s_ptr, o_c, mask_d, NCT * D)       # [BD] x4
        b_M, b_R, b_S, _ = combine(b_M, b_R, b_S, 0.0, b_sM, b_sR, b_sS, b_sG)
    if HAS_INIT:
        _initial_state_grads(i, g_ptr, h0_ptr, dh0_ptr, bos, T_i, o_d, mask_d, D, NS, b_M, b_R,
                             b_S, DISCOUNT, REVERSE)


@triton.jit
def bwd_grads_kernel(
    z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, hc_ptr, ac_ptr, cu_ptr, co_ptr, cs_ptr,
    T, D, NCT,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """Phase 3: every chunk from its incoming adjoint writes its gradients."""
    pid, o_d, mask_d, bos, T_i, c = chunk_program(cu_ptr, co_ptr, cs_ptr, T, D, BT, BD, IS_VARLEN)
    o_t, mask_2, b_z, b_a, b_g, b_l, b_y, b_L, b_AM, b_AR, b_AS, b_AG = _chunk_adjoint(
        z_ptr, a_ptr, g_ptr, gy_ptr, hc_ptr, bos, T_i, c, pid, o_d, mask_d, D, NCT,
        ATTN, DISCOUNT, REVERSE, BT, BD)
    b_M, b_R, b_S = load_state(ac_ptr, pid * D + o_d, mask_d, NCT * D)  # [BD] x3
    b_AM, b_AR, b_AS, _ = combine(b_M[None, :], b_R[None, :], b_S[None, :], 0.0,
                                  b_AM, b_AR, b_AS, b_AG)                      # [BT, BD] x3
    _store_grads(gz_ptr, ga_ptr, gg_ptr, bos, o_t, mask_2, o_d, D, b_z, b_a, b_g, b_l, b_y, b_L,
                 b_AM, b_AR, b_AS, ATTN, DISCOUNT)
