"""Triton-only checks: the two forward algorithms agree, a state of one's own with a
subnormal denominator, the algorithm heuristic and the launch knobs, the ahead-of-time
compile, and the memory traffic of the kernels (counted under the interpreter).

The Triton backend's correctness against the reference is part of the op test matrix
(tests/conftest.py); these tests cover what only this backend has. The knobs' variants
are tested in test_variants.py, the "chained" algorithm in test_chained.py.
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
from fastrwa.testing import backend_options
from fastrwa.state import ScanState
from helpers import assert_close, leaf, make_inputs
from triton_helpers import SMALL, agrees_with_the_reference

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
    agrees_with_the_reference([leaf(x) for x in (z, a, g, *tiny(86.0))], reverse, None,
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
                                        ("forward_block_t", 32.0),
                                        ("chained_chunks", 0), ("chained_prefixes", 1),
                                        ("chained_backward", "no"), ("lookback_window", 3),
                                        ("chained_programs_per_sm", -1),
                                        ("chained_programs_per_sm_backward", 1.0)])
def test_launch_knobs_are_checked(knob, value):
    with pytest.raises(ValueError, match=f"{knob} must be"):
        triton_host.set_options(**{knob: value})
    assert getattr(triton_host.options(), knob) == getattr(triton_host.Options(), knob)


@pytest.mark.interpreter
def test_warps_and_stages_reach_the_launch(monkeypatch):
    """The sweep (bench/gpu_sweep.py) sets warps and stages through the options; every
    launch of the forward and the backward takes them (and "chained" launches its own
    kernels in both passes)."""
    seen = []
    for module in (triton_host.scan_fwd, triton_host.scan_bwd, triton_host.scan_chained):
        for name in dir(module):
            kernel = getattr(module, name)
            if name.endswith("_kernel") and hasattr(kernel, "run"):
                run = kernel.run
                def spy(*args, _run=run, **kwargs):
                    seen.append((kwargs.get("num_warps"), kwargs.get("num_stages")))
                    return _run(*args, **kwargs)
                monkeypatch.setattr(kernel, "run", spy)
    z, a, g = (x.requires_grad_() for x in make_inputs(1, 9, 3, dtype=torch.float32))
    for algorithm in ("looped", "segments", "chained"):
        with fastrwa.use_backend("triton"), backend_options(
                "triton", algorithm=algorithm, warps=2, warps_backward=8, stages=1, **SMALL):
            y, _ = fastrwa.rda_scan(z, a, g)
            y.sum().backward()
    # looped: 1 + 1 launches, segments: 3 + 3, chained: 1 + 1 (its own kernels, both passes)
    assert len(seen) == (1 + 1) + (3 + 3) + (1 + 1)
    assert seen.count((2, 1)) == 1 + 3 + 1 and seen.count((8, 1)) == 1 + 3 + 1, seen


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
