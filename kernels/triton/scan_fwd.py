"""Forward kernels of the weighted scan.

* ``fwd_looped_kernel``: one program per (sequence, channel block) walks its sequence in
  chunks of ``BT`` steps, scans each chunk with ``tl.associative_scan`` and carries
  ``(m, n~, d~)`` in registers, loading the next chunk while it scans this one (a register
  double buffer). Reads every input once, writes ``y`` once, and (``SAVE_CHUNKS``) the 3
  floats per channel of each chunk's incoming state for the backward.
* ``fwd_summary_kernel`` / ``fwd_carry_kernel`` / ``fwd_output_kernel``: the three-phase
  algorithm for long sequences with few channels: every chunk summarises itself in parallel,
  the summaries are scanned per sequence, every chunk re-runs from its incoming state.

State buffers are float32 ``(3, rows, D)``: ``m``, ``n~``, ``d~``; chunk summaries add ``G``.
The launcher gives each thread whole channel columns of a ``[BT, BD]`` block (``BD`` a
multiple of 32 x warps), so every scan along time runs in a thread's registers.
"""

import triton
import triton.language as tl

from .common import (average, chunk_offsets, chunk_rows, combine, initial_state, load_chunk,
                     load_state, load_summary, log_weights, scan_chunk, state_row, store_state,
                     store_summary)
from .sequence import chunk_program, sequence_program


@triton.jit
def _load(z_ptr, a_ptr, g_ptr, bos, T_i, c, o_d, mask_d, D: tl.constexpr, DISCOUNT: tl.constexpr,
          REVERSE: tl.constexpr, BT: tl.constexpr):
    """The raw ``z, a, g`` ``[BT, BD]`` of chunk ``c`` (all masked past the last chunk)."""
    t0, o_dt, mask_t = chunk_rows(c, T_i, BT, REVERSE)
    return load_chunk(z_ptr, a_ptr, g_ptr, chunk_offsets(bos, t0, o_dt, o_d, D),
                      mask_t[:, None] & mask_d[None, :], DISCOUNT)


@triton.jit
def fwd_looped_kernel(
    z_ptr, a_ptr, g_ptr, y_ptr, h0_ptr, ht_ptr, hc_ptr, cu_ptr, co_ptr,
    T, NS, NCT, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, SAVE_CHUNKS: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    i, o_d, mask_d, bos, T_i, c0 = sequence_program(cu_ptr, co_ptr, T, D, BT, BD, IS_VARLEN)
    o_s = i.to(tl.int64) * D + o_d                                             # [BD]
    b_hm, b_hn, b_hd = initial_state(h0_ptr, o_s, mask_d, NS * D, HAS_INIT, BD)
    b_z, b_a, b_g = _load(z_ptr, a_ptr, g_ptr, bos, T_i, 0, o_d, mask_d, D, DISCOUNT, REVERSE,
                          BT)                                                  # [BT, BD] x3
    for c in range(0, tl.cdiv(T_i, BT)):
        if SAVE_CHUNKS:
            store_state(hc_ptr, (c0 + c) * D + o_d, mask_d, NCT * D, b_hm, b_hn, b_hd)
        # the next chunk's loads are issued before this chunk's scan waits on its own
        n_z, n_a, n_g = _load(z_ptr, a_ptr, g_ptr, bos, T_i, c + 1, o_d, mask_d, D, DISCOUNT,
                              REVERSE, BT)                                     # [BT, BD] x3
        t0, o_dt, mask_t = chunk_rows(c, T_i, BT, REVERSE)
        mask = mask_t[:, None] & mask_d[None, :]                               # [BT, BD]
        b_l, b_lam = log_weights(b_a, b_g, mask, ATTN, DISCOUNT)               # [BT, BD] x2
        b_m, b_n, b_d = scan_chunk(b_l, b_z, b_lam, b_hm, b_hn, b_hd)          # [BT, BD] x3
        tl.store(y_ptr + chunk_offsets(bos, t0, o_dt, o_d, D),
                 average(b_n, b_d).to(y_ptr.dtype.element_ty), mask=mask)
        b_hm, b_hn, b_hd = state_row(b_m, b_n, b_d, BT - 1, BT)                # [BD] x3
        b_z, b_a, b_g = n_z, n_a, n_g
    if STORE_FINAL:
        store_state(ht_ptr, o_s, mask_d, NS * D, b_hm, b_hn, b_hd)


@triton.jit
def _chunk(z_ptr, a_ptr, g_ptr, bos, T_i, c, o_d, mask_d, D: tl.constexpr, ATTN: tl.constexpr,
           DISCOUNT: tl.constexpr, REVERSE: tl.constexpr, BT: tl.constexpr):
    """Chunk ``c``'s offsets and mask ``[BT, BD]``, values and log-weights and -decays."""
    t0, o_dt, mask_t = chunk_rows(c, T_i, BT, REVERSE)
    o = chunk_offsets(bos, t0, o_dt, o_d, D)                                   # [BT, BD]
    mask = mask_t[:, None] & mask_d[None, :]                                   # [BT, BD]
    b_z, b_a, b_g = load_chunk(z_ptr, a_ptr, g_ptr, o, mask, DISCOUNT)         # [BT, BD] x3
    b_l, b_lam = log_weights(b_a, b_g, mask, ATTN, DISCOUNT)                   # [BT, BD] x2
    return o, mask, b_z, b_l, b_lam


@triton.jit
def fwd_summary_kernel(
    z_ptr, a_ptr, g_ptr, s_ptr, cu_ptr, co_ptr, cs_ptr,
    T, NCT, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """Phase 1: every chunk's ``(m, n~, d~, G)`` from an empty state, into ``(4, NCT, D)``."""
    pid, o_d, mask_d, bos, T_i, c = chunk_program(cu_ptr, co_ptr, cs_ptr, T, D, BT, BD, IS_VARLEN)
    _, _, b_z, b_l, b_lam = _chunk(z_ptr, a_ptr, g_ptr, bos, T_i, c, o_d, mask_d, D, ATTN,
                                   DISCOUNT, REVERSE, BT)                      # [BT, BD] x3
    b_one = tl.full([BT, BD], 1.0, tl.float32)                                 # [BT, BD]
    b_m, b_n, b_d, b_G = tl.associative_scan((b_l, b_z, b_one, b_lam), 0,
                                             combine)                          # [BT, BD] x4
    store_summary(s_ptr, pid * D + o_d, mask_d, NCT * D, b_m, b_n, b_d, b_G, BT - 1, BT)


@triton.jit
def fwd_carry_kernel(
    s_ptr, h0_ptr, ht_ptr, hc_ptr, cu_ptr, co_ptr,
    T, NS, NCT, D: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
):
    """Phase 2: per sequence, every chunk's incoming state (into ``hc``) and the final state."""
    i, o_d, mask_d, bos, T_i, c0 = sequence_program(cu_ptr, co_ptr, T, D, BT, BD, IS_VARLEN)
    o_s = i.to(tl.int64) * D + o_d                                             # [BD]
    b_hm, b_hn, b_hd = initial_state(h0_ptr, o_s, mask_d, NS * D, HAS_INIT, BD)
    for c in range(0, tl.cdiv(T_i, BT)):
        o_c = (c0 + c) * D + o_d                                               # [BD]
        store_state(hc_ptr, o_c, mask_d, NCT * D, b_hm, b_hn, b_hd)
        b_sm, b_sn, b_sd, b_sG = load_summary(s_ptr, o_c, mask_d, NCT * D)       # [BD] x4
        b_hm, b_hn, b_hd, _ = combine(b_hm, b_hn, b_hd, 0.0, b_sm, b_sn, b_sd, b_sG)
    if STORE_FINAL:
        store_state(ht_ptr, o_s, mask_d, NS * D, b_hm, b_hn, b_hd)


@triton.jit
def fwd_output_kernel(
    z_ptr, a_ptr, g_ptr, y_ptr, hc_ptr, cu_ptr, co_ptr, cs_ptr,
    T, NCT, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """Phase 3: every chunk re-runs from its incoming state and writes ``y``."""
    pid, o_d, mask_d, bos, T_i, c = chunk_program(cu_ptr, co_ptr, cs_ptr, T, D, BT, BD, IS_VARLEN)
    b_hm, b_hn, b_hd = load_state(hc_ptr, pid * D + o_d, mask_d, NCT * D)
    o, mask, b_z, b_l, b_lam = _chunk(z_ptr, a_ptr, g_ptr, bos, T_i, c, o_d, mask_d, D, ATTN,
                                      DISCOUNT, REVERSE, BT)                   # [BT, BD] x3
    b_m, b_n, b_d = scan_chunk(b_l, b_z, b_lam, b_hm, b_hn, b_hd)              # [BT, BD] x3
    tl.store(y_ptr + o, average(b_n, b_d).to(y_ptr.dtype.element_ty), mask=mask)
