"""The byte-level language model: streaming equals parallel, flat generation memory, beam
search, sampling, persistence, training, errors."""

import copy

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig, LMState, build
from fastrwa.models.config import LAYER_FIELDS, OPTIONAL_FIELDS
from helpers import ATTENTIONS
from fastrwa.testing import LiveTensorMeter, NewStorageCounter, storages
from fastrwa.nn.functional import rms_norm_into

VARIANTS = ([dict(layer="rwa")] + [dict(layer="rda", attention=a) for a in ATTENTIONS]
            + [dict(layer="rda", output_gate=False), dict(layer="rda", learn_initial_state=False),
               dict(layer="rwa", learn_initial_state=False),
               dict(layer="rda", discount_groups=4, discount_init="spread")])
TOL_FP32 = 2e-5  # logits, streaming vs parallel


def tiny(**kw):
    torch.manual_seed(0)
    return ByteLM(LMConfig(d_model=16, n_layers=2, mlp_ratio=2, **kw)).eval()


@pytest.mark.parametrize("variant", VARIANTS,
                         ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()))
def test_prefill_then_steps_equals_full_logits_at_every_split(variant):
    model = tiny(**variant)
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(tokens)
        for k in range(1, 11):
            cache = model.allocate_cache(2)
            logits = [model(tokens[:, :k])[0]]
            model.prefill(tokens[:, :k], cache)
            for t in range(k, 10):
                # step_ returns the cache's logits buffer, overwritten by the next step
                logits.append(model.step_(tokens[:, t], cache).clone()[:, None])
            err = (torch.cat(logits, dim=1) - full).abs().max().item()
            assert err <= TOL_FP32, (k, err)


@pytest.mark.parametrize("variant", [dict(layer="rwa"), dict(layer="rda", token_shift=True),
                                     dict(layer="rda", preset="sigmoid-id", dtype="bfloat16"),
                                     dict(layer="rda", output_gate=False)],
                         ids=["rwa", "rda-token-shift", "rda-sigmoid-id-bf16",
                              "rda-no-output-gate"])
def test_streaming_step_allocates_nothing_after_warm_up(variant):
    """Every op of ByteLM.step_ writes into a tensor that existed before the step."""
    dtype = getattr(torch, variant.pop("dtype", "float32"))
    model = tiny(**variant).to(dtype)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    cache = model.allocate_cache(2)
    with torch.no_grad():
        model.prefill(tokens[:, :4], cache)
        model.step_(tokens[:, 4], cache)                      # warm-up
        state = copy.deepcopy(cache.state)     # (cache.state is views of the buffers)
        known = storages(list(model.parameters()), cache.scan, cache.last, cache.work, tokens)
        for t in range(5, 12):
            with NewStorageCounter(known) as counter:
                logits = model.step_(tokens[:, t], cache)
            assert counter.new == [], counter.new
            # the same numbers as the functional step, bfloat16 included (same roundings)
            reference, state = model.step(tokens[:, t], state)
            assert torch.allclose(logits, reference, atol=1e-5, rtol=0), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rms_norm_into_matches_torch_rms_norm(dtype):
    """Same eps default (float32's for low precision) and a single rounding, as nn.RMSNorm."""
    norm = torch.nn.RMSNorm(16).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=torch.Generator().manual_seed(0)))
    x = (torch.randn(5, 16, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    wide_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.empty_like(x)
    rms_norm_into(x, norm, out, torch.empty(5, 1, dtype=wide_dtype),
                  torch.empty(5, 16, dtype=wide_dtype))
    expected = norm(x)
    if dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(out, expected)
    else:
        assert torch.allclose(out, expected, atol=0, rtol=4 * torch.finfo(dtype).eps)


def _peak_live_bytes(model, n_tokens):
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    with LiveTensorMeter() as meter:
        model.generate(prompt, n_tokens, top_k=5, generator=torch.Generator().manual_seed(3))
    return meter.peak


def test_generate_memory_does_not_grow_with_tokens():
    model = tiny()
    short, long = _peak_live_bytes(model, 10), _peak_live_bytes(model, 2000)
    output_growth = (2000 - 10) * 8          # the returned int64 ids, 1 sequence
    assert long - short <= output_growth + 1024, (short, long)
    assert short > 0


def test_beam_search_finds_the_best_two_token_continuation():
    model = tiny(layer="rda", attention="softplus")
    prompt = torch.tensor([[5, 6, 7]])
    V = model.config.vocab_size
    with torch.no_grad():
        logits, state = model(prompt)
        first = torch.log_softmax(logits[0, -1], -1)                         # [V]
        expanded = type(state)(tuple(type(s)(type(s.scan)(*(x.expand(V, -1) for x in s.scan)),
                                             s.last_input.expand(V, -1)) for s in state.layers))
        second = torch.log_softmax(model.step(torch.arange(V), expanded)[0], -1)   # [V, V]
        total = first[:, None] + second
        best = divmod(int(total.argmax()), V)
        beam = model.generate(prompt, 2, beam_size=V)
    assert beam[0, 3:].tolist() == list(best)
    assert model.generate(prompt, 1, beam_size=4)[0, 3].item() == int(first.argmax())


def test_sampling_options():
    model = tiny()
    prompt = torch.tensor([1, 2, 3])
    with torch.no_grad():
        greedy = int(model(prompt[None])[0][0, -1].argmax())
    assert model.generate(prompt, 1, top_k=1)[0, -1].item() == greedy
    assert model.generate(prompt, 1, top_p=1e-6)[0, -1].item() == greedy
    a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 20, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (1, 23) and torch.equal(a[0, :3], prompt)
    assert model.generate(torch.zeros(2, 0, dtype=torch.long), 4).shape == (2, 4)


def test_save_and_load_round_trip(tmp_path):
    model = tiny(layer="rwa", tie_embeddings=False)
    model.save_pretrained(tmp_path / "m")
    loaded = ByteLM.load(tmp_path / "m")
    tokens = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0], rtol=0, atol=0)
    assert loaded.config == model.config
    with pytest.raises(FileNotFoundError, match="config.json"):
        ByteLM.load(tmp_path / "missing")


def test_a_saved_config_without_output_gate_loads_the_model_it_was_saved_from(tmp_path):
    """A config.json written before LMConfig had ``output_gate`` came from a model without
    the gate: it loads as that model, though the field's default is now on."""
    import json

    assert LMConfig().output_gate
    model = tiny(output_gate=False)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["output_gate"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = ByteLM.load(tmp_path)
    assert loaded.config == model.config
    tokens = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0], rtol=0, atol=0)


def test_learn_initial_state_reaches_every_scan_layer():
    """Off: no layer's prior pseudo-step is a trained parameter, and each starts empty (its
    initial logit is -inf); on (the default): every one is trained and finite."""
    for learn in (True, False):
        model = tiny(learn_initial_state=learn)
        for block in model.blocks:
            for p in (block.mix.initial_value, block.mix.initial_logit):
                assert p.requires_grad == learn
            assert torch.isneginf(block.mix.initial_logit).all() != learn


def test_a_saved_config_without_learn_initial_state_loads_with_a_learned_state(tmp_path):
    """Every model saved before the field existed learned its initial state (so it loads
    as True, whatever the default may become)."""
    import json

    from fastrwa.models.config import FIELDS_BEFORE_THEY_EXISTED
    assert FIELDS_BEFORE_THEY_EXISTED["learn_initial_state"] is True

    model = tiny()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["learn_initial_state"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert ByteLM.load(tmp_path).config.learn_initial_state


def test_tied_embeddings_survive_loading(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    loaded = ByteLM.load(tmp_path)
    assert loaded.head.weight is loaded.embed.weight


def test_training_reaches_every_parameter_and_reduces_loss():
    torch.manual_seed(4)
    model = tiny(layer="rda", attention="exp", output_gate=True).train()
    data = torch.randint(0, 256, (4, 33))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        logits, _ = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 data[:, 1:].reshape(-1))
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_bad_input():
    model = tiny()
    with pytest.raises(TypeError, match="integer token ids.*float32"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"ids in \[0, 257\).*\[0, 300\]"):
        model(torch.tensor([[0, 300]]))
    with pytest.raises(ValueError, match=r"ids in \[0, 257\)"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match=r"tokens must have shape \(B, T\)"):
        model(torch.zeros(2, 3, 4, dtype=torch.long))
    _, state = model(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="LMState with 2 layer states"):
        model(torch.zeros(2, 3, dtype=torch.long), LMState(state.layers[:1]))
    with pytest.raises(TypeError, match="LMState"):
        model.step(torch.zeros(2, dtype=torch.long), state.layers)
    with pytest.raises(ValueError, match="beam_size"):
        model.generate(torch.tensor([1]), 3, beam_size=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.tensor([1]), 3, temperature=0.0)
    with pytest.raises(ValueError, match="LMConfig.layer"):
        LMConfig(layer="mamba")
    with pytest.raises(ValueError, match="unknown LMConfig fields"):
        LMConfig.from_dict({"d_model": 8, "heads": 2})


def test_generated_text_never_holds_the_bos_id():
    """BOS (256) starts a text; it is not a byte. With every logit equal, 4 x 500 samples
    would draw it ~8 times if it were allowed."""
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=16, n_layers=1, tie_embeddings=False))
    with torch.no_grad():
        model.head.weight.zero_()
    out = model.generate(torch.zeros(4, 1, dtype=torch.long), 500,
                         generator=torch.Generator().manual_seed(1))
    assert (out != model.config.bos_token).all()
    assert bytes(out[0].tolist())    # decodes as bytes


def test_a_fresh_cache_starts_from_the_learned_initial_state():
    """step_ on a cache never prefilled equals the parallel forward from the initial state."""
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=16, n_layers=2))
    with torch.no_grad():
        for block in model.blocks:
            block.mix.initial_logit.fill_(1.0)
            block.mix.initial_value.normal_()
        tokens = torch.tensor([3, 200])
        want, _ = model(tokens[:, None])
        got = model.step_(tokens, model.allocate_cache(2))
    torch.testing.assert_close(got, want[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call,error,words", [
    (lambda: LMConfig(token_shift="no"), TypeError, "token_shift must be True or False"),
    (lambda: LMConfig(tie_embeddings=1), TypeError, "tie_embeddings must be True or False"),
    (lambda: LMConfig(output_gate="yes"), TypeError, "output_gate must be True or False"),
    (lambda: LMConfig(learn_initial_state=1), TypeError,
     "learn_initial_state must be True or False"),
    (lambda: LMConfig(d_model=True), ValueError, "d_model must be a positive int"),
    (lambda: LMConfig(discount_groups=0), ValueError, "discount_groups must be None or a "),
    (lambda: LMConfig(discount_groups=True), ValueError, "discount_groups must be None or a "),
    (lambda: LMConfig(discount_groups="4"), ValueError, "discount_groups must be None or a "),
    (lambda: LMConfig(d_model=16, discount_groups=3), ValueError,
     r"discount_groups \(3\) must divide d_model \(16\)"),
])
def test_config_types_are_checked(call, error, words):
    with pytest.raises(error, match=words):
        call()


@pytest.mark.parametrize("kwargs,words", [
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(top_p="all"), "top_p"),
    (dict(top_k=True), "top_k"),
    (dict(beam_size=True), "beam_size"),
])
def test_generate_arguments_are_checked(kwargs, words):
    model = ByteLM(LMConfig(d_model=8, n_layers=1))
    with pytest.raises(ValueError, match=words):
        model.generate(torch.tensor([1, 2]), 3, **kwargs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.tensor([1, 2]), True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.bool, torch.float32])
def test_step_in_place_token_dtypes_are_checked(dtype):
    model = ByteLM(LMConfig(d_model=8, n_layers=1))
    cache = model.allocate_cache(2)
    with pytest.raises(TypeError, match="token must have dtype torch.int64"):
        model.step_(torch.tensor([1, 2]).to(dtype), cache)
    model.step_(torch.tensor([1, 2]), cache)     # int64: accepted


def test_step_in_place_without_the_id_check_matches_and_skips_only_the_check():
    """check=False (for CUDA-graph capture) computes the same logits; the range check is
    the one thing it leaves out."""
    model = tiny().eval()
    tokens = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(5))
    checked, unchecked = model.allocate_cache(2), model.allocate_cache(2)
    for t in range(6):
        want = model.step_(tokens[:, t], checked).clone()
        assert torch.equal(model.step_(tokens[:, t], unchecked, check=False), want), t
    bad = torch.tensor([1, 999])
    with pytest.raises(ValueError, match="token must be ids"):
        model.step_(bad, checked)
    with pytest.raises((IndexError, RuntimeError)) as caught:
        model.step_(bad, unchecked, check=False)
    assert "token must be ids" not in str(caught.value)


@pytest.mark.parametrize("layer", ["rda", "lstm"])
def test_stream_yields_what_generate_returns(layer):
    from fastrwa.models import build

    torch.manual_seed(0)
    model = build(LMConfig(layer=layer, d_model=16, n_layers=2)).eval()
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    want = model.generate(prompt, 12, top_k=20, generator=torch.Generator().manual_seed(3))
    got = torch.stack(list(model.stream(prompt, 12, top_k=20,
                                        generator=torch.Generator().manual_seed(3))), dim=1)
    assert torch.equal(got, want[:, 3:]) and (got < 256).all()


def test_pretrained_round_trip_for_every_layer(tmp_path):
    from fastrwa.models import build, load_pretrained, save_pretrained

    tokens = torch.randint(0, 256, (2, 9))
    for layer in ("rda", "rwa", "lstm", "gru"):
        model = build(LMConfig(layer=layer, d_model=16, n_layers=2)).eval()
        save_pretrained(model, tmp_path / layer)
        loaded = load_pretrained(tmp_path / layer)
        assert type(loaded) is type(model)
        torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0], rtol=0, atol=0)
    (tmp_path / "rda" / "config.json").write_text('{"d_model": "wide"}')
    with pytest.raises((ValueError, TypeError)):
        load_pretrained(tmp_path / "rda")


def test_spread_discount_init_gives_each_block_its_memory_lengths():
    from fastrwa.models.lm import longest_timescale

    model = ByteLM(LMConfig(d_model=16, n_layers=3, discount_init="spread"))
    for depth, block in enumerate(model.blocks):
        H = block.mix.hidden_size
        bias = block.mix.proj.bias.detach().view(4, H)[3].double()
        tau = 1 / (1 - torch.sigmoid(bias))                      # memory length in tokens
        assert tau[0] == pytest.approx(2.0) and tau[-1] == pytest.approx(
            longest_timescale(depth, 3), rel=1e-5)
        assert (tau[1:] > tau[:-1]).all()
    assert [longest_timescale(d, 3) for d in range(3)] == [16.0, 128.0, 1024.0]
    paper = ByteLM(LMConfig(d_model=16, n_layers=1))
    assert torch.equal(paper.blocks[0].mix.proj.bias.view(4, 16)[3], torch.ones(16))
    with pytest.raises(ValueError, match="discount_init"):
        LMConfig(discount_init="wide")
    with pytest.raises(ValueError, match="shortest must be a finite number > 1"):
        paper.blocks[0].mix.set_discount_timescales(1.0, 10.0)
    with pytest.raises(ValueError, match="longest"):
        paper.blocks[0].mix.set_discount_timescales(10.0, 5.0)


def test_spread_discount_init_spreads_the_groups_of_a_grouped_discount():
    """With ``discount_groups``, each block's groups (not its channels) carry the spread
    memory lengths, from 2 tokens to the block's longest; every channel of a group gets its
    group's discount."""
    from fastrwa.models.lm import longest_timescale

    model = ByteLM(LMConfig(d_model=16, n_layers=2, discount_init="spread", discount_groups=4))
    for depth, block in enumerate(model.blocks):
        bias = block.mix.proj.bias.detach().double()
        assert bias.shape == (3 * 16 + 4,)
        tau = 1 / (1 - torch.sigmoid(bias[48:]))
        assert tau[0] == pytest.approx(2.0)
        assert tau[-1] == pytest.approx(longest_timescale(depth, 2), rel=1e-5)
        assert (tau[1:] > tau[:-1]).all()
        per_channel = block.mix.proj.bias[block.mix.per_channel_rows()].detach().double()
        assert torch.equal(per_channel[48:], bias[48:].repeat_interleave(4))


FLIPPED = {"attention": "exp", "f_h": "tanh", "f_o": "tanh", "preset": "exp-tanh",
           "token_shift": False, "discount_init": "spread", "discount_groups": 4,
           "output_gate": False,
           "learn_initial_state": False, "mlp_ratio": 2, "n_heads": 2}


@pytest.mark.parametrize("layer", sorted(LAYER_FIELDS))
def test_layer_fields_lists_what_each_layer_reads(layer):
    """``LAYER_FIELDS`` (what the training CLI refuses by) against the models: a field a
    layer is said to read changes its weights or its output, any other changes nothing."""
    assert set(FLIPPED) == OPTIONAL_FIELDS

    def built(**fields):
        torch.manual_seed(0)
        model = build(LMConfig(layer=layer, d_model=16, n_layers=2, **fields)).eval()
        with torch.no_grad():
            out = model(torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1)))
        return model.state_dict(), out[0] if isinstance(out, tuple) else out

    def same(a, b):
        (wa, ya), (wb, yb) = a, b
        return (wa.keys() == wb.keys() and all(wa[k].shape == wb[k].shape
                                               and torch.equal(wa[k], wb[k]) for k in wa)
                and torch.equal(ya, yb))

    base = built()
    for name, value in FLIPPED.items():
        assert same(base, built(**{name: value})) == (name not in LAYER_FIELDS[layer]), name


def test_bytelm_load_refuses_another_models_directory_naming_load_pretrained(tmp_path):
    from fastrwa.models import RecurrentLM, load_pretrained, save_pretrained

    save_pretrained(build(LMConfig(d_model=8, n_layers=1, layer="gru")), tmp_path)
    with pytest.raises(ValueError, match=r"holds a 'gru' model, not a ByteLM: load it with "
                                         r"fastrwa.models.load_pretrained"):
        ByteLM.load(tmp_path)
    assert isinstance(load_pretrained(tmp_path), RecurrentLM)
