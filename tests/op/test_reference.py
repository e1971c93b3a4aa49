"""The reference loop against an independent O(T^2) closed form (docs/math.md §1), float64."""

import pytest
import torch
import torch.nn.functional as F

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
