"""The decoder contract (fastrwa/models/decoding.py): every decoder ``ByteLM.decoder`` returns
(the eager step, ``PackedLM`` in each weight format, the CUDA graph on a GPU) has its
members; ``generate``/``stream`` and beam search give the bytes of the loops they ran before
the contract (``sample_loop`` over ``step_``, drawing with ``sample`` on the eager step and
``sample_fused`` on the fused one); a step of the first rows leaves the others alone; a
row drawn alone is the row drawn in its batch; the server's rows work through any object
with the contract's members only; the fused path's per-row draw is written once."""

from __future__ import annotations

import copy
import inspect
import pathlib
import random

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig, PackedLM
from fastrwa.models.decoding import Decoder, Sampling
from fastrwa.models.graphed import CUDAGraphDecoder
from fastrwa.models.sampling import sample, sample_fused, sample_loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORMATS = ["eager", "float32", "bfloat16", "int8"]
MEMBERS = [name for name in dir(Decoder) if not name.startswith("_")]
SETTINGS = [dict(temperature=1e-30), dict(temperature=1.0),
            dict(temperature=0.7, top_k=20, top_p=0.9), dict(temperature=1.3, top_p=0.5)]


def tiny_lm(**kw) -> ByteLM:
    torch.manual_seed(0)
    return ByteLM(LMConfig(d_model=32, n_layers=2, **kw)).eval()


def decoders(model: ByteLM) -> list:
    found = [model.decoder(w) for w in FORMATS]
    if torch.cuda.is_available():
        found.append(copy.deepcopy(model).cuda().decoder("graph"))
    return found


class OnlyTheContract:
    """A decoder with the contract's members and nothing else (``__slots__``: no other
    attribute can be read)."""

    __slots__ = ("_inner", "kind")

    def __init__(self, inner):
        self._inner, self.kind = inner, "contract only"

    def allocate_cache(self, batch):
        return self._inner.allocate_cache(batch)

    def prefill(self, tokens, cache):
        return self._inner.prefill(tokens, cache)

    def step_(self, token, cache, *, rows=None):
        return self._inner.step_(token, cache, rows=rows)

    def draw(self, logits, sampling, forbidden):
        return self._inner.draw(logits, sampling, forbidden)

    def sample_steps(self, *args, **kwargs):
        return self._inner.sample_steps(*args, **kwargs)


def contract_parameters(name: str) -> list:
    return list(inspect.signature(getattr(Decoder, name)).parameters.values())[1:]


# -- every decoder has the contract's members ------------------------------------------------
def test_the_contract_is_prefill_step_draw_and_the_sampling_loop():
    assert sorted(MEMBERS) == ["allocate_cache", "draw", "prefill", "sample_steps", "step_"]
    assert Decoder.__annotations__ == {"kind": "str"}


@pytest.mark.parametrize("weights", FORMATS)
def test_every_decoder_has_the_contracts_members(weights):
    """Each method takes the contract's parameters (names, kinds, defaults) and may add
    optional ones only; ``kind`` is a name."""
    decoder = tiny_lm().decoder(weights)
    assert isinstance(decoder, ByteLM if weights == "eager" else PackedLM)
    assert isinstance(decoder.kind, str) and decoder.kind
    for name in MEMBERS:
        got = inspect.signature(getattr(decoder, name)).parameters
        for p in contract_parameters(name):
            assert p.name in got, f"{type(decoder).__name__}.{name} lacks {p.name}"
            q = got[p.name]
            assert (q.kind, q.default) == (p.kind, p.default), \
                f"{type(decoder).__name__}.{name}({p.name})"
        extra = [q for q in got.values() if q.name not in {p.name for p in
                                                           contract_parameters(name)}]
        assert all(q.default is not inspect.Parameter.empty for q in extra), (name, extra)


def test_the_cuda_graph_decoder_has_the_contracts_members():
    """(Without a GPU: its methods, checked on the class.)"""
    assert isinstance(CUDAGraphDecoder.kind, str)
    for name in MEMBERS:
        got = inspect.signature(getattr(CUDAGraphDecoder, name)).parameters
        assert [(q.name, q.kind, q.default) for q in list(got.values())[1:]] == \
            [(p.name, p.kind, p.default) for p in contract_parameters(name)], name


# -- the same bytes as the loops the decoders ran before -------------------------------------
def reference_tokens(model: ByteLM, decoder, context: torch.Tensor, n: int,
                     settings: dict, seed: int) -> list:
    """What ``generate`` ran before the contract: ``sample_loop`` over the decoder's
    ``step_``, drawing with ``sample`` on the eager step and ``sample_fused`` on any other."""
    cache = model.allocate_cache(context.shape[0])
    logits = decoder.prefill(context, cache)
    s = Sampling(**settings, generator=torch.Generator(context.device).manual_seed(seed))
    draw = sample if decoder is model else sample_fused
    return [t.tolist() for t in sample_loop(
        logits, lambda token: decoder.step_(token, cache), n, s.temperature, s.top_k,
        s.top_p, s.generator, model.config.bos_token, draw)]


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("settings", SETTINGS)
def test_generate_and_stream_give_the_bytes_of_the_loop_they_replace(weights, settings):
    model = tiny_lm()
    prompt = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    want = reference_tokens(model, model.decoder(weights), prompt, 12, settings, 7)
    got = model.generate(prompt, 12, **settings, weights=weights,
                         generator=torch.Generator().manual_seed(7))
    assert got[:, 5:].t().tolist() == want
    streamed = model.stream(prompt, 12, **settings, weights=weights,
                            generator=torch.Generator().manual_seed(7))
    assert [t.tolist() for t in streamed] == want


@pytest.mark.cuda
@pytest.mark.parametrize("settings", SETTINGS[:2])
def test_the_cuda_graph_gives_the_bytes_of_the_loop_it_replaces(settings):
    model = copy.deepcopy(tiny_lm()).cuda()
    prompt = torch.randint(0, 256, (2, 5), device="cuda")
    for weights in ("graph", "eager"):
        decoder = model.decoder(weights)
        want = reference_tokens(model, decoder, prompt, 10, settings, 3)
        got = model.generate(prompt, 10, **settings, weights=weights,
                             generator=torch.Generator("cuda").manual_seed(3))
        assert got[:, 5:].t().tolist() == want, weights


@pytest.mark.parametrize("weights", FORMATS)
def test_sample_steps_is_what_generate_draws(weights):
    """The contract's loop, called on a cache the decoder allocated and prefilled."""
    model = tiny_lm()
    decoder = model.decoder(weights)
    prompt = torch.tensor([[104, 101, 108, 108, 111]])
    cache = decoder.allocate_cache(1)
    logits = decoder.prefill(prompt, cache)
    got = [int(t) for t in decoder.sample_steps(logits, cache, 9, 0.8, 30, None,
                                                torch.Generator().manual_seed(2))]
    want = model.generate(prompt, 9, 0.8, 30, weights=weights,
                          generator=torch.Generator().manual_seed(2))[0, 5:].tolist()
    assert got == want


@pytest.mark.parametrize("weights", FORMATS)
def test_sample_steps_checks_its_arguments_when_called(weights):
    decoder = tiny_lm().decoder(weights)
    cache = decoder.allocate_cache(2)
    logits = decoder.prefill(torch.tensor([[1, 2], [3, 4]]), cache)
    for args, words in [((logits, cache, -1), "max_new_tokens"),
                        ((logits, cache, 2, 0.0), "temperature"),
                        ((logits, cache, 2, 1.0, 0), "top_k"),
                        ((logits, cache, 2, 1.0, None, 2.0), "top_p"),
                        ((logits, cache, 2, 1.0, None, None, None, 0), "forbidden"),
                        ((logits[:1], cache, 2), "logits")]:
        with pytest.raises(ValueError, match=words):
            decoder.sample_steps(*args)


@pytest.mark.parametrize("weights", FORMATS)
def test_generate_stream_and_beam_search_use_only_the_contract(weights, monkeypatch):
    """With ``model.decoder`` giving a decoder that has the contract's members only,
    sampling, streaming and beam search give the same ids."""
    model = tiny_lm()
    prompt = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(3))

    def calls():
        return (model.generate(prompt, 8, 0.9, 40, weights=weights,
                               generator=torch.Generator().manual_seed(1)),
                [t.tolist() for t in model.stream(prompt, 5, weights=weights,
                                                  generator=torch.Generator().manual_seed(2))],
                model.generate(prompt, 6, beam_size=3, weights=weights))
    want = calls()
    decoder = model.decoder
    monkeypatch.setattr(model, "decoder", lambda w: OnlyTheContract(decoder(w)))
    got = calls()
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(got[2], want[2])


# -- stepping the first rows, drawing a row ----------------------------------------------------
@pytest.mark.parametrize("weights", FORMATS)
def test_step_of_the_first_rows_matches_the_full_step_there(weights):
    """``step_(token, cache, rows=n)``: rows ``[0, n)`` advance as in a full step (the same
    bits for the fused step, which computes each row alone); the fused step leaves the
    other rows as they were."""
    model = tiny_lm()
    decoder = model.decoder(weights)
    prompt = torch.randint(0, 256, (5, 3), generator=torch.Generator().manual_seed(4))
    token = torch.tensor([10, 20, 30, 40, 50])
    full, part = decoder.allocate_cache(5), decoder.allocate_cache(5)
    decoder.prefill(prompt, full)
    decoder.prefill(prompt, part)
    before = [t.clone() for t in part.stacked]
    want = decoder.step_(token, full).clone()
    got = decoder.step_(token, part, rows=2)
    assert torch.equal(got[:2], want[:2])
    for a, b in zip(full.stacked, part.stacked):
        assert torch.equal(a[:, :2], b[:, :2])
    if weights != "eager":
        for a, b in zip(before, part.stacked):
            assert torch.equal(a[:, 2:], b[:, 2:])
    for rows in (-1, 6, 1.5, True):
        with pytest.raises(ValueError, match="rows must be an int in"):
            decoder.step_(token, part, rows=rows)


@pytest.mark.parametrize("weights", FORMATS)
def test_a_row_drawn_alone_with_its_own_generator_is_that_row_drawn_in_its_batch(weights):
    """The server draws each row with its own settings and generator: ``draw`` of a row of
    the logits is that row's id from ``draw`` at batch 1 with the same seed."""
    model = tiny_lm()
    decoder = model.decoder(weights)
    prompts = torch.randint(0, 256, (4, 6), generator=torch.Generator().manual_seed(5))
    cache = decoder.allocate_cache(4)
    logits = decoder.prefill(prompts, cache).clone()
    for row, settings in enumerate(SETTINGS):
        s = Sampling(**settings, generator=torch.Generator().manual_seed(row))
        if weights == "eager":      # (the eager products may round otherwise at batch 1)
            alone = logits[row:row + 1].clone()
        else:                       # (the fused step: the same bits at any batch)
            alone = decoder.prefill(prompts[row:row + 1], decoder.allocate_cache(1))
        got = decoder.draw(logits[row:row + 1], s, 256)
        s.generator.manual_seed(row)
        assert torch.equal(got, decoder.draw(alone, s, 256)), row
        assert got.shape == (1,) and got.dtype == torch.int64 and 0 <= int(got) < 256


@pytest.mark.parametrize("weights", FORMATS)
def test_draw_names_a_row_nothing_can_be_drawn_from(weights):
    decoder = tiny_lm().decoder(weights)
    logits = torch.zeros(2, 257)
    logits[1, 3] = float("nan")
    with pytest.raises(ValueError, match="row 1 hold NaN"):
        decoder.draw(logits, Sampling(generator=torch.Generator().manual_seed(0)), 256)


# -- the server uses the contract only ---------------------------------------------------------
@pytest.mark.parametrize("weights", ["eager", "float32"])
def test_the_servers_rows_need_only_the_contract(weights):
    """Streams through the engine over rows of a decoder that has the contract's members
    only: each stream's bytes are generate's for its prompt, settings and seed."""
    from fastrwa.serve.batcher import Engine
    from fastrwa.serve.rows import GREEDY_TEMPERATURE, DecoderRows
    from fastrwa.serve.schema import Completion

    model = tiny_lm()
    rows = DecoderRows(OnlyTheContract(model.decoder(weights)), 3, model.config.bos_token)
    rng = random.Random(0)
    reqs = [Completion(prompt=bytes(rng.randrange(256) for _ in range(rng.randrange(8))),
                       max_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 0.9]),
                       top_k=rng.choice([None, 9]), seed=i) for i in range(7)]
    engine = Engine(rows, model.config.bos_token)
    try:
        jobs = [engine.submit(r) for r in reqs]
        assert all(job.done.wait(30) for job in jobs)
    finally:
        assert engine.close(timeout=30)
    assert rows.kind == "contract only"
    for req, job in zip(reqs, jobs):
        out = model.generate(torch.tensor(list(req.prompt), dtype=torch.long), req.max_tokens,
                             req.temperature or GREEDY_TEMPERATURE, req.top_k, weights=weights,
                             generator=torch.Generator().manual_seed(req.seed))
        assert bytes(job.generated) == bytes(out[0, len(req.prompt):].tolist())


# -- written once ------------------------------------------------------------------------------
def test_the_fused_per_row_draw_is_written_once():
    """One call of the compiled sampler in the package: ``models.sampling.draw_fused``,
    which ``sample_fused``, ``PackedLM.sample_steps`` and (through ``PackedLM.draw``) the
    server use."""
    calls = {path.relative_to(ROOT).as_posix(): path.read_text().count("decode_host.draw(")
             for path in (ROOT / "fastrwa").rglob("*.py")}
    assert {k: v for k, v in calls.items() if v} == {"fastrwa/models/sampling.py": 1}
