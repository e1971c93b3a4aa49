"""Triton-only checks: the two forward algorithms agree, the algorithm heuristic, the
ahead-of-time compile, and the memory traffic of the kernels (counted under the interpreter).

The Triton backend's correctness against the reference is part of the op test matrix
(tests/conftest.py); these tests cover what only this backend has.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fastrwa
from fastrwa.ops import triton_host
from fastrwa.ops.contract import ScanArgs
from fastrwa.testing import backend_options
from fastrwa.state import ScanState
from helpers import assert_close, leaf, loss_and_grads, make_inputs, make_state, reference

SMALL = dict(block_t=4, block_d=4, block_d_backward=2, segment_chunks=2)
ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.interpreter
def test_algorithms_agree():
    z, a, g = make_inputs(2, 23, 5, dtype=torch.float32, attention="relu", seed=13)
    with fastrwa.use_backend("triton"):
        with backend_options("triton", algorithm="looped", **SMALL):
            y_looped, _ = fastrwa.rda_scan(z, a, g, "relu")
        with backend_options("triton", algorithm="segments", **SMALL):
            y, _ = fastrwa.rda_scan(z, a, g, "relu")
    assert_close(y, y_looped.double(), 1e-6, "segments vs looped")


def _inputs(packed: bool, T: int, lengths: list, D: int, device: str, seed: int):
    """``z, a, g``, an initial state and ``cu_seqlens`` (``None`` unless ``packed``): 2
    sequences of ``T`` steps, or the ``lengths`` packed one after another."""
    T = sum(lengths) if packed else T
    z, a, g = (x.to(device) for x in make_inputs(1 if packed else 2, T, D,
                                                 dtype=torch.float32, seed=seed))
    h0 = [x.float().to(device) for x in make_state(len(lengths) if packed else 2, D)]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(device) if packed else None
    return z, a, g, h0, cu


def _scan(leaves: list, reverse: bool, cu):
    """``rda_scan`` (exp attention) of ``leaves`` = ``z, a, g, m0, n0, d0``, with its final
    state: what the variant tests run and differentiate."""
    return lambda: fastrwa.rda_scan(*leaves[:3], "exp", initial_state=ScanState(*leaves[3:]),
                                    output_final_state=True, reverse=reverse, cu_seqlens=cu)


def _same_bits_as_default(knob: dict, algorithm: str, reverse: bool, packed: bool,
                          device: str, blocks: dict, T: int, lengths: list, D: int = 5):
    """A knob's variant (``algorithm`` among its knobs: another algorithm) against the
    launcher's defaults on the same inputs: ``y``, the final
    state and the gradients of the inputs and of an initial state, bit for bit (``blocks``:
    the other knobs, each thread owning its channel columns; ``T``: the steps, or with
    ``packed`` the sequences' ``lengths`` one after another), and the variant's ``y``
    against the float64 reference."""
    z, a, g, h0, cu = _inputs(packed, T, lengths, D, device, seed=21)
    got = []
    for knobs in ({}, knob):
        leaves = [leaf(x) for x in (z, a, g, *h0)]
        fn = _scan(leaves, reverse, cu)
        with fastrwa.use_backend("triton"), backend_options(
                "triton", **{"algorithm": algorithm, **blocks, **knobs}):
            y, final = fn()
            got.append((y, final.m, final.n, final.d, *loss_and_grads(fn, leaves)))
    for default, variant in zip(*got):
        assert torch.equal(default, variant), knob
    y_ref, _ = reference(z.cpu(), a.cpu(), g.cpu(), "exp", ScanState(*(x.cpu() for x in h0)),
                         reverse=reverse, cu_seqlens=None if cu is None else cu.cpu())
    assert_close(got[1][0].cpu(), y_ref, 1e-5, f"{knob} vs the reference")


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
    _same_bits_as_default(dict(forward_lookahead=2), algorithm, reverse, packed, "cpu",
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
    _same_bits_as_default(dict(carry_tile=tile), "segments", reverse, packed, "cpu", SMALL,
                          19, [5, 9, 19])      # (packed: 33 steps)


# (T = 19 at SMALL's blocks: 5 chunks in 3 segments of 2, the last of 1; packed: 5, 9 and
# 19 steps, 1, 2 and 3 segments.)
@pytest.mark.interpreter
@pytest.mark.parametrize("reverse,packed", [(True, False), (False, True)])
def test_the_chained_forward_gives_the_bits_of_segments(reverse, packed):
    """The "chained" forward (one launch, a look-back for each segment's incoming state)
    computes what "segments" does, bit for bit: the interpreter runs programs one at a time
    in ticket order, so each look-back finds its predecessor's prefix and folds it as the
    carry kernel does. ``y``, the final state, and the gradients through the backward from
    the chunk states it saved."""
    _same_bits_as_default(dict(algorithm="chained", chained_chunks=2), "segments", reverse,
                          packed, "cpu", SMALL, 19, [5, 9, 19])


# (T = 25 at SMALL's blocks: 7 chunks in 4 segments of 2; windows of 1 and 2 (segment 3
# looks at 1..2, then at -1..0: a window reaching before the first segment); packed: 3, 30
# and 8 steps, the 30 in 4 segments.)
@pytest.mark.interpreter
@pytest.mark.parametrize("window,reverse,packed", [(1, False, False), (2, True, False),
                                                   (2, False, True)])
def test_a_chained_look_back_over_aggregates_agrees_with_the_reference(window, reverse,
                                                                        packed):
    """With only each sequence's first segment publishing its prefix
    (``chained_prefixes=False``), every look-back folds its predecessors' aggregates,
    ``lookback_window`` at a time, back to that first segment: what a card does when
    predecessors are still running. ``y``, the final state and the gradients agree with the
    float64 reference."""
    z, a, g, h0, cu = _inputs(packed, 25, [3, 30, 8], 5, "cpu", seed=29)
    _agrees_with_the_reference([leaf(x) for x in (z, a, g, *h0)], reverse, cu,
                               dict(SMALL, algorithm="chained", chained_chunks=2,
                                    chained_prefixes=False, lookback_window=window))


@pytest.mark.cuda
@pytest.mark.parametrize("prefixes", [True, False])
@pytest.mark.parametrize("reverse,packed", [(False, False), (True, False), (False, True)])
def test_the_chained_forward_on_the_card(prefixes, reverse, packed):
    """Compiled, at the launcher's own blocks: the "chained" forward (its look-back folding
    whatever its predecessors have published, prefixes or, with ``prefixes`` off, only
    aggregates back to each sequence's first segment) against the float64 reference:
    1,000 steps, segments of 2 chunks of 16, 70 channels."""
    z, a, g, h0, cu = _inputs(packed, 1000, [37, 300, 663], 70, "cuda", seed=31)
    _agrees_with_the_reference([leaf(x) for x in (z, a, g, *h0)], reverse, cu,
                               dict(algorithm="chained", chained_chunks=2,
                                    chained_prefixes=prefixes))


@pytest.mark.cuda
def test_the_chained_forward_under_load_on_the_card():
    """The "chained" forward over 4,096 segments of 64 steps in 8 channel blocks (32,768
    programs, far more than are resident: programs wait on predecessors still running)
    gives what "segments" gives, within float32 rounding, three runs in a row: ``y``, the
    final state, and the gradients through the backward from the states it saved. A lost
    flag or a stale read would show as a wrong segment, a lost ticket as a hang."""
    inputs = [x.cuda() for x in make_inputs(1, 1 << 18, 256, dtype=torch.float32, seed=37)]

    def run(algorithm: str) -> list:
        leaves = [leaf(x) for x in inputs]
        with fastrwa.use_backend("triton"), backend_options("triton", algorithm=algorithm):
            y, final = fastrwa.rda_scan(*leaves, "exp", output_final_state=True)
            grads = torch.autograd.grad((y * y).sum(), leaves)
        return [y, final.m + final.d.log(), final.n / final.d, *grads]

    want = run("segments")
    for _ in range(3):
        for got, ref in zip(run("chained"), want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


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
    z, a, g, h0, cu = _inputs(packed, T, lengths, D, device, seed=23)
    knobs = dict(blocks, algorithm=algorithm)
    BT = triton_host.Options(**blocks).block_t
    want = _saved_states(z, a, g, h0, cu, reverse, **knobs)
    got = _saved_states(z, a, g, h0, cu, reverse, forward_block_t=forward_t, **knobs)
    rows = sum(-(-n // BT) for n in lengths) if packed else 2 * -(-z.shape[1] // BT)
    assert_close(got[:, :rows].cpu(), want[:, :rows].double().cpu(), 1e-6, "saved states")
    _agrees_with_the_reference([leaf(x) for x in (z, a, g, *h0)], reverse, cu,
                               dict(forward_block_t=forward_t, **knobs))


def _agrees_with_the_reference(leaves: list, reverse: bool, cu, knobs: dict) -> None:
    """:func:`_scan` of ``leaves`` (``z, a, g, m0, n0, d0``) on the Triton backend at
    ``knobs`` against the float64 reference: ``y``, the final state's gauge-free parts (its
    log-total and its average) and the gradients of every leaf."""
    fn = _scan(leaves, reverse, cu)
    with fastrwa.use_backend("triton"), backend_options("triton", **knobs):
        (y, final), grads = fn(), loss_and_grads(fn, leaves)
    cpu = [leaf(x.detach().cpu()) for x in leaves]
    ref = lambda: reference(*cpu[:3], "exp", ScanState(*cpu[3:]), reverse=reverse,
                            cu_seqlens=None if cu is None else cu.cpu())
    y_ref, final_ref = ref()
    assert_close(y.cpu(), y_ref, 1e-5, "y")
    assert_close((final.m + final.d.log()).cpu(), final_ref.m + final_ref.d.log(), 1e-5,
                 "log-total")
    assert_close((final.n / final.d).cpu(), final_ref.n / final_ref.d, 1e-5, "average")
    for name, got_x, want_x in zip("z a g m0 n0 d0".split(), grads, loss_and_grads(ref, cpu)):
        assert_close(got_x.cpu(), want_x, 1e-4, f"gradient of {name}")


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
    _same_bits_as_default(knob, algorithm, reverse, packed, "cuda", dict(segment_chunks=5),
                          1000, [37, 300, 663], D=70)


def _state_with_a_subnormal_denominator(device: str, blocks: dict, algorithm: str,
                                        reverse: bool) -> None:
    """A state of one's own whose ``n~`` and ``d~`` are subnormal (average 0.5; the kernels
    scale it up to a normal ``d~``, common.initial_state): through masked steps, and through
    one step (the step kernel), its average comes out (within 2 ulp); weighing a twentieth
    of a step (``m = 86``: ``exp(m) d~ = 0.045``) ahead of 40 steps, ``y``, the final state
    and every gradient (the state's scaled back) agree with the float64 reference."""
    D = 5
    z, a, g = (x.to(device) for x in make_inputs(1, 40, D, dtype=torch.float32, seed=29))
    tiny = lambda m: [torch.full((1, D), v, device=device) for v in (m, 1e-39, 2e-39)]
    # (exact under the interpreter; on a card n~ * reciprocal(d~) is within 1.5 ulp)
    half = lambda x: torch.testing.assert_close(x, torch.full_like(x, 0.5), rtol=2.4e-7, atol=0)
    masked = torch.full_like(a, float("-inf"))          # no weight: the state passes as is
    with fastrwa.use_backend("triton"), backend_options("triton", algorithm=algorithm,
                                                        **blocks):
        for steps in (40, 1):
            y, final = fastrwa.rda_scan(z[:, :steps], masked[:, :steps], g[:, :steps],
                                        initial_state=ScanState(*tiny(0.0)),
                                        output_final_state=True, reverse=reverse)
            half(y)
            half(final.n / final.d)
    _agrees_with_the_reference([leaf(x) for x in (z, a, g, *tiny(86.0))], reverse, None,
                               dict(algorithm=algorithm, **blocks))


# (40 steps: at SMALL's blocks 10 chunks, 5 segments; on a card 3 chunks, 3 segments)
@pytest.mark.interpreter
@pytest.mark.parametrize("algorithm,reverse", [("looped", False), ("segments", True)])
def test_a_state_with_a_subnormal_denominator(algorithm, reverse):
    _state_with_a_subnormal_denominator("cpu", SMALL, algorithm, reverse)


@pytest.mark.cuda
@pytest.mark.parametrize("algorithm,reverse", [("looped", False), ("segments", True)])
def test_a_state_with_a_subnormal_denominator_on_the_card(algorithm, reverse):
    """Compiled, where ``rsqrt.approx.ftz`` would read the unscaled ``d~`` as 0."""
    _state_with_a_subnormal_denominator("cuda", dict(segment_chunks=1), algorithm, reverse)


def test_heuristic():
    opts = triton_host.Options(block_t=64, block_d=32)
    cpu = torch.device("cpu")
    assert triton_host.choose_algorithm(256, 1024, 4096, opts, cpu) == "looped"   # many programs
    assert triton_host.choose_algorithm(1, 256, 1 << 20, opts, cpu) == "segments"
    assert triton_host.choose_algorithm(1, 256, 100, opts, cpu) == "looped"       # short
    # one segment a sequence (at most 8 chunks of 64 steps): segments would read twice
    assert triton_host.choose_algorithm(1, 256, 512, opts, cpu) == "looped"
    assert triton_host.choose_algorithm(1, 256, 513, opts, cpu) == "segments"
    forced = triton_host.Options(algorithm="segments")
    assert triton_host.choose_algorithm(256, 1024, 4096, forced, cpu) == "segments"
    with pytest.raises(ValueError, match="algorithm"):
        triton_host.set_options(algorithm="fast")


def test_segment_length():
    """Segments: enough for 16 programs per SM (108 SMs off a GPU), at least 8 chunks each, or
    the forced count."""
    cpu = torch.device("cpu")
    opts = triton_host.Options()                              # BT 16, BD 32
    # 1 x 1M x 256: 8 channel blocks, 216 segments of 304 chunks (not 65,536 chunks in a row)
    cps = triton_host.segment_chunks(1, 256, 1 << 20, opts, cpu)
    assert cps == 304 and -(-(1 << 20) // (16 * cps)) * 8 >= 16 * 108
    assert triton_host.segment_chunks(4, 1024, 4096, opts, cpu) == 19     # 14 of 256 chunks
    assert triton_host.segment_chunks(64, 1024, 4096, opts, cpu) == 256   # one: enough blocks
    assert triton_host.segment_chunks(1, 256, 200, opts, cpu) == 8        # the floor
    forced = triton_host.Options(segment_chunks=3)
    assert triton_host.segment_chunks(1, 256, 1 << 20, forced, cpu) == 3


@pytest.mark.parametrize("knob,value", [("block_t", 24), ("block_d", 0), ("warps", 3),
                                        ("warps_backward", 6), ("stages", 0),
                                        ("segment_chunks", -1),
                                        ("forward_lookahead", 3), ("carry_tile", 3),
                                        ("forward_lookahead", 0), ("forward_lookahead", 2.0),
                                        ("forward_block_t", 8), ("forward_block_t", 48),
                                        ("forward_block_t", 32.0)])
def test_launch_knobs_are_checked(knob, value):
    with pytest.raises(ValueError, match=f"{knob} must be"):
        triton_host.set_options(**{knob: value})
    assert getattr(triton_host.options(), knob) == getattr(triton_host.Options(), knob)


@pytest.mark.interpreter
def test_warps_and_stages_reach_the_launch(monkeypatch):
    """The sweep (bench/gpu_sweep.py) sets warps and stages through the options; every
    launch of the forward and the backward takes them."""
    seen = []
    for module in (triton_host.scan_fwd, triton_host.scan_bwd):
        for name in dir(module):
            kernel = getattr(module, name)
            if name.endswith("_kernel") and hasattr(kernel, "run"):
                run = kernel.run
                def spy(*args, _run=run, **kwargs):
                    seen.append((kwargs.get("num_warps"), kwargs.get("num_stages")))
                    return _run(*args, **kwargs)
                monkeypatch.setattr(kernel, "run", spy)
    z, a, g = (x.requires_grad_() for x in make_inputs(1, 9, 3, dtype=torch.float32))
    for algorithm in ("looped", "segments"):
        with fastrwa.use_backend("triton"), backend_options(
                "triton", algorithm=algorithm, warps=2, warps_backward=8, stages=1, **SMALL):
            y, _ = fastrwa.rda_scan(z, a, g)
            y.sum().backward()
    assert len(seen) == (1 + 1) + (3 + 3)        # looped: 1 + 1 launches, segments: 3 + 3
    assert seen.count((2, 1)) == 1 + 3 and seen.count((8, 1)) == 1 + 3, seen


def test_ahead_of_time_compile_meets_the_static_targets(tmp_path):
    """The one-pass forward and backward of rda-exp compiled for sm_90a from this CPU-only
    machine (the full table: bench/kernels.py): no spill, and the chunk loop within the
    static targets of docs/kernels.md: each thread scans its own channel columns (no
    barrier, shuffle or shared-memory operation), at most 80 (forward) and 150 (backward)
    instructions per element, and both loops double-buffered: no load's value is read
    within half a chunk's worth of instructions of the load (bench/sass.py ``load_use``;
    the backward read its loads 18 instructions after issuing them before its double
    buffer, about 1,700 after)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    table = tmp_path / "kernels.json"
    out = subprocess.run([sys.executable, "-m", "bench.kernels", "--quick", "--json", str(table)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 compiled, 0 failed or spilled" in out.stdout
    rows = json.loads(table.read_text())
    limits = {"fwd[one_pass]": 80, "bwd[one_pass]": 150}
    assert sorted(r["kernel"] for r in rows) == sorted(limits)
    for r in rows:
        assert r["loop"] and r["bar"] == r["shfl"] == r["lds"] == r["sts"] == 0, r
        assert 0 < r["instr"] <= limits[r["kernel"]], r
        bt, bd = map(int, r["blocks"].split("x"))
        per_chunk = r["instr"] * bt * bd / (32 * r["warps"])    # a thread's instructions a chunk
        assert r["load_use"] >= per_chunk / 2, r


@pytest.mark.interpreter
def test_memory_traffic_meets_targets():
    """Bytes the kernels move, counted under the interpreter, against the minimum (every
    input read once, every output written once)."""
    from bench import traffic
    with backend_options("triton", **vars(triton_host.Options())):
        for algorithm in ("looped", "segments"):
            rows = {name: (moved / minimum, launches)
                    for name, moved, minimum, launches in
                    traffic.measure("rda", algorithm, torch.bfloat16, 1, 64, 32)}
            for name, (ratio, launches) in rows.items():
                target = traffic.TARGETS.get((algorithm, name.split("+")[0]))
                if target is not None:
                    assert ratio <= target, (algorithm, name, ratio)
                assert launches == (1 if algorithm == "looped" else 3), (algorithm, name)
