"""Triton-only checks: the two forward algorithms agree, the algorithm heuristic, the
ahead-of-time compile, and the memory traffic of the kernels (counted under the interpreter).

The Triton backend's correctness against the reference is part of the op test matrix
(tests/conftest.py); these tests cover what only this backend has.
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fastrwa
from fastrwa.ops import triton_host
from fastrwa.testing import backend_options
from helpers import assert_close, make_inputs

SMALL = dict(block_t=4, block_d=4, block_d_backward=2, segment_chunks=2)
BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench"


@pytest.mark.interpreter
def test_algorithms_agree():
    z, a, g = make_inputs(2, 23, 5, dtype=torch.float32, attention="relu", seed=13)
    with fastrwa.use_backend("triton"):
        with backend_options("triton", algorithm="looped", **SMALL):
            y_looped, _ = fastrwa.rda_scan(z, a, g, "relu")
        with backend_options("triton", algorithm="segments", **SMALL):
            y, _ = fastrwa.rda_scan(z, a, g, "relu")
    assert_close(y, y_looped.double(), 1e-6, "segments vs looped")


def test_heuristic():
    opts = triton_host.Options(block_t=64, block_d=32)
    cpu = torch.device("cpu")
    assert triton_host.choose_algorithm(256, 1024, 4096, opts, cpu) == "looped"   # many programs
    assert triton_host.choose_algorithm(1, 256, 1 << 20, opts, cpu) == "segments"
    assert triton_host.choose_algorithm(1, 256, 100, opts, cpu) == "looped"       # short
    forced = triton_host.Options(algorithm="segments")
    assert triton_host.choose_algorithm(256, 1024, 4096, forced, cpu) == "segments"
    with pytest.raises(ValueError, match="algorithm"):
        triton_host.set_options(algorithm="fast")


@pytest.mark.parametrize("knob,value", [("block_t", 24), ("block_d", 0), ("warps", 3),
                                        ("warps_backward", 6), ("stages", 0)])
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


def test_ahead_of_time_compile_has_no_spill():
    """One kernel compiled for sm_90a from this CPU-only machine (the full table: bench/kernels.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCH / "kernels.py"), "--quick"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fwd[one_pass]" in out.stdout and "1 compiled, 0 failed or spilled" in out.stdout


@pytest.mark.interpreter
def test_memory_traffic_meets_targets():
    """Bytes the kernels move, counted under the interpreter, against the minimum (every
    input read once, every output written once)."""
    sys.path.insert(0, str(BENCH))
    try:
        import traffic
    finally:
        sys.path.remove(str(BENCH))
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
