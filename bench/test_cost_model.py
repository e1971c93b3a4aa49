"""bench/cost_model.py without a GPU and without compiling: the launch plan, the control-bit
decoding, the in-order replay and the terms, on a hand-written SASS listing (the shape
``cuobjdump -sass`` prints, control words included). Structural facts only: no timing."""

import argparse
import dataclasses

import pytest

from bench import cost_model as cm

# A loop of 4 instructions: a load (scoreboard 0), a MUFU waiting on it (scoreboard 1), an
# FFMA waiting on the MUFU, the backward branch. Control words: stall in bits 41-44 of the
# second word, write barrier 46-48, read barrier 49-51, wait mask 52-57.


def _word(stall, wbar=7, rbar=7, wait=0):
    return f"0x{(stall | 1 << 4 | wbar << 5 | rbar << 8 | wait << 11) << 41:016x}"


LISTING = "\n".join(f"        /*{addr:04x}*/                   {text} ;   /* 0x0000000000000000 */\n"
                    f"                                                  /* {word} */"
                    for addr, text, word in [
                        (0x00, "MOV R1, c[0x0][0x28]", _word(2)),
                        (0x10, "LDG.E R2, desc[UR4][R4.64]", _word(1, wbar=0)),
                        (0x20, "MUFU.EX2 R3, R2", _word(1, wbar=1, wait=0b01)),
                        (0x30, "FFMA R6, R3, R3, R3", _word(4, wait=0b10)),
                        (0x40, "@P1 BRA 0x10", _word(5)),
                        (0x50, "EXIT", _word(5)),
                        (0x60, "BRA 0x60", _word(0)),
                    ])


def test_control_bits_and_loop_split():
    ins = cm.control(LISTING)
    assert [x.stall for x in ins[:5]] == [2, 1, 1, 4, 5]
    assert (ins[1].wbar, ins[2].wbar, ins[2].wait, ins[3].wait) == (0, 1, 1, 2)
    body, rest = cm.split_loop(ins)
    assert [x.addr for x in body] == [0x10, 0x20, 0x30, 0x40]
    assert [x.addr for x in rest] == [0x00, 0x50]


def test_replay_adds_each_exposed_latency_once_per_iteration():
    body, _ = cm.split_loop(cm.control(LISTING))
    # the MUFU issues when the load's scoreboard is released (L cycles after the load), the
    # FFMA VARIABLE_LATENCY after the MUFU, then the FFMA's and the branch's stalls (4 + 5)
    L = 300
    assert cm.replay(body, L) == pytest.approx(L + cm.VARIABLE_LATENCY + 4 + 5)
    assert cm.replay(body, 0) == pytest.approx(1 + cm.VARIABLE_LATENCY + 4 + 5)
    assert cm.replay(body, 2 * L) - cm.replay(body, L) == pytest.approx(L)


def _launch(**more):
    base = dict(label="k", kernel="scan_fwd.fwd_kernel", const=(("BD", 32), ("BT", 16)), ints=(),
                dtype="float32", warps=1, stages=3, maxnreg=255, programs=512, iterations=256,
                bytes=10 ** 9, chunk_load_bytes=6144, depth=1)
    return cm.Launch(**{**base, **more})


def _counted(regs=158):
    ins = cm.control(LISTING)
    body, rest = cm.split_loop(ins)
    return cm.Counted(len(body), 1, regs, 0, body, rest, {})


def test_terms_are_positive_and_the_time_is_their_max():
    card, bw = cm.CARDS["h100"], 3.0e12
    t = cm.terms(_launch(), _counted(), card, bw, card.clock_hz, card.latency_ns)
    parts = [t.issue, t.mufu, t.chain, t.little, t.dram]
    assert all(x > 0 for x in parts)
    assert t.time == max(parts)
    assert t.dram == pytest.approx(1e9 / bw)                    # bytes / bandwidth
    # 512 one-warp programs on 132 SMs: 4 an SM, one warp a scheduler, one wave
    assert (t.programs_per_sm, t.warps_per_scheduler, t.waves) == (4, 1, 1)
    assert t.issue == pytest.approx((256 * 4 + 2) / card.clock_hz)  # w * (n * N + rest)
    assert t.mufu == pytest.approx(256 * 1 * 8 / card.clock_hz)
    assert t.little == pytest.approx(256 * card.latency_ns * 1e-9)
    assert t.inflight_kib == pytest.approx(4 * 6144 / 1024)


def test_more_programs_than_fit_take_waves_and_more_warps_a_scheduler():
    card = cm.CARDS["h100"]
    # 192 registers: 2 one-warp programs a scheduler, 8 an SM
    assert cm.resident(192, 1) == 8 and cm.resident(158, 1) == 12 and cm.resident(32, 1) == 32
    t = cm.terms(_launch(programs=132 * 8 * 3), _counted(192), card, 3e12, card.clock_hz, 500)
    assert (t.programs_per_sm, t.warps_per_scheduler, t.waves) == (8, 2, 3)
    one = cm.terms(_launch(programs=132 * 8), _counted(192), card, 3e12, card.clock_hz, 500)
    assert t.issue == pytest.approx(3 * one.issue) and t.chain == pytest.approx(3 * one.chain)


def test_plan_follows_the_launcher():
    k = cm.Knobs()
    assert cm.choose_algorithm(16, 1024, 4096, k, 132) == "looped"
    assert cm.choose_algorithm(1, 256, 1 << 20, k, 132) == "segments"
    assert cm.segment_chunks(1, 256, 1 << 20, k, 132) == 249      # docs/kernels.md
    assert cm.segment_chunks(16, 1024, 4096, k, 132) == 52
    fwd = cm.plan("rda-exp", (16, 4096, 1024), "float32", "looped", "fwd", k, 132)
    assert [x.label for x in fwd] == ["fwd[one_pass]"]
    assert fwd[0].programs == 512 and fwd[0].iterations == 256
    assert fwd[0].bytes == 4 * 16 * 4096 * 1024 * 4               # z, a, g read, y written
    both = cm.plan("rda-exp", (1, 1 << 20, 256), "bfloat16", "segments", "fwd+bwd", k, 132)
    assert [x.label for x in both] == ["fwd[summary]", "fwd_carry", "fwd[output,save]",
                                       "bwd[summary]", "bwd_carry", "bwd[output]"]
    assert dict(both[3].const)["LOOKAHEAD"] == 1 and both[3].depth == 1
    assert dict(both[0].ints)["CPS"] == 249 and both[0].programs == 264 * 8
    rwa = cm.plan("rwa", (16, 4096, 1024), "float32", "looped", "fwd+bwd",
                  dataclasses.replace(k, lookahead=0), 132)
    assert dict(rwa[1].const)["LOOKAHEAD"] == 0 and rwa[1].depth == 0


def test_the_chained_forward_is_planned_as_its_two_walks():
    """The "chained" forward: the summary walk reads the inputs from DRAM; the output walk
    writes y and the saved states, and reads the inputs again from L2 only when the
    segments of the programs resident at once fit in its share of L2; the look-back's hops
    are one a window of a sequence's segments, and bound the time by themselves."""
    k = cm.Knobs(chained=True, chained_backward=False)
    E, s = (1 << 20) * 256, 4
    fwd = cm.plan("rda-exp", (1, 1 << 20, 256), "float32", "segments", "fwd+bwd", k, 132)
    assert [x.label for x in fwd[:2]] == ["fwd[chained:1]", "fwd[chained:2,save]"]
    one, two = fwd[:2]
    nseg = (1 << 20) // (16 * 4)                                  # segments of 4 chunks of 16
    assert dict(one.ints)["NSEG"] == nseg and one.programs == nseg * 8
    assert one.bytes == 3 * E * s + 7 * nseg * 256 * 4
    assert two.reread == 3 * E * s and two.hops == nseg // 32
    assert two.bytes == E * s + (nseg * 4) * 3 * 256 * 4          # y, a state every 16 steps
    assert [x.label for x in fwd[2:]] == ["bwd[summary]", "bwd_carry", "bwd[output]"]
    card = cm.CARDS["h100"]
    assert two.footprint == 4 * 16 * 32 * 3 * 4         # 4 chunks of 16 x 32 x 3 inputs
    # 8 programs an SM (192 registers) x 132 SMs: 21.1 MB fit in half of L2, 31.7 MB not
    fits, spills = (dataclasses.replace(two, footprint=f) for f in (20_000, 30_000))
    assert cm.with_reread(fits, _counted(192), card).bytes == two.bytes
    assert cm.with_reread(spills, _counted(192), card).bytes == two.bytes + two.reread
    t = cm.terms(dataclasses.replace(two, hops=10 ** 6), _counted(192), card, 3e12,
                 card.clock_hz, 500)
    assert t.bound == "lookback" and t.time == pytest.approx(cm.LOOKBACK_HOP_NS * 1e-3)


def test_the_chained_backward_is_planned_as_its_two_walks():
    """The "chained" backward, as the forward: the summary walk reads z, a, g, gy and the
    chunk states from DRAM and publishes 5 floats a channel a segment; the output walk
    writes the 3 gradients and reads the rest again (L2 if it fits); one hop a window."""
    k = cm.Knobs(chained=True, chained_chunks=2, block_t=32)
    E, s, D = (1 << 20) * 256, 4, 256
    both = cm.plan("rda-exp", (1, 1 << 20, 256), "float32", "segments", "fwd+bwd", k, 132)
    assert [x.label for x in both] == ["fwd[chained:1]", "fwd[chained:2,save]",
                                       "bwd[chained:1]", "bwd[chained:2]"]
    one, two = both[2:]
    nseg = (1 << 20) // (32 * 2)
    states = (1 << 20) // 32 * 3 * D * 4                # a saved state every 32 steps
    assert dict(one.const)["PHASE"] == 1 and dict(two.const)["PHASE"] == 2
    assert dict(one.ints)["CPS"] == 2 and one.programs == nseg * 8 and one.iterations == 2
    assert one.bytes == 4 * E * s + states + 5 * nseg * D * 4
    assert two.bytes == 3 * E * s and two.reread == 4 * E * s + states
    assert two.footprint == 2 * (4 * 32 * 32 * 4 + 3 * 32 * 4) and two.hops == nseg // 32
    # without chained_backward the backward stays "segments"
    fwd_only = cm.plan("rda-exp", (1, 1 << 20, 256), "float32", "segments", "fwd+bwd",
                       dataclasses.replace(k, chained_backward=False), 132)
    assert [x.label for x in fwd_only[2:]] == ["bwd[summary]", "bwd_carry", "bwd[output]"]


def test_a_persistent_chained_launch_caps_the_programs_an_sm_and_what_l2_must_hold():
    """``chained_programs_per_sm`` (and its backward's): at most that many programs an SM,
    whatever the registers allow, so more waves, and the second walk's re-read counted as
    L2 hits once the capped programs' segments fit in L2's share."""
    card = cm.CARDS["h100"]
    assert cm.resident(192, 1, 5) == 5 and cm.resident(192, 1, 12) == 8     # 8 by registers
    k = cm.Knobs(chained=True, chained_programs_per_sm=6, chained_programs_per_sm_backward=5)
    both = cm.plan("rda-exp", (1, 1 << 20, 256), "float32", "segments", "fwd+bwd", k, 132)
    assert [x.cap for x in both] == [6, 6, 5, 5]
    two = both[1]                       # 24,576 bytes a segment (4 chunks of 16 x 32 x 3)
    # 8 programs an SM (192 registers): 26 MB held, over half of L2; 6: 19.5 MB, under
    assert cm.with_reread(dataclasses.replace(two, cap=0), _counted(192), card).bytes == \
        two.bytes + two.reread
    assert cm.with_reread(two, _counted(192), card).bytes == two.bytes
    capped = cm.terms(dataclasses.replace(two, reread=0), _counted(192), card, 3e12,
                      card.clock_hz, 500)
    free = cm.terms(dataclasses.replace(two, reread=0, cap=0), _counted(192), card, 3e12,
                    card.clock_hz, 500)
    assert (capped.programs_per_sm, free.programs_per_sm) == (6, 8)
    assert capped.waves == -(-two.programs // (6 * 132)) > free.waves


def test_ncu_report_is_read():
    kernels = cm.ncu_kernels(cm.ROOT / cm.CARDS["h100"].ncu)
    assert [k["kernel"] for k in kernels] == ["fwd_kernel", "bwd_kernel"]
    assert kernels[0]["regs"] == 158 and kernels[1]["cpi"] == pytest.approx(7.07)
    assert kernels[1]["seconds"] == pytest.approx(2.18e-3)


def test_latency_rises_with_dram_throughput_through_its_two_readings():
    lat = cm.Latency(500.0, 0.25, 800.0, 0.75, 3e12)
    assert lat.at(0.0) == lat.at(0.25) == 500.0                 # flat under light load
    assert lat.at(0.75) == pytest.approx(800.0)
    assert lat.at(0.5) == pytest.approx(650.0)                  # a line between the two
    assert lat.at(2.0) == lat.at(1.0) == pytest.approx(950.0)   # no more than all of DRAM
    assert cm.Latency(500.0).at(0.9) == 500.0 and cm.Latency(500.0).fixed
    for bad in (dict(loaded_at=0.25), dict(loaded_ns=400.0), dict(loaded_at=1.5)):
        with pytest.raises(ValueError):
            cm.Latency(**{**dict(light_ns=500.0, light_at=0.25, loaded_ns=800.0,
                                 loaded_at=0.75), **bad})
    card = cm.CARDS["h100"]
    assert card.latency(fixed=True) == cm.Latency(card.latency_ns)
    moved = card.latency(600.0)                                 # the line moves with its base
    assert moved.at(moved.loaded_at) - card.latency().at(moved.loaded_at) == pytest.approx(100)


def test_a_loaded_latency_is_the_fixed_point_of_the_launchs_own_throughput():
    card, bw = cm.CARDS["h100"], 3.0e12
    lat = card.latency()
    for n_bytes in (10 ** 6, 10 ** 9, 4 * 10 ** 9):
        launch = _launch(bytes=n_bytes)
        t = cm.terms(launch, _counted(), card, bw, card.clock_hz, lat)
        u = n_bytes / (t.time * lat.peak_bw)
        assert t.latency_ns == pytest.approx(lat.at(u), abs=0.5)
        fixed = cm.terms(launch, _counted(), card, bw, card.clock_hz, t.latency_ns)
        assert fixed.time == pytest.approx(t.time)
    # a chain-bound launch (its time grows with the latency) on the line's slope: it runs
    # slower than at the light latency, and at the latency its own throughput gives
    chained = _launch(bytes=2 * 10 ** 8)
    t = cm.terms(chained, _counted(), card, bw, card.clock_hz, lat)
    at_light = cm.terms(chained, _counted(), card, bw, card.clock_hz, lat.light_ns)
    u = 2 * 10 ** 8 / (t.time * lat.peak_bw)
    assert t.bound == "chain" and lat.light_at < u < lat.loaded_at
    assert t.time > at_light.time and t.latency_ns > lat.light_ns
    assert t.latency_ns == pytest.approx(lat.at(u), abs=0.5)
    light = cm.terms(_launch(bytes=10 ** 6), _counted(), card, bw, card.clock_hz, lat)
    assert light.latency_ns == lat.light_ns                     # a launch that moves little
    assert cm.terms(_launch(), _counted(), card, bw, card.clock_hz, card.latency(fixed=True)) \
        == cm.terms(_launch(), _counted(), card, bw, card.clock_hz, card.latency_ns)


def test_knobs_and_rows_are_chosen_from_the_command_line(capsys):
    """``--knob NAME=VALUE`` takes a Knobs field (bools as 0 or 1) and refuses anything
    else, naming the fields; ``--shape`` and ``--algorithm`` filter the record's rows, and
    a filter that leaves none is an error."""
    assert cm.knob_field("chained=1") == ("chained", True)
    assert cm.knob_field("chained_programs_per_sm=6") == ("chained_programs_per_sm", 6)
    for bad in ("chained=2", "nope=1", "block_t", "block_t=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cm.knob_field(bad)
    with pytest.raises(SystemExit):
        cm.main(["--shape", "3x3x3"])
    assert "no row of the record" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cm.main(["--shape", "1xMx256"])
    assert "--shape must be BxTxD" in capsys.readouterr().err


def test_a_new_cards_record_replaces_the_cards_own(tmp_path, capsys):
    """``--record FILE``: the card's rows become that file's, measured with the kernels of
    ``--source`` (which must be named: the card's own commit is of its own record), with no
    Nsight Compute output; a missing file is an error naming it."""
    card = cm.CARDS["h100"]
    new = cm.with_record(card, str(tmp_path / "gpu-x.json"), None)
    assert new.record == str(tmp_path / "gpu-x.json") and new.source is None
    assert new.ncu is None and (new.sms, new.clock_hz) == (card.sms, card.clock_hz)
    with pytest.raises(SystemExit):
        cm.main(["--record", str(tmp_path / "gpu-x.json")])
    assert "name the kernels the card ran with --source" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cm.main(["--record", str(tmp_path / "gpu-x.json"), "--source", "worktree"])
    assert "no file" in capsys.readouterr().err
