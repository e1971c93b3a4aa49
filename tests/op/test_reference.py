"""The reference loop against an independent O(T^2) closed form (docs/math.md §1), float64;
its step (``weighted_step_reference``, what the ONNX step exports) token by token against
the same closed form, and at the limits of docs/math.md §2."""

import math

import pytest
import torch
import torch.nn.functional as F

from fastrwa.reference import reference_log_weight, weighted_step_reference
from fastrwa.state import ScanState
from helpers import ATTENTIONS, make_inputs, make_state, reference

WEIGHT = {
    "exp": torch.exp,
    "sigmoid": torch.sigmoid,
    "softplus": F.softplus,
    "relu": torch.relu,
}


def closed_form(z, a, g, attention, state=None):
    """``y_t = sum_i w_i prod_{j=i+1..t} gamma_j z_i / (same without z)``, pairwise, in float64.

    The state, if any, is a pseudo-step before ``t = 0`` of weight ``exp(m) d`` and value ``n / d``.
    """
    B, T, D = z.shape
    w = WEIGHT[attention](a)
    gamma = torch.ones_like(z) if g is None else torch.sigmoid(g)
    y = torch.zeros_like(z)
    for t in range(T):
        num = torch.zeros(B, D, dtype=z.dtype)
        den = torch.zeros(B, D, dtype=z.dtype)
        for i in range(t + 1):
            p = w[:, i] * torch.prod(gamma[:, i + 1:t + 1], dim=1)
            num += p * z[:, i]
            den += p
        if state is not None:
            p0 = torch.exp(state.m) * state.d * torch.prod(gamma[:, :t + 1], dim=1)
            num += p0 * state.n / state.d
            den += p0
        y[:, t] = torch.where(den > 0, num / torch.where(den > 0, den, 1), 0)
    return y


# RWA is exp attention without a discount; RDA is every attention with one.
VARIANTS = [("exp", False)] + [(attention, True) for attention in ATTENTIONS]


@pytest.mark.parametrize("attention,decay", VARIANTS)
@pytest.mark.parametrize("with_state", [False, True])
def test_reference_matches_closed_form(attention, decay, with_state):
    z, a, g = make_inputs(2, 11, 3, attention=attention, decay=decay, seed=3)
    state = make_state(2, 3) if with_state else None
    y, _ = reference(z, a, g, attention, state)
    torch.testing.assert_close(y, closed_form(z, a, g, attention, state), rtol=1e-12, atol=1e-12)


def test_reference_reverse_is_flipped_forward():
    z, a, g = make_inputs(2, 9, 3, seed=4)
    y, _ = reference(z, a, g, "sigmoid", reverse=True)
    flip = lambda x: x.flip(1)
    expected = closed_form(flip(z), flip(a), flip(g), "sigmoid").flip(1)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_reference_masked_prefix_is_zero_not_nan():
    z, a, _ = make_inputs(1, 6, 2)
    a[:, :3] = float("-inf")
    y, state = reference(z, a)
    assert torch.equal(y[:, :3], torch.zeros_like(y[:, :3]))
    torch.testing.assert_close(y, closed_form(z, a, None, "exp"), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(state.m).all()


@pytest.mark.parametrize("attention,decay", VARIANTS)
def test_the_step_reference_token_by_token_is_the_closed_form(attention, decay):
    z, a, g = make_inputs(2, 7, 3, attention=attention, decay=decay, seed=5)
    state = make_state(2, 3)
    log_w = reference_log_weight(a, attention)
    ys = []
    step_state = state
    for t in range(z.shape[1]):
        lam = None if g is None else F.logsigmoid(g[:, t])
        y_t, step_state = weighted_step_reference(z[:, t], log_w[:, t], lam, step_state)
        ys.append(y_t)
    expected = closed_form(z, a, g, attention, state)
    torch.testing.assert_close(torch.stack(ys, 1), expected, rtol=1e-12, atol=1e-12)


INF, NAN = math.inf, math.nan
# (state m, n, d; this token's z, l, lam (None: no discount)) -> (y, m', n', d')
LIMITS = {
    "nothing seen, a masked token": ((-INF, 0, 0), (3, -INF, None), (0, -INF, 0, 0)),
    "a finite step": ((0, 1, 1), (2, math.log(3), None), (7 / 4, math.log(3), 7 / 3, 4 / 3)),
    "equal infinite logits share the weight": ((INF, 2, 1), (4, INF, None), (3, INF, 6, 2)),
    "lam = -inf forgets even a max of +inf": ((INF, 2, 1), (5, 0, -INF), (5, 0, 5, 1)),
    "lam = -inf and a masked token: empty": ((INF, 2, 1), (5, -INF, -INF), (0, -INF, 0, 0)),
    "a NaN logit gives NaN": ((0, 1, 1), (2, NAN, None), (NAN, NAN, NAN, NAN)),
}


@pytest.mark.parametrize("case", LIMITS)
def test_the_step_reference_keeps_the_limits(case):
    (m, n, d), (z, l, lam), want = LIMITS[case]
    row = lambda v: torch.tensor([[float(v)]], dtype=torch.float64)  # noqa: E731
    y, state = weighted_step_reference(row(z), row(l), None if lam is None else row(lam),
                                       ScanState(row(m), row(n), row(d)))
    got = torch.cat([y, *state], dim=1)[0]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-15,
                               atol=0, equal_nan=True)
