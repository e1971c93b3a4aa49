"""Device helpers shared by the scan kernels: the combine, the attention and discount
functions in log space, their derivatives, and loading one chunk.

Constexpr codes ``ATTN``, ``DISCOUNT`` and ``PHASE`` are those of :mod:`fastrwa.kernels.codes`.
"""

import triton
import triton.language as tl

from .. import codes

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
EXP = tl.constexpr(codes.EXP)
SIGMOID = tl.constexpr(codes.SIGMOID)
SOFTPLUS = tl.constexpr(codes.SOFTPLUS)
RELU = tl.constexpr(codes.RELU)
NO_DISCOUNT = tl.constexpr(codes.NO_DISCOUNT)
LOG_DISCOUNT = tl.constexpr(codes.LOG_DISCOUNT)
ONE_PASS = tl.constexpr(codes.ONE_PASS)
SUMMARY = tl.constexpr(codes.SUMMARY)
OUTPUT = tl.constexpr(codes.OUTPUT)
# log softplus(a) and its derivative switch to a series below this logit (see codes.py).
SOFTPLUS_SERIES_BELOW = tl.constexpr(codes.SOFTPLUS_SERIES_BELOW)


LOG2E = tl.constexpr(1.4426950408889634)
SMALLEST_NORMAL = tl.constexpr(1.1754943508222875e-38)     # 2**-126
STATE_SCALE = tl.constexpr(18446744073709551616.0)         # 2**64
LOG_STATE_SCALE = tl.constexpr(44.3614195558365)           # 64 ln 2


@triton.jit
def weight(x):
    """``exp(x)`` for ``x <= 0`` (or NaN): a weight in ``[0, 1]``, as ``exp2(x log2 e)``.
    On a GPU that is one ``MUFU.EX2`` (``ex2.approx.ftz``) after the multiply, where
    ``tl.exp`` adds a fix-up for results below ``2**-126`` (a compare and two predicated
    multiplies: 3 more instructions an exponential); such a weight is 0 here, a difference
    under ``1.2e-38`` that no sum it enters can show, since the largest weight in every
    combine is 1. (``logsigmoid``'s exponential keeps ``tl.exp``: a log decay needs its
    relative accuracy there, :func:`log1p`.)"""
    return tl.exp2(x * LOG2E)


@triton.jit
def reciprocal(x, NEWTON: tl.constexpr):
    """``1 / x`` for a denominator that is a positive, finite, normal number (``d~ >= 1``:
    :func:`average` masks ``d~ = 0``; ``2 + e``; ``1 + e``), as ``rsqrt(x) ** 2``. On a GPU
    that is one ``MUFU.RSQ`` (``rsqrt.approx.ftz``, relative error below ``2**-22.9``) and a
    multiply, where ``/`` compiles to ``div.full.f32``: 8 instructions, of which 6 rescale
    divisors above ``2**126`` or below ``2**-126``, which these never are.

    ``NEWTON`` (the kernels set it for float32 inputs, whose outputs are float32) adds a
    Newton step, two fused multiply-adds, which squares the error (3e-7 to 1e-13): the
    result is then within 1 ulp, ``n * reciprocal(d)`` within 1.5 ulp of ``n / d``
    (``div.full``: 2 ulp). Without it (bfloat16 and float16 outputs, rounded to 8 or 11
    bits) ``n * reciprocal(d)`` is within 4e-7 relative. NaN gives NaN; 0 gives ``+inf``
    without the step and NaN with it, ``+inf`` gives 0 without and NaN with (keep ``/``
    where either can occur). On a GPU a subnormal ``x`` counts as 0 (``.ftz``; not under
    the interpreter): :func:`initial_state` scales a state's subnormal ``d~`` up. Calls
    with the same ``x`` compile to one ``MUFU.RSQ``."""
    r = tl.math.rsqrt(x)
    b = r * r
    if NEWTON:
        b = tl.fma(tl.fma(-x, b, 1.0), b, b)
    return b


@triton.jit
def combine(m1, n1, d1, g1, m2, n2, d2, g2):
    """Segment 1 then segment 2: ``m = max(m1 + g2, m2)``, sums rescaled to ``m``, ``g = g1 + g2``
    (the forward state ``(m, n~, d~, G)``), with one exponential: of the two factors
    ``exp(m1 + g2 - m)`` and ``exp(m2 - m)`` one is exp(0) = 1, the other ``exp(-|diff|)``.

    A log decay ``g2 = -inf`` forgets segment 1 whatever its ``m1`` (``+inf`` included: the
    limit, not ``inf - inf``). Equal infinite maxima count as a difference of 0 (``+inf``: both
    dominate, weight 1 each); a ``-inf`` maximum (nothing seen) has weight 0. A NaN maximum
    makes its side's factor NaN (and the other's unless that side is empty), so NaN reaches
    ``n~`` and ``d~`` whichever side it came from.

    The factor is :func:`weight` written out, not called (the same PTX once compiled):
    Triton's interpreter, which the tests run, calls a scan's combine once per element and
    re-patches ``triton.language`` at every device-function call, so a call here would cost
    several times the rest of the combine.
    """
    m1d = tl.where(g2 == NEG_INF, NEG_INF, m1 + g2)
    diff = tl.where(m2 == m1d, 0.0, m2 - m1d)
    e = tl.exp2(-tl.abs(diff) * LOG2E)         # weight(-|diff|); NaN iff diff is NaN
    k1 = tl.where(diff <= 0, tl.where(m1d == NEG_INF, 0.0, 1.0), e)
    k2 = tl.where(diff > 0, 1.0, tl.where(m2 == NEG_INF, 0.0, e))
    m = tl.maximum(m1d, m2, propagate_nan=tl.PropagateNan.ALL)
    return m, n1 * k1 + n2 * k2, d1 * k1 + d2 * k2, g1 + g2


@triton.jit
def step_weights(dec, l):
    """One step's ``(m, keep, take)``: ``m = max(dec, l)`` (``dec`` the decayed running max,
    :func:`decayed`; ``l`` the step's log-weight), ``keep = exp(dec - m)``,
    ``take = exp(l - m)``, with the limits of the CPU step: equal infinite arguments count as
    a difference of 0, a ``-inf`` argument has weight 0. NaN propagates."""
    diff = tl.where(l == dec, 0.0, l - dec)
    e = weight(-tl.abs(diff))
    up = diff > 0
    keep = tl.where(up, e, tl.where(dec == NEG_INF, 0.0, 1.0))
    take = tl.where(up, 1.0, tl.where(l == NEG_INF, 0.0, e))
    return tl.where(up, l, dec), keep, take


@triton.jit
def decayed(m, lam):
    """``m + lam``, and ``-inf`` where ``lam = -inf`` (forgetting wins over ``m = +inf``)."""
    return tl.where(lam == NEG_INF, NEG_INF, m + lam)


@triton.jit
def own_weight(l, m):
    """``take = exp(l - m)`` of a step whose state after it has running max ``m``
    (:func:`step_weights`' value, from ``m`` alone)."""
    return tl.where(l == NEG_INF, 0.0, tl.where(l == m, 1.0, weight(l - m)))


@triton.jit
def linear_combine(k1, p1, q1, k2, p2, q2):
    """Segment 1 then segment 2 of the adjoint's linear recurrence ``x <- k x + p`` (two value
    streams ``p``, ``q`` sharing ``k``): ``(k1 k2, p1 k2 + p2, q1 k2 + q2)``."""
    return k1 * k2, p1 * k2 + p2, q1 * k2 + q2


@triton.jit
def _last_two(a_x, a_px, a_u, a_pu, a_v, a_pv, a_cnt, b_x, b_px, b_u, b_pu, b_v, b_pv, b_cnt):
    """Segment ``a`` then segment ``b``: the last element of three streams ``x``, ``u``, ``v``,
    the one before it in each, the count."""
    more = b_cnt >= 2
    return (b_x, tl.where(more, b_px, a_x), b_u, tl.where(more, b_pu, a_u), b_v,
            tl.where(more, b_pv, a_v), a_cnt + b_cnt)


@triton.jit
def previous_rows(b_x, b_fx, b_u, b_fu, b_v, b_fv):
    """Rows ``t - 1`` of three ``[BT, BD]`` blocks at row ``t`` (``[BD]`` fills at row 0): a
    shift in registers, as a scan."""
    b_one = tl.full(b_x.shape, 1.0, tl.float32)                              # [BT, BD]
    b_zero = tl.zeros_like(b_x)                                               # [BT, BD]
    _, b_px, _, b_pu, _, b_pv, _ = tl.associative_scan(
        (b_x, b_zero + b_fx[None, :], b_u, b_zero + b_fu[None, :], b_v,
         b_zero + b_fv[None, :], b_one), 0, _last_two)                        # [BT, BD] x3
    return b_px, b_pu, b_pv


@triton.jit
def next_rows(b_x, b_fx, b_u, b_fu):
    """Rows ``t + 1`` of two ``[BT, BD]`` blocks at row ``t`` (``[BD]`` fills at the last
    row): :func:`previous_rows` of the blocks flipped in time (a flip of a thread's own
    column is a renaming of its registers; a ``reverse=True`` scan would shuffle)."""
    b_ru = tl.flip(b_u, 0)                                                    # [BT, BD]
    b_nx, b_nu, _ = previous_rows(tl.flip(b_x, 0), b_fx, b_ru, b_fu, b_ru, b_fu)  # [BT, BD] x3
    return tl.flip(b_nx, 0), tl.flip(b_nu, 0)


@triton.jit
def reverse_linear_scan(b_k, b_p, b_q):
    """The linear recurrence ``x <- k x + p`` (and ``q``) run from the last row to the first,
    as :func:`linear_combine`'s scan of the rows flipped in time (see :func:`next_rows`)."""
    b_K, b_P, b_Q = tl.associative_scan((tl.flip(b_k, 0), tl.flip(b_p, 0), tl.flip(b_q, 0)),
                                        0, linear_combine)                    # [BT, BD] x3
    return tl.flip(b_K, 0), tl.flip(b_P, 0), tl.flip(b_Q, 0)


@triton.jit
def log1p(x, NEWTON: tl.constexpr):
    """``log(1 + x)`` for ``0 <= x <= 1`` (what :func:`logsigmoid` and softplus pass: an
    ``exp(-|a|)``), without a logarithm: ``2 atanh(s)`` with ``s = x / (2 + x) <= 1/3``, as
    ``2 s P(s^2)``, ``P`` a degree-4 fit to ``atanh(s) / s`` (relative error 4e-9; 2.2e-7 in
    float32, from the rounding of ``s``, with :func:`reciprocal`'s Newton step; about 6e-7
    without it). Relative accuracy holds down to the smallest normal
    ``x`` (1.4e-5 for subnormal ones), which a log decay needs: its error adds up over the
    steps it is applied."""
    b_s = x * reciprocal(2.0 + x, NEWTON)
    b_w = b_s * b_s
    b_p = 0.14088399708271027 * b_w + 0.13980455696582794
    b_p = b_p * b_w + 0.20012445747852325
    b_p = b_p * b_w + 0.3333315849304199
    b_p = b_p * b_w + 1.0
    return 2.0 * b_s * b_p


@triton.jit
def logsigmoid(x, NEWTON: tl.constexpr):
    """``log sigmoid(x) = min(x, 0) - log1p(exp(-|x|))``; the exp argument is never positive."""
    return tl.minimum(x, 0.0) - log1p(tl.exp(-tl.abs(x)), NEWTON)


@triton.jit
def sigmoid_neg(x, NEWTON: tl.constexpr):
    """``sigmoid(-x)`` without overflow."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, e, 1.0) * reciprocal(1.0 + e, NEWTON)


@triton.jit
def log_weight(a, ATTN: tl.constexpr, NEWTON: tl.constexpr):
    """``l = log f_a(a)``."""
    if ATTN == EXP:
        l = a
    elif ATTN == SIGMOID:
        l = logsigmoid(a, NEWTON)
    elif ATTN == SOFTPLUS:
        u = tl.exp(tl.minimum(a, SOFTPLUS_SERIES_BELOW))
        series = a - 0.5 * u + (5.0 / 24.0) * u * u
        softplus = tl.maximum(a, 0.0) + log1p(tl.exp(-tl.abs(a)), NEWTON)
        direct = tl.log(tl.maximum(softplus, 1e-30))
        l = tl.where(a < SOFTPLUS_SERIES_BELOW, series, direct)
        l = tl.where(a != a, a, l)          # a NaN logit gives NaN (tl.maximum drops it)
    else:
        l = tl.where(a > 0, tl.log(tl.where(a > 0, a, 1.0)), tl.where(a <= 0, NEG_INF, a))
    return l


@triton.jit
def attention_grad(gl, a, ATTN: tl.constexpr, NEWTON: tl.constexpr, x, take, m):
    """``ga = gl * dl/da``, with the step's ``gl = take x`` given as its parts too (``take =
    exp(l - m)``, ``m`` the running max after the step), which relu reads.

    For relu ``gl`` carries a factor ``exp(l) = a``: ``ga = gl / a``, as ``gl`` times
    :func:`reciprocal` (both scaled by ``2**64`` where ``a`` is subnormal, which
    :func:`reciprocal` reads as 0; ``0 / a = 0`` then). Where ``take`` underflowed (below
    ``2**-126``, where :func:`weight` flushes it to 0) ``gl`` has lost ``x``, and ``ga = x
    exp(-m)`` (``take / a = exp(-m)``): a tiny logit keeps its gradient, with ``m``'s
    rounding (``|m| eps`` relative, 6e-6 at ``m = -100`` in float32), and no overflow
    (``exp(-m) < 2**-126 / a`` there). ``gl / (+inf)`` is ``gl * 0`` (0, or NaN for a NaN or
    infinite ``gl``, as a division gives); ``a <= 0`` gives 0, a NaN logit NaN."""
    if ATTN == EXP:
        ga = gl
    elif ATTN == SIGMOID:
        ga = gl * sigmoid_neg(a, NEWTON)
    elif ATTN == SOFTPLUS:
        # dl/da = sigmoid(a) / softplus(a), one division: below the switch the series'
        # 1 / ((1 + u)(1 - u/2 + u^2/3)), above it sigmoid(a) = (a >= 0 ? 1 : e) / (1 + e)
        # with e = exp(-|a|), and softplus(a) as log_weight computes it (the same
        # expressions, so a kernel that computes both shares them).
        u = tl.exp(tl.minimum(a, SOFTPLUS_SERIES_BELOW))
        e = tl.exp(-tl.abs(a))
        softplus = tl.maximum(a, 0.0) + log1p(e, NEWTON)
        series = a < SOFTPLUS_SERIES_BELOW
        num = tl.where(series | (a >= 0), 1.0, e)
        den = tl.where(series, (1.0 + u) * (1.0 - 0.5 * u + u * u / 3.0),
                       (1.0 + e) * softplus)
        ga = gl * (num / den)    # (not reciprocal: a = +inf gives den = +inf, and ga = 0)
        ga = tl.where(a != a, a, ga)        # a NaN logit gives NaN
    else:
        s = tl.where(a < SMALLEST_NORMAL, STATE_SCALE, 1.0)
        ga = tl.where(take < SMALLEST_NORMAL, x * tl.exp2(-m * LOG2E),
                      (gl * s) * reciprocal(a * s, NEWTON))
        ga = tl.where(a == POS_INF, gl * 0.0, ga)
        ga = tl.where(a <= 0, 0.0, ga)                                        # (NaN: NaN)
    return ga


@triton.jit
def log_decay(g, DISCOUNT: tl.constexpr, NEWTON: tl.constexpr):
    """``lam = log gamma``: 0 (none), ``g`` (log) or ``logsigmoid(g)``."""
    if DISCOUNT == NO_DISCOUNT:
        lam = tl.zeros_like(g)
    elif DISCOUNT == LOG_DISCOUNT:
        lam = g
    else:
        lam = logsigmoid(g, NEWTON)
    return lam


@triton.jit
def decay_grad(glam, g, DISCOUNT: tl.constexpr, NEWTON: tl.constexpr):
    """``gg = glam * dlam/dg``."""
    if DISCOUNT == LOG_DISCOUNT:
        gg = glam
    else:
        gg = glam * sigmoid_neg(g, NEWTON)
    return gg


@triton.jit
def chunk_rows(c, T, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Where the rows of the ``c``-th chunk of a sequence of length ``T`` are, in scan order.

    Row ``r`` of chunk ``c`` is scan step ``s = c * BT + r``: position ``s``, or ``T - 1 - s``
    reversed. Returns the position ``t0`` of row 0, each row's step from it (``[BT]``: ``r``,
    or ``-r`` reversed; constants, so that every row's address is the thread's base plus an
    immediate offset) and the rows' mask (``s < T``). Every block is scanned first row to
    last whatever the direction (only the positions differ), and the ragged chunk is the last
    one, its masked rows at the end of its block, in both directions.
    """
    o_r = tl.arange(0, BT)                                                    # [BT]
    if REVERSE:
        t0 = T - 1 - c * BT
        o_dt = -o_r                                                           # [BT]
    else:
        t0 = c * BT
        o_dt = o_r                                                            # [BT]
    return t0, o_dt, o_r < T - c * BT


@triton.jit
def chunk_offsets(bos, t0, o_dt, o_d, D: tl.constexpr):
    """Element offsets ``[BT, BD]`` (int64) of a chunk's rows (:func:`chunk_rows`) in the
    sequence starting at row ``bos`` of the flattened ``(rows, D)`` tensors."""
    return ((bos + t0) * D + o_d)[None, :] + (o_dt * D)[:, None]              # [BT, BD]


@triton.jit
def load_chunk(z_ptr, a_ptr, g_ptr, o, mask, DISCOUNT: tl.constexpr):
    """``z, a`` (and ``g``) at offsets ``o`` ``[BT, BD]``, as float32 (``g = 0`` without a
    discount); masked lanes read 0."""
    b_z = tl.load(z_ptr + o, mask=mask, other=0.0).to(tl.float32)            # [BT, BD]
    b_a = tl.load(a_ptr + o, mask=mask, other=0.0).to(tl.float32)            # [BT, BD]
    if DISCOUNT == NO_DISCOUNT:
        b_g = tl.zeros_like(b_a)                                              # [BT, BD]
    else:
        b_g = tl.load(g_ptr + o, mask=mask, other=0.0).to(tl.float32)        # [BT, BD]
    return b_z, b_a, b_g


@triton.jit
def log_weights(b_a, b_g, mask, ATTN: tl.constexpr, DISCOUNT: tl.constexpr,
                NEWTON: tl.constexpr):
    """Log-weights ``l`` and log-decays ``lam`` ``[BT, BD]`` of loaded logits. Masked lanes
    get ``l = -inf`` and ``lam = 0``: no weight and no decay, so they leave any state
    unchanged."""
    b_l = tl.where(mask, log_weight(b_a, ATTN, NEWTON), NEG_INF)              # [BT, BD]
    if DISCOUNT == NO_DISCOUNT:
        b_lam = tl.zeros_like(b_l)                                            # [BT, BD]
    else:
        b_lam = tl.where(mask, log_decay(b_g, DISCOUNT, NEWTON), 0.0)         # [BT, BD]
    return b_l, b_lam


@triton.jit
def scan_chunk(b_l, b_z, b_lam, b_hm, b_hn, b_hd):
    """States ``(m, n~, d~)`` after every row of a chunk ``[BT, BD]`` (rows in scan order,
    :func:`chunk_rows`), from incoming ``[BD]`` state, and the log decay ``G`` summed over the
    rows so far (from the chunk's start). The state is folded into the first row
    (one combine there), then the rows are scanned. With each thread holding a channel's
    column of the chunk (the launcher's blocks) the scan is a loop in that thread's
    registers, and the fold costs one row's combine."""
    b_first = (tl.arange(0, b_l.shape[0]) == 0)[:, None]                      # [BT, 1]
    f_m, f_n, f_d, _ = combine(b_hm[None, :], b_hn[None, :], b_hd[None, :], 0.0,
                               b_l, b_z, 1.0, b_lam)                          # [BT, BD] x3
    b_m = tl.where(b_first, f_m, b_l)                                         # [BT, BD]
    b_n = tl.where(b_first, f_n, b_z)                                         # [BT, BD]
    b_d = tl.where(b_first, f_d, 1.0)                                         # [BT, BD]
    return tl.associative_scan((b_m, b_n, b_d, b_lam), 0, combine)           # [BT, BD] x4


@triton.jit
def scan_summaries(b_sm, b_sn, b_sd, b_sG, b_hm, b_hn, b_hd):
    """States ``(m, n~, d~, G)`` after every row of ``[KT, BD]`` segment summaries (rows in
    order), from incoming ``[BD]`` state: :func:`scan_chunk` of summaries, whose rows are
    the combine's elements already."""
    b_first = (tl.arange(0, b_sm.shape[0]) == 0)[:, None]                     # [KT, 1]
    f_m, f_n, f_d, _ = combine(b_hm[None, :], b_hn[None, :], b_hd[None, :], 0.0,
                               b_sm, b_sn, b_sd, b_sG)                        # [KT, BD] x3
    b_m = tl.where(b_first, f_m, b_sm)                                        # [KT, BD]
    b_n = tl.where(b_first, f_n, b_sn)                                        # [KT, BD]
    b_d = tl.where(b_first, f_d, b_sd)                                        # [KT, BD]
    return tl.associative_scan((b_m, b_n, b_d, b_sG), 0, combine)            # [KT, BD] x4


@triton.jit
def _later(x1, i1, x2, i2):
    """Of two (value, row) pairs, the one with the larger row (associative and commutative)."""
    later = i2 > i1
    return tl.where(later, x2, x1), tl.where(later, i2, i1)


@triton.jit
def row(b_x, o_r, r):
    """Row ``r`` of a ``[BT, BD]`` block as ``[BD]``: a reduction that keeps the latest row up
    to ``r`` (NaN kept; in a thread's own column the row compares fold away at compile time)."""
    b_i = tl.broadcast_to(tl.where(o_r <= r, o_r, -1)[:, None], b_x.shape)          # [BT, BD]
    out, _ = tl.reduce((b_x, b_i), 0, _later)                                 # [BD]
    return out


@triton.jit
def average(b_n, b_d, NEWTON: tl.constexpr):
    """``n / d`` (:func:`reciprocal`), 0 where ``d = 0`` (a NaN stays NaN)."""
    return tl.where(b_d == 0, 0.0, b_n * reciprocal(b_d, NEWTON))


@triton.jit
def plane(p, k: tl.constexpr, rows):
    """Pointer to plane ``k`` of a ``(planes, rows, D)`` buffer given as ``rows`` elements a
    plane (an int32 argument times ``D``): added one plane at a time, so that no product
    ``k * rows`` wraps int32."""
    for _ in tl.static_range(k):
        p += rows
    return p


@triton.jit
def load_state(p, o_s, mask_d, rows, VOLATILE: tl.constexpr = False):
    """``(m, n~, d~)`` ``[BD]`` at ``o_s`` of a ``(3, rows, D)`` buffer (masked lanes: empty);
    ``VOLATILE``: read past L1 (another program's published values)."""
    b_m = tl.load(p + o_s, mask=mask_d, other=NEG_INF, volatile=VOLATILE)         # [BD]
    b_n = tl.load(plane(p, 1, rows) + o_s, mask=mask_d, other=0.0, volatile=VOLATILE)
    b_d = tl.load(plane(p, 2, rows) + o_s, mask=mask_d, other=0.0, volatile=VOLATILE)
    return b_m, b_n, b_d


@triton.jit
def store_state(p, o_s, mask_d, rows, b_m, b_n, b_d):
    """Store ``(m, n~, d~)`` ``[BD]`` at ``o_s`` of a ``(3, rows, D)`` buffer."""
    tl.store(p + o_s, b_m, mask=mask_d)
    tl.store(plane(p, 1, rows) + o_s, b_n, mask=mask_d)
    tl.store(plane(p, 2, rows) + o_s, b_d, mask=mask_d)


@triton.jit
def state_scale(b_d):
    """``2**64`` where a state's ``d~`` is subnormal, else 1: the factor :func:`initial_state`
    takes ``n~`` and ``d~`` of a state of one's own by."""
    return tl.where((b_d > 0) & (b_d < SMALLEST_NORMAL), STATE_SCALE, 1.0)


@triton.jit
def initial_state(h0_ptr, o_s, mask_d, rows, HAS_INIT: tl.constexpr, BD: tl.constexpr):
    """The state a sequence starts from: loaded from ``h0`` ``(3, rows, D)``, or empty.

    A state of one's own whose ``d~`` is subnormal (the kernels' own have ``d~`` 0 or at
    least 1, and every row after it has at least the smaller of its ``d~`` and 1) is taken
    with ``n~`` and ``d~`` times ``2**64`` (:func:`state_scale`) and ``m`` less ``64 ln 2``:
    the same sums ``exp(m) n~`` and ``exp(m) d~``, within ``m``'s rounding, and a ``d~``
    that :func:`reciprocal` can take (``rsqrt.approx.ftz`` reads a subnormal as 0). The
    backward scales the gradients of ``n~`` and ``d~`` by the same factor."""
    if HAS_INIT:
        b_m, b_n, b_d = load_state(h0_ptr, o_s, mask_d, rows)                     # [BD] x3
        b_s = state_scale(b_d)                                                 # [BD]
        b_m = tl.where(b_s == 1.0, b_m, b_m - LOG_STATE_SCALE)                 # [BD]
        b_n = b_n * b_s                                                        # [BD]
        b_d = b_d * b_s                                                        # [BD]
    else:
        b_m = tl.full([BD], NEG_INF, tl.float32)                               # [BD]
        b_n = tl.zeros([BD], tl.float32)                                       # [BD]
        b_d = tl.zeros([BD], tl.float32)                                       # [BD]
    return b_m, b_n, b_d


@triton.jit
def state_row(b_m, b_n, b_d, b_G, r, BT: tl.constexpr):
    """Row ``r`` of a ``[BT, BD]`` scanned chunk ``(m, n~, d~, G)`` as four ``[BD]``."""
    o_r = tl.arange(0, BT)
    return row(b_m, o_r, r), row(b_n, o_r, r), row(b_d, o_r, r), row(b_G, o_r, r)


@triton.jit
def store_summary(p, o_s, mask_d, rows, b_m, b_n, b_d, b_G):
    """Store a summary ``(m, n~, d~, G)`` ``[BD]`` at ``o_s`` of a ``(4, rows, D)`` buffer."""
    store_state(p, o_s, mask_d, rows, b_m, b_n, b_d)
    tl.store(plane(p, 3, rows) + o_s, b_G, mask=mask_d)


@triton.jit
def load_summary(p, o_s, mask_d, rows, VOLATILE: tl.constexpr = False):
    """A chunk summary ``(m, n~, d~, G)`` ``[BD]`` from ``(4, rows, D)`` (``VOLATILE``:
    :func:`load_state`)."""
    b_m, b_n, b_d = load_state(p, o_s, mask_d, rows, VOLATILE)                    # [BD] x3
    b_G = tl.load(plane(p, 3, rows) + o_s, mask=mask_d, other=0.0, volatile=VOLATILE)
    return b_m, b_n, b_d, b_G
