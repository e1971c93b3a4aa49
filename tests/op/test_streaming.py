"""Streaming: a scan of x[:, :k] continued by a scan or by steps over x[:, k:] equals one scan of x.
The in-place step (``rda_step_``) refuses self-overlapping buffers and, under autograd,
tensors that require grad, naming them, and steps interleaved views that share no element."""

import pytest
import torch

import fastrwa
from fastrwa.state import ScanState
from helpers import ATTENTIONS, TOL, assert_close, leaf, make_inputs, make_state, run

T = 9


def _scan(z, a, g, attention, state, reverse=False, chunk=None):
    return run(z, a, g, attention, state, final=True, reverse=reverse, chunk=chunk)


@pytest.mark.parametrize("attention", ("rwa",) + ATTENTIONS)
@pytest.mark.parametrize("with_state", [False, True])
def test_prefix_scan_then_scan_at_every_split(backend, attention, with_state):
    z, a, g = make_inputs(2, T, 3, dtype=backend.dtype, attention=attention, seed=17)
    if attention == "rwa":
        attention, g = "exp", None
    init = make_state(2, 3, dtype=backend.dtype) if with_state else None
    y_full, st_full = _scan(z, a, g, attention, init)
    for k in backend.splits(T):
        part = lambda x, s: None if x is None else x[:, s]
        y1, st1 = _scan(part(z, slice(None, k)), part(a, slice(None, k)),
                        part(g, slice(None, k)), attention, init, chunk=2)
        y2, st2 = _scan(part(z, slice(k, None)), part(a, slice(k, None)),
                        part(g, slice(k, None)), attention, st1, chunk=3)
        assert_close(torch.cat([y1, y2], dim=1), y_full, backend.tol["y"], f"y split at {k}")
        assert_close(st2.average(), st_full.average(), backend.tol["y"], f"state split at {k}")


@pytest.mark.parametrize("attention", ("rwa",) + ATTENTIONS)
@pytest.mark.parametrize("with_state", [False, True])
def test_prefix_scan_then_steps_at_every_split(backend, attention, with_state):
    z, a, g = make_inputs(2, T, 3, dtype=backend.dtype, attention=attention, seed=19)
    rwa = attention == "rwa"
    if rwa:
        attention = "exp"
    init = make_state(2, 3, dtype=backend.dtype) if with_state else None
    if rwa:
        y_full, _ = fastrwa.rwa_scan(z, a, init)
    else:
        y_full, _ = fastrwa.rda_scan(z, a, g, attention, init)
    for k in backend.splits(T):
        if rwa:
            y1, state = fastrwa.rwa_scan(z[:, :k], a[:, :k], init, output_final_state=True)
        else:
            y1, state = fastrwa.rda_scan(z[:, :k], a[:, :k], g[:, :k], attention, init,
                                         output_final_state=True)
        outs = [y1]
        for t in range(k, T):
            if rwa:
                y_t, state = fastrwa.rwa_step(z[:, t], a[:, t], state)
            else:
                y_t, state = fastrwa.rda_step(z[:, t], a[:, t], g[:, t], state, attention)
            outs.append(y_t[:, None])
        assert_close(torch.cat(outs, dim=1), y_full, backend.tol["y"], f"y split at {k}")


def test_steps_from_nothing_equal_scan(backend):
    z, a, g = make_inputs(3, T, 4, dtype=backend.dtype, seed=23)
    state, outs = None, []
    for t in range(T):
        y_t, state = fastrwa.rda_step(z[:, t], a[:, t], g[:, t], state, "sigmoid")
        outs.append(y_t)
    y_full, st_full = fastrwa.rda_scan(z, a, g, "sigmoid", output_final_state=True)
    assert_close(torch.stack(outs, dim=1), y_full, backend.tol["y"], "y")
    assert isinstance(state, fastrwa.ScanState)
    assert_close(state.average(), st_full.average(), backend.tol["y"], "state")


def test_reverse_split_suffix_first(backend):
    """Reversed, the suffix is scanned first and its state continues into the prefix."""
    z, a, g = make_inputs(2, T, 3, dtype=backend.dtype, seed=29)
    y_full, _ = _scan(z, a, g, "exp", None, reverse=True)
    for k in backend.splits(T):
        y2, st2 = _scan(z[:, k:], a[:, k:], g[:, k:], "exp", None, reverse=True)
        y1, _ = _scan(z[:, :k], a[:, :k], g[:, :k], "exp", st2, reverse=True)
        assert_close(torch.cat([y1, y2], dim=1), y_full, backend.tol["y"], f"y split at {k}")


# (The split's gradients pass through the initial and final states, whatever the attention;
# each attention's own gradients are tests/op/test_scan_backward.py's. So on the interpreter
# the Triton column keeps one attention: tests/conftest.py, triton_repeat.)
@pytest.mark.triton_repeat(keep=[dict(attention="exp")])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gradients_through_a_split_equal_gradients_of_one_scan(backend, attention):
    """The final-state and initial-state gradients compose: split scans backprop like one."""
    z, a, g = make_inputs(2, T, 3, dtype=backend.dtype, attention=attention, seed=31)
    init = make_state(2, 3, dtype=backend.dtype)
    gy = torch.randn(2, T, 3, dtype=backend.dtype)

    def grads(split):
        leaves = [leaf(x) for x in (z, a, g, *init)]
        zz, aa, gg, m0, n0, d0 = leaves
        state = ScanState(m0, n0, d0)
        if split is None:
            y, _ = _scan(zz, aa, gg, attention, state)
        else:
            y1, st = _scan(zz[:, :split], aa[:, :split], gg[:, :split], attention, state)
            y2, _ = _scan(zz[:, split:], aa[:, split:], gg[:, split:], attention, st)
            y = torch.cat([y1, y2], dim=1)
        return torch.autograd.grad((y * gy).sum(), leaves)

    want = grads(None)
    for k in backend.splits(T):
        for i, (g_, w_) in enumerate(zip(grads(k), want)):
            assert_close(g_, w_.double(), 1e-10 if backend.exact else backend.tol["grad"],
                         f"gradient #{i}, split at {k}")


@pytest.mark.parametrize("attention", ("rwa",) + ATTENTIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_in_place_steps_continue_a_prefix_scan(backend, attention, dtype):
    """rwa_step_/rda_step_ update the state where it lies and write y into the given buffer
    (the numba backend in place, the torch backend through a copy): both equal the scan."""
    n = 16
    z, a, g = (x.to(dtype) for x in make_inputs(2, n, 5, attention=attention, seed=31))
    g = None if attention == "rwa" else g
    prefix = lambda x: None if x is None else x[:, :7]   # noqa: E731
    kw = {} if g is None else dict(attention=attention)
    scan = fastrwa.rwa_scan if g is None else fastrwa.rda_scan
    y_full, final = scan(*(x for x in (z, a, g) if x is not None), **kw,
                         output_final_state=True)
    _, state = scan(*(prefix(x) for x in (z, a, g) if x is not None), **kw,
                    output_final_state=True)
    buffers = [s.data_ptr() for s in state]
    out = torch.empty(2, 5, dtype=dtype)
    with torch.no_grad():
        for t in range(7, n):
            # contiguous rows take the in-place kernel; a strided row (t = 7) the fallback
            row = lambda x: None if x is None else (x[:, t] if t == 7 else x[:, t].contiguous())  # noqa: E731
            if g is None:
                fastrwa.rwa_step_(row(z), row(a), state, out)
            else:
                fastrwa.rda_step_(row(z), row(a), row(g), state, out, attention)
            assert_close(out, y_full[:, t].double(), TOL[dtype]["y"], f"y at {t}")
    assert [s.data_ptr() for s in state] == buffers
    assert_close(state.average(), final.average().double(), TOL[dtype]["y"], "final average")
    assert_close(state.m + torch.log(state.d), (final.m + torch.log(final.d)).double(),
                 TOL[dtype]["y"], "final log-total")


@pytest.mark.parametrize("attention", ("rwa",) + ATTENTIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_in_place_steps_on_reused_buffers_continue_a_prefix_scan(backend, attention, dtype):
    """rwa_step_/rda_step_ called once a step on inputs written into the same buffers (as a
    decode loop does; a backend may keep views of them) equal the scan, and leave the state
    where it lies."""
    n = 12
    z, a, g = (x.to(dtype) for x in make_inputs(2, n, 5, attention=attention, seed=41))
    g = None if attention == "rwa" else g
    kw = {} if g is None else dict(attention=attention)
    scan = fastrwa.rwa_scan if g is None else fastrwa.rda_scan
    inputs = [x for x in (z, a, g) if x is not None]
    y_full, final = scan(*inputs, **kw, output_final_state=True)
    _, state = scan(*(x[:, :5] for x in inputs), **kw, output_final_state=True)
    buffers = [torch.empty(2, 5, dtype=dtype) for _ in inputs]
    out = torch.empty(2, 5, dtype=dtype)
    step = ((lambda: fastrwa.rwa_step_(*buffers, state, out)) if g is None else
            (lambda: fastrwa.rda_step_(*buffers, state, out, attention)))
    where = [x.data_ptr() for x in state]
    with torch.no_grad():
        for t in range(5, n):
            for buf, x in zip(buffers, inputs):
                buf.copy_(x[:, t])
            assert step() is out
            assert [x.data_ptr() for x in state] == where
            assert_close(out, y_full[:, t].double(), TOL[dtype]["y"], f"y at {t}")
    assert_close(state.average(), final.average().double(), TOL[dtype]["y"], "final average")


def test_in_place_step_errors(backend):
    z = torch.randn(2, 3)
    state = fastrwa.ScanState.empty(2, 3)
    with pytest.raises(ValueError, match=r"out must be a tensor of shape \(B, D\) = \(2, 3\)"):
        fastrwa.rwa_step_(z, z, state, torch.empty(3, 2))
    with pytest.raises(TypeError, match="state must be a fastrwa.ScanState.*None"):
        fastrwa.rwa_step_(z, z, None, torch.empty(2, 3))
    with pytest.raises(RuntimeError, match="inference.*no_grad"):
        fastrwa.rwa_step_(z.requires_grad_(), z, state, torch.empty(2, 3))


def test_in_place_step_checks_every_new_layout_and_the_gradient_every_time():
    """The in-place step checks a set of buffers once (a decode loop steps the same ones), but
    a buffer that changed its shape, strides or dtype where it lies, or a new buffer, is
    checked again, and the no-gradient check runs on every call."""
    z, a = torch.randn(2, 3), torch.randn(2, 3)
    state, out = fastrwa.ScanState.empty(2, 3), torch.empty(2, 3)
    with torch.no_grad():
        fastrwa.rwa_step_(z, a, state, out)                 # checked, and remembered
        fastrwa.rwa_step_(z, a, state, out)
    with pytest.raises(RuntimeError, match="inference.*no_grad"):
        fastrwa.rwa_step_(z.requires_grad_(), a, state, out)
    z = z.detach()
    with torch.no_grad():
        out.resize_(3, 2)                                   # same memory, another shape
        with pytest.raises(ValueError, match=r"out must be a tensor of shape \(B, D\)"):
            fastrwa.rwa_step_(z, a, state, out)
        wrong = fastrwa.ScanState(state.m, state.n, state.d.view(torch.int32))
        with pytest.raises(TypeError, match="state.d must have dtype torch.float32"):
            fastrwa.rwa_step_(z, a, wrong, torch.empty(2, 3))
        with pytest.raises(ValueError, match="out and state.n share memory"):
            fastrwa.rwa_step_(z, a, state, state.n)


def test_in_place_steps_refuse_overlapping_buffers(backend):
    """``out`` aliasing the state, one tensor as all of ``m, n, d``, or ``out`` over an input
    would give a wrong answer: each is refused with an error naming the two arguments."""
    z, a, g = (x[:, 0] for x in make_inputs(2, 1, 3, dtype=backend.dtype, seed=37))
    sdt = torch.float64 if backend.exact else torch.float32
    fresh = lambda: fastrwa.ScanState.empty(2, 3, dtype=sdt)   # noqa: E731
    shared = torch.zeros(2, 3, dtype=sdt)
    cases = [
        (lambda: (fresh(), z), r"out and z_t share memory"),
        (lambda: (fastrwa.ScanState(shared, shared, shared), torch.empty_like(z)),
         r"state.m and state.n share memory"),
    ]
    if backend.exact:   # out has the state's dtype only for float64 inputs
        st = fresh()
        cases.append((lambda: (st, st.n), r"out and state.n share memory"))
    with torch.no_grad():
        for make, message in cases:
            state, out = make()
            with pytest.raises(ValueError, match=message):
                fastrwa.rda_step_(z, a, g, state, out)
        state, out = fresh(), torch.empty_like(z)
        both = torch.zeros(2, 2, 3, dtype=sdt)      # rows of one buffer are separate: fine
        state = fastrwa.ScanState(torch.full_like(both[0], float("-inf")), both[0], both[1])
        fastrwa.rda_step_(z, a, g, state, out)
        y, _ = fastrwa.rda_step(z, a, g)
        assert_close(out, y.double(), backend.tol["y"], "y")


@pytest.mark.parametrize("which", ["out", "state.n"])
def test_inplace_step_refuses_a_self_overlapping_tensor_before_touching_anything(backend, which):
    """An expanded (self-overlapping) ``out`` or state tensor is refused by the in-place step,
    naming it, with the state as it was (a sibling of the layers' step_ checks)."""
    dt = backend.dtype
    sdt = torch.float64 if dt == torch.float64 else torch.float32
    z, a, g = (torch.randn(3, 4, dtype=dt) for _ in range(3))
    state = fastrwa.ScanState(*(torch.randn(3, 4, dtype=sdt) for _ in range(2)),
                              torch.rand(3, 4, dtype=sdt) + 1)
    out = torch.empty(3, 4, dtype=dt)
    if which == "out":
        out = torch.empty(1, 4, dtype=dt).expand(3, 4)
    else:
        state = state._replace(n=state.n[:1].expand(3, 4))
    before = [s.clone() for s in state]
    with torch.no_grad(), pytest.raises(ValueError, match=f"{which} overlaps itself"):
        fastrwa.rda_step_(z, a, g, state, out)
    for s, b in zip(state, before):
        torch.testing.assert_close(s, b, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["out", "state.m", "state.d"])
def test_inplace_step_with_tensors_that_require_grad(backend, which):
    """A state tensor or ``out`` that requires grad: refused under autograd, naming it (the
    step records no graph); stepped under no_grad like detached tensors, on every backend
    (numba's NumPy views refused such tensors)."""
    dt = backend.dtype
    sdt = torch.float64 if dt == torch.float64 else torch.float32
    z, a, g = (torch.randn(3, 4, dtype=dt) for _ in range(3))
    plain = fastrwa.ScanState(torch.randn(3, 4, dtype=sdt), torch.randn(3, 4, dtype=sdt),
                              torch.rand(3, 4, dtype=sdt) + 1)
    grad = fastrwa.ScanState(*(t.clone().requires_grad_(f"state.{f}" == which)
                               for f, t in zip(fastrwa.ScanState._fields, plain)))
    out = torch.empty(3, 4, dtype=dt, requires_grad=which == "out")
    with pytest.raises(RuntimeError, match=f"{which} requires grad"):
        fastrwa.rda_step_(z, a, g, grad, out)
    with torch.no_grad():
        fastrwa.rda_step_(z, a, g, grad, out)
        want = torch.empty(3, 4, dtype=dt)
        fastrwa.rda_step_(z, a, g, plain, want)
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    for s, p in zip(grad, plain):
        torch.testing.assert_close(s.detach(), p, rtol=0, atol=0)


def test_inplace_step_takes_interleaved_views_that_share_no_element(backend):
    """``m, n, d`` as interleaved columns of one buffer (``buf[:, 0::3]`` ...) share no
    element: stepped like separate tensors; views that do share one are still refused."""
    dt = backend.dtype
    sdt = torch.float64 if dt == torch.float64 else torch.float32
    z, a, g = (torch.randn(3, 4, dtype=dt) for _ in range(3))
    plain = fastrwa.ScanState(torch.randn(3, 4, dtype=sdt), torch.randn(3, 4, dtype=sdt),
                              torch.rand(3, 4, dtype=sdt) + 1)
    buf = torch.empty(3, 12, dtype=sdt)
    views = fastrwa.ScanState(buf[:, 0::3], buf[:, 1::3], buf[:, 2::3])
    for v, p in zip(views, plain):
        v.copy_(p)
    out, want = torch.empty(3, 4, dtype=dt), torch.empty(3, 4, dtype=dt)
    with torch.no_grad():
        fastrwa.rda_step_(z, a, g, views, out)
        fastrwa.rda_step_(z, a, g, plain, want)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        for v, p in zip(views, plain):
            torch.testing.assert_close(v, p, rtol=0, atol=0)
        shared = views._replace(d=buf[:, 1:12:3])             # the same elements as n
        with pytest.raises(ValueError, match="state.n and state.d share memory"):
            fastrwa.rda_step_(z, a, g, shared, out)
