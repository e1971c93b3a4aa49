"""Packed variable-length sequences (``cu_seqlens``) on every backend."""

import pytest
import torch

from helpers import assert_close, compare_gradients, make_inputs, make_state, reference, run


@pytest.mark.parametrize("reverse", [False, True])
def test_varlen(backend, reverse):
    """Packed sequences (lengths 0, 1, 5, 9, 4) each scan on their own, with states per sequence."""
    cu = torch.tensor([0, 0, 1, 6, 15, 19])
    z, a, g = make_inputs(1, 19, 5, dtype=backend.dtype, attention="softplus", seed=11)
    state = make_state(5, 5, dtype=backend.dtype)
    y, st = run(z, a, g, "softplus", state, final=True, reverse=reverse, cu_seqlens=cu)
    y_ref, st_ref = reference(z, a, g, "softplus", state, reverse, cu)
    assert st.m.shape == (5, 5)
    assert_close(y, y_ref, backend.tol["y"], "y")
    assert_close(st.average(), st_ref.average(), backend.tol["y"], "state")
    compare_gradients(z, a, g, "softplus", state, reverse, None, backend.dtype, cu_seqlens=cu)


def test_varlen_offsets_may_be_a_strided_view(backend):
    """``cu_seqlens`` taken as every other entry of a longer tensor reads as its values."""
    cu = torch.tensor([0, 99, 3, 99, 8, 99, 11])[::2]
    z, a, g = make_inputs(1, 11, 3, dtype=backend.dtype, seed=12)
    y, st = run(z, a, g, "sigmoid", final=True, cu_seqlens=cu)
    y_ref, st_ref = reference(z, a, g, "sigmoid", None, False, cu.contiguous())
    assert_close(y, y_ref, backend.tol["y"], "y")
    assert_close(st.average(), st_ref.average(), backend.tol["y"], "state")
