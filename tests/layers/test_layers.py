"""Scan layers (fastrwa.nn.RWA / RDA): streaming equals parallel, directions, init, training, errors.
The in-place step (``step_``) checks every argument before it writes anything; the layers
check x's dtype and a state's last_input; discount timescales must be finite and above one."""

import math

import pytest
import torch

import fastrwa
from helpers import assert_unchanged, snapshot
from fastrwa.nn import RDA, RWA, LayerState
from fastrwa.state import ScanState
from helpers import ATTENTIONS

LAYERS = [("rwa", None)] + [("rda", attention) for attention in ATTENTIONS]
GROUPED = [("rda-grouped", "sigmoid")]     # one discount shared by all 5 channels
TOL_FP32 = 1e-5   # layer outputs, streaming vs parallel, float32 state


def make_layer(kind, attention, **kw):
    torch.manual_seed(0)
    if kind == "rwa":
        return RWA(6, 5, **kw)
    if kind == "rda-identity":      # f_h = f_o = identity: the step writes the output itself
        return RDA(6, 5, attention=attention, f_h="identity", **kw)
    if kind == "rda-grouped":
        return RDA(6, 5, attention=attention, discount_groups=1, **kw)
    return RDA(6, 5, attention=attention, **kw)


@pytest.mark.parametrize("kind,attention", LAYERS + GROUPED)
@pytest.mark.parametrize("token_shift", [False, True])
def test_prefix_then_steps_equals_parallel_at_every_split(kind, attention, token_shift):
    layer = make_layer(kind, attention, token_shift=token_shift)
    x = torch.randn(3, 9, 6)
    with torch.no_grad():
        full, final = layer(x)
        for k in range(10):
            out, state = layer(x[:, :k])
            outs = [out]
            for t in range(k, 9):
                o, state = layer.step(x[:, t], state)
                outs.append(o[:, None])
            err = (torch.cat(outs, dim=1) - full).abs().max().item()
            assert err <= TOL_FP32, (k, err)
            torch.testing.assert_close(state.scan.average(), final.scan.average())


@pytest.mark.parametrize("kind,attention", LAYERS + GROUPED + [("rda-identity", "sigmoid")])
@pytest.mark.parametrize("token_shift", [False, True])
@pytest.mark.parametrize("batch", [1, 3])     # (one row: the kernel reads the gate columns in place)
def test_in_place_step_equals_step(kind, attention, token_shift, batch):
    """layer.step_ (state updated in place, output into a buffer) equals layer.step."""
    layer = make_layer(kind, attention, token_shift=token_shift)
    check_in_place_steps(layer, torch.randn(batch, 6, 6))


@torch.no_grad()
def check_in_place_steps(layer, x, full=None):
    """From the state after ``x[:, :2]``, ``layer.step_`` on an owned copy of the state
    equals ``layer.step`` token by token (and, given ``full``, the sequence's outputs)."""
    batch = x.shape[0]
    _, state = layer(x[:, :2])
    mine = LayerState(type(state.scan)(*(s.clone() for s in state.scan)),
                      None if state.last_input is None else state.last_input.clone())
    work, out = layer.step_workspace(batch), torch.empty(batch, layer.hidden_size)
    for t in range(2, x.shape[1]):
        want, state = layer.step(x[:, t], state)
        if full is not None:
            torch.testing.assert_close(want, full[:, t], atol=1e-6, rtol=1e-6)
        assert layer.step_(x[:, t], mine, out, work) is out
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(mine.scan.average(), state.scan.average())


def test_in_place_step_follows_the_backend_in_force(monkeypatch):
    """A change of backend between two in-place steps is seen: the next step runs on the
    backend now in force (the numba backend keeps views of the step's tensors)."""
    from fastrwa.ops import dispatch

    layer = RDA(4, 6, attention="sigmoid").eval()
    x = torch.randn(2, 5, 4)
    _, state = layer(x[:, :3])
    out, work = torch.empty(2, 6), layer.step_workspace(2)
    torch_backend, calls = dispatch.load("torch"), []
    original = torch_backend.forward
    monkeypatch.setattr(torch_backend, "forward",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad(), fastrwa.use_backend("numba"):
        layer.step_(x[:, 3], state, out, work)
    assert calls == []
    expected, _ = layer.step(x[:, 4], state)
    with torch.no_grad(), fastrwa.use_backend("torch"):
        layer.step_(x[:, 4], state, out, work)
    assert calls == [1]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_bidirectional_halves_are_a_forward_and_a_reversed_layer():
    torch.manual_seed(1)
    bi = RDA(6, 5, attention="softplus", bidirectional=True)
    x = torch.randn(2, 7, 6)
    out, state = bi(x)
    assert out.shape == (2, 7, 10) and state.scan.m.shape == (2, 10)
    for direction in (0, 1):
        uni = RDA(6, 5, attention="softplus")
        with torch.no_grad():
            uni.proj.weight.copy_(bi.proj.weight.view(2, -1, 6)[direction])
            uni.proj.bias.copy_(bi.proj.bias.view(2, -1)[direction])
            uni.initial_value.copy_(bi.initial_value.view(2, -1)[direction])
            uni.initial_logit.copy_(bi.initial_logit.view(2, -1)[direction])
        half = out[..., direction * 5:(direction + 1) * 5]
        if direction == 0:
            torch.testing.assert_close(half, uni(x)[0])
        else:
            torch.testing.assert_close(half, uni(x.flip(1))[0].flip(1))
    with pytest.raises(RuntimeError, match="bidirectional"):
        bi.step(x[:, 0], state)


def test_batch_first_false_is_a_transpose():
    layer = make_layer("rda", "exp")
    x = torch.randn(2, 7, 6)
    out, _ = layer(x)
    layer.batch_first = False
    out_t, _ = layer(x.transpose(0, 1))
    torch.testing.assert_close(out_t.transpose(0, 1), out)


def test_initialisation_follows_the_papers():
    layer = RDA(40, 30)
    w = layer.proj.weight.view(4, 30, 40)
    bound = math.sqrt(6 / (40 + 30))
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound   # Xavier-uniform per gate
    b = layer.proj.bias.view(4, 30)
    assert torch.equal(b[:3], torch.zeros(3, 30)) and torch.equal(b[3], torch.ones(30))
    assert layer.initial_logit.eq(0).all() and layer.initial_value.std() > 0.5
    empty = RWA(4, 3, learn_initial_state=False)
    st = empty.initial_state(2)
    assert torch.isneginf(st.scan.m).all() and st.scan.d.eq(0).all()
    assert not empty.initial_value.requires_grad


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("token_shift", [False, True])
def test_a_grouped_discount_is_a_per_channel_layer_with_each_group_s_row_repeated(
        bidirectional, token_shift):
    """``discount_groups=G``: forward (with padding), its gradients and the final state equal
    those of the per-channel layer whose discount rows are the grouped layer's, each
    repeated for the channels of its group (``per_channel_rows``); float64."""
    torch.manual_seed(0)
    grouped = RDA(6, 8, discount_groups=2, bidirectional=bidirectional,
                  token_shift=token_shift).double()
    wide = RDA(6, 8, bidirectional=bidirectional, token_shift=token_shift).double()
    rows = grouped.per_channel_rows()
    assert grouped.proj.weight.shape[0] == (2 if bidirectional else 1) * (3 * 8 + 2)
    assert rows.shape == wide.proj.bias.shape
    with torch.no_grad():
        grouped.proj.bias.normal_()
        wide.proj.weight.copy_(grouped.proj.weight[rows])
        wide.proj.bias.copy_(grouped.proj.bias[rows])
        for name in ("initial_value", "initial_logit"):
            getattr(wide, name).copy_(getattr(grouped, name))
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    mask = torch.rand(3, 7) > 0.3
    (y_g, s_g), (y_w, s_w) = grouped(x, mask=mask), wide(x, mask=mask)
    torch.testing.assert_close(y_g, y_w, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(s_g.scan.average(), s_w.scan.average(), rtol=1e-13, atol=1e-13)
    weights = torch.randn_like(y_g)
    (y_g * weights).sum().backward()
    (y_w * weights).sum().backward()
    # a grouped row's gradient is the sum of its copies'
    summed = torch.zeros_like(grouped.proj.weight).index_add_(0, rows, wide.proj.weight.grad)
    torch.testing.assert_close(grouped.proj.weight.grad, summed, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grouped.initial_value.grad, wide.initial_value.grad)


@pytest.mark.parametrize("token_shift", [False, True])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_a_grouped_discount_streams_in_place_as_it_steps(token_shift, batch):
    """Three groups of two channels: ``step_`` (each group's logit copied to its channels
    in the workspace) equals ``step``, which equals the whole sequence; an empty batch too."""
    torch.manual_seed(0)
    layer = RDA(4, 6, attention="sigmoid", discount_groups=3, token_shift=token_shift)
    with torch.no_grad():
        layer.proj.bias.normal_()                   # (distinct discounts per group)
        x = torch.randn(batch, 6, 4)
        check_in_place_steps(layer, x, full=layer(x)[0])


def test_grouped_discount_initialisation_has_the_per_channel_bound():
    torch.manual_seed(0)
    layer = RDA(40, 30, discount_groups=3)
    c = layer.proj.weight[90:]
    bound = math.sqrt(6 / (40 + 30))
    assert c.shape == (3, 40) and c.abs().max() <= bound and c.abs().max() > 0.9 * bound
    assert torch.equal(layer.proj.bias[90:], torch.ones(3))


def test_a_layer_saved_before_discount_groups_existed_runs_per_channel():
    """A module pickled by an earlier version has no ``discount_groups`` attribute: it runs
    as the per-channel layer it was."""
    layer = RDA(6, 5)
    x = torch.randn(2, 4, 6)
    want, _ = layer(x)
    del layer.discount_groups                       # (as unpickled from before the option)
    assert layer.discount_groups is None
    torch.testing.assert_close(layer(x)[0], want, rtol=0, atol=0)


def test_discount_groups_must_divide_the_hidden_size():
    with pytest.raises(ValueError, match=r"discount_groups \(3\) must divide hidden_size \(8\)"):
        RDA(6, 8, discount_groups=3)
    for bad in (0, -2, True, "4", 2.0):
        with pytest.raises(ValueError, match="discount_groups must be None or a positive int"):
            RDA(6, 8, discount_groups=bad)
    assert "discount_groups=4" in repr(RDA(6, 8, discount_groups=4))
    assert RDA(6, 8, discount_groups=8).per_channel_rows().equal(torch.arange(32))


def test_presets():
    assert RDA(4, 3, preset="exp-tanh").attention == "exp"
    layer = RDA(4, 3, preset="sigmoid-id")
    assert (layer.attention, layer.f_h_name, layer.f_o_name) == ("sigmoid", "identity", "identity")
    with pytest.raises(ValueError, match="preset.*'exp-id'"):
        RDA(4, 3, preset="exp-id")


@pytest.mark.parametrize("kind,attention", LAYERS + GROUPED)
def test_gradients_reach_every_parameter_and_training_reduces_loss(kind, attention):
    layer = make_layer(kind, attention, token_shift=True)
    head = torch.nn.Linear(5, 1)
    torch.manual_seed(3)
    x, target = torch.randn(8, 12, 6), torch.randn(8, 12, 1)
    params = list(layer.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = ((head(layer(x)[0]) - target) ** 2).mean()
        loss.backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_bad_input_messages():
    layer = RDA(6, 5, token_shift=True)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, input_size\).*6.*\(2, 3, 4\)"):
        layer(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([[0.0]])
    with pytest.raises(TypeError, match="state must be a fastrwa.nn.LayerState.*ScanState"):
        layer(torch.randn(2, 3, 6), fastrwa.ScanState.empty(2, 5))
    _, state = layer(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"state.scan.*\(3, 5\).*\(2, 5\)"):
        layer(torch.randn(3, 3, 6), state)
    with pytest.raises(ValueError, match="state.last_input"):
        layer(torch.randn(2, 3, 6), LayerState(state.scan, None))
    with pytest.raises(ValueError, match=r"x_t must have shape \(B, input_size\)"):
        layer.step(torch.randn(2, 3, 6), state)
    with pytest.raises(ValueError, match="attention"):
        RDA(6, 5, attention="tanh")
    with pytest.raises(ValueError, match="f_o must be one of"):
        RDA(6, 5, f_o="gelu")
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        RWA(6, 0)


@pytest.mark.parametrize("kind", ["rwa", "rda"])
def test_states_handed_out_own_their_memory(kind):
    """step_ updates a state in place: a state from forward() must not be a view of the
    caller's input, and one from initial_state() not a view of the parameters (B > 1 too)."""
    torch.manual_seed(0)
    layer = (RWA(3, 4, token_shift=True) if kind == "rwa"
             else RDA(3, 4, preset="sigmoid-id", token_shift=True))
    with torch.no_grad():
        layer.initial_logit.fill_(0.5)                  # a learned, finite prior
    x = torch.randn(2, 5, 3)
    x_before, params_before = x.clone(), [p.detach().clone() for p in layer.parameters()]
    out = torch.empty(2, 4)
    _, state = layer(x)
    layer.step_(torch.randn(2, 3), state, out)
    assert torch.equal(x, x_before), "step_ wrote into the caller's input"
    for batch in (1, 3):
        state, x_t, y = layer.initial_state(batch), torch.randn(batch, 3), torch.empty(batch, 4)
        layer.step_(x_t, state, y)
        with torch.no_grad():
            want, _ = layer.step(x_t, layer.initial_state(batch))
        assert torch.allclose(y, want, atol=1e-6)
    for p, before in zip(layer.parameters(), params_before):
        assert torch.equal(p, before), "step_ wrote into a parameter"


I, H = 6, 5


def layer_of(kind: str, token_shift: bool, input_size: int = I):
    torch.manual_seed(0)
    if kind == "rwa":
        return RWA(input_size, H, token_shift=token_shift)
    if kind == "rda-identity":          # f_h = f_o = identity: the scan writes out itself
        return RDA(input_size, H, f_h="identity", attention="sigmoid", token_shift=token_shift)
    return RDA(input_size, H, attention="softplus", token_shift=token_shift)


def fresh_state(layer, batch: int = 2) -> LayerState:
    with torch.no_grad():
        _, state = layer(torch.randn(batch, 3, layer.input_size,
                                     generator=torch.Generator().manual_seed(4)))
    return state


# -- step_ checks everything before it writes ----------------------------------------------
def _bad_step_calls():
    """(name, call(layer, state, x, out, work), error, words): each a mistake step_ refuses."""
    f64 = torch.float64
    return [
        ("out of another batch", lambda l, s, x, o, w: l.step_(x, s, torch.empty(3, H), w),
         ValueError, r"out must have shape \(B, hidden_size\) = \(2, 5\).*\(3, 5\)"),
        ("out of another width", lambda l, s, x, o, w: l.step_(x, s, torch.empty(2, H + 1), w),
         ValueError, r"out must have shape"),
        ("out of another dtype", lambda l, s, x, o, w: l.step_(x, s, o.double(), w),
         TypeError, r"out must have dtype torch.float32.*float64"),
        ("out not a tensor", lambda l, s, x, o, w: l.step_(x, s, None, w),
         TypeError, r"out must be a torch.Tensor.*NoneType"),
        ("out expanded", lambda l, s, x, o, w: l.step_(x, s, torch.zeros(1, H).expand(2, H), w),
         ValueError, r"out .*overlap"),
        ("out is the state", lambda l, s, x, o, w: l.step_(x, s, s.scan.n, w),
         ValueError, r"out and state.scan.n share memory"),
        ("work of another batch", lambda l, s, x, o, w: l.step_(x, s, o, l.step_workspace(3)),
         ValueError, r"work\['\w+'\] must have shape \(2, "),
        ("work of another dtype",
         lambda l, s, x, o, w: l.step_(x, s, o, l.step_workspace(2, f64)),
         TypeError, r"work\[.*\] must have dtype torch.float32.*float64"),
        ("work not a workspace", lambda l, s, x, o, w: l.step_(x, s, o, {"proj": w["proj"]}),
         TypeError, r"work must be the dict of step_workspace"),
        ("x of another batch", lambda l, s, x, o, w: l.step_(torch.randn(3, I), s,
                                                              torch.empty(3, H),
                                                              l.step_workspace(3)),
         ValueError, r"state.scan.m must have shape \(B, hidden_size\) = \(3, 5\).*\(2, 5\)"),
        ("x of another dtype", lambda l, s, x, o, w: l.step_(x.double(), s, o, w),
         TypeError, r"x_t must have the layer's dtype torch.float32.*float64"),
        ("x of an integer dtype", lambda l, s, x, o, w: l.step_(x.long(), s, o, w),
         TypeError, r"x_t must have a floating dtype.*int64"),
        ("state not a LayerState", lambda l, s, x, o, w: l.step_(x, tuple(s), o, w),
         TypeError, r"state must be a fastrwa.nn.LayerState"),
        ("state of another dtype",
         lambda l, s, x, o, w: l.step_(x, LayerState(ScanState(*(t.double() for t in s.scan)),
                                                     s.last_input), o, w),
         TypeError, r"state.scan.m must have dtype torch.float32.*float64"),
    ]


BAD_STEP_CALLS = _bad_step_calls()


@pytest.mark.parametrize("kind", ["rwa", "rda", "rda-identity"])
@pytest.mark.parametrize("token_shift", [False, True])
@pytest.mark.parametrize("name,call,error,words", BAD_STEP_CALLS,
                         ids=[c[0] for c in BAD_STEP_CALLS])
def test_layer_step_in_place_refuses_before_it_writes(kind, token_shift, name, call, error,
                                                      words):
    """Each mistake is a TypeError/ValueError naming the argument, and the state is as it
    was: not advanced, not partly written. A good call first (the checks remember the
    layouts they passed) must not let a different layout through."""
    layer = layer_of(kind, token_shift)
    state, x = fresh_state(layer), torch.randn(2, I)
    out, work = torch.empty(2, H), layer.step_workspace(2)
    layer.step_(x, state, out, work)                              # a good call first
    before, out_before = snapshot(state), out.clone()
    with pytest.raises(error, match=words):
        call(layer, state, x, out, work)
    assert_unchanged(state, before)
    assert torch.equal(out, out_before)


@pytest.mark.parametrize("kind", ["rwa", "rda", "rda-identity"])
def test_layer_step_in_place_may_write_its_output_over_its_input(kind):
    """``out`` may be ``x_t`` itself (when the sizes agree): the step reads ``x_t`` before it
    writes ``out``, and the token shift keeps the input, not the output it was overwritten
    with (it kept the output)."""
    layer = layer_of(kind, True, input_size=H)
    state, buf = fresh_state(layer), torch.randn(2, H)
    twin, x = fresh_state(layer), buf.clone()
    work = layer.step_workspace(2)
    want = layer.step_(x, twin, torch.empty(2, H), work).clone()
    got = layer.step_(buf, state, buf, work)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(state.last_input, x, rtol=0, atol=0)
    assert_unchanged(state, snapshot(twin))


@pytest.mark.parametrize("kind", ["rwa", "rda"])
def test_layer_step_in_place_refuses_a_previous_input_that_would_broadcast(kind):
    """A token-shift state whose last_input has one row (or another width) is refused, not
    broadcast into the step's buffer."""
    layer = layer_of(kind, True)
    state, x = fresh_state(layer), torch.randn(2, I)
    for bad in (state.last_input[:1].clone(), torch.zeros(2, I + 1), None):
        wrong = LayerState(state.scan, bad)
        before = snapshot(state)
        with pytest.raises((ValueError, TypeError), match=r"state.last_input"):
            layer.step_(x, wrong, torch.empty(2, H), layer.step_workspace(2))
        assert_unchanged(state, before)


@pytest.mark.parametrize("kind", ["rwa", "rda"])
def test_layer_step_in_place_takes_a_state_that_requires_grad(kind):
    """A state straight out of a forward with autograd (its tensors require grad) steps in
    place like a detached one: step_ runs without autograd."""
    layer = layer_of(kind, True)
    x = torch.randn(2, 3, I)
    _, graph_state = layer(x)
    assert graph_state.scan.n.requires_grad
    with torch.no_grad():
        _, plain = layer(x)
    got, want = torch.empty(2, H), torch.empty(2, H)
    x_t = torch.randn(2, I)
    layer.step_(x_t, graph_state, got)
    layer.step_(x_t, plain, want)
    assert torch.equal(got, want)
    assert torch.equal(graph_state.scan.n.detach(), plain.scan.n)


# -- the layers check x's dtype ------------------------------------------------------------
@pytest.mark.parametrize("cls", [RWA, RDA])
def test_scan_layers_name_a_wrong_input_dtype(cls):
    layer = cls(I, H)
    with pytest.raises(TypeError, match=r"x must have the layer's dtype torch.float32.*"
                                        r"torch.float64"):
        layer(torch.randn(2, 3, I, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x_t must have the layer's dtype.*float64"):
        layer.step(torch.randn(2, I, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x must have a floating dtype.*torch.int64"):
        layer(torch.ones(2, 3, I, dtype=torch.long))
    with torch.autocast("cpu", dtype=torch.bfloat16):      # autocast casts at the product
        out, _ = layer(torch.randn(2, 3, I, dtype=torch.float16))
        assert out.shape == (2, 3, H)
        with pytest.raises(TypeError, match=r"x must have the layer's dtype"):
            layer(torch.randn(2, 3, I, dtype=torch.float64))    # (autocast leaves float64)
    layer.double()
    out, _ = layer(torch.randn(2, 3, I, dtype=torch.float64))    # now the layer's dtype
    assert out.dtype == torch.float64


# -- discount timescales -------------------------------------------------------------------
@pytest.mark.parametrize("shortest,longest,name", [
    (2.0, math.inf, "longest"), (math.inf, math.inf, "shortest"), (2.0, math.nan, "longest"),
    (1.0, 10.0, "shortest"), (2.0, 0.5, "longest"), (2.0, 10 ** 400, "longest"),
])
def test_discount_timescales_must_be_finite_and_above_one(shortest, longest, name):
    layer = RDA(I, H)
    bias = layer.proj.bias.detach().clone()
    with pytest.raises(ValueError, match=rf"{name} must be a finite number > 1"):
        layer.set_discount_timescales(shortest, longest)
    assert torch.equal(layer.proj.bias, bias)


def test_discount_timescales_give_finite_outputs_up_to_huge_lengths():
    layer = RDA(I, H)
    layer.set_discount_timescales(1.5, 1e300)
    out, _ = layer(torch.randn(2, 4, I))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("call", ["forward", "step"])
def test_layer_state_last_input_is_checked(call):
    """A state's last_input of another dtype, or given to a layer without token shift, is
    refused naming it (both were accepted: the first silently promoted)."""
    shifted, plain = RDA(4, 6, token_shift=True), RDA(4, 6)
    x = torch.randn(2, 3, 4)
    _, state = shifted(x)
    run = (lambda layer, st: layer(x, st)) if call == "forward" \
        else (lambda layer, st: layer.step(x[:, 0], st))
    wrong = LayerState(state.scan, state.last_input.double())
    with pytest.raises(TypeError, match=r"state.last_input must have dtype torch.float32, "
                                        r"got torch.float64"):
        run(shifted, wrong)
    with pytest.raises(ValueError, match="state.last_input must be None: this layer has no "
                                         "token shift"):
        run(plain, state)
    run(shifted, state)                                    # the layer's own state runs
    run(plain, LayerState(state.scan, None))
