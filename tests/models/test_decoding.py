"""Decoding with the language models: a block's and ByteLM's in-place steps check every
argument (the cache a model allocated included) before they write anything; sampling
survives a tiny temperature, refuses one beyond float32 (every way to sample, the CLI too)
and names NaN logits; the inference cache checks what it loads and how it is reordered;
empty batches generate empty batches and ids past the bytes are never generated."""

import math

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig, LMState, RecurrentLM
from fastrwa.models.sampling import sample
from helpers import assert_unchanged, snapshot
from fastrwa.nn import LayerState


# -- the in-place steps check everything before they write ---------------------------------
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


# -- sampling ------------------------------------------------------------------------------
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


# -- the inference cache -------------------------------------------------------------------
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
