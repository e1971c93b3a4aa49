"""fastrwa.hf: a ByteLM as a Hugging Face causal LM. Logits and the loss equal ByteLM's; greedy
generate() equals ByteLM.generate and the streaming CLI (after an export of a trained run,
loaded by the Auto classes in a process without training code); padding and holes in the
attention mask stay out of the state; save/load is bit-identical; the cache does not grow;
the pipeline runs offline. Skipped only where the ``hf`` extra is absent and not under CI
(CI installs it: there a missing transformers fails)."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not os.environ.get("CI"):
    pytest.importorskip("transformers")

import fastrwa.hf as fhf  # noqa: E402
from helpers import fit_on_bytes  # noqa: E402
from fastrwa.models import ByteLM, LMConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


TEXT = (b"the cat sat on the mat. a dog ran in the fog. my hat is red, his is blue. "
        b"we hid the big lid under the bed; she fed ten hens. ") * 8


@pytest.fixture(scope="module")
def byte_lm():
    """A ByteLM trained a little on TEXT: its next byte depends on the context (an untrained
    one repeats one byte whatever it reads, which would hide a state fed with padding)."""
    torch.manual_seed(0)
    return fit_on_bytes(ByteLM(LMConfig(d_model=32, n_layers=2, mlp_ratio=2)), TEXT,
                        steps=60, window=32)


@pytest.fixture(scope="module")
def exported(byte_lm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    fhf.FastRWAForCausalLM.from_bytelm(byte_lm).save_pretrained(directory)
    fhf.FastRWAByteTokenizer().save_pretrained(directory)
    return directory


def test_logits_and_loss_equal_the_byte_lm(byte_lm, exported):
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert type(model) is fhf.FastRWAForCausalLM
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids)
    want, _ = byte_lm(ids)
    assert torch.allclose(out.logits, want, rtol=0, atol=1e-5)
    # the trainer's loss: inputs bytes[:-1], targets bytes[1:], mean cross-entropy
    loss = torch.nn.functional.cross_entropy(want[:, :-1].reshape(-1, want.shape[-1]),
                                             ids[:, 1:].reshape(-1))
    assert abs(float(out.loss.detach()) - float(loss.detach())) < 1e-5


def test_greedy_generate_equals_the_byte_lm_and_the_tokenizer_gives_its_context(byte_lm,
                                                                                 exported):
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert type(tokenizer) is fhf.FastRWAByteTokenizer
    for text in ("The cat", ""):             # (an empty prompt starts from BOS, as ByteLM's)
        enc = tokenizer(text, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=30, do_sample=False)
        prompt = torch.tensor([list(text.encode())], dtype=torch.long)
        for weights in ("eager", "float32"):
            want = byte_lm.generate(prompt, 30, top_k=1, weights=weights)
            assert out[0, -30:].tolist() == want[0, -30:].tolist(), (text, weights)
        assert all(t < 256 for t in out[0, -30:].tolist())


def test_sampling_with_a_seed_is_reproducible(exported):
    model = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([[104, 101, 108]])
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, max_new_tokens=40, do_sample=True, top_k=20))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_ids_past_the_bytes_are_never_generated(exported, tmp_path):
    """Even by a model whose best next id is BOS, and from a directory without
    generation_config.json (whose suppress_tokens would otherwise be lost)."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in exported.iterdir():
        if f.name != "generation_config.json":
            (plain / f.name).write_bytes(f.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(plain)

    def favour_bos(module, inputs, logits):
        return logits + 100 * torch.nn.functional.one_hot(torch.tensor(256), logits.shape[-1])

    model.model.head.register_forward_hook(favour_bos)
    ids = torch.tensor([[104, 101]])
    assert int(model(ids).logits[0, -1].argmax()) == 256
    # (use_cache=False: every step runs the forward, and so the hook; the decode step's
    # product does not call the head module)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, use_cache=False)
    assert all(t < 256 for t in out[0, 2:].tolist())


def test_padding_and_holes_stay_out_of_the_state(exported):
    """Left padding (as the tokenizer pads) and a hole in the mask: each row generates the
    bytes it generates alone. Feeding the padding into the state breaks this (tried)."""
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    texts = ["hi", "a longer prompt", "mid"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert batch.attention_mask[0, 0] == 0               # (left padding)
    out = model.generate(**batch, max_new_tokens=15, do_sample=False)
    for row, text in enumerate(texts):
        alone = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=15,
                               do_sample=False)
        assert out[row, -15:].tolist() == alone[0, -15:].tolist(), text
    ids = torch.tensor([[104, 33, 33, 105]])             # "h!!i" with the "!!" masked out
    holed = model.generate(ids, attention_mask=torch.tensor([[1, 0, 0, 1]]),
                           max_new_tokens=15, do_sample=False)
    alone = model.generate(torch.tensor([[104, 105]]), max_new_tokens=15, do_sample=False)
    assert holed[0, -15:].tolist() == alone[0, -15:].tolist()
    tokenizer.padding_side = "right"                     # (right padding: the logits at a
    batch = tokenizer(texts, return_tensors="pt", padding=True)   # pad are the last byte's)
    assert batch.attention_mask[0, -1] == 0
    out = model.generate(**batch, max_new_tokens=15, do_sample=False)
    for row, text in enumerate(texts):
        alone = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=15,
                               do_sample=False)
        assert out[row, -15:].tolist() == alone[0, -15:].tolist(), text
    with pytest.raises(ValueError, match=r"pass the attention_mask the tokenizer returned"):
        model.generate(batch.input_ids, max_new_tokens=2)          # (padding without its mask)


def test_a_row_whose_mask_keeps_no_token_starts_from_bos(byte_lm, exported):
    """A row of a batch whose attention_mask is all 0 (an empty prompt, padded) generates
    what ByteLM.generate gives an empty prompt, which it starts from BOS (it sampled from
    the logits of no token before); the other row generates what it generates alone; the
    cached and uncached steps, and input_ids by keyword, agree."""
    model = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([[257, 257, 257], [104, 105, 33]])
    mask = torch.tensor([[0, 0, 0], [1, 1, 1]])
    empty = byte_lm.generate(torch.zeros(1, 0, dtype=torch.long), 12, top_k=1)[0].tolist()
    alone = byte_lm.generate(ids[1:], 12, top_k=1)[0, -12:].tolist()
    runs = [model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False),
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                           do_sample=False, use_cache=False)]
    for out in runs:
        assert out[0, -12:].tolist() == empty and out[1, -12:].tolist() == alone
        assert out[0, :3].tolist() == [257, 257, 256]        # (BOS, as tokenizer("") gives)
    assert ids[0].tolist() == [257, 257, 257] and mask[0].tolist() == [0, 0, 0]  # (copies)


def test_a_sampling_temperature_beyond_float32_is_refused_naming_it(exported):
    """As ByteLM.generate refuses it (it failed with torch's raw "probability tensor
    contains inf, nan"); unused by greedy decoding, it is not checked there."""
    model = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([[104, 105]])
    for temperature in (3.5e38, float("inf")):
        with pytest.raises(ValueError, match=r"temperature must be a finite number > 0 and "
                                             r"at most 3.4028234663852886e\+38"):
            model.generate(ids, max_new_tokens=2, do_sample=True, temperature=temperature)
    assert model.generate(ids, max_new_tokens=2, do_sample=True,
                          temperature=3.4028234663852886e38).shape == (1, 4)


def test_an_attention_mask_of_the_wrong_length_is_refused(exported):
    """The mask covers the cache's positions and the new ids: a shorter or longer one is
    refused naming both lengths (one of 4 for 3 ids had its first entry dropped; one of 2
    gave a raw size mismatch); the right length, with and without a cache, runs."""
    model = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([[104, 105, 33]])
    for bad in ([[1, 1]], [[0, 1, 1, 1]], [[1, 1, 1], [1, 1, 1]]):
        with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, past \+ T\)"
                                             r" = \(1, 0 \+ 3\)"):
            model(ids, attention_mask=torch.tensor(bad))
    first = model(ids, attention_mask=torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match=r"= \(1, 3 \+ 1\).*got \(1, 1\)"):
        model(torch.tensor([[106]]), attention_mask=torch.tensor([[1]]),
              past_key_values=first.past_key_values)
    step = model(torch.tensor([[106]]), attention_mask=torch.tensor([[0, 1, 1, 1]]),
                 past_key_values=first.past_key_values)
    whole = model(torch.tensor([[104, 105, 33, 106]]),
                  attention_mask=torch.tensor([[0, 1, 1, 1]]))
    torch.testing.assert_close(step.logits[:, -1], whole.logits[:, -1], rtol=1e-5, atol=1e-5)


def test_the_tokenizer_reads_text_as_bytes(exported):
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer("a<bos>b<pad>").input_ids == list(b"a<bos>b<pad>")
    assert tokenizer("é").input_ids == [195, 169] and tokenizer("").input_ids == [256]
    assert tokenizer.decode([104, 0xFF, 105]) == "h\ufffdi"
    assert tokenizer.batch_decode([[257, 257, 104, 105]], skip_special_tokens=True) == ["hi"]


def test_round_trip_is_bit_identical_and_damage_is_a_clear_error(exported, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(exported)
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert again.model.head.weight is again.model.embed.weight       # (tied, as trained)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in exported.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])                  # (cut short)
    with pytest.raises(ValueError, match="model.safetensors: the weights are damaged"):
        AutoModelForCausalLM.from_pretrained(damaged)
    from safetensors.torch import load_file, save_file
    tensors = load_file(exported / "model.safetensors")
    tensors.pop("model.blocks.0.mix.proj.weight")
    save_file(tensors, weights, metadata={"format": "pt"})       # (no checksum: a warning)
    with pytest.warns(UserWarning, match="no fastrwa_sha256 checksum"), \
            pytest.raises(ValueError, match="do not hold.*model.blocks.0.mix.proj.weight"):
        AutoModelForCausalLM.from_pretrained(damaged)
    (damaged / "config.json").write_text(json.dumps({"model_type": "fastrwa",
                                                     "attention": "nope"}))
    with pytest.raises(ValueError, match="attention must be one of"):
        AutoModelForCausalLM.from_pretrained(damaged)


def test_a_flipped_bit_in_the_weights_is_refused(exported, tmp_path):
    """save_pretrained stores a SHA-256 of the weights in model.safetensors' metadata and
    from_pretrained checks it: one flipped bit in a weight (it loaded silently, a weight
    2.9e37) is a ValueError naming the file; a file without the checksum loads with a
    warning; the intact export loads without one."""
    import shutil
    import warnings

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from fastrwa.models.integrity import DIGEST_KEY
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        assert len(f.metadata()[DIGEST_KEY]) == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no warning for an intact export
        AutoModelForCausalLM.from_pretrained(exported)
    flipped = tmp_path / "flipped"
    shutil.copytree(exported, flipped)
    raw = bytearray((flipped / "model.safetensors").read_bytes())
    raw[-3] ^= 0x40                                     # the last weight's exponent
    (flipped / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"model.safetensors: the weights are damaged \(they "
                                         "do not match the checksum"):
        AutoModelForCausalLM.from_pretrained(flipped)
    unsigned = tmp_path / "unsigned"
    shutil.copytree(exported, unsigned)
    save_file(load_file(str(exported / "model.safetensors")),
              str(unsigned / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=f"has no {DIGEST_KEY} checksum"):
        AutoModelForCausalLM.from_pretrained(unsigned)


def test_the_configuration_carries_every_lm_field_and_its_default():
    import dataclasses

    assert fhf.FastRWAConfig().to_lm_config() == LMConfig()
    # every field away from its default survives the round trip
    other = LMConfig(vocab_size=300, d_model=8, n_layers=3, layer="rwa", attention="exp",
                     f_h="tanh", f_o="tanh", preset="exp-tanh", token_shift=False,
                     discount_init="spread", discount_groups=2, output_gate=False,
                     learn_initial_state=False,
                     mlp_ratio=2,
                     tie_embeddings=False, n_heads=2, context=64)
    assert all(getattr(other, f.name) != f.default for f in dataclasses.fields(LMConfig))
    assert fhf.FastRWAConfig.from_lm_config(other).to_lm_config() == other


def test_untied_and_spread_models_round_trip(tmp_path):
    torch.manual_seed(0)
    byte_lm = ByteLM(LMConfig(d_model=8, n_layers=2, mlp_ratio=2, tie_embeddings=False,
                              discount_init="spread"))
    fhf.FastRWAForCausalLM.from_bytelm(byte_lm).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.model.head.weight is not model.model.embed.weight
    for (name, a), b in zip(byte_lm.state_dict().items(), model.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_cache_does_not_grow_and_other_decodings_are_refused(exported):
    model = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([[104, 101]])
    sizes = []
    for n in (2, 60):
        out = model.generate(ids, max_new_tokens=n, do_sample=False,
                             return_dict_in_generate=True)
        assert isinstance(out.past_key_values, fhf.FastRWACache)
        sizes.append(out.past_key_values.nbytes())
    assert sizes[0] == sizes[1] > 0
    for option in (dict(penalty_alpha=0.6, top_k=4), dict(assistant_model=model),
                   dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0)):
        with pytest.raises(ValueError, match="not supported by FastRWAForCausalLM: it "
                                             "generates greedily, by sampling or by beam"):
            model.generate(ids, max_new_tokens=3, **option)
    with pytest.raises(ValueError, match="no past_key_values"):
        model.generate(ids, past_key_values=out.past_key_values, max_new_tokens=3)


def test_generate_decodes_with_the_fused_step_and_its_tokens_are_the_eager_steps(exported):
    """generate() on a float32 CPU model: the prompt through the parallel forward (padding
    skipped), each new token through the fused decode step in place (PackedLM); greedy and
    sampled tokens are those of the eager step (ByteLM.step_, equal to the functional step:
    tests/models/test_lm.py), seed for seed, padded rows included."""
    from fastrwa.models import PackedLM
    model = AutoModelForCausalLM.from_pretrained(exported)
    out = model.generate(torch.tensor([[104, 101]]), max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True)
    assert isinstance(out.past_key_values.decoder, PackedLM)
    ids = torch.tensor([[257, 257, 104, 101, 108], [116, 104, 101, 32, 99]])
    mask = (ids < 256).long()
    for sample in (dict(do_sample=False), dict(do_sample=True, top_k=20),
                   dict(do_sample=True, top_p=0.9, temperature=0.7)):
        for seed in (0, 1, 2):
            runs = {}
            for weights in ("auto", "eager"):
                torch.manual_seed(seed)
                runs[weights] = model.generate(ids, attention_mask=mask, max_new_tokens=40,
                                               weights=weights, **sample)
            assert torch.equal(runs["auto"], runs["eager"]), (sample, seed)


@pytest.mark.parametrize("weights", ["auto", "eager"])
def test_beam_search_is_the_byte_lms(weights):
    """num_beams through the cache's reorder: the sequences of ByteLM.generate(beam_size=K),
    per prompt of a batch, for K = 1 (greedy), 2 and 4; beam sampling runs too. Untrained
    models (seeded): their beams trade places, so a state not reordered gives other bytes
    (tried; the trained fixture's beams mostly keep their rows); a large BOS row makes the
    scores differ unless renormalised over the bytes, as ByteLM does (tried)."""
    ids = torch.tensor([list(b"the c"), list(b"a dog")])
    for seed in (0, 1):
        torch.manual_seed(seed)
        byte_lm = ByteLM(LMConfig(d_model=32, n_layers=2)).eval()
        with torch.no_grad():    # (BOS's probability, never generated, varies between
            byte_lm.head.weight[256] *= 30      # beams: scores must be renormalised)
        model = fhf.FastRWAForCausalLM.from_bytelm(byte_lm).eval()
        for K in (1, 2, 4):
            out = model.generate(ids, max_new_tokens=25, do_sample=False, num_beams=K,
                                 weights=weights)
            want = byte_lm.generate(ids, 25, beam_size=K, top_k=1, weights=weights)
            assert out.tolist() == want.tolist(), (seed, K)
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=10, do_sample=True, num_beams=3, weights=weights)
    assert out.shape == (2, 15) and int(out[:, 5:].max()) < 256


def test_a_bfloat16_model_generates_with_the_eager_in_place_step(byte_lm, exported):
    """No fused step for bfloat16: ByteLM's in-place step (what ByteLM.generate runs for it),
    the same greedy bytes."""
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    ids = torch.tensor([list(b"the c")])
    out = model.generate(ids, max_new_tokens=20, do_sample=False,
                         return_dict_in_generate=True)
    assert out.past_key_values.decoder is model.model
    want = copy.deepcopy(byte_lm).to(torch.bfloat16).generate(ids, 20, top_k=1)
    assert out.sequences.tolist() == want.tolist()


def test_pipeline_runs_offline(exported, byte_lm):
    generator = pipeline("text-generation", model=str(exported))
    text = generator("The cat", max_new_tokens=10, do_sample=False)[0]["generated_text"]
    want = byte_lm.generate(torch.tensor(list(b"The cat")), 10, top_k=1)[0]
    assert text == bytes(want.tolist()).decode("utf-8", errors="replace")


def test_an_exported_training_run_generates_what_the_cli_streams(tmp_path):
    """Train a tiny run, export it with the CLI, load it with the Auto classes in a process
    that imports no training code, and generate greedily: the bytes the streaming CLI gives
    with --top-k 1."""
    from fastrwa.train.cli import main as train_main

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 400)
    run = tmp_path / "run"
    assert train_main(["--task", "text", "--data", str(corpus), "--hidden", "16",
                       "--layers", "2", "--bptt", "32", "--batch-size", "4", "--steps", "30",
                       "--lr", "1e-2", "--warmup", "0", "--eval-every", "30",
                       "--eval-bytes", "200", "--no-progress", "--run-dir", str(run)]) == 0
    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "fastrwa.hf.export", str(run), str(out)],
                   check=True, env=ENV, capture_output=True, timeout=600)
    cli = subprocess.run([sys.executable, "-m", "fastrwa.generate", str(run), "--prompt",
                          "the quick ", "--max-new", "40", "--top-k", "1"], check=True,
                         env=ENV, capture_output=True, timeout=600).stdout
    script = textwrap.dedent(f"""
        import sys
        import fastrwa.hf
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(out)!r})
        tokenizer = AutoTokenizer.from_pretrained({str(out)!r})
        ids = model.generate(**tokenizer("the quick ", return_tensors="pt"),
                             max_new_tokens=40, do_sample=False)
        assert not [m for m in sys.modules if m.startswith("fastrwa.train")], "training code"
        sys.stdout.buffer.write(bytes(ids[0].tolist()))
    """)
    hf = subprocess.run([sys.executable, "-c", script], check=True, env=ENV,
                        capture_output=True, timeout=600).stdout
    assert hf == cli[:len(hf)] and len(hf) == len("the quick ") + 40
    assert b"the" in hf[len("the quick "):]               # (it learned something)


def test_export_refuses_to_overwrite_what_it_did_not_write(tmp_path, exported, capsys):
    from fastrwa.hf.export import main as export_main
    from fastrwa.models import save_pretrained

    torch.manual_seed(0)
    save_pretrained(ByteLM(LMConfig(d_model=8, n_layers=1)), tmp_path / "m")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert export_main([str(tmp_path / "m"), str(other)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert export_main([str(tmp_path / "m"), str(other), "--overwrite"]) == 2
    assert "not a fastrwa Hugging Face export" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep me"
    capsys.readouterr()
    assert export_main([str(tmp_path / "m"), str(tmp_path / "new")]) == 0
    err = capsys.readouterr().err            # one line, no "Writing model shards" bar
    assert err.startswith("exported ") and len(err.strip().splitlines()) == 1, err
    assert export_main([str(tmp_path / "m"), str(tmp_path / "new"), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "new", "other"]   # no leftovers
    (tmp_path / "new" / "README.md").write_text("# my own notes\n")   # (not a model card)
    assert export_main([str(tmp_path / "m"), str(tmp_path / "new"), "--overwrite"]) == 2
    assert (tmp_path / "new" / "README.md").read_text() == "# my own notes\n"
    assert export_main([str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert "no model there" in capsys.readouterr().err


def test_export_never_follows_a_link_and_a_full_disk_is_one_error(tmp_path, capsys,
                                                                    monkeypatch):
    """--overwrite onto a symbolic link to an earlier export is refused, the link and its
    target as they were (it replaced the link with a directory, left a hidden .old behind
    and exited 2 after succeeding); a full disk while writing is one error: line with
    nothing half-written (it was a raw SafetensorError traceback)."""
    import errno

    from safetensors import SafetensorError

    from fastrwa.hf import FastRWAForCausalLM
    from fastrwa.hf.export import main as export_main
    from fastrwa.models import save_pretrained

    torch.manual_seed(0)
    save_pretrained(ByteLM(LMConfig(d_model=8, n_layers=1)), tmp_path / "m")
    assert export_main([str(tmp_path / "m"), str(tmp_path / "first")]) == 0
    (tmp_path / "link").symlink_to(tmp_path / "first")
    before = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert export_main([str(tmp_path / "m"), str(tmp_path / "link"), "--overwrite"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in (tmp_path / "first").iterdir()) == before
    for error in (OSError(errno.ENOSPC, "No space left on device"),
                  SafetensorError("Error while serializing: IoError(No space left on device)")):
        def full(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(FastRWAForCausalLM, "save_pretrained", full)
        assert export_main([str(tmp_path / "m"), str(tmp_path / "second")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "No space left on device" in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "link", "m"]  # no leftovers


def test_one_model_directory_loads_the_same_ways(tmp_path):
    """A run's directory and its Hugging Face export: the generate CLI reads both (greedy:
    the same bytes; an export was "no model there"), load_pretrained takes the run's
    directory (it wanted model/), and the export's generation_config.json carries the
    suppress_tokens docs/hf.md describes."""
    from fastrwa.models import load_pretrained, save_pretrained

    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=16, n_layers=1))
    save_pretrained(model, tmp_path / "run" / "model")
    assert type(load_pretrained(tmp_path / "run")).__name__ == "ByteLM"
    fhf.FastRWAForCausalLM.from_bytelm(model).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["suppress_tokens"] == [256]
    out = {}
    for name in ("run", "hf"):
        done = subprocess.run([sys.executable, "-m", "fastrwa.generate", str(tmp_path / name),
                               "--prompt", "ab", "--max-new", "8", "--top-k", "1"],
                              capture_output=True, env=ENV, timeout=600)
        assert done.returncode == 0, done.stderr
        assert b"Loading weights" not in done.stderr
        out[name] = done.stdout
    assert out["hf"] == out["run"] and len(out["run"]) >= 10


REMOTE = """
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
directory = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
ids = model.generate(**tokenizer("ab", return_tensors="pt"), max_new_tokens=8, do_sample=False)
text = pipeline("text-generation", model=model, tokenizer=tokenizer)("ab", max_new_tokens=8,
                                                                     do_sample=False)
print(ids[0].tolist(), type(model).__name__, text[0]["generated_text"] == tokenizer.decode(ids[0]))
"""


def test_a_runs_model_directory_and_its_export_load_every_way(tmp_path):
    """One directory format (issue 43, item 2): a training run's model/ and best/ and its
    export load through load_pretrained, the Auto classes (after import fastrwa.hf, or
    after import transformers then fastrwa) and, in a process that never imports fastrwa
    itself, with trust_remote_code=True (auto_map); each carries a model card with how it
    was trained and its validation bpc, and the generation config; the same greedy bytes
    every way."""
    from fastrwa.models import load_pretrained
    from fastrwa.models.directory import config_json
    from fastrwa.train.cli import main as train_main

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT * 20)
    run = tmp_path / "run"
    assert train_main(["--task", "text", "--data", str(corpus), "--hidden", "16",
                       "--layers", "1", "--bptt", "32", "--batch-size", "4", "--steps", "20",
                       "--lr", "1e-2", "--warmup", "0", "--eval-every", "10",
                       "--eval-bytes", "300", "--no-progress", "--run-dir", str(run)]) == 0
    from fastrwa.hf.export import main as export_main
    assert export_main([str(run), str(tmp_path / "hf")]) == 0
    byte_lm = load_pretrained(run)
    want = byte_lm.generate(torch.tensor([list(b"ab")]), 8, top_k=1)[0].tolist()
    for directory in (run / "model", run / "best", tmp_path / "hf"):
        card = (directory / "README.md").read_text()
        assert "## Training" in card and "| steps taken |" in card and "corpus.txt" in card
        assert "| seed | 0 |" in card and "| warmup | 0 |" in card     # (zeros are settings)
        assert "valid bpc (the first 300 bytes):" in card and "Not recorded" not in card, directory
        generation = json.loads((directory / "generation_config.json").read_text())
        assert generation["suppress_tokens"] == [256]
        loaded = load_pretrained(directory)
        if directory.name != "best":
            for (name, a), b in zip(byte_lm.state_dict().items(), loaded.state_dict().values()):
                assert torch.equal(a, b), (directory, name)
        model = AutoModelForCausalLM.from_pretrained(directory)
        assert type(model) is fhf.FastRWAForCausalLM
        out = model.generate(torch.tensor([list(b"ab")]), max_new_tokens=8, do_sample=False)
        if directory.name != "best":
            assert out[0].tolist() == want, directory
    # config.json: the keys FastRWAConfig writes, in a run's directory too
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    ours = config_json(byte_lm.config)
    assert {k: written[k] for k in ours} == ours
    assert json.loads((run / "model" / "config.json").read_text()) == ours
    for directory in (run / "model", tmp_path / "hf"):
        done = subprocess.run([sys.executable, "-c", REMOTE, str(directory)],
                              capture_output=True, text=True, env=ENV, timeout=600,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split("] ")[0] + "]" == str(want) and \
            done.stdout.strip().endswith("FastRWAForCausalLM True"), done.stdout
    order = ("import transformers, fastrwa, sys\n"
             "from transformers import AutoModelForCausalLM\n"
             "print(type(AutoModelForCausalLM.from_pretrained(sys.argv[1])).__name__)")
    done = subprocess.run([sys.executable, "-c", order, str(run / "model")],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert done.stdout.strip() == "FastRWAForCausalLM", done.stderr[-3000:]


def test_a_forward_from_a_generate_cache_reads_a_copy_and_concurrent_calls_stay_apart(
        exported):
    """A cache generate() returned is not advanced by forwards outside generate(): two
    forwards from it give the same logits, those of the eager model from its state; two
    threads generating on one model with different weights each get what they get alone."""
    import threading

    model = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([list(b"the c")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True)
    cache = out.past_key_values
    seen = cache.seen
    nxt = out.sequences[:, -1:]
    mask = torch.ones(1, seen + 1, dtype=torch.long)
    first = model(nxt, attention_mask=mask, past_key_values=cache).logits
    second = model(nxt, attention_mask=mask, past_key_values=cache).logits
    assert cache.seen == seen and torch.equal(first, second)
    want, _ = model.model(nxt, cache.state)
    torch.testing.assert_close(first, want, rtol=0, atol=1e-5)
    alone = {w: model.generate(ids, max_new_tokens=30, do_sample=False, weights=w)
             for w in ("eager", "int8")}
    got, errors = {}, []

    def run(weights):
        try:
            for _ in range(3):
                got[weights] = model.generate(ids, max_new_tokens=30, do_sample=False,
                                              weights=weights)
                assert torch.equal(got[weights], alone[weights]), weights
        except Exception as exc:          # (reported below, in the test's thread)
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(w,)) for w in alone]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_from_pretrained_takes_a_training_runs_directory(tmp_path):
    """The run's root (its config.json is the run's, not the model's) loads its model/;
    options a model.pt directory cannot honour are refused, not ignored."""
    from fastrwa.models import save_pretrained

    torch.manual_seed(0)
    byte_lm = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
    save_pretrained(byte_lm, tmp_path / "run" / "model")
    (tmp_path / "run" / "config.json").write_text(json.dumps({"task": "text"}))
    model = fhf.FastRWAForCausalLM.from_pretrained(tmp_path / "run", device_map={"": "cpu"})
    for a, b in zip(byte_lm.state_dict().values(), model.model.state_dict().values()):
        assert torch.equal(a, b)
    assert model.generation_config.suppress_tokens == [256]
    with pytest.raises(ValueError, match="revision"):
        fhf.FastRWAForCausalLM.from_pretrained(tmp_path / "run", revision="v2")


def _as_an_older_version_wrote_it(directory, field):
    """``directory`` as a fastrwa from before ``field`` existed wrote it: ``field`` neither in
    config.json nor in the configuration recorded with the weights (the weights' checksum,
    over the tensors only, still holds)."""
    from safetensors.torch import load_file, save_file

    from fastrwa.models.directory import ARCHITECTURE_KEY
    from fastrwa.models.integrity import read_metadata
    from fastrwa.models.storage import save_with_crcs

    config = json.loads((directory / "config.json").read_text())
    del config[field]
    (directory / "config.json").write_text(json.dumps(config))

    def without_field(recorded):
        fields = json.loads(recorded)
        del fields[field]
        return json.dumps(fields)

    if (directory / "model.pt").exists():
        state = torch.load(directory / "model.pt", weights_only=True)
        state._metadata[ARCHITECTURE_KEY] = without_field(state._metadata[ARCHITECTURE_KEY])
        with open(directory / "model.pt", "wb") as f:
            save_with_crcs(state, f)
    else:
        path = directory / "model.safetensors"
        metadata = read_metadata(path)
        metadata[ARCHITECTURE_KEY] = without_field(metadata[ARCHITECTURE_KEY])
        save_file(load_file(path), path, metadata=metadata)


def test_a_config_written_before_output_gate_existed_reads_the_same_through_every_loader(
        tmp_path):
    """Issue 59: a config.json without output_gate (an older fastrwa's: its models had no
    gate) is an ungated model through every loader; AutoModelForCausalLM read True and
    refused the directory as "damaged or foreign"."""
    from transformers import AutoConfig

    from fastrwa.models import load_pretrained, save_pretrained

    torch.manual_seed(0)
    byte_lm = ByteLM(LMConfig(d_model=16, n_layers=1, output_gate=False)).eval()
    save_pretrained(byte_lm, tmp_path / "run" / "model")
    fhf.FastRWAForCausalLM.from_bytelm(byte_lm).save_pretrained(tmp_path / "hf")
    ids = torch.tensor([list(b"the cat")])
    want, _ = byte_lm(ids)
    for directory in (tmp_path / "run" / "model", tmp_path / "hf"):
        _as_an_older_version_wrote_it(directory, "output_gate")
        assert AutoConfig.from_pretrained(directory).output_gate is False, directory
        assert fhf.FastRWAConfig.from_pretrained(directory).output_gate is False, directory
        loaded = [load_pretrained(directory), ByteLM.load(directory),
                  AutoModelForCausalLM.from_pretrained(directory).model,
                  fhf.FastRWAForCausalLM.from_pretrained(directory).model]
        for model in loaded:
            assert model.config.output_gate is False, directory
            torch.testing.assert_close(model(ids)[0], want, rtol=0, atol=1e-6)


# What lm-eval's HFLM passes from_pretrained (lm_eval 0.4.13, a single device): the options
# at the values that change nothing.
LM_EVAL_OPTIONS = {"revision": "main", "dtype": "auto", "trust_remote_code": True,
                   "gguf_file": None, "quantization_config": None, "subfolder": "",
                   "max_memory": None, "device_map": {"": "cpu"}}


def test_a_model_pt_directory_takes_the_options_that_change_nothing(tmp_path):
    """Issue 59: from a run's model/ (model.pt) from_pretrained refused the neutral options
    lm-eval always passes; every option transformers' from_pretrained names is either
    taken (at any value, or at the value that changes nothing) or refused in one line
    naming it and its value; a subfolder is joined to the path."""
    import inspect

    from transformers import PreTrainedModel

    from fastrwa.hf.options import KNOWN
    from fastrwa.models import save_pretrained

    torch.manual_seed(0)
    byte_lm = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
    save_pretrained(byte_lm, tmp_path / "run" / "model")
    ids = torch.tensor([list(b"abc")])
    for directory, extra in ((tmp_path / "run" / "model", {}),
                             (tmp_path / "run", {"subfolder": "model"})):
        model = AutoModelForCausalLM.from_pretrained(directory, **{**LM_EVAL_OPTIONS, **extra})
        torch.testing.assert_close(model(ids).logits, byte_lm(ids)[0], rtol=0, atol=0)
    named = {p.name for p in inspect.signature(PreTrainedModel.from_pretrained).parameters.values()
             if p.kind is p.KEYWORD_ONLY or p.default is not p.empty}
    assert named <= KNOWN, sorted(named - KNOWN)
    for name, value in (("gguf_file", "model.gguf"), ("max_memory", {"cpu": "1GB"}),
                        ("quantization_config", {"load_in_8bit": True}),
                        ("revision", "v2"), ("variant", "fp16"), ("no_such_option", 1)):
        with pytest.raises(ValueError) as refused:
            fhf.FastRWAForCausalLM.from_pretrained(tmp_path / "run" / "model", **{name: value})
        message = str(refused.value)
        assert f"{name}={value!r}" in message and "model.pt" in message and \
            "\n" not in message, message


def test_the_tokenizer_and_generate_agree_on_an_eos_the_model_never_generates(tmp_path):
    """Issue 59: lm-eval's generate_until failed (``'NoneType' object is not iterable``) on a
    tokenizer without EOS. The EOS is 256 (BOS's id) in the tokenizer, the configuration
    and the generation configuration of a run's model/, of its export and of a directory
    written before EOS was set; the bytes generated are the same (it is never generated)."""
    from fastrwa.hf.export import export
    from fastrwa.models import save_pretrained

    torch.manual_seed(0)
    byte_lm = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
    save_pretrained(byte_lm, tmp_path / "run" / "model")
    export(tmp_path / "run", tmp_path / "hf")
    old = tmp_path / "old"                       # (as an earlier fastrwa wrote it: no EOS)
    save_pretrained(byte_lm, old)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        data = json.loads((old / name).read_text())
        data.pop("eos_token", None)
        data.pop("eos_token_id", None)
        if name == "config.json":
            data["eos_token_id"] = None
        (old / name).write_text(json.dumps(data))
    want = byte_lm.generate(torch.tensor([list(b"ab")]), 12, top_k=1)[0].tolist()
    for directory in (tmp_path / "run" / "model", tmp_path / "hf", old):
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory)
        assert tokenizer.eos_token_id == model.config.eos_token_id == \
            model.generation_config.eos_token_id == byte_lm.config.eos_token == 256, directory
        assert tokenizer.decode([tokenizer.eos_token_id]) == tokenizer.eos_token
        out = model.generate(**tokenizer("ab", return_tensors="pt"), max_new_tokens=12,
                             do_sample=False)
        assert out[0].tolist() == want, directory


def test_the_hf_export_cli_stops_in_one_line_on_sigterm(tmp_path, capsys, monkeypatch):
    """SIGTERM during the Hugging Face export: one line naming what OUT_DIR is, status
    143, nothing left beside it (SIGTERM killed it, leaving its staging directory)."""
    import os
    import signal

    from fastrwa.hf import export as hf_export
    from fastrwa.models import ByteLM, LMConfig, save_pretrained

    save_pretrained(ByteLM(LMConfig(d_model=16, n_layers=1)), tmp_path / "model")
    real = hf_export.FastRWAByteTokenizer.save_pretrained

    def terminated(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(hf_export.FastRWAByteTokenizer, "save_pretrained", terminated)
    assert hf_export.main([str(tmp_path / "model"), str(tmp_path / "out")]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"stopped (SIGTERM): {tmp_path / 'out'} was not created"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
