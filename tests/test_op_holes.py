"""Holes in the op found by a user campaign (issue 22), each checked on every backend: strided
float16 inputs, the gradient of a small relu logit, gradients at +inf logits, finite logits
near the float minimum, and bad packed offsets inside a compiled graph."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

import fastrwa
from helpers import TOL, randn

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtypes(backend):
    """The input dtypes a backend takes (Triton refuses float64; tests/test_backend.py)."""
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


@pytest.mark.parametrize("layout", range(6), ids=[name for name, _ in _layouts(1, 1, 1, torch.float32, torch.Generator())])
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


def _relu_mean_loop(z, a, g, gy):
    """Loss ``sum_t gy_t y_t`` of the relu RDA in float64, as the running mean
    ``y_t = y_{t-1} + s_t (z_t - y_{t-1})`` with ``w = relu(a)``, ``d_t = gamma_t d_{t-1} +
    w_t`` and the share ``s_t = w_t / d_t`` written ``1 / (1 + gamma_t d_{t-1} / w_t)``: no
    step, and no step of its autograd, subtracts two large numbers, so the gradient is exact
    to float64 rounding even for a tiny first weight."""
    y, d, loss = (torch.zeros((), dtype=torch.float64) for _ in range(3))
    for t in range(len(z)):
        w = torch.relu(a[t])
        kept = torch.sigmoid(g[t]) * d
        share = torch.where(w > 0, 1 / (1 + kept / torch.where(w > 0, w, 1)), 0)
        d = kept + w
        y = y + share * (z[t] - y)
        loss = loss + gy[t] * y
    return loss


@pytest.mark.parametrize("a0", [1e-30, 1e-20, 1e-12, 1e-8, 1e-6, 1e-3])
def test_relu_gradient_of_a_small_first_weight(backend, a0):
    """A small positive relu logit that is the only weight so far keeps its gradient
    (it was lost to cancellation: 0 instead of about 1.65 below 1e-8)."""
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


_COMPILED_BAD_OFFSETS = textwrap.dedent("""
    import sys, torch, fastrwa
    backend = sys.argv[1]
    @torch.compile(backend="eager", fullgraph=True)
    def f(z, a, cu):
        return fastrwa.rwa_scan(z, a, cu_seqlens=cu)[0]
    z, a = torch.randn(1, 6, 3), torch.randn(1, 6, 3)
    with fastrwa.use_backend(backend):
        print(f(z, a, torch.tensor([0, 2, 6])).shape)   # good offsets compile and run
        for bad in ([0, 9, 6], [0, 4, 2, 6], [0, 2, 7], [-3, 2, 6], [0, 2, 5]):
            try:
                f(z, a, torch.tensor(bad))
            except Exception as error:
                assert "cu_seqlens must start at 0, never decrease and end at T = 6" in \\
                    str(error), error
            else:
                raise SystemExit(f"offsets {bad} were accepted")
    print("refused")
""")


@pytest.mark.parametrize("name", ["numba", "torch"])
def test_bad_offsets_are_refused_inside_a_compiled_graph(name):
    """A compiled graph skips the public checks, so the op checks packed offsets itself:
    offsets past T or decreasing are refused, never read out of bounds (they crashed the
    process or returned uninitialised memory). In a child process, as the old failure was
    a crash."""
    done = subprocess.run([sys.executable, "-c", _COMPILED_BAD_OFFSETS, name],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("refused")


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

