"""``mask=`` of the scan layers and ByteLM: a row with skipped tokens (padding, anywhere)
gives, at its kept tokens, the outputs, the final state and the gradients of the row without
them (float64, numba and torch backends); bad masks are clear errors."""

import pytest
import torch

import fastrwa
from fastrwa.models import ByteLM, LMConfig
from fastrwa.nn import LayerState
from fastrwa.state import ScanState

B, T, I, H = 3, 9, 3, 4


def _row(state, b):
    """Row ``b`` of a layer state, as a batch of one."""
    last = None if state.last_input is None else state.last_input[b:b + 1]
    return LayerState(ScanState(*(t[b:b + 1] for t in state.scan)), last)


def _masks():
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(B, T, generator=gen) > 0.4
    mask[0, :3] = False                      # left padding
    mask[0, 3:] = True
    mask[1, 2:5] = False                     # a hole
    mask[2] = False                          # nothing kept
    return mask


LAYERS = {
    "rwa": lambda shift: fastrwa.nn.RWA(I, H, token_shift=shift),
    "rda-exp": lambda shift: fastrwa.nn.RDA(I, H, token_shift=shift),
    "rda-sigmoid": lambda shift: fastrwa.nn.RDA(I, H, attention="sigmoid", f_h="identity",
                                                token_shift=shift),
    "rda-softplus": lambda shift: fastrwa.nn.RDA(I, H, attention="softplus", token_shift=shift),
    "rda-relu": lambda shift: fastrwa.nn.RDA(I, H, attention="relu", token_shift=shift),
    "bidirectional": lambda shift: fastrwa.nn.RDA(I, H, bidirectional=True, token_shift=shift),
}


LAYERS["rda, no learned prior"] = lambda shift: fastrwa.nn.RDA(I, H, token_shift=shift,
                                                             learn_initial_state=False)


def _average(state):
    return state.scan.n / state.scan.d.clamp(min=1e-300)


@pytest.mark.parametrize("scan_backend", ["numba", "torch"])
@pytest.mark.parametrize("shift", [False, True], ids=["no shift", "token shift"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_skipped_tokens_leave_the_state_as_if_absent(kind, shift, scan_backend):
    """Per row: the kept outputs, the final state (every direction) and the gradients of
    x, of the parameters and of the starting state equal those of the row without its
    skipped tokens."""
    torch.manual_seed(0)
    layer = LAYERS[kind](shift).double()
    x = torch.randn(B, T, I, dtype=torch.float64)
    with torch.no_grad():
        _, start = layer(torch.randn(B, 2, I, dtype=torch.float64))
    mask = _masks()
    width = layer.num_directions * H
    w = torch.randn(B, T, width, dtype=torch.float64)
    wf = torch.randn(B, width, dtype=torch.float64)

    def leaves(state):
        last = None if state.last_input is None else state.last_input.clone().requires_grad_()
        return LayerState(ScanState(*(t.clone().requires_grad_() for t in state.scan)), last)

    def loss(y, final, weights, final_weights, keep=None):
        kept = y if keep is None else y * keep[..., None]
        return (kept * weights).sum() + (_average(final) * final_weights).sum()

    with fastrwa.use_backend(scan_backend):
        xs, states = x.clone().requires_grad_(), leaves(start)
        y, final = layer(xs, states, mask)
        loss(y, final, w, wf, mask).backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        for b in range(B):
            keep = mask[b]
            layer.zero_grad(set_to_none=True)
            xb, sb = x[b:b + 1, keep].clone().requires_grad_(), leaves(_row(start, b))
            yb, fb = layer(xb, sb)
            # (each row's own loss: the batch's gradients are the sums of the rows')
            assert torch.allclose(y[b, keep], yb[0], rtol=0, atol=1e-12), b
            assert torch.allclose(_average(final)[b], _average(fb)[0], rtol=0, atol=1e-12), b
            loss(yb, fb, w[b:b + 1, keep], wf[b:b + 1]).backward()
            assert torch.allclose(xs.grad[b, keep], xb.grad[0], rtol=0, atol=1e-12), b
            assert torch.all(xs.grad[b, ~keep] == 0), b
            for got, want in zip(states.scan, sb.scan):   # (no gradient: zero)
                g = torch.zeros_like(got[b]) if got.grad is None else got.grad[b]
                h = torch.zeros_like(want[0]) if want.grad is None else want.grad[0]
                assert torch.allclose(g, h, rtol=0, atol=1e-12), b
            if shift:
                assert torch.equal(final.last_input[b], fb.last_input[0]), b
        # the parameters' gradient of the batch is the sum over rows of each row's alone
        total = {n: torch.zeros_like(g) for n, g in grads.items()}
        for b in range(B):
            layer.zero_grad(set_to_none=True)
            keep = mask[b]
            yb, fb = layer(x[b:b + 1, keep], _row(start, b))
            loss(yb, fb, w[b:b + 1, keep], wf[b:b + 1]).backward()
            for n in total:
                total[n] += layer.get_parameter(n).grad
        for n, g in grads.items():
            assert torch.allclose(g, total[n], rtol=0, atol=1e-11), n


def test_time_first_masks_follow_the_layout():
    torch.manual_seed(0)
    layer = fastrwa.nn.RDA(I, H, token_shift=True, batch_first=False).double()
    x = torch.randn(T, B, I, dtype=torch.float64)
    mask = _masks()
    y, _ = layer(x, mask=mask.t())
    first, _ = fastrwa.nn.RDA(I, H, token_shift=True).double(), None
    first.load_state_dict(layer.state_dict())
    want, _ = first(x.transpose(0, 1), mask=mask)
    assert torch.allclose(y.transpose(0, 1)[mask], want[mask], rtol=0, atol=1e-12)


def test_a_padded_language_model_row_equals_the_row_alone():
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=8, n_layers=2, mlp_ratio=2)).double()
    tokens = torch.randint(0, 256, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False                     # left padding
    tokens[1, :2] = 256                     # (any id: skipped)
    logits, state = model(tokens, mask=mask)
    alone, alone_state = model(tokens[1:, 2:])
    assert torch.allclose(logits[1, 2:], alone[0], rtol=0, atol=1e-12)
    for got, want in zip(state.layers, alone_state.layers):
        assert torch.allclose(got.scan.n[1] / got.scan.d[1], want.scan.n[0] / want.scan.d[0],
                              rtol=0, atol=1e-12)
        assert torch.equal(got.last_input[1], want.last_input[0])


@pytest.mark.parametrize("mask,error,words", [
    (torch.ones(B, T), TypeError, "bool tensor"),
    (torch.ones(B, T + 1, dtype=torch.bool), ValueError, "shape (B, T) = (3, 9)"),
    ([[True] * T] * B, TypeError, "bool torch.Tensor"),
])
def test_bad_masks_are_clear_errors(mask, error, words):
    layer = fastrwa.nn.RDA(I, H)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        layer(torch.randn(B, T, I), mask=mask)
