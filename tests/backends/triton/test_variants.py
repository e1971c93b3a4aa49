"""The Triton launch knobs' variants for a card to time (issue 62): each computes the
defaults' bits, or where it cannot (a longer forward chunk) agrees with the float64
reference and saves the states the backward reads; under the interpreter, and compiled on
a card (``pytest --cuda``)."""

import pytest

from fastrwa.ops import triton_host
from fastrwa.ops.contract import ScanArgs
from fastrwa.testing import backend_options
from helpers import assert_close, leaf
from triton_helpers import SMALL, agrees_with_the_reference, inputs, same_bits_as_default


# (T = 23 at SMALL's blocks: 6 chunks, the last ragged; segments of 2 chunks. Packed: 3, 9
# and 11 steps.)
@pytest.mark.interpreter
@pytest.mark.parametrize("algorithm,reverse,packed", [("looped", True, False),
                                                     ("segments", False, True)])
def test_forward_lookahead_two_gives_the_same_bits(algorithm, reverse, packed):
    """The forward loading two chunks ahead (``forward_lookahead=2``, a variant for the card
    to time) computes what loading one ahead does, bit for bit, forward and backward: a
    ragged last chunk, segments of 2 chunks and a segment of 1 (the loads past a segment's
    end masked), reversed and packed; and agrees with the float64 reference."""
    same_bits_as_default(dict(forward_lookahead=2), algorithm, reverse, packed, "cpu",
                          SMALL, 23, [3, 9, 11])


# (T = 19 at SMALL's blocks: 5 chunks in 3 segments, the last of 1 chunk; packed: 5, 9 and
# 19 steps, 1, 2 and 3 segments. A tile of 2 takes 3 segments as 2 + 1, one of 16 as one
# tile mostly empty. Each case runs the interpreter four times: few cases, short ones.)
@pytest.mark.interpreter
@pytest.mark.parametrize("tile,reverse,packed", [(2, False, False), (2, True, False),
                                                 (2, False, True), (16, False, False)])
def test_carry_tiles_give_what_the_walk_gives(tile, reverse, packed):
    """The carry kernels taking ``carry_tile`` segments at a time compute what the walk one
    segment at a time does (forward, backward, final state and its gradient, an initial
    state and its gradient), tiles cut short at the sequence's first or last segment, and
    agree with the float64 reference."""
    same_bits_as_default(dict(carry_tile=tile), "segments", reverse, packed, "cpu", SMALL,
                          19, [5, 9, 19])      # (packed: 33 steps)


def _saved_states(z, a, g, h0, cu, reverse, **knobs):
    """The chunk states the Triton forward saves for its backward (``(3, rows, D)``)."""
    args = ScanArgs(z, a, g, "exp", "sigmoid", tuple(h0), reverse, cu)
    with backend_options("triton", **knobs):
        return triton_host.forward(args, output_final_state=False, save=True).saved[0]


def _longer_forward_chunk(forward_t: int, algorithm: str, reverse: bool, packed: bool,
                          device: str, blocks: dict, T: int, lengths: list, D: int = 5):
    """``forward_block_t = forward_t`` against the float64 reference (``y``, the final
    state's log-total and average, the gradients through the backward at ``block_t``), and
    its saved chunk states against the default forward's."""
    z, a, g, h0, cu = inputs(packed, T, lengths, D, device, seed=23)
    knobs = dict(blocks, algorithm=algorithm)
    BT = triton_host.Options(**blocks).block_t
    want = _saved_states(z, a, g, h0, cu, reverse, **knobs)
    got = _saved_states(z, a, g, h0, cu, reverse, forward_block_t=forward_t, **knobs)
    rows = sum(-(-n // BT) for n in lengths) if packed else 2 * -(-z.shape[1] // BT)
    assert_close(got[:, :rows].cpu(), want[:, :rows].double().cpu(), 1e-6, "saved states")
    agrees_with_the_reference([leaf(x) for x in (z, a, g, *h0)], reverse, cu,
                               dict(forward_block_t=forward_t, **knobs))


# (SMALL's backward chunks are 4 steps; the forward's 16 or 8. T = 23: forward chunks of 8
# end with one of 7 steps, 2 saved states; T = 19: the last forward chunk has 3 steps, 1
# saved state, its second part past the end (without the mask its store lands past the
# buffer's end). Packed: 3, 9 and 37 steps; segments of 2 forward chunks, so the 37 steps
# are 2 segments of chunks of 16 or 3 of chunks of 8, each starting mid-sequence.)
@pytest.mark.interpreter
@pytest.mark.parametrize("forward_t,algorithm,reverse,packed,T", [
    (8, "looped", False, False, 23), (8, "looped", True, False, 19),
    (16, "segments", False, True, None), (8, "segments", True, True, None)])
def test_a_longer_forward_chunk_saves_the_backwards_states(forward_t, algorithm, reverse,
                                                           packed, T):
    """``forward_block_t`` (a variant for the card to time: the forward scans chunks of 8 or
    16 steps while the backward keeps chunks of 4) saves the state entering every 4 steps,
    as the default forward does, and nothing for a part past a sequence's end; its ``y``,
    final state and gradients (through the backward at chunks of 4) agree with the float64
    reference."""
    _longer_forward_chunk(forward_t, algorithm, reverse, packed, "cpu", SMALL, T, [3, 9, 37])


@pytest.mark.cuda
@pytest.mark.parametrize("block_t", [16, 32])
@pytest.mark.parametrize("algorithm", ["looped", "segments"])
@pytest.mark.parametrize("reverse,packed", [(False, False), (True, False), (False, True)])
def test_a_longer_forward_chunk_on_the_card(block_t, algorithm, reverse, packed):
    """Compiled, at the launcher's own blocks: the forward at chunks of 32 steps, the
    backward at ``block_t`` (16: the variant ``forward_block_t = 32``; 32: the variant
    ``block_t = 32``, both passes at 32, the backward without its lookahead, where the
    saved-states comparison compares the build with itself and the reference is the
    test), 1,000 steps, segments of 5 chunks, 70 channels, against the reference."""
    _longer_forward_chunk(32, algorithm, reverse, packed, "cuda",
                          dict(segment_chunks=5, block_t=block_t), 1000, [37, 300, 663], D=70)


@pytest.mark.cuda
@pytest.mark.parametrize("knob,algorithm", [(dict(forward_lookahead=2), "looped"),
                                            (dict(forward_lookahead=2), "segments"),
                                            (dict(carry_tile=8), "segments"),
                                            (dict(carry_tile=16), "segments")])
@pytest.mark.parametrize("reverse,packed", [(False, False), (True, False), (False, True)])
def test_variants_give_the_defaults_bits_on_the_card(knob, algorithm, reverse, packed):
    """Compiled, at the launcher's own blocks (each thread scanning its channel columns), the
    variants issue 62 times give the defaults' bits: 1,000 steps in chunks of 16, segments
    of 5 chunks (13 segments: tiles cut short), 70 channels (a ragged channel block)."""
    same_bits_as_default(knob, algorithm, reverse, packed, "cuda", dict(segment_chunks=5),
                          1000, [37, 300, 663], D=70)
