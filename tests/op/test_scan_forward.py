"""The forward of every backend against the reference: lengths, chunkings, dtypes, extremes;
and inputs in any memory layout (strided, transposed, expanded, at an offset) give, in every
dtype, the outputs and gradients of the same numbers made contiguous."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import fastrwa
from helpers import (ATTENTIONS, TOL, assert_close, compare_gradients, make_inputs, make_state,
                     randn, reference, run)

LENGTHS = [1, 2, 3, 5, 7, 13, 16, 17, 64, 65, 97]
CHUNKS = [None, 1, 2, 3, 4, 8]


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_rwa_every_length_and_chunking(backend, T, chunk):
    """Lengths that are 1, primes, and cross every chunk boundary (with and without rest)."""
    z, a, _ = make_inputs(2, T, 3, dtype=backend.dtype, seed=T)
    y, st = run(z, a, final=True, chunk=chunk)
    y_ref, st_ref = reference(z, a)
    tol = backend.tol["y"]
    assert_close(y, y_ref, tol, "y")
    assert_close(st.m + torch.log(st.d), st_ref.m + torch.log(st_ref.d), tol, "log d")
    assert_close(st.n / st.d, st_ref.n / st_ref.d, tol, "average")


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("with_state", [False, True])
def test_rda_matches_reference(backend, attention, reverse, chunk, with_state):
    z, a, g = make_inputs(2, 23, 4, dtype=backend.dtype, attention=attention, seed=7)
    state = make_state(2, 4, dtype=backend.dtype) if with_state else None
    y, _ = run(z, a, g, attention, state, reverse=reverse, chunk=chunk)
    y_ref, _ = reference(z, a, g, attention, state, reverse)
    assert_close(y, y_ref, backend.tol["y"], "y")


# (On the interpreter the Triton column takes every attention in float32 and bfloat16, and
# float16 for one: tests/conftest.py, triton_repeat.)
@pytest.mark.triton_repeat(keep=[dict(attention="exp"), dict(dtype=torch.float32),
                                 dict(dtype=torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_low_precision_dtypes(backend, dtype, attention):
    z, a, g = make_inputs(3, 37, 5, dtype=dtype, attention=attention, seed=11)
    state = make_state(3, 5, dtype=torch.float32)
    y, st = run(z, a, g, attention, state, final=True, chunk=8)
    assert y.dtype == dtype
    assert st.m.dtype == st.n.dtype == st.d.dtype == torch.float32
    y_ref, _ = reference(z, a, g, attention, state)
    assert_close(y, y_ref, TOL[dtype]["y"], f"y {dtype}")


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_logits_spread_over_1e4(backend, attention):
    """Logits of +-1e4 overflow exp() by far; the stabilised scan must stay exact and finite."""
    z, a, g = make_inputs(2, 40, 3, attention=attention, scale=1e4, seed=5)
    g = g * 5e3
    z, a, g = (x.to(backend.dtype) for x in (z, a, g))
    y, st = run(z, a, g, attention, final=True, chunk=6)
    assert torch.isfinite(y).all() and torch.isfinite(st.n).all() and torch.isfinite(st.d).all()
    y_ref, _ = reference(z, a, g, attention)
    # float32 logits of 1e4 carry an absolute error of ~1e-3 in every exponent.
    assert_close(y, y_ref, 1e-12 if backend.exact else 5e-3, "y")


@pytest.mark.parametrize("chunk", [None, 2, 5])
def test_minus_inf_masks(backend, chunk):
    """A masked prefix gives y = 0 (not NaN); masked steps anywhere carry no weight."""
    z, a, g = make_inputs(2, 19, 3, dtype=backend.dtype, seed=2)
    a[0, :7] = float("-inf")               # all-masked prefix in batch 0
    a[1, 3:12:2] = float("-inf")           # scattered masks in batch 1
    a[:, :, 2] = float("-inf")             # one channel never sees anything
    for gg in (None, g):
        y, st = run(z, a, gg, final=True, chunk=chunk)
        y_ref, _ = reference(z, a, gg)
        assert torch.equal(y[0, :7], torch.zeros_like(y[0, :7]))
        assert torch.equal(y[:, :, 2], torch.zeros_like(y[:, :, 2]))
        assert_close(y, y_ref, backend.tol["y"], "y")
        assert torch.isneginf(st.m[:, 2]).all() and (st.d[:, 2] == 0).all()


@pytest.mark.parametrize("gamma", [1 - 1e-6, 1e-6, 0.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_discount_near_one_and_near_zero(backend, gamma, dtype):
    """gamma = 1 - 1e-6 keeps the whole past alive: a wrong carry between chunks shows."""
    z, a, _ = make_inputs(2, 300 if backend.exact else 60, 3, seed=9)
    if gamma == 0.0:
        g = torch.full_like(z, -1e4)       # logsigmoid(-1e4) = -1e4: forget everything
    else:
        g = torch.full_like(z, float(torch.logit(torch.tensor(gamma, dtype=torch.float64))))
    z, a, g = z.to(dtype), a.to(dtype), g.to(dtype)
    y_ref, _ = reference(z, a, g, "exp")
    for chunk in (None, 7, 32):
        y, _ = run(z, a, g, "exp", chunk=chunk)
        assert_close(y, y_ref, TOL[dtype]["y"], f"y chunk={chunk}")


def test_state_dtype_and_empty_sequence(backend):
    z, a, g = make_inputs(2, 0, 3, dtype=backend.dtype)
    y, st = run(z, a, g, final=True)
    assert y.shape == (2, 0, 3) and y.dtype == backend.dtype
    assert st.m.dtype == (torch.float64 if backend.exact else torch.float32)
    assert torch.isneginf(st.m).all() and (st.d == 0).all()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 3), T=st.integers(1, 40), D=st.integers(1, 5),
    chunk=st.one_of(st.none(), st.integers(1, 12)),
    attention=st.sampled_from(ATTENTIONS), decay=st.booleans(), with_state=st.booleans(),
    reverse=st.booleans(), seed=st.integers(0, 2**16),
)
def test_random_shapes(exact_backend, B, T, D, chunk, attention, decay, with_state, reverse,
                       seed):
    if not decay:
        attention = "exp"
    z, a, g = make_inputs(B, T, D, attention=attention, decay=decay, seed=seed)
    state = make_state(B, D, seed=seed + 1) if with_state else None
    y, st_ = run(z, a, g, attention, state, final=True, reverse=reverse, chunk=chunk)
    y_ref, st_ref = reference(z, a, g, attention, state, reverse)
    assert_close(y, y_ref, 1e-11, "y")
    assert_close(st_.average(), st_ref.average(), 1e-11, "state average")


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 3), T=st.integers(1, 13), D=st.integers(1, 6),
       attention=st.sampled_from(ATTENTIONS), decay=st.booleans(), with_state=st.booleans(),
       reverse=st.booleans(), seed=st.integers(0, 2**16))
def test_random_shapes_every_backend(backend, B, T, D, attention, decay, with_state, reverse,
                                     seed):
    """Forward and gradients at the backend's own precision (Triton: float32)."""
    if not decay:
        attention = "exp"
    z, a, g = make_inputs(B, T, D, dtype=backend.dtype, attention=attention, decay=decay,
                          seed=seed)
    state = make_state(B, D, dtype=backend.dtype, seed=seed + 1) if with_state else None
    y, _ = run(z, a, g, attention, state, reverse=reverse)
    assert_close(y, reference(z, a, g, attention, state, reverse)[0], backend.tol["y"], "y")
    compare_gradients(z, a, g, attention, state, reverse, None, backend.dtype)


DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtypes(backend):
    """The input dtypes a backend takes (Triton refuses float64; tests/backends/test_selection.py)."""
    return [dt for dt in DTYPES if backend.name != "triton" or dt != torch.float64]


def _layouts(B, T, D, dtype, gen):
    """``(name, make)``: ``make()`` returns a ``(B, T, D)`` view in that layout of fresh
    random numbers (the same numbers for every layout)."""
    base = randn(B, T, D, gen=gen)
    return [
        ("contiguous", lambda: base.to(dtype).clone()),
        ("transposed", lambda: base.transpose(1, 2).to(dtype).contiguous().transpose(1, 2)),
        ("every other channel",
         lambda: torch.stack([base, base], dim=3).to(dtype).reshape(B, T, 2 * D)[..., ::2]),
        ("slice of a projection", lambda: torch.cat([base, base], dim=2).to(dtype)[..., D:]),
        ("expanded batch", lambda: base[:1].to(dtype).expand(B, T, D)),
        ("at an offset",
         lambda: torch.cat([torch.zeros(5, dtype=dtype), base.to(dtype).flatten()])[5:]
         .view(B, T, D)),
    ]


# (Triton's launcher makes every input contiguous before a kernel reads it: on the
# interpreter its column keeps one strided layout, "every other channel", as the check of
# that; tests/conftest.py, triton_repeat)
@pytest.mark.parametrize("layout", [
    pytest.param(i, id=name, marks=[] if name == "every other channel"
                 else [pytest.mark.triton_repeat])
    for i, (name, _) in enumerate(_layouts(1, 1, 1, torch.float32, torch.Generator()))])
def test_every_dtype_and_layout_gives_the_contiguous_answer(backend, layout):
    """Inputs in any layout give the outputs and gradients of the same numbers made
    contiguous, for every dtype (float16 strided along channels was misread on numba)."""
    B, T, D = 2, 7, 5
    for dtype in _dtypes(backend):
        gen = torch.Generator().manual_seed(3)
        made = [_layouts(B, T, D, dtype, gen)[layout][1]() for _ in range(3)]
        if layout == 4:     # (the expanded batch shares row 0, as its name says)
            assert made[0].stride(0) == 0
        leaves = [x.detach().requires_grad_() for x in made]
        flat = [x.detach().contiguous().requires_grad_() for x in made]
        gy = randn(B, T, D, gen=gen).to(dtype)
        y, _ = fastrwa.rda_scan(*leaves, attention="softplus")
        y_flat, _ = fastrwa.rda_scan(*flat, attention="softplus")
        torch.testing.assert_close(y, y_flat, rtol=0, atol=0, msg=f"y, {dtype}")
        got = torch.autograd.grad(y, leaves, gy)
        want = torch.autograd.grad(y_flat, flat, gy)
        for i, (g_, w_) in enumerate(zip(got, want)):
            torch.testing.assert_close(g_, w_, rtol=TOL[dtype]["grad"], atol=TOL[dtype]["grad"],
                                       msg=f"gradient #{i}, {dtype}")
