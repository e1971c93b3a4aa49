"""Packed variable-length sequences (``cu_seqlens``) on every backend."""

import pytest
import torch

import fastrwa

from helpers import (assert_close, compare_gradients, make_inputs, make_state, randn, reference,
                     run)


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


LAYERS = {
    "rwa": lambda: fastrwa.nn.RWA(3, 4),
    "rda shift": lambda: fastrwa.nn.RDA(3, 4, token_shift=True),
    "rda sigmoid bidirectional shift": lambda: fastrwa.nn.RDA(
        3, 4, attention="sigmoid", bidirectional=True, token_shift=True),
    "rda time-first grouped": lambda: fastrwa.nn.RDA(3, 4, batch_first=False,
                                                     discount_groups=2, token_shift=True),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_run_packed_sequences_as_each_alone(backend, name):
    """``layer(x, state, cu_seqlens=cu)`` with ``x`` ``(1, total, input)``: each sequence (one
    empty) as if run alone from its row of the state, its token shift restarting from that
    row's last input: outputs, final states and the gradients of the inputs, the state and
    the parameters equal one call per sequence."""
    torch.manual_seed(0)
    layer = LAYERS[name]().to(backend.dtype)
    time_first = not layer.batch_first
    cu = torch.tensor([0, 3, 3, 8, 9])
    gen = torch.Generator().manual_seed(1)
    x = randn(1, 9, 3, gen=gen).to(backend.dtype)
    with torch.no_grad():      # a state of 4 rows, as a forward over 4 sequences leaves it
        start = randn(4, 2, 3, gen=gen).to(backend.dtype)
        _, state = layer(start.transpose(0, 1) if time_first else start)
    leaves = [x.clone().requires_grad_(), *(t.clone().requires_grad_() for t in state.scan),
              state.last_input.clone().requires_grad_() if layer.token_shift else None]
    tf = (lambda t: t.transpose(0, 1)) if time_first else (lambda t: t)

    def states(rows):
        return fastrwa.nn.LayerState(fastrwa.ScanState(*(t[rows] for t in leaves[1:4])),
                                     None if leaves[4] is None else leaves[4][rows])

    y, final = layer(tf(leaves[0]), states(slice(None)), cu_seqlens=cu)
    y = tf(y)
    ys, finals = [], []
    for i in range(4):
        yi, fi = layer(tf(leaves[0][:, cu[i]:cu[i + 1]]), states(slice(i, i + 1)))
        ys.append(tf(yi))
        finals.append(fi)
    want = torch.cat(ys, 1)
    tol = backend.tol
    assert_close(y, want.double(), tol["y"], "packed output")
    for k, field in enumerate(("m", "n", "d")):
        got = getattr(final.scan, field)
        expect = torch.cat([getattr(f.scan, field) for f in finals])
        if field == "m":
            got, expect = got.clamp(min=-1e30), expect.clamp(min=-1e30)
        assert_close(got, expect.double(), tol["y"], f"final {field}")
    if layer.token_shift:
        assert_close(final.last_input, torch.cat([f.last_input for f in finals]).double(),
                     tol["y"], "final last_input")
    w = randn(*y.shape, gen=gen).to(backend.dtype)
    wanted = [t for t in leaves if t is not None] + list(layer.parameters())
    loss = lambda out, fin: (out * w).sum() + (fin.n / fin.d).sum()           # noqa: E731
    got = torch.autograd.grad(loss(y, final.scan), wanted, allow_unused=True)
    ref_final = fastrwa.ScanState(*(torch.cat([getattr(f.scan, k) for f in finals])
                                    for k in ("m", "n", "d")))
    expect = torch.autograd.grad(loss(want, ref_final), wanted, allow_unused=True)
    for i, (g, e) in enumerate(zip(got, expect)):
        if e is None:
            assert g is None or not g.abs().any(), i
            continue
        assert_close(g, e.double(), tol["grad"], f"gradient {i}")


def test_packed_edge_cases_of_a_layer():
    """No state given (each sequence from the initial state), an empty last sequence, and no
    tokens at all: as each sequence alone."""
    torch.manual_seed(0)
    layer = fastrwa.nn.RDA(3, 4, token_shift=True).double()
    x = torch.randn(1, 5, 3, dtype=torch.float64)
    y, state = layer(x, cu_seqlens=torch.tensor([0, 2, 5, 5]))
    for i, (lo, hi) in enumerate(((0, 2), (2, 5), (5, 5))):
        alone, final = layer(x[:, lo:hi])
        assert_close(y[:, lo:hi], alone, 1e-12, f"sequence {i}")
        assert_close(state.scan.n[i] / state.scan.d[i], final.scan.n[0] / final.scan.d[0],
                     1e-12, f"state {i}")
        assert_close(state.last_input[i], final.last_input[0], 1e-12, f"last input {i}")
    y, state = layer(x[:, :0], cu_seqlens=torch.tensor([0, 0]))
    assert y.shape == (1, 0, 4) and state.last_input.shape == (1, 3)


def test_byte_lm_runs_packed_documents_as_each_alone():
    """``ByteLM(tokens, cu_seqlens=cu)``: each document's logits and final state are those of
    running it alone; a mask with cu_seqlens is refused (a context group too: the context
    parallel worker checks that every rank raises)."""
    from fastrwa.models import ByteLM, LMConfig
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=16, n_layers=2)).double()
    cu = torch.tensor([0, 4, 4, 11])
    tokens = torch.randint(0, 256, (1, 11))
    logits, state = model(tokens, cu_seqlens=cu)
    for i in range(3):
        alone, final = model(tokens[:, cu[i]:cu[i + 1]])
        assert_close(logits[:, cu[i]:cu[i + 1]], alone, 1e-12, f"document {i}")
        for got, want in zip(state.layers, final.layers):
            assert_close(got.scan.n[i] / got.scan.d[i], want.scan.n[0] / want.scan.d[0], 1e-12)
            assert_close(got.last_input[i], want.last_input[0], 1e-12)
    with pytest.raises(ValueError, match="cu_seqlens cannot be combined with mask"):
        model(tokens, mask=torch.ones(1, 11, dtype=torch.bool), cu_seqlens=cu)
