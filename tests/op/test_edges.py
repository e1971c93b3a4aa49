"""Edge values, one table run on every backend: NaN anywhere propagates, +inf logits give
the limit, a step that is both masked and fully forgotten resets the average, and the
extremes of the float range stay exact. Each row is compared with an expected output
(written out where the limit is known, else the float64 reference) and so, through it,
every backend with every other. Empty sizes work with autograd; finite logits just above
the lowest float are weights, not masks; a log discount of -inf forgets a past whose maximum
is +inf."""

import math

import pytest
import torch

import fastrwa
from fastrwa.reference import rda_scan_reference, weighted_scan_reference
from fastrwa.state import ScanState
from helpers import TOL

NAN, INF = math.nan, math.inf


def _seq(*values):
    """A (1, T, 1) float64 tensor."""
    return torch.tensor(values, dtype=torch.float64).reshape(1, -1, 1)


def _state(m, n, d):
    return ScanState(*(torch.tensor([[v]], dtype=torch.float64) for v in (m, n, d)))


# (name, op, inputs, state, expected y or None for the float64 reference)
# op: "rwa" (z, a), "rda-<attention>" (z, a, g), "weighted" (z, log_w, log_decay)
ROWS = [
    ("nan in a", "rwa", (_seq(1, 2, 3), _seq(0, NAN, 0)), None, [1, NAN, NAN]),
    ("nan in z", "rwa", (_seq(1, NAN, 3), _seq(0, 0, 0)), None, [1, NAN, NAN]),
    ("nan in g", "rda-exp", (_seq(1, 2, 3), _seq(0, 0, 0), _seq(0, NAN, 0)), None,
     [1, NAN, NAN]),
    ("nan in log_decay", "weighted", (_seq(1, 2, 3), _seq(0, 0, 0), _seq(0, NAN, 0)), None,
     [1, NAN, NAN]),
    ("nan in a, relu", "rda-relu", (_seq(1, 2, 3), _seq(1, NAN, 1), _seq(0, 0, 0)), None,
     [1, NAN, NAN]),
    ("nan in a, sigmoid", "rda-sigmoid", (_seq(1, 2, 3), _seq(1, NAN, 1), _seq(0, 0, 0)),
     None, [1, NAN, NAN]),
    ("nan in a, softplus", "rda-softplus", (_seq(1, 2, 3), _seq(1, NAN, 1), _seq(0, 0, 0)),
     None, [1, NAN, NAN]),
    ("nan in state.m", "rwa", (_seq(1, 2), _seq(0, 0)), _state(NAN, 1, 1), [NAN, NAN]),
    ("nan in state.n", "rwa", (_seq(1, 2), _seq(0, 0)), _state(0, NAN, 1), [NAN, NAN]),
    ("nan in state.d", "rwa", (_seq(1, 2), _seq(0, 0)), _state(0, 1, NAN), [NAN, NAN]),
    ("+inf logit", "rwa", (_seq(1, 5, 3), _seq(0, INF, 0)), None, [1, 5, 5]),
    ("two +inf logits", "rwa", (_seq(1, 5, 3), _seq(INF, 0, INF)), None, [1, 1, 2]),
    ("+inf logit, discounted", "weighted", (_seq(1, 5, 3), _seq(0, INF, 0), _seq(0, 0, -1)),
     None, [1, 5, 5]),
    ("masked and forgotten", "weighted",
     (_seq(1, 2, 3, 4), _seq(0, -INF, 0, 0), _seq(0, -INF, 0, 0)), None, [1, 0, 3, 3.5]),
    ("masked and forgotten, from a state", "weighted",
     (_seq(2, 3), _seq(-INF, 0), _seq(-INF, 0)), _state(0, 7, 1), [0, 3]),
    ("logits at the float32 extremes", "rwa", (_seq(1, 2, 3), _seq(3e38, -3e38, 3e38)), None,
     [1, 1, 2]),
    ("values near the float32 maximum", "rwa", (_seq(1e38, -1e38, 2e38), _seq(0, 0, 0)), None,
     None),
    ("discount logits of +-3e38", "rda-exp",
     (_seq(1, 2, 3), _seq(0, 0, 0), _seq(0, -3e38, 3e38)), None, [1, 2, 2.5]),
]


def _call(op, inputs, state):
    if op == "rwa":
        return fastrwa.rwa_scan(*inputs, initial_state=state)[0]
    if op == "weighted":
        return fastrwa.weighted_scan(*inputs, initial_state=state)[0]
    return fastrwa.rda_scan(*inputs, attention=op.split("-")[1], initial_state=state)[0]


def _reference(op, inputs, state):
    if op == "rwa":
        return weighted_scan_reference(*inputs, None, state)[0]
    if op == "weighted":
        return weighted_scan_reference(*inputs, state)[0]
    return rda_scan_reference(*inputs, op.split("-")[1], state)[0]


@pytest.mark.parametrize("name,op,inputs,state,expected", ROWS, ids=[r[0] for r in ROWS])
def test_edge_table(backend, name, op, inputs, state, expected):
    # The table is built at import, on the CPU: move it to the column's device and dtype.
    cast = lambda x: x.to(backend.device, backend.dtype)                   # noqa: E731
    st = None if state is None else ScanState(*(cast(s) if backend.exact
                                                else s.to(backend.device, torch.float32)
                                                for s in state))
    y = _call(op, [cast(x) for x in inputs], st).double().flatten().cpu()
    ref = _reference(op, [cast(x).double() for x in inputs],
                     None if st is None else ScanState(*(s.double() for s in st)))
    ref = ref.flatten().cpu()
    want = ref if expected is None else torch.tensor(expected, dtype=torch.float64, device="cpu")
    if expected is not None:    # the reference itself must give the stated answer
        torch.testing.assert_close(ref, want, equal_nan=True, rtol=1e-6, atol=0)
    torch.testing.assert_close(y, want, equal_nan=True, rtol=backend.tol["y"], atol=0)


@pytest.mark.parametrize("name,op,inputs,state,expected",
                         [r for r in ROWS if r[0].startswith("nan")],
                         ids=[r[0] for r in ROWS if r[0].startswith("nan")])
def test_nan_reaches_the_gradients(backend, name, op, inputs, state, expected):
    """A NaN input gives the same gradients on every backend as on the torch backend (whose
    analytic backward is checked against the reference's autograd everywhere else): NaN at
    the same places, never a silent finite number there."""
    def grads(backend_name):
        leaves = [x.to(backend.device, backend.dtype).requires_grad_() for x in inputs]
        st = None if state is None else ScanState(*(s.to(backend.device, backend.dtype
                                                         if backend.exact else torch.float32)
                                                    for s in state))
        with fastrwa.use_backend(backend_name):
            return torch.autograd.grad(_call(op, leaves, st).sum(), leaves)

    got_all, want_all = grads(backend.name), grads("torch")
    assert any(torch.isnan(w).any() for w in want_all), "a NaN input must reach the gradients"
    for got, want in zip(got_all, want_all):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=backend.tol["grad"],
                                   atol=backend.tol["grad"])


@pytest.mark.parametrize("shape", [(0, 3, 2), (2, 0, 2), (2, 3, 0), (0, 0, 0)])
def test_empty_sizes_with_autograd(backend, shape):
    z, a, g = (torch.randn(shape, dtype=backend.dtype, requires_grad=True) for _ in range(3))
    y, state = fastrwa.rda_scan(z, a, g, "sigmoid", output_final_state=True)
    assert y.shape == shape and state.m.shape == (shape[0], shape[2])
    grads = torch.autograd.grad(y.sum() + state.n.sum(), (z, a, g), allow_unused=True)
    for x, gr in zip((z, a, g), grads):
        assert gr is None or (gr.shape == x.shape and not torch.isnan(gr).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finite_logits_near_the_float_minimum_are_weights(backend, dtype):
    """Only -inf masks: finite logits just above the lowest float count (numba read logits
    below -3e38 as masked and gave 0)."""
    if backend.name == "triton" and dtype == torch.float64:
        dtype = torch.float32
    low = torch.finfo(dtype).min
    z = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=dtype).view(1, -1, 1)
    for a_values, expected in (([low, low, low, low], [1, 1.5, 2, 3]),
                               ([low, -INF, low * 0.99, low], [1, 1, 3, 3])):
        a = torch.tensor(a_values, dtype=dtype).view(1, -1, 1)
        y, state = fastrwa.rwa_scan(z, a, output_final_state=True)
        torch.testing.assert_close(y.flatten().double(), torch.tensor(expected).double(),
                                   rtol=TOL[dtype]["y"], atol=0)
        assert torch.isfinite(state.m).all() and (state.d > 0).all()


def test_a_forgotten_infinite_maximum_is_forgotten(backend):
    """A log discount of -inf forgets the past even when its maximum is +inf (the limit; it
    was inf - inf = NaN on every backend)."""
    dt = backend.dtype
    z = torch.tensor([1.0, 5.0, 3.0, 4.0], dtype=dt).view(1, -1, 1)
    lw = torch.tensor([0.1, INF, 0.5, 2.0], dtype=dt).view(1, -1, 1)
    ld = torch.tensor([0.0, -0.3, -INF, -0.2], dtype=dt).view(1, -1, 1)
    leaves = [x.clone().requires_grad_() for x in (z, lw, ld)]
    y, _ = fastrwa.weighted_scan(*leaves)
    w2, w3 = math.exp(0.5 - 0.2), math.exp(2.0)
    expected = torch.tensor([1, 5, 3, (3 * w2 + 4 * w3) / (w2 + w3)], dtype=torch.float64)
    torch.testing.assert_close(y.flatten().double(), expected, rtol=TOL[dt]["y"], atol=0)
    grads = torch.autograd.grad(y.sum(), leaves)
    assert all(torch.isfinite(gr).all() for gr in grads)
    gz = grads[0].flatten().double()
    torch.testing.assert_close(gz, torch.tensor([1, 1, 1 + w2 / (w2 + w3), w3 / (w2 + w3)],
                                                dtype=torch.float64),
                               rtol=TOL[dt]["grad"], atol=TOL[dt]["grad"])
