"""What every command loads with (``fastrwa.models.load_model`` / ``load_bytelm``: a run's
directory or a model directory, the baselines refused where only a ``ByteLM`` will do) and
the one policy of what an exporter's ``--overwrite`` replaces
(``fastrwa.models.files.ExportDirectory``)."""

import json
import os

import pytest
import torch

from fastrwa.models import (ByteLM, LMConfig, build, load_bytelm, load_model,
                            save_pretrained)
from fastrwa.models.files import ExportDirectory


@pytest.fixture
def run(tmp_path):
    """A run's directory: its final model/ and a different best/."""
    torch.manual_seed(0)
    save_pretrained(ByteLM(LMConfig(d_model=8, n_layers=1)), tmp_path / "run" / "model")
    save_pretrained(ByteLM(LMConfig(d_model=16, n_layers=1)), tmp_path / "run" / "best")
    return tmp_path / "run"


def test_a_run_or_a_model_directory_loads(run):
    assert load_bytelm(run).config.d_model == 8
    assert load_bytelm(run, best=True).config.d_model == 16
    assert load_bytelm(run / "model").config.d_model == 8
    assert isinstance(load_model(run / "best"), ByteLM)
    assert not load_bytelm(run).training


@pytest.mark.parametrize("layer", ["lstm", "gru", "transformer", "mingru"])
def test_a_baseline_is_refused_naming_it_and_the_use(tmp_path, layer):
    model = build(LMConfig(layer=layer, d_model=8, n_layers=1))
    save_pretrained(model, tmp_path / "m")
    assert type(load_model(tmp_path / "m")) is type(model)     # (what generate takes)
    with pytest.raises(ValueError) as refused:
        load_bytelm(tmp_path / "m", use="the server")
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'm'}: the server takes a fastrwa.models.ByteLM")
    assert f"the {layer!r} baseline ({type(model).__name__})" in message


def test_what_cannot_load_is_named(run, tmp_path):
    with pytest.raises(FileNotFoundError, match="no model there"):
        load_bytelm(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no best/ export"):
        load_bytelm(run / "model", best=True)
    weights = run / "model" / "model.pt"
    weights.write_bytes(weights.read_bytes()[:-100])        # cut short
    with pytest.raises(ValueError, match="model.pt"):
        load_bytelm(run)


POLICY = ExportDirectory("notes export", frozenset({"a.json", "b.bin"}), "a.json",
                         ("format", "notes"), leftovers=frozenset({".b.bin.tmp"}),
                         own=lambda d: "b.bin is empty" if (d / "b.bin").exists()
                         and not (d / "b.bin").read_bytes() else None)


@pytest.mark.parametrize("files, reason", [
    ({"a.json": '{"format": "notes"}', "b.bin": "x"}, None),
    ({".b.bin.tmp": "half"}, None),                         # an older version's leftover
    ({"a.json": '{"format": "notes"}', "mine.txt": ""}, "it holds mine.txt"),
    ({"x": "", "y": "", "z": ""}, "it holds x and 2 other files"),
    ({"b.bin": "x"}, "it has no a.json"),
    ({"a.json": "{"}, "its a.json cannot be read"),
    ({"a.json": '{"format": "other"}'}, "its a.json is not of format 'notes'"),
    ({"a.json": '["format"]'}, "its a.json is not of format 'notes'"),
    ({"a.json": '{"format": "notes"}', "b.bin": ""}, "b.bin is empty"),
])
def test_the_export_directory_policy_names_why_a_directory_is_not_an_export(
        tmp_path, files, reason):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert POLICY.foreign(tmp_path) == reason


def test_an_entry_that_is_not_a_plain_file_is_never_replaced(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"format": "notes"}))
    (tmp_path / "b.bin").mkdir()
    assert POLICY.foreign(tmp_path) == "its b.bin is not a plain file"
    (tmp_path / "b.bin").rmdir()
    (tmp_path / "b.bin").symlink_to(tmp_path / "a.json")
    assert POLICY.foreign(tmp_path) == "its b.bin is not a plain file"


def test_both_exporters_use_the_one_policy():
    pytest.importorskip("onnx")
    pytest.importorskip("transformers")
    from fastrwa.export import onnx
    from fastrwa.hf import export as hf

    assert isinstance(onnx.OUTPUT, ExportDirectory) and isinstance(hf.OUTPUT, ExportDirectory)
    assert onnx.OUTPUT.what == "fastrwa ONNX export"
    assert hf.OUTPUT.what == "fastrwa Hugging Face export"


def test_a_locked_staging_of_a_process_not_seen_here_is_left_alone(tmp_path):
    """A staging directory whose PID names no process here may be a write running on another
    machine (a shared file system): its lock, not the PID, says it is still in use; once the
    lock is released (its writer died) the next run removes it."""
    import fcntl

    from fastrwa.models.files import recover_stale

    out = tmp_path / "out"
    dead = 2 ** 22 + 12345          # (above Linux's largest PID: no such process here)
    staging = tmp_path / f".out.fastrwa-staging-{dead}-abcd"
    staging.mkdir()
    fd = os.open(staging, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        recover_stale(out)
        assert staging.is_dir()
    finally:
        os.close(fd)
    recover_stale(out)
    assert not staging.exists()
