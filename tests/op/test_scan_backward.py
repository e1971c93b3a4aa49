"""The analytic backward against autograd: gradcheck in float64, the float64 reference's
autograd for float32/bfloat16/float16, and the extremes (+-1e4 logits, -inf masks, gamma ~ 0, 1).
On every backend: the gradient of a small relu logit that is the only weight so far, the
gradients at +inf logits (the limit, with and without a discount), and no gradient through
steps masked while nothing has been seen."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import fastrwa
from fastrwa.reference import rwa_scan_reference, weighted_scan_reference
from fastrwa.state import ScanState
from helpers import (ATTENTIONS, TOL, compare_gradients, leaf, loss_and_grads, make_inputs,
                     make_state, randn, run)


def _gauge_free(y, state):
    return y, state.m + torch.log(state.d), state.n / state.d


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("T,chunk", [(1, None), (6, 2), (10, 3), (12, None)])
def test_gradcheck_float64(exact_backend, attention, reverse, T, chunk):
    z, a, g = (leaf(x) for x in make_inputs(2, T, 3, attention=attention, seed=T))
    m0, n0, d0 = (leaf(x) for x in make_state(2, 3))

    def with_state(z, a, g, m0, n0, d0):
        y, st = run(z, a, g, attention, ScanState(m0, n0, d0), final=True, reverse=reverse,
                    chunk=chunk)
        return _gauge_free(y, st)

    def rwa(z, a):
        return run(z, a, reverse=reverse, chunk=chunk)[0]

    assert torch.autograd.gradcheck(with_state, (z, a, g, m0, n0, d0))
    assert torch.autograd.gradcheck(rwa, (z, a))


def _tied(T=12, B=2, D=3):
    """``(z, a)`` whose logits tie the running maximum exactly at many steps (as bfloat16
    logits often do): ``a`` is 0.25 or (two times in three) 0.5."""
    gen = torch.Generator().manual_seed(4)
    z = randn(B, T, D, gen=gen)
    pick = torch.randint(0, 3, (B, T, D), generator=gen, device="cpu")
    a = torch.tensor([0.25, 0.5, 0.5], dtype=torch.float64, device="cpu")[pick]
    return z, a.to(z.device)


def test_the_reference_gradient_where_logits_tie_the_running_max():
    """Finite differences of the reference (a smooth function: the max is only a gauge) equal
    its autograd where a logit equals the running max, discounted (log decay 0) or not."""
    z, a = (leaf(x) for x in _tied())
    log_decay = leaf(torch.zeros_like(a))
    m0, n0, d0 = (leaf(x) for x in make_state(2, 3))
    m0 = leaf(torch.full_like(m0, 0.5))         # the state's max ties the logits too

    def weighted(z, a, log_decay, m0, n0, d0):
        y, st = weighted_scan_reference(z, a, log_decay, ScanState(m0, n0, d0))
        return _gauge_free(y, st)

    assert torch.autograd.gradcheck(lambda z, a: rwa_scan_reference(z, a)[0], (z, a))
    assert torch.autograd.gradcheck(weighted, (z, a, log_decay, m0, n0, d0))


def test_gradients_where_logits_tie(backend):
    z, a = _tied(T=20)
    for dtype in (torch.float64, torch.float32)[0 if backend.exact else 1:]:
        compare_gradients(z, a, None, "exp", make_state(2, 3), False, 7, dtype)
        # A discount logit of 40: log sigmoid(40) = -4e-18 rounds away in float64 too, so
        # the decayed max still ties the logits (at 30 it would not, in float64).
        compare_gradients(z, a, torch.zeros_like(a) + 40, "exp", None, True, None, dtype)


# (On the interpreter the Triton column takes every attention in float32 and bfloat16, and
# float16 for one: tests/conftest.py, triton_repeat.)
@pytest.mark.triton_repeat(keep=[dict(attention="exp"), dict(dtype=torch.float32),
                                 dict(dtype=torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gradients_against_reference(backend, dtype, attention):
    z, a, g = make_inputs(2, 37 if backend.exact else 13, 4, attention=attention, seed=21)
    compare_gradients(z, a, g, attention, make_state(2, 4), False, 5, dtype)
    compare_gradients(z, a, g, attention, None, True, None, dtype)


def test_rwa_gradients_against_reference(backend):
    z, a, _ = make_inputs(3, 50, 4, seed=8)
    for dtype in (torch.float64, torch.float32)[0 if backend.exact else 1:]:
        compare_gradients(z, a, None, "exp", make_state(3, 4), False, 7, dtype)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_with_logits_of_1e4(backend, attention, dtype):
    z, a, g = make_inputs(2, 30, 3, attention=attention, scale=1e4, seed=13)
    g = g * 5e3
    # float32 logits of 1e4 carry ~1e-3 absolute error in every exponent.
    tol = None if dtype == torch.float64 else 5e-3
    compare_gradients(z, a, g, attention, None, False, 4, dtype, tol)
    if attention == "exp":
        compare_gradients(z, a, None, "exp", None, False, 4, dtype, tol)


@pytest.mark.parametrize("chunk", [None, 3])
def test_gradients_with_minus_inf_masks(backend, chunk):
    z, a, g = make_inputs(2, 17, 3, dtype=backend.dtype, seed=4)
    a[0, :6] = float("-inf")
    a[1, 2:11:3] = float("-inf")
    a[:, :, 1] = float("-inf")
    za, aa, ga = leaf(z), leaf(a), leaf(g)
    grads = loss_and_grads(lambda: run(za, aa, ga, final=True, chunk=chunk), [za, aa, ga])
    for gr in grads:
        assert torch.isfinite(gr).all()
    masked = torch.isneginf(a)
    assert (grads[1][masked] == 0).all(), "a masked step's logit gets no gradient"
    compare_gradients(z, a, g, "exp", make_state(2, 3), False, chunk, backend.dtype)
    compare_gradients(z, a, None, "exp", None, True, chunk, backend.dtype)


@pytest.mark.parametrize("gamma", [1 - 1e-6, 1e-6])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_discount_near_one_and_zero(backend, gamma, dtype):
    z, a, _ = make_inputs(2, 200 if backend.exact else 60, 3, seed=10)
    logit = float(torch.logit(torch.tensor(gamma, dtype=torch.float64)))
    g = torch.full_like(z, logit) + 0.01 * torch.randn_like(z)
    compare_gradients(z, a, g, "exp", make_state(2, 3), False, 9, dtype)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 2), T=st.integers(1, 25), D=st.integers(1, 4),
    chunk=st.one_of(st.none(), st.integers(1, 8)),
    attention=st.sampled_from(ATTENTIONS), decay=st.booleans(), with_state=st.booleans(),
    reverse=st.booleans(), seed=st.integers(0, 2**16),
)
def test_random_shapes_gradients(exact_backend, B, T, D, chunk, attention, decay, with_state,
                                 reverse, seed):
    if not decay:
        attention = "exp"
    z, a, g = make_inputs(B, T, D, attention=attention, decay=decay, seed=seed)
    state = make_state(B, D, seed=seed + 1) if with_state else None
    compare_gradients(z, a, g, attention, state, reverse, chunk, torch.float64)


def _share_of_a_small_first_weight(w, kept):
    """``w / (w + kept)`` as ``1 / (1 + kept / w)``: no cancellation in its gradient where
    ``w`` is tiny and ``kept = 0`` (it overflows where ``w`` is tiny and ``kept`` is not)."""
    return 1 / (1 + kept / w)


def _share_of_a_small_later_weight(w, kept):
    """``w / (w + kept)`` as it is: no overflow in its gradient where ``w`` is tiny and
    ``kept`` is not (it cancels where ``kept = 0``)."""
    return w / (w + kept)


def _relu_mean_loop(z, a, g, gy, share_of=_share_of_a_small_first_weight):
    """Loss ``sum_t gy_t y_t`` of the relu RDA in float64, as the running mean
    ``y_t = y_{t-1} + s_t (z_t - y_{t-1})`` with ``w = relu(a)``, ``d_t = gamma_t d_{t-1} +
    w_t`` and the share ``s_t = w_t / d_t`` written by ``share_of(w_t, gamma_t d_{t-1})``: no
    step, and no step of its autograd, subtracts two large numbers, so the gradient is exact
    to float64 rounding even for a tiny weight (the one ``share_of`` is written for)."""
    y, d, loss = (torch.zeros((), dtype=torch.float64) for _ in range(3))
    for t in range(len(z)):
        w = torch.relu(a[t])
        kept = torch.sigmoid(g[t]) * d
        share = torch.where(w > 0, share_of(torch.where(w > 0, w, 1), kept), 0)
        d = kept + w
        y = y + share * (z[t] - y)
        loss = loss + gy[t] * y
    return loss


@pytest.mark.parametrize("a0", [1e-40, 1e-30, 1e-20, 1e-12, 1e-8, 1e-6, 1e-3])
def test_relu_gradient_of_a_small_first_weight(backend, a0):
    """A small positive relu logit that is the only weight so far keeps its gradient
    (it was lost to cancellation: 0 instead of about 1.65 below 1e-8), a float32 subnormal
    one (1e-40) included."""
    z = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.7], dtype=torch.float64)
    a = torch.tensor([a0, 1.0, 0.5, 2.0, 0.25], dtype=torch.float64)
    g = torch.tensor([0.0, 3.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    gy = torch.tensor([1.0, -0.5, 1.0, 0.25, 2.0], dtype=torch.float64)
    a64 = a.clone().requires_grad_()
    (want,) = torch.autograd.grad(_relu_mean_loop(z, a64, g, gy), a64)
    dt = backend.dtype
    leaf = a.to(dt).view(1, -1, 1).requires_grad_()
    y, _ = fastrwa.rda_scan(z.to(dt).view(1, -1, 1), leaf, g.to(dt).view(1, -1, 1),
                            attention="relu")
    (got,) = torch.autograd.grad(y, leaf, gy.to(dt).view(1, -1, 1))
    rtol = 1e-9 if dt == torch.float64 else 1e-4
    torch.testing.assert_close(got.flatten().double(), want, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("a0", [1e-40, 2.0 ** -149, 1e-30, 3.0])
def test_relu_gradient_of_a_single_step_is_zero(backend, a0):
    """One step: ``y = z`` whatever its logit, so ``gz = 1`` and ``ga = 0``, for a subnormal
    float32 logit too (its ``1 / a`` overflows; ``ga`` is ``0 / a``, not ``0 * inf``)."""
    z = torch.tensor([[[0.7]]], dtype=torch.float32)
    a = torch.tensor([[[a0]]], dtype=torch.float32).requires_grad_()
    zl = z.clone().requires_grad_()
    y, _ = fastrwa.rda_scan(zl, a, torch.zeros_like(z), attention="relu")
    gz, ga = torch.autograd.grad(y.sum(), (zl, a))
    assert gz.item() == 1.0 and ga.item() == 0.0, (gz.item(), ga.item())


# (the exponent of the tiny logit, by dtype): its weight exp(l - m) is about half of it,
# just normal at the first, subnormal or 0 at the others; the last is the smallest subnormal
TINY_EXPONENTS = {torch.float32: [-125, -127, -130, -140, -149],
                  torch.float64: [-1021, -1023, -1030, -1050, -1074]}


def test_relu_gradient_of_a_logit_whose_weight_underflows(backend):
    """A tiny positive relu logit after a large one keeps its gradient where its weight
    ``exp(l - m)`` underflows: ``gl / a`` (about ``weight * 1 / a``) is ``exp(-m)`` times an
    O(1) term there (it was 0 at ``2**-126`` on the torch and numba backends, in float32)."""
    z = torch.tensor([0.3, 1.0, -0.5, 0.7], dtype=torch.float64)
    g = torch.tensor([0.0, 3.0, -1.0, 0.5], dtype=torch.float64)
    gy = torch.tensor([1.0, -0.5, 1.0, 2.0], dtype=torch.float64)
    for dt in [torch.float32] + ([torch.float64] if backend.exact else []):
        for e in TINY_EXPONENTS[dt]:
            a = torch.tensor([2.0, 2.0 ** e, 1.0, 0.5], dtype=torch.float64)
            a64 = a.clone().requires_grad_()
            loss = _relu_mean_loop(z, a64, g, gy, _share_of_a_small_later_weight)
            (want,) = torch.autograd.grad(loss, a64)
            leaf = a.to(dt).view(1, -1, 1).requires_grad_()
            y, _ = fastrwa.rda_scan(z.to(dt).view(1, -1, 1), leaf, g.to(dt).view(1, -1, 1),
                                    attention="relu")
            (got,) = torch.autograd.grad(y, leaf, gy.to(dt).view(1, -1, 1))
            rtol = 1e-9 if dt == torch.float64 else 1e-4
            torch.testing.assert_close(got.flatten().double(), want, rtol=rtol, atol=rtol,
                                       msg=lambda m: f"{dt}, a[1] = 2**{e}: {m}")


@pytest.mark.parametrize("a", [[1.0, math.inf, 2.0], [math.inf, 0.5, math.inf]])
def test_relu_gradient_at_inf_logits_is_the_limit(backend, a):
    """relu logits of ``+inf`` (weights of ``+inf``, which outweigh every finite one) give
    ``ga = 0`` everywhere, the limit (``gl / a`` with ``a = +inf``; a finite weight beside
    an infinite one has no say), on every backend (the Triton backward's ``1 / a`` was NaN
    at ``a = +inf``)."""
    dt = backend.dtype
    z, g = (torch.tensor(v, dtype=dt).view(1, -1, 1) for v in ([1.0, 5.0, 3.0], [0.0, 1.0, -1.0]))
    a_ = torch.tensor(a, dtype=dt).view(1, -1, 1).requires_grad_()
    y, _ = fastrwa.rda_scan(z, a_, g, "relu")
    (ga,) = torch.autograd.grad(y.sum(), a_)
    assert torch.equal(ga, torch.zeros_like(ga)), ga.flatten().tolist()


INF = math.inf


# (z, a, expected gradients of sum(y) for z and for a): +inf logits take the limit the
# forward takes (an infinite logit dominates; equal infinite logits share the weight).
INF_ROWS = [
    ("one +inf logit", [1, 5, 3], [0, INF, 0], [1, 2, 0], [0, 0, 0]),
    ("two +inf logits", [1, 5, 3], [INF, 0, INF], [2.5, 0, 0.5], [-0.5, 0, 0.5]),
    ("+inf first", [2, 1, 4], [INF, 1, -1], [3, 0, 0], [0, 0, 0]),
]


@pytest.mark.parametrize("z,a,gz,ga", [r[1:] for r in INF_ROWS], ids=[r[0] for r in INF_ROWS])
def test_gradients_at_inf_logits_are_the_limit(backend, z, a, gz, ga):
    """The gradient at +inf logits is the limit, the same on every backend (it was NaN on
    torch and Triton)."""
    dt = backend.dtype
    z_, a_ = (torch.tensor(v, dtype=dt).view(1, -1, 1).requires_grad_() for v in (z, a))
    y, _ = fastrwa.rwa_scan(z_, a_)
    got_z, got_a = torch.autograd.grad(y.sum(), (z_, a_))
    torch.testing.assert_close(got_z.flatten().double(), torch.tensor(gz, dtype=torch.float64))
    torch.testing.assert_close(got_a.flatten().double(), torch.tensor(ga, dtype=torch.float64))


def test_inf_logits_with_a_discount_agree_with_the_torch_backend(backend):
    """With a discount and a state, +inf logits give finite gradients, equal on every backend."""
    dt = backend.dtype
    z = torch.tensor([1.0, 5.0, 3.0, -2.0], dtype=dt).view(1, -1, 1)
    a = torch.tensor([0.0, INF, 0.5, INF], dtype=dt).view(1, -1, 1)
    g = torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=dt).view(1, -1, 1)
    sdt = torch.float64 if dt == torch.float64 else torch.float32
    state = fastrwa.ScanState(*(torch.tensor([[v]], dtype=sdt) for v in (0.5, 2.0, 1.5)))

    def grads(name):
        leaves = [x.clone().requires_grad_() for x in (z, a, g, *state)]
        with fastrwa.use_backend(name):
            y, st = fastrwa.rda_scan(*leaves[:3], initial_state=fastrwa.ScanState(*leaves[3:]),
                                     output_final_state=True)
        return torch.autograd.grad(y.sum() + st.n.sum() + st.d.sum(), leaves)

    for got, want in zip(grads(backend.name), grads("torch")):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=TOL[dt]["grad"], atol=TOL[dt]["grad"])


def test_an_all_masked_sequence_passes_no_gradient(backend):
    """Masked steps while nothing has been seen weigh nothing, also for the gradient that
    enters through the final state (Triton gave the last one weight 1)."""
    dt = backend.dtype
    z, lw, ld = (torch.randn(2, 5, 3, dtype=dt) for _ in range(3))
    lw = lw.clone()
    lw[0] = -INF                                  # row 0: every step masked
    lw[1, 3:] = -INF                              # row 1: the last two masked, after a
    ld = -ld.abs()                                # forgotten past (below)
    ld[1, 2] = -INF
    leaves = [x.clone().requires_grad_() for x in (z, lw, ld)]
    y, st = fastrwa.weighted_scan(*leaves, output_final_state=True)
    loss = y.sum() + st.n.sum() + 0.5 * st.d.sum()
    got = torch.autograd.grad(loss, leaves)
    assert (got[0][0] == 0).all() and (got[1][0] == 0).all() and (got[2][0] == 0).all()
    with fastrwa.use_backend("torch"):
        y_t, st_t = fastrwa.weighted_scan(*leaves, output_final_state=True)
        want = torch.autograd.grad(y_t.sum() + st_t.n.sum() + 0.5 * st_t.d.sum(), leaves)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=TOL[dt]["grad"], atol=TOL[dt]["grad"])
