"""Forward kernels of the weighted scan.

A program covers one segment of a sequence (up to ``CPS`` chunks of ``BT`` steps; see
``sequence.segment_program``) for one block of ``BD`` channels. It walks its chunks in scan
order with the state ``(m, n~, d~)`` in registers, scanning each chunk with
``tl.associative_scan`` and loading the next chunk while it scans this one (a register double
buffer). The launcher gives each thread whole channel columns of a ``[BT, BD]`` block (``BD``
a multiple of 32 x warps), so every scan along time runs in a thread's registers: no
shuffles, barriers or shared memory.

* ``fwd_kernel`` with ``PHASE = ONE_PASS``: each sequence is one segment; from the initial
  state, writes ``y``, each chunk's incoming state (``SAVE_CHUNKS``, for the backward) and the
  final state. Reads every input once, writes ``y`` once: the "looped" algorithm.
* The "segments" algorithm, for long sequences with few channels: ``fwd_kernel`` with
  ``PHASE = SUMMARY`` (every segment's ``(m, n~, d~, G)`` from an empty state, in parallel),
  ``fwd_carry_kernel`` (per sequence, the summaries combined in order: each segment's incoming
  state and the final state; a walk over segments, ``KT`` at a time, not chunks),
  ``fwd_kernel`` with
  ``PHASE = OUTPUT`` (every segment from its incoming state, as in one pass).

State buffers are float32 ``(3, rows, D)``: ``m``, ``n~``, ``d~``; segment summaries add ``G``.
"""

import triton
import triton.language as tl

from .common import (ONE_PASS, SUMMARY, average, chunk_offsets, chunk_rows, initial_state,
                     load_chunk, load_state, load_summary, log_weights, previous_rows,
                     scan_chunk, scan_summaries, state_row, store_state, store_summary)
from .sequence import (first_chunk, first_segment, segment_program, segments,
                       sequence_program)


@triton.jit
def _load(z_ptr, a_ptr, g_ptr, bos, T_i, c, c_hi, o_d, mask_d, D: tl.constexpr,
          DISCOUNT: tl.constexpr, REVERSE: tl.constexpr, BT: tl.constexpr):
    """The raw ``z, a, g`` ``[BT, BD]`` of chunk ``c`` (all masked from ``c_hi`` on)."""
    t0, o_dt, _ = chunk_rows(c, T_i, BT, REVERSE)
    mask_t = tl.arange(0, BT) < tl.minimum(T_i, c_hi * BT) - c * BT           # [BT]
    mask = mask_t[:, None] & mask_d[None, :]                                   # [BT, BD]
    return load_chunk(z_ptr, a_ptr, g_ptr, chunk_offsets(bos, t0, o_dt, o_d, D), mask, DISCOUNT)


@triton.jit
def walk_segment(z_ptr, a_ptr, g_ptr, y_ptr, hc_ptr, b_hm, b_hn, b_hd, bos, T_i, c0, c_lo, c_hi,
                 o_d, mask_d, NCT, D: tl.constexpr, ATTN: tl.constexpr, DISCOUNT: tl.constexpr,
                 WRITE: tl.constexpr, SAVE: tl.constexpr, REVERSE: tl.constexpr,
                 LOOKAHEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                 SAVE_BT: tl.constexpr):
    """Walk chunks ``[c_lo, c_hi)`` of a sequence (row ``bos``, length ``T_i``) in scan order
    from the state ``(m, n~, d~)`` ``[BD]`` entering them; returns the state after them and
    their log decay ``G`` summed. ``WRITE``: store ``y``; ``SAVE``: store the state entering
    every ``SAVE_BT`` steps into ``hc`` (its rows from ``c0``, the sequence's first)
    (:func:`fwd_kernel`'s docstring has ``LOOKAHEAD`` and ``SAVE_BT``)."""
    R: tl.constexpr = BT // SAVE_BT                         # saved states a chunk
    NEWTON: tl.constexpr = z_ptr.dtype.element_ty == tl.float32     # (common.reciprocal)
    b_hG = tl.zeros([BD], tl.float32)                                          # [BD]
    b_z, b_a, b_g = _load(z_ptr, a_ptr, g_ptr, bos, T_i, c_lo, c_hi, o_d, mask_d, D, DISCOUNT,
                          REVERSE, BT)                                         # [BT, BD] x3
    if LOOKAHEAD == 2:      # the chunk after it too: two chunks' loads in flight
        m_z, m_a, m_g = _load(z_ptr, a_ptr, g_ptr, bos, T_i, c_lo + 1, c_hi, o_d, mask_d, D,
                              DISCOUNT, REVERSE, BT)                           # [BT, BD] x3
    for c in range(c_lo, c_hi):
        if SAVE:
            store_state(hc_ptr, (c0 + c * R) * D + o_d, mask_d, NCT * D, b_hm, b_hn, b_hd)
        # the loads LOOKAHEAD chunks on are issued before this chunk's scan waits on its own
        n_z, n_a, n_g = _load(z_ptr, a_ptr, g_ptr, bos, T_i, c + LOOKAHEAD, c_hi, o_d, mask_d,
                              D, DISCOUNT, REVERSE, BT)                        # [BT, BD] x3
        t0, o_dt, mask_t = chunk_rows(c, T_i, BT, REVERSE)
        mask = mask_t[:, None] & mask_d[None, :]                               # [BT, BD]
        b_l, b_lam = log_weights(b_a, b_g, mask, ATTN, DISCOUNT, NEWTON)       # [BT, BD] x2
        b_m, b_n, b_d, b_G = scan_chunk(b_l, b_z, b_lam, b_hm, b_hn, b_hd)     # [BT, BD] x4
        if WRITE:
            tl.store(y_ptr + chunk_offsets(bos, t0, o_dt, o_d, D),
                     average(b_n, b_d, NEWTON).to(y_ptr.dtype.element_ty), mask=mask)
        if SAVE:
            for j in tl.static_range(1, R):     # the state entering part j: after its row
                b_pm, b_pn, b_pd, b_pG = state_row(b_m, b_n, b_d, b_G, j * SAVE_BT - 1, BT)
                # (a part past the sequence's end has no row: its store would be the next
                # sequence's)
                t_j = tl.full([BD], (c * R + j) * SAVE_BT, tl.int64)           # [BD]
                mask_j = mask_d & (t_j < T_i)                                  # [BD]
                store_state(hc_ptr, (c0 + c * R + j) * D + o_d, mask_j, NCT * D, b_pm, b_pn,
                            b_pd)
        b_hm, b_hn, b_hd, b_cG = state_row(b_m, b_n, b_d, b_G, BT - 1, BT)    # [BD] x4
        b_hG += b_cG
        if LOOKAHEAD == 2:
            b_z, b_a, b_g = m_z, m_a, m_g
            m_z, m_a, m_g = n_z, n_a, n_g
        else:
            b_z, b_a, b_g = n_z, n_a, n_g
    return b_hm, b_hn, b_hd, b_hG


@triton.jit
def fwd_kernel(
    z_ptr, a_ptr, g_ptr, y_ptr, h0_ptr, ht_ptr, hc_ptr, s_ptr, cu_ptr, co_ptr, so_ptr, ss_ptr,
    T, CPS, NS, NCT, NSEG, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, PHASE: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, SAVE_CHUNKS: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, LOOKAHEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SAVE_BT: tl.constexpr,
):
    """One segment: ``ONE_PASS`` from ``h0`` (final state into ``ht``), ``SUMMARY`` from an
    empty state (its ``(m, n~, d~, G)`` into ``s``, ``(4, NSEG, D)``), ``OUTPUT`` from its
    incoming state in ``s`` (``(3, NSEG, D)``, the carry kernel's). ``LOOKAHEAD``: how
    many chunks ahead of its scan a chunk's inputs are loaded, 1 (the next chunk's while
    this one scans) or 2 (two chunks' loads in flight: more bytes in flight for the same
    latency, at 3 x BT more registers a thread; the launcher's ``forward_lookahead``).
    ``SAVE_BT``: the steps of a saved chunk state (``hc``, ``(3, NCT, D)``, rows of
    ``SAVE_BT`` steps: the backward's chunks), ``BT`` or a divisor of it: a chunk saves the
    state entering each of its ``BT / SAVE_BT`` parts (the launcher's ``forward_block_t``)."""
    pid, i, o_d, mask_d, bos, T_i, _, c_lo, c_hi = segment_program(
        cu_ptr, co_ptr, so_ptr, ss_ptr, T, CPS, D, BT, BD, IS_VARLEN, PHASE == ONE_PASS)
    c0 = first_chunk(i, co_ptr, T, SAVE_BT, IS_VARLEN)      # in rows of SAVE_BT steps
    o_seg = pid * D + o_d                                                      # [BD]
    if PHASE == ONE_PASS:
        b_hm, b_hn, b_hd = initial_state(h0_ptr, i * D + o_d, mask_d, NS * D, HAS_INIT, BD)
    elif PHASE == SUMMARY:
        b_hm, b_hn, b_hd = initial_state(h0_ptr, o_seg, mask_d, NSEG * D, False, BD)
    else:
        b_hm, b_hn, b_hd = load_state(s_ptr, o_seg, mask_d, NSEG * D)          # [BD] x3
    b_hm, b_hn, b_hd, b_hG = walk_segment(
        z_ptr, a_ptr, g_ptr, y_ptr, hc_ptr, b_hm, b_hn, b_hd, bos, T_i, c0, c_lo, c_hi, o_d,
        mask_d, NCT, D, ATTN, DISCOUNT, PHASE != SUMMARY, SAVE_CHUNKS and PHASE != SUMMARY,
        REVERSE, LOOKAHEAD, BT, BD, SAVE_BT)                                   # [BD] x4
    if PHASE == SUMMARY:
        store_summary(s_ptr, o_seg, mask_d, NSEG * D, b_hm, b_hn, b_hd, b_hG)
    elif PHASE == ONE_PASS and STORE_FINAL:
        store_state(ht_ptr, i * D + o_d, mask_d, NS * D, b_hm, b_hn, b_hd)


@triton.jit
def fwd_carry_kernel(
    s_ptr, hs_ptr, h0_ptr, ht_ptr, cu_ptr, co_ptr, so_ptr,
    T, CPS, NS, NSEG, D: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, KT: tl.constexpr,
):
    """Phase 2: per sequence, every segment's incoming state (into ``hs``, ``(3, NSEG, D)``)
    from the summaries ``s`` (``(4, NSEG, D)``), and the final state. ``KT`` segments at a
    time: their summaries loaded together (one load latency a tile, not one a segment), the
    carried state folded into the first, scanned in registers as a chunk's steps are."""
    i, o_d, mask_d, bos, T_i, c0 = sequence_program(cu_ptr, co_ptr, T, D, BT, BD, IS_VARLEN)
    o_s = i.to(tl.int64) * D + o_d                                             # [BD]
    s0 = first_segment(i, so_ptr, T, CPS, BT, IS_VARLEN)
    n_seg = segments(T_i, CPS, BT)
    b_hm, b_hn, b_hd = initial_state(h0_ptr, o_s, mask_d, NS * D, HAS_INIT, BD)
    o_r = tl.arange(0, KT)                                                     # [KT]
    for k0 in range(0, n_seg, KT):
        mask = ((k0 + o_r) < n_seg)[:, None] & mask_d[None, :]                 # [KT, BD]
        o_k = (s0 + k0 + o_r)[:, None] * D + o_d[None, :]                      # [KT, BD]
        # (segments past the last are empty: no weight, no decay)
        b_sm, b_sn, b_sd, b_sG = load_summary(s_ptr, o_k, mask, NSEG * D)     # [KT, BD] x4
        b_m, b_n, b_d, b_G = scan_summaries(b_sm, b_sn, b_sd, b_sG, b_hm, b_hn,
                                            b_hd)                              # [KT, BD] x4
        # each segment's incoming state: the state after the one before it
        b_im, b_in, b_id = previous_rows(b_m, b_hm, b_n, b_hn, b_d, b_hd)     # [KT, BD] x3
        store_state(hs_ptr, o_k, mask, NSEG * D, b_im, b_in, b_id)
        b_hm, b_hn, b_hd, _ = state_row(b_m, b_n, b_d, b_G, KT - 1, KT)        # [BD] x3
    if STORE_FINAL:
        store_state(ht_ptr, o_s, mask_d, NS * D, b_hm, b_hn, b_hd)
