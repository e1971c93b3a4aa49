"""The "chained" algorithm, forward and backward: one launch a pass, each sequence's
segments chained by a decoupled look-back (Merrill and Garland, "Single-pass Parallel Prefix
Scan with Decoupled Look-back", 2016), so that every input is read from DRAM once (the
"segments" algorithm reads it twice: its summary pass, then its output pass).
``fwd_chained_kernel`` is described here; ``bwd_chained_kernel`` is the same in adjoint
order (its docstring).

A program takes a ticket (an atomic counter) and covers the segment and channel block the
ticket names, segment-major: a program waits only on segments of lower tickets, which were
taken by programs already running, so the waits always end (whatever order the hardware
starts programs in). It then

1. walks its segment from an empty state (as the "segments" summary pass): the segment's
   aggregate ``(m, n~, d~, G)``, published with its flag set to ``AGGREGATE``;
2. looks back for the state entering its segment: it reads the flags of a window of
   ``WINDOW`` predecessors at once; when the window holds a ``PREFIX`` (a segment's
   inclusive prefix: the state after it) with every segment after it published, it
   combines that prefix and the aggregates after it, and is done; when every segment of
   the window has published its aggregate (and none its prefix), it folds the window's
   aggregates into what it carries and moves one window back; otherwise it reads the
   window again (a predecessor is still walking). A sequence's first segment starts from
   the initial state and looks back at nothing;
3. publishes its own inclusive prefix (flag ``PREFIX``), which ends its successors' looks
   back;
4. walks its segment again from the state entering it (as the "segments" output pass),
   writing ``y`` and the saved chunk states; the last segment of a sequence stores its
   prefix as the final state. The second walk reads the segment's inputs from L2 when
   segments are short enough (the launcher's ``chained_chunks``).

With ``PERSISTENT`` the grid holds fewer programs than tickets (the launcher's
``chained_programs_per_sm``): each program takes a ticket, covers it, and takes the next
until none is left. So no more segments are held between their two walks than programs are
resident, however many the registers would allow: a cap on what the second walks need of
L2. The waits still end: only a running program holds a ticket, one at a time, and the
one holding the lowest ticket not yet covered waits on nothing (every ticket below it is
covered). Under the interpreter (below) the first program takes every ticket.

Publishing: every thread stores its channels, a barrier, then one release of the flag
(gpu scope; cumulative over the stores the barrier ordered before it). Looking back: one
acquire of the window's flags, a barrier, then loads that skip L1 (``volatile``), so no
thread reads a line cached before the flag was seen.

Under ``TRITON_INTERPRET=1`` programs run one at a time in ticket order, so every look-back
finds its predecessor's prefix at once and no wait is ever taken: the interpreter tests the
arithmetic (with ``PREFIX_EVERY = False`` every look-back walks aggregates back to the
sequence's first segment), never the waiting. There a wait would never end, so a bug that
made one would hang the tests: with ``SPIN`` False (the launcher's choice off a GPU) a
look-back that would wait ends at once with NaN for its state instead, a failure the tests
report.
"""

import triton
import triton.language as tl

from .common import (NEG_INF, combine, initial_state, linear_combine, load_state, load_summary,
                     plane, reverse_linear_scan, row, scan_summaries, state_row, store_state,
                     store_summary)
from .scan_bwd import final_adjoint, initial_state_grads, walk_adjoint
from .scan_fwd import walk_segment
from .sequence import channels_at, first_chunk, segment_at, segments

AGGREGATE = tl.constexpr(1)     # a segment's flag: its aggregate is published
PREFIX = tl.constexpr(2)        # ... and its inclusive prefix


@triton.jit
def _publish(f_ptr, ticket, FLAG: tl.constexpr):
    """Set a program's flag, after the stores of every thread (barrier, then release)."""
    tl.debug_barrier()
    tl.atomic_xchg(f_ptr + ticket, FLAG, sem="release", scope="gpu")


@triton.jit
def _read_flags(f_ptr, o_seg, valid, blk, n_d, WINDOW: tl.constexpr):
    """The flags ``[W]`` of segments ``o_seg`` in channel block ``blk``, one acquire;
    ``AGGREGATE`` where not ``valid`` (before a sequence's first segment or after its last:
    nothing to wait for, nothing to fold)."""
    b_f = tl.atomic_add(f_ptr + o_seg * n_d + blk, tl.zeros([WINDOW], tl.int32), mask=valid,
                        sem="acquire", scope="gpu")                            # [W]
    return tl.where(valid, b_f, AGGREGATE)                                     # [W]


@triton.jit
def _look_back(f_ptr, s_ptr, p_ptr, s0, k, blk, n_d, o_d, mask_d, NSEG, D: tl.constexpr,
               WINDOW: tl.constexpr, BD: tl.constexpr, SPIN: tl.constexpr):
    """The state ``(m, n~, d~)`` ``[BD]`` entering segment ``k`` (``k >= 1``) of the sequence
    whose first segment is ``s0``, from its predecessors' flags ``f``, aggregates ``s`` and
    prefixes ``p`` (module docstring, step 2)."""
    o_w = tl.arange(0, WINDOW)                                                 # [W]
    c_m = tl.full([BD], NEG_INF, tl.float32)    # the aggregates folded so far (j, k)
    c_n = tl.zeros([BD], tl.float32)                                           # [BD]
    c_d = tl.zeros([BD], tl.float32)                                           # [BD]
    c_G = tl.zeros([BD], tl.float32)                                           # [BD]
    j = k - 1                                   # the window's last segment
    going = k > 0
    while going:
        o_j = j - (WINDOW - 1) + o_w            # the window's segments, in order      # [W]
        valid = o_j >= 0                                                       # [W]
        b_f = _read_flags(f_ptr, s0 + o_j, valid, blk, n_d, WINDOW)            # [W]
        last_wait = tl.max(tl.where(b_f == 0, o_w, -1), 0)
        last_prefix = tl.max(tl.where(b_f == PREFIX, o_w, -1), 0)
        tl.debug_barrier()
        if (last_prefix > last_wait) | (last_wait < 0):
            # the prefix at last_prefix (if any), then the aggregates after it, in order
            has_prefix = last_prefix >= 0
            o_p = (s0 + j - (WINDOW - 1) + last_prefix) * D + o_d              # [BD]
            b_hm, b_hn, b_hd = load_state(p_ptr, o_p, tl.where(has_prefix, mask_d, False),
                                          NSEG * D, True)                      # [BD] x3
            mask = ((o_w > last_prefix) & valid)[:, None] & mask_d[None, :]     # [W, BD]
            o_k = (s0 + o_j)[:, None] * D + o_d[None, :]                       # [W, BD]
            b_sm, b_sn, b_sd, b_sG = load_summary(s_ptr, o_k, mask, NSEG * D,
                                                  True)                        # [W, BD] x4
            b_m, b_n, b_d, b_G = scan_summaries(b_sm, b_sn, b_sd, b_sG, b_hm, b_hn,
                                                b_hd)                          # [W, BD] x4
            w_m, w_n, w_d, w_G = state_row(b_m, b_n, b_d, b_G, WINDOW - 1, WINDOW)  # [BD] x4
            c_m, c_n, c_d, c_G = combine(w_m, w_n, w_d, w_G, c_m, c_n, c_d, c_G)  # [BD] x4
            j -= WINDOW
            # (j < 0 with no prefix cannot happen, as a first segment always publishes its
            # prefix; the test ends the loop rather than spin past the sequence on a bug)
            going = (last_prefix < 0) & (j >= 0)
        elif not SPIN:      # (module docstring: a wait under the interpreter is a bug)
            c_m = tl.full([BD], float("nan"), tl.float32)                      # [BD]
            going = False
    return c_m, c_n, c_d


@triton.jit
def _take(f_ptr, n_tickets):
    """The next ticket: the counter after the ``n_tickets`` flags, incremented."""
    return tl.atomic_add(f_ptr + n_tickets, 1, sem="relaxed", scope="gpu").to(tl.int64)


@triton.jit
def _fwd_segment(
    z_ptr, a_ptr, g_ptr, y_ptr, h0_ptr, ht_ptr, hc_ptr, s_ptr, p_ptr, f_ptr, cu_ptr, co_ptr,
    so_ptr, ss_ptr, ticket, T, CPS, NS, NCT, NSEG, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, SAVE_CHUNKS: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, LOOKAHEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SAVE_BT: tl.constexpr, WINDOW: tl.constexpr, PREFIX_EVERY: tl.constexpr,
    SPIN: tl.constexpr,
):
    """The segment and channel block of ``ticket`` (:func:`fwd_chained_kernel`)."""
    n_d = tl.cdiv(D, BD)
    pid = ticket // n_d
    blk = ticket % n_d
    o_d, mask_d = channels_at(blk, D, BD)
    i, k, bos, T_i, c_lo, c_hi = segment_at(pid, cu_ptr, so_ptr, ss_ptr, T, CPS, BT, IS_VARLEN,
                                            False)
    s0 = pid - k                                # the sequence's first segment
    c0 = first_chunk(i, co_ptr, T, SAVE_BT, IS_VARLEN)      # in rows of SAVE_BT steps
    o_seg = pid * D + o_d                                                      # [BD]
    # 1. the segment's aggregate, from an empty state
    e_m, e_n, e_d = initial_state(h0_ptr, o_seg, mask_d, NS * D, False, BD)     # [BD] x3
    a_m, a_n, a_d, a_G = walk_segment(
        z_ptr, a_ptr, g_ptr, y_ptr, hc_ptr, e_m, e_n, e_d, bos, T_i, c0, c_lo, c_hi, o_d,
        mask_d, NCT, D, ATTN, DISCOUNT, False, False, REVERSE, LOOKAHEAD, BT, BD,
        SAVE_BT)                                                               # [BD] x4
    # 2. the state entering it
    if k == 0:
        i_m, i_n, i_d = initial_state(h0_ptr, i * D + o_d, mask_d, NS * D, HAS_INIT, BD)
    else:
        store_summary(s_ptr, o_seg, mask_d, NSEG * D, a_m, a_n, a_d, a_G)
        _publish(f_ptr, ticket, AGGREGATE)
        i_m, i_n, i_d = _look_back(f_ptr, s_ptr, p_ptr, s0, k, blk, n_d, o_d, mask_d, NSEG,
                                   D, WINDOW, BD, SPIN)                              # [BD] x3
    # 3. the state after it
    p_m, p_n, p_d, _ = combine(i_m, i_n, i_d, 0.0, a_m, a_n, a_d, a_G)         # [BD] x3
    if PREFIX_EVERY:
        publish = k >= 0
    else:
        publish = k == 0
    if publish:
        store_state(p_ptr, o_seg, mask_d, NSEG * D, p_m, p_n, p_d)
        _publish(f_ptr, ticket, PREFIX)
    # 4. its outputs, from the state entering it
    walk_segment(
        z_ptr, a_ptr, g_ptr, y_ptr, hc_ptr, i_m, i_n, i_d, bos, T_i, c0, c_lo, c_hi, o_d,
        mask_d, NCT, D, ATTN, DISCOUNT, True, SAVE_CHUNKS, REVERSE, LOOKAHEAD, BT, BD,
        SAVE_BT)                                                               # [BD] x4
    if STORE_FINAL:         # the last segment's prefix (as the "segments" carry forms it)
        last = k == segments(T_i, CPS, BT) - 1
        # (tl.where: the interpreter cannot AND a block with a scalar)
        store_state(ht_ptr, i * D + o_d, tl.where(last, mask_d, False), NS * D, p_m, p_n, p_d)


@triton.jit
def fwd_chained_kernel(
    z_ptr, a_ptr, g_ptr, y_ptr, h0_ptr, ht_ptr, hc_ptr, s_ptr, p_ptr, f_ptr, cu_ptr, co_ptr,
    so_ptr, ss_ptr,
    T, CPS, NS, NCT, NSEG, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, SAVE_CHUNKS: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, LOOKAHEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SAVE_BT: tl.constexpr, WINDOW: tl.constexpr, PREFIX_EVERY: tl.constexpr,
    SPIN: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """The segment and channel block its ticket names, or with ``PERSISTENT`` those of every
    ticket it takes (module docstring): aggregates into ``s`` ``(4, NSEG, D)``, inclusive
    prefixes into ``p`` ``(3, NSEG, D)``, flags in ``f`` (``NSEG * blocks`` int32, then the
    ticket counter; zeros at launch).
    ``PREFIX_EVERY`` False: only each sequence's first segment publishes its prefix (tests).
    ``PERSISTENT``: a grid of fewer programs than tickets, each taking tickets until none is
    left (module docstring)."""
    n_tickets = NSEG * tl.cdiv(D, BD)
    ticket = _take(f_ptr, n_tickets)
    if PERSISTENT:
        while ticket < n_tickets:
            _fwd_segment(
                z_ptr, a_ptr, g_ptr, y_ptr, h0_ptr, ht_ptr, hc_ptr, s_ptr, p_ptr, f_ptr, cu_ptr,
                co_ptr, so_ptr, ss_ptr, ticket, T, CPS, NS, NCT, NSEG, D, ATTN, DISCOUNT,
                HAS_INIT, STORE_FINAL, SAVE_CHUNKS, IS_VARLEN, REVERSE, LOOKAHEAD, BT, BD,
                SAVE_BT, WINDOW, PREFIX_EVERY, SPIN)
            ticket = _take(f_ptr, n_tickets)
    else:
        _fwd_segment(
            z_ptr, a_ptr, g_ptr, y_ptr, h0_ptr, ht_ptr, hc_ptr, s_ptr, p_ptr, f_ptr, cu_ptr,
            co_ptr, so_ptr, ss_ptr, ticket, T, CPS, NS, NCT, NSEG, D, ATTN, DISCOUNT, HAS_INIT,
            STORE_FINAL, SAVE_CHUNKS, IS_VARLEN, REVERSE, LOOKAHEAD, BT, BD, SAVE_BT, WINDOW,
            PREFIX_EVERY, SPIN)


@triton.jit
def _load_adjoints(p, o, mask, rows):
    """Published local adjoints ``(K, W, V)`` ``[W, BD]`` at ``o`` of a ``(3, rows, D)``
    buffer, read past L1 (masked: the identity, ``K = 1``, ``W = V = 0``)."""
    b_K = tl.load(p + o, mask=mask, other=1.0, volatile=True)                 # [W, BD]
    b_W = tl.load(plane(p, 1, rows) + o, mask=mask, other=0.0, volatile=True)  # [W, BD]
    b_V = tl.load(plane(p, 2, rows) + o, mask=mask, other=0.0, volatile=True)  # [W, BD]
    return b_K, b_W, b_V


@triton.jit
def _look_ahead(f_ptr, s_ptr, p_ptr, s0, k, last, blk, n_d, o_d, mask_d, NSEG,
                D: tl.constexpr, WINDOW: tl.constexpr, BD: tl.constexpr, SPIN: tl.constexpr):
    """The adjoint ``(W, V)`` ``[BD]`` entering after the last row of segment ``k``
    (``k < last``) of the sequence whose segments are ``s0 .. s0 + last``, from its
    successors' flags ``f``, local adjoints ``s`` ``(3, NSEG, D)`` and prefixes ``p`` (the
    ``(W, V)`` at a segment's first row, ``(2, NSEG, D)``): :func:`_look_back` mirrored in
    time. A window holds the ``WINDOW`` segments after the ones folded so far, nearest
    first; a prefix enters as the row ``(K, W, V) = (0, W, V)``, which ends the window's
    scan there."""
    o_w = tl.arange(0, WINDOW)                                                 # [W]
    c_K = tl.full([BD], 1.0, tl.float32)        # the successors folded so far (k, j)
    c_W = tl.zeros([BD], tl.float32)                                           # [BD]
    c_V = tl.zeros([BD], tl.float32)                                           # [BD]
    j = k + 1                                   # the window's first segment
    going = k < last
    while going:
        o_j = j + o_w                           # the window's segments, nearest first  # [W]
        valid = o_j <= last                                                    # [W]
        b_f = _read_flags(f_ptr, s0 + o_j, valid, blk, n_d, WINDOW)            # [W]
        first_wait = tl.min(tl.where(b_f == 0, o_w, WINDOW), 0)
        first_prefix = tl.min(tl.where(b_f == PREFIX, o_w, WINDOW), 0)
        tl.debug_barrier()
        if (first_prefix < first_wait) | (first_wait == WINDOW):
            # the adjoints before the prefix (if any) in order, then the prefix
            o_k = (s0 + o_j)[:, None] * D + o_d[None, :]                       # [W, BD]
            mask = ((o_w < first_prefix) & valid)[:, None] & mask_d[None, :]    # [W, BD]
            b_sK, b_sW, b_sV = _load_adjoints(s_ptr, o_k, mask, NSEG * D)      # [W, BD] x3
            o_p = (s0 + j + first_prefix) * D + o_d                            # [BD]
            mask_p = tl.where(first_prefix < WINDOW, mask_d, False)            # [BD]
            b_pW = tl.load(p_ptr + o_p, mask=mask_p, other=0.0, volatile=True)  # [BD]
            b_pV = tl.load(plane(p_ptr, 1, NSEG * D) + o_p, mask=mask_p, other=0.0,
                           volatile=True)                                      # [BD]
            at_prefix = (o_w == first_prefix)[:, None]                         # [W, 1]
            b_sK = tl.where(at_prefix, 0.0, b_sK)                              # [W, BD]
            b_sW = tl.where(at_prefix, b_pW[None, :], b_sW)                    # [W, BD]
            b_sV = tl.where(at_prefix, b_pV[None, :], b_sV)                    # [W, BD]
            b_K, b_W, b_V = reverse_linear_scan(b_sK, b_sW, b_sV)              # [W, BD] x3
            c_K, c_W, c_V = linear_combine(row(b_K, o_w, 0), row(b_W, o_w, 0),
                                           row(b_V, o_w, 0), c_K, c_W, c_V)   # [BD] x3
            j += WINDOW
            # (past the last segment with no prefix cannot happen, as a last segment always
            # publishes its prefix; the test ends the loop rather than spin on a bug)
            going = (first_prefix == WINDOW) & (j <= last)
        elif not SPIN:      # (module docstring: a wait under the interpreter is a bug)
            c_W = tl.full([BD], float("nan"), tl.float32)                      # [BD]
            going = False
    return c_W, c_V


@triton.jit
def _bwd_segment(
    z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, h0_ptr, dh0_ptr, dht_ptr, hc_ptr,
    s_ptr, p_ptr, f_ptr, cu_ptr, co_ptr, so_ptr, ss_ptr, ticket,
    T, CPS, NS, NCT, NSEG, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
    LOOKAHEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, WINDOW: tl.constexpr,
    PREFIX_EVERY: tl.constexpr, SPIN: tl.constexpr,
):
    """The segment and channel block of ``ticket`` (:func:`bwd_chained_kernel`)."""
    n_d = tl.cdiv(D, BD)
    pid = NSEG - 1 - ticket // n_d              # the last segment first
    blk = ticket % n_d
    o_d, mask_d = channels_at(blk, D, BD)
    i, k, bos, T_i, c_lo, c_hi = segment_at(pid, cu_ptr, so_ptr, ss_ptr, T, CPS, BT, IS_VARLEN,
                                            False)
    s0 = pid - k                                # the sequence's first segment
    last = segments(T_i, CPS, BT) - 1           # (its index there)
    c0 = first_chunk(i, co_ptr, T, BT, IS_VARLEN)
    o_seg = pid * D + o_d                                                      # [BD]
    flag = pid * n_d + blk
    # 1. the segment's local adjoint
    a_K, a_W, a_V = walk_adjoint(
        z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, hc_ptr, 0.0, 0.0, bos, T_i, c0,
        c_lo, c_hi, o_d, mask_d, NCT, D, ATTN, DISCOUNT, True, REVERSE, LOOKAHEAD, BT,
        BD)                                                                    # [BD] x3
    # 2. the adjoint entering after its last row
    if k == last:
        i_W, i_V = final_adjoint(i, dht_ptr, o_d, mask_d, D, NS, HAS_FINAL_GRAD, BD)  # [BD] x2
    else:
        store_state(s_ptr, o_seg, mask_d, NSEG * D, a_K, a_W, a_V)
        _publish(f_ptr, flag, AGGREGATE)
        i_W, i_V = _look_ahead(f_ptr, s_ptr, p_ptr, s0, k, last, blk, n_d, o_d, mask_d, NSEG,
                               D, WINDOW, BD, SPIN)                                  # [BD] x2
    # 3. the adjoint at its first row (as the carry kernel forms it)
    _, p_W, p_V = linear_combine(1.0, i_W, i_V, a_K, a_W, a_V)                 # [BD] x2
    if PREFIX_EVERY:
        publish = k <= last
    else:
        publish = k == last
    if publish:
        tl.store(p_ptr + o_seg, p_W, mask=mask_d)
        tl.store(plane(p_ptr, 1, NSEG * D) + o_seg, p_V, mask=mask_d)
        _publish(f_ptr, flag, PREFIX)
    if HAS_INIT:            # (before the second walk: nothing more is live across it)
        if k == 0:
            initial_state_grads(i, h0_ptr, dh0_ptr, o_d, mask_d, D, NS, p_W, p_V)
    # 4. its gradients, from the adjoint entering it
    walk_adjoint(
        z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, hc_ptr, i_W, i_V, bos, T_i, c0,
        c_lo, c_hi, o_d, mask_d, NCT, D, ATTN, DISCOUNT, False, REVERSE, LOOKAHEAD, BT, BD)


@triton.jit
def bwd_chained_kernel(
    z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, h0_ptr, dh0_ptr, dht_ptr, hc_ptr,
    s_ptr, p_ptr, f_ptr, cu_ptr, co_ptr, so_ptr, ss_ptr,
    T, CPS, NS, NCT, NSEG, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
    LOOKAHEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, WINDOW: tl.constexpr,
    PREFIX_EVERY: tl.constexpr, SPIN: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """The backward (scan_bwd.py) as :func:`fwd_chained_kernel` does the forward, in adjoint
    order: tickets take a sequence's segments last first, and each program

    1. walks its segment from nothing entering (the "segments" summary pass): its local
       adjoint ``(K, W, V)``, published (``AGGREGATE``);
    2. looks ahead (:func:`_look_ahead`) for the ``(W, V)`` entering after its last row (a
       sequence's last segment: the final state's gradient);
    3. publishes the ``(W, V)`` at its first row (``PREFIX``); a sequence's first segment
       stores the initial state's gradients from it;
    4. walks its segment again from what enters it, storing the gradients.

    ``s`` ``(3, NSEG, D)``, ``p`` ``(2, NSEG, D)``, flags ``f`` as the forward's.
    ``PREFIX_EVERY`` False: only each sequence's last segment publishes its prefix (tests);
    ``PERSISTENT`` as the forward's."""
    n_tickets = NSEG * tl.cdiv(D, BD)
    ticket = _take(f_ptr, n_tickets)
    if PERSISTENT:
        while ticket < n_tickets:
            _bwd_segment(
                z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, h0_ptr, dh0_ptr, dht_ptr,
                hc_ptr, s_ptr, p_ptr, f_ptr, cu_ptr, co_ptr, so_ptr, ss_ptr, ticket, T, CPS, NS,
                NCT, NSEG, D, ATTN, DISCOUNT, HAS_INIT, HAS_FINAL_GRAD, IS_VARLEN, REVERSE,
                LOOKAHEAD, BT, BD, WINDOW, PREFIX_EVERY, SPIN)
            ticket = _take(f_ptr, n_tickets)
    else:
        _bwd_segment(
            z_ptr, a_ptr, g_ptr, gy_ptr, gz_ptr, ga_ptr, gg_ptr, h0_ptr, dh0_ptr, dht_ptr,
            hc_ptr, s_ptr, p_ptr, f_ptr, cu_ptr, co_ptr, so_ptr, ss_ptr, ticket, T, CPS, NS, NCT,
            NSEG, D, ATTN, DISCOUNT, HAS_INIT, HAS_FINAL_GRAD, IS_VARLEN, REVERSE, LOOKAHEAD, BT,
            BD, WINDOW, PREFIX_EVERY, SPIN)
