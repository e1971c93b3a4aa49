"""Faithful cells against hand-written steps from the papers' equations, and RWA cell vs scan layer;
a cell's state of another dtype is refused, not cast."""

import pytest
import torch

import fastrwa
from fastrwa.nn import RDACell, Recurrent, RRACell, RWA, RWACell


def test_rwa_cell_matches_the_papers_equations():
    """Raw (unstabilised) n, d of Ostmeyer & Cowell on a tiny float64 case."""
    torch.manual_seed(0)
    cell = RWACell(2, 3).double()
    x = torch.randn(4, 1, 2, dtype=torch.float64)
    Wg, Wa = cell.gates
    h = torch.tanh(cell.s0)[None]
    n = torch.zeros(1, 3, dtype=torch.float64)
    d = torch.zeros(1, 3, dtype=torch.float64)
    state = None
    for t in range(4):
        xh = torch.cat([x[t], h], dim=-1)
        z = (x[t] @ cell.u.weight.T + cell.u.bias) * torch.tanh(xh @ Wg.weight.T + Wg.bias)
        a = xh @ Wa.weight.T + Wa.bias
        n, d = n + z * torch.exp(a), d + torch.exp(a)
        h = torch.tanh(n / d)
        out, state = cell(x[t], state)
        torch.testing.assert_close(out, h, rtol=1e-12, atol=1e-12)


def test_rda_cell_matches_the_papers_equations():
    torch.manual_seed(1)
    for attention, f_a in (("exp", torch.exp), ("sigmoid", torch.sigmoid),
                           ("softplus", torch.nn.functional.softplus)):
        cell = RDACell(2, 3, attention=attention, f_h="tanh", f_o="sigmoid").double()
        x = torch.randn(5, 1, 2, dtype=torch.float64)
        Wg, Wa, Wc = cell.gates
        h = torch.tanh(cell.s0)[None]
        n = d = torch.zeros(1, 3, dtype=torch.float64)
        state = None
        for t in range(5):
            xh = torch.cat([x[t], h], dim=-1)
            z = (x[t] @ cell.u.weight.T + cell.u.bias) * torch.tanh(xh @ Wg.weight.T + Wg.bias)
            w = f_a(xh @ Wa.weight.T + Wa.bias)
            gamma = torch.sigmoid(xh @ Wc.weight.T + Wc.bias)
            n, d = gamma * n + w * z, gamma * d + w
            h = torch.tanh(n / d)
            o, state = cell(x[t], state)
            torch.testing.assert_close(o, torch.sigmoid(h), rtol=1e-12, atol=1e-12)


def test_rda_cell_discount_bias_starts_at_one():
    assert torch.equal(RDACell(2, 3).gates[2].bias.detach(), torch.ones(3))


def test_rra_cell_matches_its_equations():
    torch.manual_seed(2)
    cell = RRACell(2, 3, window=2).double()
    with torch.no_grad():
        cell.window_logits.copy_(torch.tensor([0.3, -0.2]))
    x = torch.randn(5, 1, 2, dtype=torch.float64)
    h = c = torch.zeros(1, 3, dtype=torch.float64)
    past = [torch.zeros(1, 3, dtype=torch.float64)] * 3     # h_{t-1}, h_{t-2}, h_{t-3}
    alpha = torch.softmax(cell.window_logits, 0)
    state = None
    for t in range(5):
        i, f, g, o = (torch.cat([x[t], h], -1) @ cell.lstm.weight.T + cell.lstm.bias).chunk(4, -1)
        r = alpha[0] * past[1] + alpha[1] * past[2]
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g) + r
        h = torch.sigmoid(o) * torch.tanh(c)
        past = [h] + past[:2]
        out, state = cell(x[t], state)
        torch.testing.assert_close(out, h, rtol=1e-12, atol=1e-12)


def test_rwa_cell_equals_scan_layer_without_recurrent_weights():
    torch.manual_seed(3)
    layer = RWA(4, 5, learn_initial_state=False)
    cell = RWACell(4, 5)
    with torch.no_grad():
        u, g, a = layer.proj.weight.view(3, 5, 4)
        bu, bg, ba = layer.proj.bias.view(3, 5)
        cell.u.weight.copy_(u), cell.u.bias.copy_(bu)
        for gate, w, b in zip(cell.gates, (g, a), (bg, ba)):
            gate.weight.zero_()
            gate.weight[:, :4].copy_(w)
            gate.bias.copy_(b)
    x = torch.randn(2, 11, 4)
    torch.testing.assert_close(Recurrent(cell)(x)[0], layer(x)[0], rtol=1e-5, atol=1e-6)


def test_recurrent_wrapper_layouts_and_errors():
    rnn = Recurrent(RDACell(3, 4, preset="sigmoid-id"), batch_first=False)
    x = torch.randn(6, 2, 3)
    out, state = rnn(x)
    assert out.shape == (6, 2, 4) and state.h.shape == (2, 4)
    with pytest.raises(ValueError, match="x_t must have shape"):
        RWACell(3, 4)(torch.randn(2, 5))
    with pytest.raises(TypeError, match="state must be a fastrwa.nn.CellState"):
        RWACell(3, 4)(torch.randn(2, 3), fastrwa.ScanState.empty(2, 4))


def _bad_cell_uses():
    """(what, call, error type, message pattern): each a user mistake with a clear error."""
    rwa, rda, rra = RWACell(4, 8), RDACell(4, 8), RRACell(4, 8, window=3)
    x = torch.randn(2, 4)
    _, s = rwa(x)
    _, s_rra = rra(x)
    return [
        ("size 0", lambda: RWACell(0, 8), ValueError, "input_size must be a positive int"),
        ("negative size", lambda: RDACell(4, -1), ValueError, "hidden_size must be a positive"),
        ("float size", lambda: RRACell(4.0, 8), ValueError, "input_size must be a positive"),
        ("bool size", lambda: RWACell(True, 8), ValueError, "input_size must be a positive"),
        ("bool window", lambda: RRACell(4, 8, window=True), ValueError, "window must be"),
        ("integer x", lambda: rwa(torch.ones(2, 4, dtype=torch.long)), TypeError,
         "x_t must have a floating dtype"),
        ("float64 x, float32 cell", lambda: rda(x.double()), TypeError, "module's dtype"),
        ("integer x for RRA", lambda: rra(torch.ones(2, 4, dtype=torch.long)), TypeError,
         "floating dtype"),
        ("state of another batch", lambda: rwa(torch.randn(3, 4), s), ValueError,
         r"state.h must have shape \(3, 8\)"),
        ("state.h of another width", lambda: rwa(x, s._replace(h=torch.randn(2, 5))),
         ValueError, "state.h must have shape"),
        ("state.scan None", lambda: rwa(x, s._replace(scan=None)), TypeError,
         "state.scan must be a fastrwa.ScanState"),
        ("state.scan of another width",
         lambda: rwa(x, s._replace(scan=fastrwa.ScanState.empty(2, 5))), ValueError,
         "state.scan.m must have shape"),
        ("RRA state of another batch", lambda: rra(torch.randn(3, 4), s_rra), ValueError,
         "state.h must have shape"),
        ("RRA history of another window",
         lambda: rra(x, s_rra._replace(history=torch.zeros(2, 5, 8))), ValueError,
         "state.history must have shape"),
        ("Recurrent of a non-cell", lambda: Recurrent(object()), TypeError,
         "cell must be a torch.nn.Module"),
        ("Recurrent batch_first not bool", lambda: Recurrent(rwa, batch_first="yes"), TypeError,
         "batch_first must be a bool"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cell_uses())))
def test_cells_refuse_bad_arguments_with_clear_errors(case):
    what, call, error, pattern = _bad_cell_uses()[case]
    with pytest.raises(error, match=pattern):
        call()


def test_cells_take_other_dtypes_under_autocast():
    cell = RDACell(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, state = cell(torch.randn(2, 4, dtype=torch.bfloat16))
        out, state = cell(torch.randn(2, 4, dtype=torch.bfloat16), state)
    assert out.shape == (2, 8) and torch.isfinite(out).all()


def test_cell_state_h_of_another_dtype_is_refused():
    """A cell's state.h must have the input's (or the parameters') dtype: a float64 h with a
    float32 cell was cast silently."""
    for cell in (RWACell(4, 6), RDACell(4, 6)):
        _, state = cell(torch.randn(2, 4))
        with pytest.raises(TypeError, match=r"state.h must have dtype torch.float32, got "
                                            r"torch.float64"):
            cell(torch.randn(2, 4), state._replace(h=state.h.double()))
    rra = RRACell(4, 6, window=3)
    _, state = rra(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"state.c must have dtype torch.float32"):
        rra(torch.randn(2, 4), state._replace(c=state.c.double()))
