"""The language-model comparison's Transformer and minGRU baselines against plain references:
minGRU's log-space scan against its recurrence (float64, forward and backward), the
Transformer's sliding windows against each window recomputed, streams carried in pieces
against one call, and sampling against the logits of ``forward``."""

import pytest
import torch

from fastrwa.models import LMConfig, MinGRULM, TransformerLM, build
from fastrwa.models import mingru
from fastrwa.models.mingru import min_gru_scan


def mingru_loop(k, v, h0=None):
    """The paper's recurrence, written out here: z = sigmoid(k), h~ = g(v),
    h_t = (1 - z_t) h_{t-1} + z_t h~_t from h0 (zero when None)."""
    h = torch.zeros_like(k[:, 0]) if h0 is None else h0
    out = []
    for t in range(k.shape[1]):
        z = torch.sigmoid(k[:, t])
        candidate = torch.where(v[:, t] >= 0, v[:, t] + 0.5, torch.sigmoid(v[:, t]))
        h = (1 - z) * h + z * candidate
        out.append(h)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("chunk", [512, 7])              # one chunk; chunks of 7 steps
@pytest.mark.parametrize("with_h0", [False, True])
def test_mingru_scan_matches_the_recurrence_forward_and_backward(with_h0, chunk, monkeypatch):
    monkeypatch.setattr(mingru, "CHUNK", chunk)
    torch.manual_seed(0)
    k = (3 * torch.randn(2, 40, 5, dtype=torch.float64)).requires_grad_()
    v = (3 * torch.randn(2, 40, 5, dtype=torch.float64)).requires_grad_()
    h0 = (torch.rand(2, 5, dtype=torch.float64) + 0.1).requires_grad_() if with_h0 else None
    inputs = [k, v] + ([h0] if with_h0 else [])
    got, want = min_gru_scan(k, v, h0), mingru_loop(k, v, h0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(want)
    grads = torch.autograd.grad((got * weights).sum(), inputs)
    expected = torch.autograd.grad((want * weights).sum(), inputs)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_mingru_scan_float32_matches_the_float64_recurrence():
    """float32's error grows with the length scanned at once (exp(a) meets exp(-a)); the
    chunks bound it: within 1e-4 at T = 4000."""
    torch.manual_seed(1)
    k, v = torch.randn(3, 4000, 8), torch.randn(3, 4000, 8)
    want = mingru_loop(k.double(), v.double())
    torch.testing.assert_close(min_gru_scan(k, v).double(), want, rtol=1e-4, atol=1e-6)


def test_mingru_scan_computes_in_float32_under_bfloat16_autocast():
    torch.manual_seed(2)
    k, v = torch.randn(2, 300, 8).bfloat16(), torch.randn(2, 300, 8).bfloat16()
    h0 = torch.rand(2, 8).bfloat16() + 0.1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = min_gru_scan(k, v, h0)
    assert got.dtype == torch.float32
    want = mingru_loop(k.double(), v.double(), h0.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def tiny(layer, **kw):
    torch.manual_seed(0)
    extra = dict(n_heads=2, context=8) if layer == "transformer" else {}
    return build(LMConfig(layer=layer, d_model=16, n_layers=2, **extra, **kw)).eval()


@pytest.mark.parametrize("layer", ["transformer", "mingru"])
def test_a_stream_in_pieces_matches_one_call(layer):
    model = tiny(layer)
    tokens = torch.randint(0, 256, (2, 37))
    whole, _ = model(tokens)
    pieces, state = [], None
    for lo, hi in ((0, 5), (5, 6), (6, 20), (20, 37)):
        logits, state = model(tokens[:, lo:hi], state)
        pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_transformer_scores_each_position_in_its_sliding_window():
    """Position i is read from the window starting at max(0, (i // 4 - 1) * 4) (context 8,
    stride 4), recomputed from nothing: each byte sees between 5 and 8 bytes."""
    model = tiny("transformer")
    tokens = torch.randint(0, 256, (2, 30))
    got, state = model(tokens)
    for i in range(30):
        start = max(0, (i // 4 - 1) * 4)
        alone, _ = model(tokens[:, start:i + 1])         # (at most 8 bytes: one window)
        torch.testing.assert_close(got[:, i], alone[:, -1], rtol=1e-5, atol=1e-5)
    assert torch.equal(state, tokens[:, 24:])             # the next window starts at 24
    # a training window (T <= context, no state) is causal attention over the window
    first, _ = model(tokens[:, :8])
    torch.testing.assert_close(first, got[:, :8], rtol=0, atol=1e-6)


def test_transformer_cached_decoding_gives_the_logits_of_forward():
    """The key/value cache: a window read in pieces through the cache scores each byte as
    ``forward`` reads the whole window (the logits, not only their argmax)."""
    model = tiny("transformer")
    window = torch.randint(0, 256, (2, 8))
    want, _ = model(window)
    logits, cache = model._extend(window[:, :3], [None] * len(model.blocks))
    got = [logits]
    for t in range(3, 8):
        logits, cache = model._extend(window[:, t:t + 1], cache)
        got.append(logits)
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt_length", [3, 13])         # shorter and longer than a window
@pytest.mark.parametrize("layer", ["transformer", "mingru"])
def test_greedy_sampling_follows_the_forward_logits(layer, prompt_length):
    """Greedy decoding (the Transformer's key/value cache moves with its window) picks the
    argmax of ``forward`` over the text so far, at every step, across several windows."""
    model = tiny(layer)
    prompt = torch.randint(0, 256, (2, prompt_length))
    got = model.generate(prompt, 20, top_k=1)
    text = prompt
    for _ in range(20):
        logits, _ = model(text)
        text = torch.cat([text, logits[:, -1, :256].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, text)


@pytest.mark.parametrize("layer", ["transformer", "mingru"])
def test_bad_input_is_refused(layer):
    model = tiny(layer)
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"ids in \[0, 257\)"):
        model(torch.tensor([[0, 300]]))
    with pytest.raises(ValueError, match="beam_size must be 1"):
        model.generate(torch.tensor([1]), 3, beam_size=2)
    with pytest.raises(ValueError, match="state must be"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 9, dtype=torch.long)
              if layer == "transformer" else (torch.ones(2, 16),))


@pytest.mark.parametrize("layer", ["transformer", "mingru"])
def test_empty_batches_and_empty_sequences(layer):
    """B = 0 or T = 0 gives empty logits; an empty piece of a stream leaves its state."""
    model = tiny(layer)
    for shape in ((0, 20), (0, 0), (2, 0)):
        logits, _ = model(torch.zeros(shape, dtype=torch.long))
        assert logits.shape == (*shape, 257)
    tokens = torch.randint(0, 256, (2, 11))
    whole, _ = model(tokens)
    _, state = model(tokens[:, :6])
    _, state = model(tokens[:, 6:6], state)
    rest, _ = model(tokens[:, 6:], state)
    torch.testing.assert_close(rest, whole[:, 6:], rtol=1e-5, atol=1e-5)


def test_mingru_state_errors_name_the_entry():
    model = tiny("mingru")
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"state\[1\] must have shape \(2, 16\)"):
        model(tokens, (torch.ones(2, 16), torch.ones(3, 16)))
    with pytest.raises(TypeError, match=r"state\[0\] must be a floating-point tensor"):
        model(tokens, (torch.ones(2, 16, dtype=torch.long), torch.ones(2, 16)))
    with pytest.raises(ValueError, match=r"state\[1\] must be >= 0"):
        model(tokens, (torch.ones(2, 16), -torch.ones(2, 16)))


def test_mingru_lm_trains_under_bfloat16_autocast():
    """Forward and backward under autocast: finite, and the logits close to float32's."""
    model = tiny("mingru").train()
    tokens = torch.randint(0, 256, (2, 50))
    want, _ = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, state = model(tokens)
    got.float().logsumexp(-1).sum().backward()
    assert state[0].dtype == torch.float32
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_recurrent_lm_checks_its_tokens():
    model = tiny("gru")
    with pytest.raises(ValueError, match=r"ids in \[0, 257\)"):
        model(torch.tensor([[0, 300]]))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(2, 3))


def test_configuration_errors_name_the_field():
    with pytest.raises(ValueError, match=r"n_heads \(3\) must divide d_model \(16\)"):
        TransformerLM(LMConfig(layer="transformer", d_model=16, n_heads=3))
    with pytest.raises(ValueError, match="context must be even"):
        LMConfig(layer="transformer", d_model=16, n_heads=2, context=7)
    with pytest.raises(ValueError, match="MinGRULM needs LMConfig.layer 'mingru'"):
        MinGRULM(LMConfig(layer="gru"))
    from fastrwa.train.config import RunConfig
    with pytest.raises(ValueError, match="--bptt is the transformer's context and must be even"):
        RunConfig(task="text", model="transformer", bptt=33)
    with pytest.raises(ValueError, match=r"--hidden \(30\) must split into --lm n_heads=4"):
        RunConfig(task="text", model="transformer", hidden=30)


def test_the_trainer_trains_each_transformer_window_from_nothing(tmp_path):
    """Every LM carries its state from one BPTT segment to the next except the Transformer,
    whose context is the segment: its checkpoint carries nothing; its run resumes, exports
    and generates."""
    from fastrwa.generate import main as generate_main
    from fastrwa.models import load_pretrained
    from fastrwa.train.checkpoints import load_checkpoint
    from fastrwa.train.cli import main as train_main

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    flags = ["--task", "text", "--data", str(corpus), "--hidden", "16", "--layers", "1",
             "--bptt", "16", "--batch-size", "2", "--eval-every", "3", "--checkpoint-every",
             "3", "--eval-bytes", "200", "--no-progress"]
    for model in ("transformer", "mingru"):
        run = tmp_path / model
        assert train_main([*flags, "--model", model, "--steps", "3", "--run-dir", str(run)]) == 0
        carried = load_checkpoint(run / "checkpoint.pt")["carried"][0]
        assert (carried == [None]) == (model == "transformer"), carried
        assert train_main(["--resume", str(run), "--steps", "4", "--no-progress"]) == 0
        loaded = load_pretrained(run / "model")
        assert loaded.config.layer == model and loaded.config.context == 16
        assert generate_main([str(run), "--prompt", "the", "--max-new", "5"]) == 0
    assert train_main(["--task", "adding", "--model", "mingru", "--steps", "1",
                       "--run-dir", str(tmp_path / "adding")]) == 2
