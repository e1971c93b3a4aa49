"""Reliability of the modules (issue 22): the in-place steps check every argument before they
write anything, the layers check their input's dtype, the discount timescales are finite,
sampling survives a tiny temperature and names NaN logits, the inference cache checks what
it loads and how it is reordered, and every public module pickles."""

import copy
import io
import math
import pickle

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig, LMState, RecurrentLM
from fastrwa.models.sampling import sample
from fastrwa.nn import RDA, RWA, LayerState, RDACell, Recurrent, RRACell, RWACell
from fastrwa.state import ScanState

I, H = 6, 5


def layer_of(kind: str, token_shift: bool, input_size: int = I):
    torch.manual_seed(0)
    if kind == "rwa":
        return RWA(input_size, H, token_shift=token_shift)
    if kind == "rda-identity":          # f_h = f_o = identity: the scan writes out itself
        return RDA(input_size, H, f_h="identity", attention="sigmoid", token_shift=token_shift)
    return RDA(input_size, H, attention="softplus", token_shift=token_shift)


def snapshot(state: LayerState) -> list:
    return [t.detach().clone() for t in (*state.scan, state.last_input) if t is not None]


def assert_unchanged(state: LayerState, before: list) -> None:
    now = [t for t in (*state.scan, state.last_input) if t is not None]
    for got, want in zip(now, before, strict=True):
        assert torch.equal(got, want), "a refused call changed the state"


def fresh_state(layer, batch: int = 2) -> LayerState:
    with torch.no_grad():
        _, state = layer(torch.randn(batch, 3, layer.input_size,
                                     generator=torch.Generator().manual_seed(4)))
    return state


# -- 14. the in-place steps check everything before they write ----------------------------
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


def tiny_lm(**kw) -> ByteLM:
    torch.manual_seed(0)
    return ByteLM(LMConfig(d_model=8, n_layers=2, mlp_ratio=2, **kw)).eval()


@pytest.mark.parametrize("token_shift", [False, True])
def test_block_step_in_place_runs_without_autograd_like_the_layer(token_shift):
    """Block.step_ called with grad mode on (outside ByteLM.step_) used to advance the state
    and then fail in an out= product; it runs without autograd, as the layer's step_ does."""
    block = tiny_lm(token_shift=token_shift).blocks[0]
    states = [block.mix.initial_state(2) for _ in range(2)]
    xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    works = [block.step_workspace(2, torch.float32) for _ in range(2)]
    block.step_(xs[0], states[0], works[0])                  # grad mode on
    with torch.no_grad():
        block.step_(xs[1], states[1], works[1])
    assert torch.equal(xs[0], xs[1])
    for a, b in zip(snapshot(states[0]), snapshot(states[1])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("token_shift", [False, True])
def test_block_step_in_place_refuses_before_it_writes(token_shift):
    block = tiny_lm(token_shift=token_shift).blocks[0]
    state, work = block.mix.initial_state(2), block.step_workspace(2, torch.float32)
    x = torch.randn(2, 8)
    cases = [
        (lambda: block.step_(torch.randn(3, 8), state, work), ValueError,
         r"work\['\w+'\] must have shape \(3, "),
        (lambda: block.step_(x, state, block.step_workspace(3, torch.float32)), ValueError,
         r"work\['\w+'\] must have shape \(2, "),
        (lambda: block.step_(torch.zeros(1, 8).expand(2, 8), state, work), ValueError,
         r"x .*overlap"),
        (lambda: block.step_(x.double(), state, work), TypeError,
         r"x must have the block's dtype torch.float32.*float64"),
        (lambda: block.step_(x, block.mix.initial_state(3), work), ValueError,
         r"state.scan.m must have shape"),
        (lambda: block.step_(x, state, dict(work, mix={})), TypeError,
         r"work\['mix'\] must be the dict of step_workspace"),
    ]
    for call, error, words in cases:
        before, x_before = snapshot(state), x.clone()
        with pytest.raises(error, match=words):
            call()
        assert_unchanged(state, before)
        assert torch.equal(x, x_before)


def cache_contents(cache) -> list:
    return [t.clone() for bufs in cache.scan for t in bufs] + \
        [t.clone() for t in cache.last if t is not None]


def assert_cache_unchanged(cache, before) -> None:
    for got, want in zip(cache_contents(cache), before, strict=True):
        assert torch.equal(got, want), "a refused call changed the cache"


@pytest.mark.parametrize("other", [dict(d_model=16), dict(n_layers=3), dict(layer="rwa"),
                                   dict(token_shift=False), dict(mlp_ratio=4),
                                   dict(discount_groups=2)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_lm_step_in_place_refuses_a_cache_of_another_model(other):
    """A cache allocated by a model of another shape (a 3-layer model on a 2-layer cache
    used to run silently on two of its blocks) is refused before anything is written."""
    model = tiny_lm()
    config = dict(dict(d_model=8, n_layers=2, mlp_ratio=2), **other)
    torch.manual_seed(0)
    stranger = ByteLM(LMConfig(**config)).eval()
    cache = stranger.allocate_cache(2)
    before = cache_contents(cache)
    with pytest.raises(ValueError, match=r"cache was allocated by a model of another"):
        model.step_(torch.tensor([1, 2]), cache)
    with pytest.raises(ValueError, match=r"cache was allocated by a model of another"):
        model.prefill(torch.tensor([[1, 2], [3, 4]]), cache)
    assert_cache_unchanged(cache, before)


def test_lm_step_in_place_refuses_a_cache_after_the_model_changed_dtype():
    model = tiny_lm()
    cache = model.allocate_cache(2)
    model.double()
    with pytest.raises(ValueError, match=r"cache .*torch.float32.*torch.float64"):
        model.step_(torch.tensor([1, 2]), cache)


# -- 15. the scan layers check x's dtype ---------------------------------------------------
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


# -- 16. discount timescales -------------------------------------------------------------
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


# -- 17. sampling ------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-324])
def test_a_temperature_too_small_for_float32_samples_greedily(temperature):
    """logits / temperature overflows float32 (or the temperature itself rounds to 0 in
    float32): the limit of a vanishing temperature, the greedy choice, not an error."""
    logits = torch.randn(4, 257, generator=torch.Generator().manual_seed(0)) * 5
    got = sample(logits, temperature, None, None, None, forbidden=256)
    assert torch.equal(got, logits[:, :256].argmax(-1))
    model = tiny_lm()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 5, top_k=1)
    assert torch.equal(model.generate(prompt, 5, temperature=temperature), greedy)


FLOAT32_LARGEST = 3.4028234663852886e38      # (numpy.finfo(numpy.float32).max)


@pytest.mark.parametrize("temperature", [3.5e38, 1e300, 10 ** 400, math.inf])
def test_a_temperature_beyond_float32_is_refused_naming_it(temperature, tmp_path,
                                                           capsys):
    """As the trainer refuses an --lr beyond float32: the sampler divides float32 logits by
    it, where it is inf (-inf / inf: NaN). Before, the eager step failed with torch's raw
    "probability tensor contains inf, nan" and the fused step sampled uniformly; an int
    beyond float64 was an OverflowError. Every way to sample refuses it, the CLI too; the
    largest float32 samples."""
    from fastrwa.generate import main as generate_main
    from fastrwa.models import PackedLM, save_pretrained

    model = tiny_lm()
    prompt = torch.tensor([[1, 2, 3]])
    words = r"temperature must be a finite number > 0 and at most 3.4028234663852886e\+38"
    for weights in ("eager", "float32", "int8"):
        with pytest.raises(ValueError, match=words):
            model.generate(prompt, 3, temperature=temperature, weights=weights)
        with pytest.raises(ValueError, match=words):
            next(model.stream(prompt, 3, temperature=temperature, weights=weights))
        out = model.generate(prompt, 3, temperature=FLOAT32_LARGEST, weights=weights)
        assert out.shape == (1, 6) and int(out.max()) < 256
    packed = PackedLM(model)
    cache = packed.allocate_cache(1)
    logits = packed.prefill(prompt, cache)
    with pytest.raises(ValueError, match=words):
        packed.sample_steps(logits, cache, 2, temperature=temperature)
    with pytest.raises(ValueError, match=words):
        RecurrentLM(LMConfig(layer="gru", d_model=8, n_layers=1)).generate(
            prompt, 2, temperature=temperature)
    if isinstance(temperature, float):           # (the CLI reads a float)
        save_pretrained(model, tmp_path / "m")
        capsys.readouterr()
        assert generate_main([str(tmp_path / "m"), "--max-new", "2", "--temperature",
                              repr(temperature)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --temperature must be a finite number > 0 and at most "
                              "3.4028234663852886e+38") and len(err.strip().splitlines()) == 1, err


def test_a_top_p_below_the_smallest_float32_is_refused_naming_the_cli_flag(tmp_path,
                                                                           capsys):
    """--top-p 1e-46 is 0 in float32 (no id kept): refused as --top-p, not as the Python
    argument top_p it reached before."""
    from fastrwa.generate import main as generate_main
    from fastrwa.models import save_pretrained

    save_pretrained(tiny_lm(), tmp_path / "m")
    capsys.readouterr()
    assert generate_main([str(tmp_path / "m"), "--max-new", "2", "--top-p", "1e-46"]) == 2
    assert capsys.readouterr().err.startswith("error: --top-p must be in (0, 1] and at least "
                                              "1.4e-45")


def test_a_tiny_temperature_shares_the_choice_between_tied_maxima():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0, 0.0]])
    draws = {int(sample(logits, 1e-42, None, None, torch.Generator().manual_seed(s), 4))
             for s in range(40)}
    assert draws == {1, 2}


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_logits_are_named(bad):
    logits = torch.randn(2, 257)
    logits[1, 7] = bad
    with pytest.raises(ValueError, match=r"logits .*row 1.*(NaN|inf)"):
        sample(logits, 1.0, None, None, None, forbidden=256)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_model_that_produces_nan_gives_a_clear_error(beam_size):
    model = tiny_lm()
    with torch.no_grad():
        model.norm.weight.fill_(math.nan)
    with pytest.raises(ValueError, match=r"model produced NaN"):
        model.generate(torch.tensor([[1, 2]]), 3, beam_size=beam_size)
    baseline = RecurrentLM(LMConfig(layer="gru", d_model=8, n_layers=1))
    with torch.no_grad():
        baseline.norm.weight.fill_(math.nan)
    with pytest.raises(ValueError, match=r"model produced NaN"):
        baseline.generate(torch.tensor([[1, 2]]), 3)


# -- 18. the inference cache ---------------------------------------------------------------
def test_cache_load_refuses_a_partial_or_broadcast_state():
    model = tiny_lm()
    cache = model.allocate_cache(3)
    with torch.no_grad():
        model.prefill(torch.randint(0, 256, (3, 4)), cache)
        _, three = model(torch.randint(0, 256, (3, 4)))
        _, one = model(torch.randint(0, 256, (1, 4)))
    before = cache_contents(cache)
    cases = [
        (LMState(three.layers[:1]), ValueError, r"state must hold 2 layer states.*got 1"),
        (one, ValueError, r"state.layers\[0\].scan.m must have shape \(3, 8\).*\(1, 8\)"),
        (three.layers, TypeError, r"state must be a fastrwa.models.LMState.*tuple"),
        (LMState((three.layers[0], LayerState(three.layers[1].scan, None))), ValueError,
         r"state.layers\[1\].last_input must have shape \(3, 8\).*None"),
        (LMState((three.layers[0], LayerState(three.layers[1].scan,
                                              three.layers[1].last_input[:1]))), ValueError,
         r"state.layers\[1\].last_input must have shape \(3, 8\).*\(1, 8\)"),
    ]
    for state, error, words in cases:
        with pytest.raises(error, match=words):
            cache.load_(state)
        assert_cache_unchanged(cache, before)
    cache.load_(three)                                          # the right state loads


def test_a_prefill_under_autograd_leaves_values_not_a_graph_in_the_cache():
    """load_ copies values: the cache's buffers used to take the prefill's autograd graph
    (requires_grad, a grad_fn keeping the whole forward alive) when grad mode was on."""
    model = tiny_lm()
    cache = model.allocate_cache(2)
    model.prefill(torch.tensor([[1, 2], [3, 4]]), cache)           # grad mode on
    for t in cache_contents(cache) + [t for bufs in cache.scan for t in bufs]:
        assert not t.requires_grad and t.grad_fn is None


def test_cache_reorder_checks_its_index():
    model = tiny_lm()
    cache = model.allocate_cache(3)
    with torch.no_grad():
        model.prefill(torch.randint(0, 256, (3, 4)), cache)
    before = cache_contents(cache)
    cases = [
        (torch.tensor([0]), ValueError, r"index must have shape \(B,\) = \(3,\).*\(1,\)"),
        (torch.tensor([0, 1, 5]), ValueError, r"index must be in \[0, 3\).*\[0, 5\]"),
        (torch.tensor([0, 1, -1]), ValueError, r"index must be in \[0, 3\).*\[-1, 1\]"),
        (torch.tensor([0.0, 1.0, 2.0]), TypeError, r"index must hold integer.*float32"),
        ([0, 1, 2], TypeError, r"index must be a torch.Tensor.*list"),
    ]
    for index, error, words in cases:
        with pytest.raises(error, match=words):
            cache.reorder_(index)
        assert_cache_unchanged(cache, before)
    cache.reorder_(torch.tensor([2, 0, 0]))
    scan_before = before[0]
    assert torch.equal(cache.scan[0][0], scan_before[[2, 0, 0]])


@pytest.mark.parametrize("batch,error", [(-1, ValueError), (2.5, TypeError),
                                         (True, TypeError), ("2", TypeError)])
def test_allocate_cache_checks_the_batch(batch, error):
    with pytest.raises(error, match=r"batch must be an int >= 0"):
        tiny_lm().allocate_cache(batch)


def test_prefill_checks_its_tokens_against_the_cache():
    model = tiny_lm()
    cache = model.allocate_cache(3)
    before = cache_contents(cache)
    with pytest.raises(ValueError, match=r"tokens must have shape \(B, T\) = \(3, T\).*\(2, 4\)"):
        model.prefill(torch.zeros(2, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"tokens must hold at least one position"):
        model.prefill(torch.zeros(3, 0, dtype=torch.long), cache)
    assert_cache_unchanged(cache, before)


@pytest.mark.parametrize("prompt_length", [0, 3])
def test_an_empty_batch_generates_an_empty_batch(prompt_length):
    """A batch of 0 prompts gives 0 continuations (as the forward and the baselines do)."""
    model = tiny_lm()
    prompt = torch.zeros(0, prompt_length, dtype=torch.long)
    assert model.generate(prompt, 4).shape == (0, prompt_length + 4)
    assert model.generate(prompt, 4, beam_size=2).shape == (0, prompt_length + 4)
    assert [t.shape for t in model.stream(prompt, 2)] == [(0,), (0,)]
    baseline = RecurrentLM(LMConfig(layer="lstm", d_model=8, n_layers=1))
    assert baseline.generate(prompt, 4).shape == (0, prompt_length + 4)
    grouped = ByteLM(LMConfig(d_model=8, n_layers=1, mlp_ratio=2, discount_groups=2)).eval()
    for weights in ("eager", "float32"):
        assert grouped.generate(prompt, 4, weights=weights).shape == (0, prompt_length + 4)


# -- 20. pickling whole modules ------------------------------------------------------------
def _modules():
    torch.manual_seed(0)
    seq = torch.randn(2, 4, I)
    step = torch.randn(2, I)
    tokens = torch.randint(0, 256, (2, 5))
    run_layer = lambda m: m(seq)[0]                               # noqa: E731
    run_cell = lambda m: m(step)[0]                               # noqa: E731
    run_lm = lambda m: m(tokens)[0]                               # noqa: E731
    cases = [("RWA", RWA(I, H, token_shift=True), run_layer),
             ("RWA-bidirectional", RWA(I, H, bidirectional=True), run_layer),
             ("RWACell", RWACell(I, H), run_cell),
             ("RRACell", RRACell(I, H, window=3), run_cell),
             ("Recurrent", Recurrent(RDACell(I, H, f_h="identity")), run_layer)]
    for f_h in ("tanh", "identity", "sigmoid", "relu"):
        cases.append((f"RDA-f_h={f_h}", RDA(I, H, f_h=f_h, f_o="identity"), run_layer))
        cases.append((f"RDACell-f_h={f_h}", RDACell(I, H, f_h=f_h, f_o="identity"), run_cell))
    cases.append(("RDA-sigmoid-id", RDA(I, H, preset="sigmoid-id"), run_layer))
    for layer in ("rda", "rwa"):
        cases.append((f"ByteLM-{layer}", ByteLM(LMConfig(layer=layer, d_model=8, n_layers=2,
                                                          discount_init="spread")), run_lm))
    for layer in ("lstm", "gru"):
        cases.append((f"RecurrentLM-{layer}",
                      RecurrentLM(LMConfig(layer=layer, d_model=8, n_layers=1)), run_lm))
    return cases


MODULES = _modules()


@pytest.mark.parametrize("name,module,run", MODULES, ids=[c[0] for c in MODULES])
def test_every_public_module_pickles_and_saves_whole(name, module, run):
    module.eval()
    with torch.no_grad():
        want = run(module)
        from_pickle = pickle.loads(pickle.dumps(module))
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        from_save = torch.load(buffer, weights_only=False)
        for loaded in (from_pickle, from_save, copy.deepcopy(module)):
            assert type(loaded) is type(module)
            assert torch.equal(run(loaded), want), name


def test_a_larger_vocabulary_never_generates_a_non_byte_id():
    """Ids past the 256 bytes (BOS, and any a larger vocab_size adds) are never sampled, by
    any decoding, so generated text can always be decoded (a vocab_size=300 model sampled
    them and the run died decoding its first sample)."""
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=8, n_layers=1, vocab_size=300)).eval()
    with torch.no_grad():
        model.head.weight[256:] += 50.0        # the non-byte ids are by far the likeliest
        prompt = torch.tensor([104, 105])
        for kwargs in (dict(), dict(temperature=1e-3), dict(top_k=5), dict(top_p=0.9),
                       dict(beam_size=3)):
            out = model.generate(prompt, 6, **kwargs)
            assert int(out[:, 2:].max()) < 256, kwargs


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
