"""The Triton backend (under TRITON_INTERPRET=1 on CPU) against the float64 reference,
plus the ahead-of-time compile and the memory-traffic counts of the kernels.

Both forward algorithms are forced in turn (never left to the heuristic).
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fastrwa
from fastrwa import triton_backend
from helpers import (ATTENTIONS, TOL, assert_close, compare_gradients, make_inputs, make_state,
                     options, reference, run)

ALGORITHMS = ("looped", "three_phase")
# Blocks small enough that these shapes cross chunk and channel-block edges with ragged tails;
# the backward's channel block differs from the forward's, as it does by default.
SMALL = dict(block_t=4, block_d=4, block_d_backward=2)
VARIANTS = [("rwa", None)] + [("rda", attention) for attention in ATTENTIONS]


@pytest.fixture(params=ALGORITHMS)
def algorithm(request):
    with options(triton_backend, algorithm=request.param, **SMALL):
        with fastrwa.use_backend("triton"):
            yield request.param


def _inputs(kind, attention, B=2, T=11, D=5, dtype=torch.float32, seed=0, scale=1.0):
    z, a, g = make_inputs(B, T, D, dtype=dtype, attention=attention or "exp", seed=seed,
                          scale=scale)
    return z, a, (None if kind == "rwa" else g), (attention or "exp")


@pytest.mark.parametrize("kind,attention", VARIANTS)
@pytest.mark.parametrize("reverse", [False, True])
def test_forward_and_gradients(algorithm, kind, attention, reverse):
    z, a, g, attention = _inputs(kind, attention, seed=3)
    state = make_state(2, 5, dtype=torch.float32)
    y, st = run(z, a, g, attention, state, final=True, reverse=reverse)
    y_ref, st_ref = reference(z, a, g, attention, state, reverse)
    assert_close(y, y_ref, TOL[torch.float32]["y"], "y")
    assert_close(st.average(), st_ref.average(), TOL[torch.float32]["y"], "final average")
    compare_gradients(z, a, g, attention, state, reverse, None, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(algorithm, dtype):
    z, a, g, attention = _inputs("rda", "sigmoid", dtype=dtype, seed=5)
    y, st = run(z, a, g, attention, final=True)
    assert y.dtype == dtype and st.m.dtype == torch.float32
    assert_close(y, reference(z, a, g, attention)[0], TOL[dtype]["y"], "y")
    compare_gradients(z, a, g, attention, make_state(2, 5, torch.float32), False, None, dtype)


def test_extremes(algorithm):
    """Logits of +-1e4, -inf masks (all-masked prefix and channel), gamma ~ 1 and ~ 0."""
    z, a, g, _ = _inputs("rda", "exp", T=13, seed=7, scale=1e4)
    g = g * 5e3
    y, _ = run(z, a, g, "exp")
    assert torch.isfinite(y).all()
    assert_close(y, reference(z, a, g)[0], 5e-3, "y, logits 1e4")
    compare_gradients(z, a, g, "exp", None, False, None, torch.float32, tol=5e-3)

    z, a, g, _ = _inputs("rda", "exp", T=13, seed=8)
    a[0, :5] = float("-inf")
    a[:, :, 3] = float("-inf")
    y, st = run(z, a, g, "exp", final=True)
    assert torch.equal(y[0, :5], torch.zeros_like(y[0, :5]))
    assert torch.equal(y[:, :, 3], torch.zeros_like(y[:, :, 3]))
    assert_close(y, reference(z, a, g)[0], TOL[torch.float32]["y"], "y, masked")
    compare_gradients(z, a, g, "exp", None, False, None, torch.float32)

    z, a, _, _ = _inputs("rwa", None, T=40, seed=9)
    for logit in (13.8155, -13.8155):                  # gamma = 1 - 1e-6 and 1e-6
        g = torch.full_like(z, logit)
        assert_close(run(z, a, g)[0], reference(z, a, g)[0], TOL[torch.float32]["y"],
                     f"y, logit(gamma) = {logit}")
        compare_gradients(z, a, g, "exp", make_state(2, 5, torch.float32), False, None,
                          torch.float32)


@pytest.mark.parametrize("backend", ["triton", "torch", "numba"])
@pytest.mark.parametrize("reverse", [False, True])
def test_varlen(backend, reverse):
    """Packed sequences (lengths 0, 1, 5, 9, 4) each scan on their own, with states per sequence."""
    cu = torch.tensor([0, 0, 1, 6, 15, 19])
    z, a, g, _ = _inputs("rda", "softplus", B=1, T=19, seed=11)
    state = make_state(5, 5, dtype=torch.float32)
    algorithms = ALGORITHMS if backend == "triton" else ("auto",)
    for algo in algorithms:
        with options(triton_backend, algorithm=algo, **SMALL), \
                fastrwa.use_backend(backend):
            y, st = run(z, a, g, "softplus", state, final=True, reverse=reverse, cu_seqlens=cu)
            y_ref, st_ref = reference(z, a, g, "softplus", state, reverse, cu)
            assert st.m.shape == (5, 5)
            assert_close(y, y_ref, TOL[torch.float32]["y"], f"y {algo}")
            assert_close(st.average(), st_ref.average(), TOL[torch.float32]["y"], f"state {algo}")
            compare_gradients(z, a, g, "softplus", state, reverse, None, torch.float32,
                              cu_seqlens=cu)


def test_algorithms_agree(algorithm):
    z, a, g, _ = _inputs("rda", "relu", T=23, seed=13)
    with options(triton_backend, algorithm="looped"):
        y_looped, _ = run(z, a, g, "relu")
    y, _ = run(z, a, g, "relu")
    assert_close(y, y_looped.double(), 1e-6, "three-phase vs looped")


def test_prefill_then_step_kernel(algorithm):
    z, a, g, _ = _inputs("rda", "sigmoid", T=9, seed=17)
    y_full, _ = reference(z, a, g, "sigmoid")
    for k in (0, 4, 8):
        with torch.no_grad():
            y_pre, state = fastrwa.rda_scan(z[:, :k], a[:, :k], g[:, :k], "sigmoid",
                                            output_final_state=True)
            outs = [y_pre]
            for t in range(k, 9):
                y_t, state = fastrwa.rda_step(z[:, t], a[:, t], g[:, t], state, "sigmoid")
                outs.append(y_t[:, None])
        assert_close(torch.cat(outs, dim=1), y_full, TOL[torch.float32]["y"], f"split {k}")


def test_heuristic():
    opts = triton_backend.Options(block_t=64, block_d=32)
    cpu = torch.device("cpu")
    assert triton_backend.choose_algorithm(256, 1024, 4096, opts, cpu) == "looped"   # many programs
    assert triton_backend.choose_algorithm(1, 256, 1 << 20, opts, cpu) == "three_phase"
    assert triton_backend.choose_algorithm(1, 256, 100, opts, cpu) == "looped"       # short
    forced = triton_backend.Options(algorithm="three_phase")
    assert triton_backend.choose_algorithm(256, 1024, 4096, forced, cpu) == "three_phase"
    with pytest.raises(ValueError, match="algorithm"):
        triton_backend.set_options(algorithm="fast")


BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def test_ahead_of_time_compile_has_no_spill():
    """One kernel compiled for sm_90a from this CPU-only machine (the full table: bench/kernels.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCH / "kernels.py"), "--quick"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fwd_looped_kernel" in out.stdout and "1 compiled, 0 failed or spilled" in out.stdout


def test_memory_traffic_meets_targets():
    """Bytes the kernels move, counted under the interpreter, against DESIGN.md's minimum."""
    sys.path.insert(0, str(BENCH))
    try:
        import traffic
    finally:
        sys.path.remove(str(BENCH))
    with options(triton_backend, **dataclasses.asdict(triton_backend.Options())):
        for algorithm in ALGORITHMS:
            rows = {name: (moved / minimum, launches)
                    for name, moved, minimum, launches in
                    traffic.measure("rda", algorithm, torch.bfloat16, 1, 64, 32)}
            for name, (ratio, launches) in rows.items():
                target = traffic.TARGETS.get((algorithm, name.split("+")[0]))
                if target is not None:
                    assert ratio <= target, (algorithm, name, ratio)
                assert launches == (1 if algorithm == "looped" else 3), (algorithm, name)


def test_prefix_then_scan_at_every_split(algorithm):
    """A scan of x[:, :k] continued by a scan of x[:, k:] equals one scan, for every k."""
    z, a, g, _ = _inputs("rda", "exp", T=9, seed=19)
    init = make_state(2, 5, dtype=torch.float32)
    y_full, st_full = reference(z, a, g, "exp", init)
    for k in range(10):
        y1, st1 = run(z[:, :k], a[:, :k], g[:, :k], "exp", init, final=True)
        y2, st2 = run(z[:, k:], a[:, k:], g[:, k:], "exp", st1, final=True)
        assert_close(torch.cat([y1, y2], dim=1), y_full, TOL[torch.float32]["y"], f"y at {k}")
        assert_close(st2.average(), st_full.average(), TOL[torch.float32]["y"], f"state {k}")


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 13), D=st.integers(1, 6),
       variant=st.sampled_from(VARIANTS), reverse=st.booleans(), with_state=st.booleans(),
       algo=st.sampled_from(ALGORITHMS), seed=st.integers(0, 2**16))
def test_random_shapes(B, T, D, variant, reverse, with_state, algo, seed):
    kind, attention = variant
    z, a, g, attention = _inputs(kind, attention, B=B, T=T, D=D, seed=seed)
    state = make_state(B, D, dtype=torch.float32, seed=seed) if with_state else None
    with options(triton_backend, algorithm=algo, **SMALL), fastrwa.use_backend("triton"):
        y, _ = run(z, a, g, attention, state, reverse=reverse)
        assert_close(y, reference(z, a, g, attention, state, reverse)[0],
                     TOL[torch.float32]["y"], "y")
        compare_gradients(z, a, g, attention, state, reverse, None, torch.float32)
