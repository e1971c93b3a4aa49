"""Property-based test of the op: any dtype, input layout, attention, direction, initial
state, final state, packing, chunking and masks (``-inf`` logits and log discounts), on
every backend, against a float64 answer computed here by the direct formula (not the
recurrence, and not fastrwa.reference):

    y_t = sum_i exp(l_i + Lam_{i,t}) z_i / sum_i exp(l_i + Lam_{i,t})

over the steps ``i`` seen by ``t`` (and the initial state as one more term), where
``Lam_{i,t}`` sums the log discounts of the steps after ``i`` up to ``t``. Gradients are
autograd of that formula.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import fastrwa
from fastrwa.testing import backend_options
from helpers import TOL

OPS = ("rwa", "weighted", "exp", "sigmoid", "softplus", "relu")   # the last four: rda_scan
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "offset")
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _log_weight(a, op):
    """``log f_a(a)``; ``-inf`` where ``a = -inf`` (a masked step, weight 0, gradient 0)."""
    masked = torch.isneginf(a)
    a = torch.where(masked, 0, a)
    if op in ("rwa", "weighted", "exp"):
        l = a
    elif op == "sigmoid":
        l = F.logsigmoid(a)
    elif op == "softplus":
        l = torch.log(F.softplus(a))
    else:
        positive = a > 0
        l = torch.where(positive, torch.log(torch.where(positive, a, 1)), -torch.inf)
    return torch.where(masked, -torch.inf, l)


def _log_decay(g, op):
    if op == "rwa":
        return None
    return g if op == "weighted" else F.logsigmoid(g)


def _direct(z, l, lam, state):
    """``(y, log total, average)`` of one ``(T, D)`` sequence in scan order, from its
    log-weights ``l`` and log discounts ``lam`` (the last two ``0`` when nothing was seen)."""
    if state is not None:       # the state is a step before the first, with its own weight
        m0, n0, d0 = state
        l = torch.cat([(m0 + torch.log(d0))[None], l])
        z = torch.cat([(n0 / d0)[None], z])
        lam = torch.cat([torch.zeros_like(m0)[None], lam])
    first = 0 if state is None else 1
    ys, total, average = [], torch.zeros(z.shape[1:]), torch.zeros(z.shape[1:])
    for t in range(len(z)):
        # Lam_{i,t} = lam_{i+1} + ... + lam_t, summed from t down (-inf stays -inf)
        after = torch.cat([lam[1:t + 1].flip(0).cumsum(0).flip(0), torch.zeros_like(lam[:1])])
        s = l[:t + 1] + after                                                   # [t+1, D]
        top = s.max(0).values
        empty = torch.isneginf(top)
        w = torch.exp(s - torch.where(empty, 0, top))
        d = w.sum(0)
        average = torch.where(empty, 0, (w * z[:t + 1]).sum(0) / torch.where(empty, 1, d))
        total = torch.where(empty, 0, top + torch.log(torch.where(empty, 1, d)))
        if t >= first:
            ys.append(average)
    y = torch.stack(ys) if ys else z[:0]
    return y, total, average


def _expected(z, a, g, op, state, reverse, cu):
    """``(y, log totals, averages)`` of every sequence (the last two ``(N, D)``)."""
    bounds = [0, z.shape[1]] if cu is None else cu
    l, lam = _log_weight(a, op), _log_decay(g, op)
    lam = torch.zeros_like(z) if lam is None else lam
    ys, totals, averages = [], [], []
    for b in range(z.shape[0]):
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            st_i = None if state is None else tuple(s[b if cu is None else i] for s in state)
            order = (lambda x: x.flip(0)) if reverse else (lambda x: x)
            y, total, average = _direct(order(z[b, lo:hi]), order(l[b, lo:hi]),
                                        order(lam[b, lo:hi]), st_i)
            ys.append(order(y))
            totals.append(total)
            averages.append(average)
    return torch.cat(ys).reshape(z.shape), torch.stack(totals), torch.stack(averages)


def _in_layout(x, layout, dtype):
    """``x`` ``(B, T, D)`` as ``dtype`` in the named memory layout (same values)."""
    B, T, D = x.shape
    if layout == "transposed":
        return x.transpose(1, 2).to(dtype).contiguous().transpose(1, 2)
    if layout == "sliced":
        return torch.cat([x, x], dim=2).to(dtype)[..., D:]
    if layout == "expanded":
        return x[:1].to(dtype).expand(B, T, D)
    if layout == "offset":
        return torch.cat([torch.zeros(3, dtype=dtype), x.to(dtype).flatten()])[3:].view(B, T, D)
    return x.to(dtype).clone()


@st.composite
def cases(draw, dtype, layout):
    packed = draw(st.booleans())
    B = 1 if packed else draw(st.integers(1, 2))
    T = draw(st.integers(1, 9))
    D = draw(st.integers(1, 4))
    cu = None
    if packed:
        cu = [0, *sorted(draw(st.lists(st.integers(0, T), max_size=3))), T]
    n_seq = B if cu is None else len(cu) - 1
    values = st.floats(-3, 3, allow_nan=False, allow_subnormal=False, width=32)

    def tensor(*shape):
        n = shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)
        return torch.tensor(draw(st.lists(values, min_size=n, max_size=n)),
                            dtype=torch.float64).reshape(shape)

    op = draw(st.sampled_from(OPS))
    z, a, g = tensor(B, T, D), tensor(B, T, D), tensor(B, T, D)
    if op == "weighted":             # a log discount <= 0
        g = -F.softplus(g)
    if draw(st.booleans()):          # some steps masked, some pasts forgotten (exp(-inf) = 0)
        a = torch.where(tensor(B, T, D) > 2, -torch.inf, a)
        if op == "weighted":
            g = torch.where(tensor(B, T, D) > 2, -torch.inf, g)
    state = None
    if draw(st.booleans()):
        state = (tensor(n_seq, D), tensor(n_seq, D), 1 + tensor(n_seq, D).abs())
    return dict(dtype=dtype, layout=layout, op=op, reverse=draw(st.booleans()), final=draw(st.booleans()),
                chunk=draw(st.sampled_from([None, 2, 3])), z=z, a=a, g=g, state=state, cu=cu)


def _run(leaves, op, state, case, cu):
    opts = dict(torch=dict(chunk_size=case["chunk"]),
                numba={} if case["chunk"] is None else dict(chunk=case["chunk"], block=2))
    with backend_options("torch", **opts["torch"]), backend_options("numba", **opts["numba"]):
        kw = dict(initial_state=state, output_final_state=case["final"],
                  reverse=case["reverse"], cu_seqlens=cu)
        if op == "rwa":
            return fastrwa.rwa_scan(*leaves, **kw)
        if op == "weighted":
            return fastrwa.weighted_scan(*leaves, **kw)
        return fastrwa.rda_scan(*leaves, attention=op, **kw)


def _check(case):
    dtype, op = case["dtype"], case["op"]
    z, a, g = (_in_layout(case[k], case["layout"], dtype) for k in "zag")
    leaves = [x.detach().requires_grad_() for x in ((z, a) if op == "rwa" else (z, a, g))]
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    state = None if case["state"] is None else \
        fastrwa.ScanState(*(s.to(sdt).requires_grad_() for s in case["state"]))
    cu = None if case["cu"] is None else torch.tensor(case["cu"])
    y, final = _run(leaves, op, state, case, cu)
    # the answer, from the same (rounded) numbers in float64
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref_state = None if state is None else tuple(s.detach().double().requires_grad_()
                                                 for s in state)
    rg = ref_leaves[2] if len(ref_leaves) > 2 else None
    want, w_total, w_average = _expected(*ref_leaves[:2], rg, op, ref_state, case["reverse"],
                                         case["cu"])
    tol = TOL[dtype]
    scale = max([1.0] + [x.abs().max().item() for x in (want, w_average) if x.numel()])
    torch.testing.assert_close(y.double(), want, rtol=0, atol=tol["y"] * scale * 4)
    # gradients of a fixed linear functional of y and, when returned, of the final state's
    # log total and average (what any continuation of the scan depends on)
    weights = lambda x: torch.linspace(-1, 1, x.numel(), dtype=torch.float64).reshape(x.shape)
    loss, ref_loss = (y.double() * weights(y)).sum(), (want * weights(want)).sum()
    if case["final"]:
        seen = final.d > 0
        total = torch.where(seen, final.m + torch.log(torch.where(seen, final.d, 1)), 0)
        torch.testing.assert_close(total.double(), w_total, rtol=0, atol=1e-4 * scale * 4)
        torch.testing.assert_close(final.average().double(), w_average, rtol=0,
                                   atol=tol["y"] * scale * 4)
        loss = loss + (total.double() * weights(total)).sum() \
            + (final.average().double() * weights(total).flip(-1)).sum()
        ref_loss = ref_loss + (w_total * weights(w_total)).sum() \
            + (w_average * weights(w_total).flip(-1)).sum()
    inputs = leaves + ([] if state is None else list(state))
    ref_inputs = ref_leaves + ([] if ref_state is None else list(ref_state))
    got = torch.autograd.grad(loss, inputs, allow_unused=True)
    expected = torch.autograd.grad(ref_loss, ref_inputs, allow_unused=True)
    for i, (g_, w_) in enumerate(zip(got, expected)):
        w_ = torch.zeros_like(ref_inputs[i]) if w_ is None else w_
        g_ = torch.zeros_like(inputs[i]) if g_ is None else g_
        g_scale = max(1.0, w_.abs().max().item()) if w_.numel() else 1.0
        torch.testing.assert_close(g_.double(), w_, rtol=0, atol=tol["grad"] * g_scale * 4,
                                   msg=lambda m: f"gradient #{i}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: str(dt)[6:])
def test_the_op_equals_the_direct_formula(backend, dtype, layout):
    """Random cases (op, reverse, initial and final state, packed sequences, chunk lengths,
    masks) in every dtype and memory layout on this backend equal the direct float64
    formula, outputs and gradients."""
    examples = 4 if backend.interpreted else 12

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases(dtype, layout))
    def check(case):
        _check(case)

    check()
