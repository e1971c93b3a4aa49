"""``python -m fastrwa.generate``: options and damaged exports are one-line errors naming
the option or the file (exit code 2), never tracebacks (issue 22)."""

import os
import pickle
import zipfile

import pytest
import torch

from fastrwa.generate import main as generate_main
from fastrwa.models import LMConfig, build, save_pretrained


@pytest.fixture
def export(tmp_path):
    """A tiny model as a run exports it: RUN/model/{config.json, model.pt}."""
    save_pretrained(build(LMConfig(d_model=8, n_layers=1)), tmp_path / "run" / "model")
    return tmp_path / "run"


def _error(capsysbinary) -> str:
    err = capsysbinary.readouterr().err.decode()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("flags,words", [
    (["--beam", "0"], "--beam must be at least 1"),
    (["--beam", "-2"], "--beam must be at least 1"),
    (["--max-new", "-1"], "--max-new must be"),
    (["--temperature", "0"], "--temperature must be"),
    (["--top-k", "0"], "--top-k must be"),
    (["--top-p", "1.5"], "--top-p must be"),
    (["--seed", str(2 ** 70)], "--seed must be"),
])
def test_unusable_options_are_refused(export, capsysbinary, flags, words):
    assert generate_main([str(export), "--max-new", "2", *flags]) == 2
    assert words in _error(capsysbinary)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(export, capsysbinary):
    assert generate_main([str(export), "--device", "cuda", "--max-new", "2"]) == 2
    assert "--device cuda" in _error(capsysbinary)


def test_an_empty_model_file_is_a_clear_error(export, capsysbinary):
    (export / "model" / "model.pt").write_bytes(b"")
    assert generate_main([str(export), "--max-new", "2"]) == 2
    assert "model.pt" in _error(capsysbinary)


def test_a_pickle_payload_is_refused_without_being_run(export, tmp_path, capsysbinary):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (export / "model" / "model.pt").write_bytes(pickle.dumps(Payload()))
    assert generate_main([str(export), "--max-new", "2"]) == 2
    assert "model.pt" in _error(capsysbinary)
    assert not marker.exists()


def test_an_export_with_a_flipped_byte_prints_no_text(export, capsysbinary):
    weights = export / "model" / "model.pt"
    with zipfile.ZipFile(weights) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    data = bytearray(weights.read_bytes())
    data[info.header_offset + 200] ^= 0x7F       # inside the first record's values
    weights.write_bytes(bytes(data))
    assert generate_main([str(export), "--max-new", "5"]) == 2
    out = capsysbinary.readouterr()
    assert out.out == b""
    assert b"model.pt" in out.err and b"corrupt" in out.err


def test_a_reader_that_stops_early_ends_generation_quietly(export):
    """``python -m fastrwa.generate RUN | head -c 10``: the closed pipe is no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "fastrwa.generate", str(export),
                             "--max-new", "1000000", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_weights_formats_stream_and_refuse_what_they_cannot_run(export, tmp_path,
                                                                capsysbinary):
    for weights in ("auto", "eager", "float32", "bfloat16", "int8"):
        assert generate_main([str(export), "--max-new", "5", "--weights", weights,
                              "--prompt", "ab"]) == 0
        out = capsysbinary.readouterr().out
        assert out.startswith(b"ab") and len(out) == 2 + 5 + 1
    lstm = tmp_path / "lstm"
    save_pretrained(build(LMConfig(layer="lstm", d_model=8, n_layers=1)), lstm / "model")
    assert generate_main([str(lstm), "--max-new", "2", "--weights", "eager"]) == 0
    capsysbinary.readouterr()
    assert generate_main([str(lstm), "--max-new", "2", "--weights", "int8"]) == 2
    assert "has the eager step only" in _error(capsysbinary)


def test_the_cli_samples_at_the_temperature_generate_defaults_to():
    """The CLI's default temperature is ByteLM.generate's (it was 0.8 against 1.0)."""
    import inspect

    from fastrwa.generate import parser
    from fastrwa.models import ByteLM
    default = inspect.signature(ByteLM.generate).parameters["temperature"].default
    assert parser().parse_args(["run"]).temperature == default == 1.0
