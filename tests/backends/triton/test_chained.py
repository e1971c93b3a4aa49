"""The "chained" algorithm (kernels/triton/scan_chained.py, a variant for a card to time):
the segments algorithm's bits where every look-back finds its neighbour's prefix, the
float64 reference where look-backs fold aggregates; under the interpreter, which runs
programs one at a time in ticket order (never a wait), and compiled on a card, where
programs wait on each other (``pytest --cuda``, under a time limit in bench/gpu_run.sh)."""

import pytest
import torch
import triton
import triton.language as tl

import fastrwa
from fastrwa.kernels.triton import scan_chained
from fastrwa.ops import triton_host
from fastrwa.testing import backend_options
from helpers import assert_close, leaf, make_inputs
from triton_helpers import SMALL, agrees_with_the_reference, inputs, same_bits_as_default


# (T = 19 at SMALL's blocks: 5 chunks in 3 segments of 2, the last of 1; packed: 5, 9 and
# 19 steps, 1, 2 and 3 segments.)
@pytest.mark.interpreter
@pytest.mark.parametrize("reverse,packed", [(True, False), (False, True)])
def test_the_chained_algorithm_gives_the_bits_of_segments(reverse, packed):
    """The "chained" forward and backward (one launch a pass, a look-back for each segment's
    incoming state, a look-ahead for its incoming adjoint) compute what "segments" does, bit
    for bit: the interpreter runs programs one at a time in ticket order, so each look-back
    (look-ahead) finds its neighbour's prefix and folds it as the carry kernel does. ``y``,
    the final state, and the gradients of the inputs and of the initial state (the loss
    includes the final state)."""
    same_bits_as_default(dict(algorithm="chained", chained_chunks=2), "segments", reverse,
                          packed, "cpu", SMALL, 19, [5, 9, 19])


@pytest.mark.interpreter
def test_a_persistent_chained_launch_gives_the_bits_of_segments(monkeypatch):
    """``chained_programs_per_sm`` 1 and ``chained_programs_per_sm_backward`` 2 on a card of
    2 SMs (``_num_sms`` stubbed): the forward is one launch of 2 programs taking its
    tickets in turn, the backward one of 4 (``PERSISTENT``; under the interpreter the first
    takes them all, then each finds none left), and together they compute what "segments"
    does, bit for bit (reversed, three packed sequences)."""
    monkeypatch.setattr(triton_host, "_num_sms", lambda device: 2)
    seen = []
    for kernel in (scan_chained.fwd_chained_kernel, scan_chained.bwd_chained_kernel):
        def spy(*args, _run=kernel.run, **kwargs):
            seen.append((tuple(kwargs["grid"]), kwargs["PERSISTENT"]))
            return _run(*args, **kwargs)
        monkeypatch.setattr(kernel, "run", spy)
    same_bits_as_default(dict(algorithm="chained", chained_chunks=2, chained_programs_per_sm=1,
                              chained_programs_per_sm_backward=2), "segments", True,
                         True, "cpu", SMALL, 19, [5, 9, 19])
    # (1 + 2 + 3 segments: the forward's 12 tickets in 2 channel blocks of 4, the
    # backward's 18 in 3 of 2)
    assert seen == [((2,), True), ((4,), True)], seen


def test_the_chained_grid_is_persistent_only_with_more_tickets_than_programs(monkeypatch):
    """``_chained_grid``: a program a ticket at ``per_sm`` 0 or where the tickets are no
    more than ``per_sm`` x SMs programs; otherwise that many programs, ``PERSISTENT``."""
    monkeypatch.setattr(triton_host, "_num_sms", lambda device: 3)
    cpu = torch.device("cpu")
    assert triton_host._chained_grid(100, 0, cpu) == ((100,), False)
    assert triton_host._chained_grid(6, 2, cpu) == ((6,), False)       # 6 programs: as many
    assert triton_host._chained_grid(7, 2, cpu) == ((6,), True)
    assert triton_host._chained_grid(100, 1, cpu) == ((3,), True)


# (T = 25 at SMALL's blocks: 7 chunks in 4 segments of 2; windows of 1 and 2 (segment 3
# looks back at 1..2, then at -1..0: a window reaching before the first segment; segment 0
# looks ahead at 1..2, then 3..4: one reaching past the last); packed: 3, 30 and 8 steps,
# the 30 in 4 segments.)
@pytest.mark.interpreter
@pytest.mark.parametrize("window,reverse,packed", [(1, False, False), (2, True, False),
                                                   (2, False, True)])
def test_a_chained_look_back_over_aggregates_agrees_with_the_reference(window, reverse,
                                                                        packed):
    """With only each sequence's first segment publishing its prefix
    (``chained_prefixes=False``; in the backward its last), every look-back folds its
    predecessors' aggregates, ``lookback_window`` at a time, back to that first segment,
    and every look-ahead its successors' adjoints forward to that last one: what a card
    does when neighbours are still running. ``y``, the final state and the gradients agree
    with the float64 reference."""
    z, a, g, h0, cu = inputs(packed, 25, [3, 30, 8], 5, "cpu", seed=29)
    agrees_with_the_reference([leaf(x) for x in (z, a, g, *h0)], reverse, cu,
                               dict(SMALL, algorithm="chained", chained_chunks=2,
                                    chained_prefixes=False, lookback_window=window))


@pytest.mark.cuda
@pytest.mark.parametrize("prefixes", [True, False])
@pytest.mark.parametrize("reverse,packed", [(False, False), (True, False), (False, True)])
def test_the_chained_algorithm_on_the_card(prefixes, reverse, packed):
    """Compiled, at the launcher's own blocks: the "chained" forward and backward (a
    look-back folding whatever its predecessors have published, prefixes or, with
    ``prefixes`` off, only aggregates back to each sequence's first segment; the look-ahead
    likewise forward to its last) against the float64 reference: 1,000 steps, segments of 2
    chunks of 16, 70 channels."""
    z, a, g, h0, cu = inputs(packed, 1000, [37, 300, 663], 70, "cuda", seed=31)
    agrees_with_the_reference([leaf(x) for x in (z, a, g, *h0)], reverse, cu,
                               dict(algorithm="chained", chained_chunks=2,
                                    chained_prefixes=prefixes))


@pytest.mark.cuda
def test_a_persistent_chained_launch_on_the_card(monkeypatch):
    """Compiled, persistent, on a card taken as 1 SM (``_num_sms`` stubbed): 2 programs
    take the forward's tickets in turn, 3 the backward's, and with only each sequence's
    first (last) segment publishing its prefix every look-back (look-ahead) folds what
    the others have published, while they still run: against the float64 reference, as
    :func:`test_the_chained_algorithm_on_the_card`."""
    monkeypatch.setattr(triton_host, "_num_sms", lambda device: 1)
    z, a, g, h0, cu = inputs(True, 1000, [37, 300, 663], 70, "cuda", seed=31)
    agrees_with_the_reference([leaf(x) for x in (z, a, g, *h0)], False, cu,
                               dict(algorithm="chained", chained_chunks=2,
                                    chained_prefixes=False, chained_programs_per_sm=2,
                                    chained_programs_per_sm_backward=3))


@pytest.mark.cuda
@pytest.mark.parametrize("per_sm", [(0, 0), (6, 5), (16, 16)])
def test_the_chained_algorithm_under_load_on_the_card(per_sm):
    """The "chained" forward and backward over 4,096 segments of 64 steps in 8 channel
    blocks (32,768 tickets a pass, far more than are resident: programs wait on neighbours
    still running; with ``per_sm`` (forward, backward) set, that many programs an SM take
    them all in turn: the knobs timed at 6 and 5, and at 16 more programs than the
    registers let an SM hold, some starting late to find few tickets or none) give what
    "segments" gives, within float32 rounding, three runs in a row: ``y``, the final state,
    and the gradients. A lost flag or a stale read would show as a wrong segment, a lost
    ticket as a hang."""
    inputs = [x.cuda() for x in make_inputs(1, 1 << 18, 256, dtype=torch.float32, seed=37)]

    def run(**knobs) -> list:
        leaves = [leaf(x) for x in inputs]
        with fastrwa.use_backend("triton"), backend_options("triton", **knobs):
            y, final = fastrwa.rda_scan(*leaves, "exp", output_final_state=True)
            grads = torch.autograd.grad((y * y).sum(), leaves)
        return [y, final.m + final.d.log(), final.n / final.d, *grads]

    want = run(algorithm="segments")
    for _ in range(3):
        for got, ref in zip(run(algorithm="chained", chained_programs_per_sm=per_sm[0],
                                chained_programs_per_sm_backward=per_sm[1]), want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@triton.jit
def _look_kernel(f_ptr, s_ptr, p_ptr, out_ptr, k, last, NSEG, D: tl.constexpr,
                 WINDOW: tl.constexpr, BD: tl.constexpr, AHEAD: tl.constexpr):
    """One look of segment ``k`` of a sequence of segments ``0 .. last`` (one channel block):
    the backward's look-ahead (``AHEAD``: ``(W, V)`` into ``out`` rows 0, 1) or the
    forward's look-back (``(m, n~, d~)`` into rows 0-2)."""
    o_d = tl.arange(0, BD)                                                     # [BD]
    mask_d = o_d < D                                                           # [BD]
    if AHEAD:
        b_W, b_V = scan_chained._look_ahead(f_ptr, s_ptr, p_ptr, 0, k, last, 0, 1, o_d, mask_d,
                                            NSEG, D, WINDOW, BD, False)       # [BD] x2
        tl.store(out_ptr + o_d, b_W)
        tl.store(out_ptr + BD + o_d, b_V)
    else:
        b_m, b_n, b_d = scan_chained._look_back(f_ptr, s_ptr, p_ptr, 0, k, 0, 1, o_d, mask_d,
                                                NSEG, D, WINDOW, BD, False)   # [BD] x3
        tl.store(out_ptr + o_d, b_m)
        tl.store(out_ptr + BD + o_d, b_n)
        tl.store(out_ptr + 2 * BD + o_d, b_d)


def _look(ahead: bool, flags: list, k: int, garbage: float, seed: int) -> torch.Tensor:
    """:func:`_look_kernel` over ``len(flags)`` segments whose flags are ``flags``
    (``scan_chained.AGGREGATE``/``PREFIX``, 0: unpublished): summaries drawn at random in
    ``[0.5, 1.5)`` (adjoints ``(K, W, V)``; forward summaries ``(m, n~, d~, G)``, ``G``
    negated), prefixes likewise, and ``garbage`` wherever a segment has not published
    that."""
    n, D = len(flags), 2
    gen = torch.Generator().manual_seed(seed)
    planes = 3 if ahead else 4
    s = torch.rand(planes, n, D, generator=gen) + 0.5
    p = torch.rand(planes - 1, n, D, generator=gen) + 0.5
    if not ahead:
        s[3] = -s[3]                            # G, a log decay: at most 0
    f = torch.tensor(flags, dtype=torch.int32)
    s[:, f == 0] = garbage
    p[:, f != scan_chained.PREFIX.value] = garbage
    out = torch.empty(planes - 1, D)
    _look_kernel[(1,)](torch.cat([f, torch.zeros(1, dtype=torch.int32)]), s.contiguous(),
                       p.contiguous(), out, k, n - 1, n, D=D, WINDOW=4, BD=D, AHEAD=ahead)
    return out, s.double(), p.double()


A, P = scan_chained.AGGREGATE.value, scan_chained.PREFIX.value


# (segment 0 of 7 looking ahead: its window 1..4 holds a prefix at 3 with 4 unpublished, or
# aggregates only, then the window 5..8 a prefix at 5 with 6 unpublished and 7, 8 past the
# last segment)
@pytest.mark.interpreter
@pytest.mark.parametrize("flags", [[0, A, A, P, 0, 0, A], [0, A, A, A, A, P, 0]])
def test_a_look_ahead_folds_what_is_published_and_nothing_else(flags):
    """The backward's look-ahead, on made-up flags: the adjoints of the segments before the
    nearest prefix, composed by hand in float64 (``x <- K x + W``, the farthest first), and
    not a bit of what the segments after that prefix hold (unpublished: NaN or 1e30)."""
    got, s, p = _look(True, flags, 0, float("nan"), seed=41)
    again, _, _ = _look(True, flags, 0, 1e30, seed=41)
    assert torch.equal(got, again) and torch.isfinite(got).all()
    j = flags.index(P)
    want = p[:, j]                                                     # (W, V) at j's first row
    for i in range(j - 1, 0, -1):
        want = s[0, i] * want + s[1:, i]
    assert_close(got, want, 1e-6, "look-ahead")


# (segment 6 of 7 looking back: its window 2..5 holds a prefix at 3 with 2 unpublished, or
# aggregates only, then the window -2..1 a prefix at 1 with 0 unpublished)
@pytest.mark.interpreter
@pytest.mark.parametrize("flags", [[0, 0, 0, P, A, A, 0], [0, P, A, A, A, A, 0]])
def test_a_look_back_folds_what_is_published_and_nothing_else(flags):
    """The forward's look-back, on made-up flags: the state it finds does not depend on what
    the segments before the nearest prefix hold (unpublished: NaN or 1e30), and is the
    prefix's state advanced through the aggregates after it, in float64 by hand: each
    summary ``(m, n~, d~, G)`` takes a state ``(m', n', d')`` to ``M = max(m' + G, m)``,
    ``n = n' e^(m' + G - M) + n~ e^(m - M)``, ``d`` alike."""
    got, s, p = _look(False, flags, len(flags) - 1, float("nan"), seed=43)
    again, _, _ = _look(False, flags, len(flags) - 1, 1e30, seed=43)
    assert torch.equal(got, again) and torch.isfinite(got).all()
    j = len(flags) - 1 - flags[::-1].index(P)
    m, n, d = p[:, j]
    for i in range(j + 1, len(flags) - 1):
        sm, sn, sd, sG = s[:, i]
        M = torch.maximum(m + sG, sm)
        m, n, d = M, n * torch.exp(m + sG - M) + sn * torch.exp(sm - M), \
            d * torch.exp(m + sG - M) + sd * torch.exp(sm - M)
    # (a state is defined up to its gauge: compare its log-total and its average)
    assert_close(got[0] + got[2].log(), m + d.log(), 1e-6, "log-total")
    assert_close(got[1] / got[2], n / d, 1e-6, "average")
