"""A model directory read by every loader (``load_pretrained``, the Auto classes through
``fastrwa.hf``, ``python -m fastrwa.generate``), issue 53: a ``config.json`` that no longer
matches the weights is refused (item 2), a cut-short or damaged ``model.safetensors`` is the
one-line "weights are damaged" error (item 7), and the files written honour the umask
(item 13). Exported weights carry CRCs (a file saved without them is unverified, not
corrupt), a flipped byte in ``model.pt`` is refused, and an unreadable archive is an OSError,
not "corrupt". The parts through transformers are skipped where the ``hf`` extra is absent
and not under CI (as tests/hf/test_hf.py)."""

import json
import os
import re
import stat
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from fastrwa.generate import main as generate_main
from fastrwa.models import ByteLM, LMConfig, build, load_pretrained, save_pretrained
from fastrwa.models.pretrained import save_with_crcs, weights_file, write_atomically

PROMPT = torch.tensor([[104, 105, 33]])


def _hf():
    """``fastrwa.hf`` (the test is skipped without transformers, except under CI)."""
    if not os.environ.get("CI"):
        pytest.importorskip("transformers")
    import fastrwa.hf
    return fastrwa.hf


def _auto(directory):
    from transformers import AutoModelForCausalLM
    _hf()
    return AutoModelForCausalLM.from_pretrained(directory)


def _cli_error(directory, capsysbinary) -> str:
    """The one line ``python -m fastrwa.generate DIRECTORY`` prints, exiting 2."""
    capsysbinary.readouterr()                  # (what the test printed before: not the CLI's)
    assert generate_main([str(directory), "--max-new", "2", "--device", "cpu"]) == 2
    out = capsysbinary.readouterr()
    err = out.err.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    assert out.out == b""
    return lines[0]


@pytest.fixture
def model() -> ByteLM:
    torch.manual_seed(0)
    return ByteLM(LMConfig(d_model=16, n_layers=2, mlp_ratio=2)).eval()


@pytest.fixture(params=["model.pt", "model.safetensors"])
def directory(request, model, tmp_path):
    """The model's directory as a run writes it (model.pt) or as the export (safetensors)."""
    if request.param == "model.pt":
        save_pretrained(model, tmp_path / "m")
    else:
        _hf().FastRWAForCausalLM.from_bytelm(model).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _edit(directory, **fields) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _logits(loaded) -> torch.Tensor:
    """The logits of PROMPT by a loaded ByteLM or FastRWAForCausalLM."""
    with torch.no_grad():
        return (loaded(PROMPT)[0] if isinstance(loaded, ByteLM) else loaded(PROMPT).logits)


# -- item 2: config.json against the configuration recorded with the weights ---------------
@pytest.mark.parametrize("field,given,saved", [
    ("attention", "exp", "sigmoid"), ("f_h", "tanh", "identity"), ("n_layers", 1, 2),
    ("d_model", 32, 16), ("preset", "exp-tanh", None), ("tie_embeddings", False, True)])
def test_a_config_json_that_no_longer_matches_its_weights_is_refused_by_every_loader(
        directory, field, given, saved, capsysbinary):
    """Each edit loaded silently with other logits (attention, f_h, preset), or through
    the Auto classes with only an unexpected-keys report (n_layers 1)."""
    key = "tie_word_embeddings" if field == "tie_embeddings" else field
    _edit(directory, **{key: given})
    words = f"{directory / 'config.json'} does not match the weights {weights_file(directory)}"
    said = f"{field} is {given!r} there, the weights were written with {field} {saved!r}"
    with pytest.raises(ValueError) as error:
        load_pretrained(directory)
    message = str(error.value)
    assert message.startswith(words) and said in message and "\n" not in message, message
    assert said in _cli_error(directory, capsysbinary)
    with pytest.raises(ValueError, match="does not match the weights") as error:
        _auto(directory)
    assert said in str(error.value)


def test_settings_that_do_not_change_the_computation_still_load(directory, model):
    """Generation defaults, token ids and the keys transformers adds to config.json, the
    initialisation (discount_init), a field the layer does not read (context, n_heads for
    rda) and a preset that sets the functions the weights were written with: every loader
    loads the same logits."""
    want = _logits(model)
    _edit(directory, max_length=50, temperature=0.7, do_sample=True, sep_token_id=3,
          decoder_start_token_id=256, transformers_version="9.9.9", torch_dtype="float32",
          architectures=["FastRWAForCausalLM"], discount_init="spread", context=64, n_heads=2,
          preset="sigmoid-id")
    assert torch.equal(_logits(load_pretrained(directory)), want)
    assert torch.equal(_logits(_auto(directory)), want)
    assert generate_main([str(directory), "--max-new", "2", "--device", "cpu"]) == 0


def test_a_configuration_given_to_from_pretrained_is_checked_too(directory):
    """(A model.pt directory refuses any other configuration: it loads as it was saved.)"""
    fhf = _hf()
    other = fhf.FastRWAConfig(d_model=16, n_layers=2, mlp_ratio=2, attention="exp")
    with pytest.raises(ValueError, match="the configuration given to from_pretrained does not "
                                         "match the weights .*attention is 'exp' there, the "
                                         "weights were written with attention 'sigmoid'"
                                         "|config must be the configuration .* holds"):
        fhf.FastRWAForCausalLM.from_pretrained(directory, config=other)


def test_a_transformers_context_is_part_of_what_it_computes(tmp_path):
    """The window of a TransformerLM changes its logits (an rda ignores context)."""
    save_pretrained(build(LMConfig(layer="transformer", d_model=16, n_heads=2, n_layers=1,
                                   context=8)), tmp_path / "t")
    _edit(tmp_path / "t", context=16)
    with pytest.raises(ValueError, match="context is 16 there, the weights were written with "
                                         "context 8"):
        load_pretrained(tmp_path / "t")


def test_directories_written_before_the_record_load_as_their_config_json_says(
        directory, model, recwarn):
    """No configuration recorded with the weights (fastrwa before this check): config.json is
    taken as it is, with no warning (docs/hf.md)."""
    if (directory / "model.pt").exists():
        save_with_crcs(model.state_dict(), directory / "model.pt")   # (no _metadata record)
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        from fastrwa.models.directory import ARCHITECTURE_KEY
        path = str(directory / "model.safetensors")
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
        del metadata[ARCHITECTURE_KEY]
        save_file(load_file(path), path, metadata=metadata)
    _edit(directory, attention="exp")
    assert load_pretrained(directory).config.attention == "exp"
    assert _auto(directory).config.attention == "exp"
    assert not [w for w in recwarn.list if "fastrwa" in str(w.message)], recwarn.list


# -- item 7: a damaged model.safetensors -------------------------------------------------
DAMAGES = ("cut short in the tensors", "cut short in the header", "one byte short", "empty",
           "a damaged header length", "a damaged header")


def _damaged(data: bytes, damage: str) -> bytes:
    """``data``, a safetensors file (8 bytes of header length, the JSON header, the
    tensors), with ``damage`` done to it."""
    header = struct.unpack("<Q", data[:8])[0]
    middle = 8 + header // 2                      # (a byte inside the JSON header)
    return {"cut short in the tensors": lambda: data[:len(data) // 2],
            "cut short in the header": lambda: data[:100],
            "one byte short": lambda: data[:-1],
            "empty": lambda: b"",
            "a damaged header length": lambda: struct.pack("<Q", header + 5) + data[8:],
            "a damaged header": lambda: data[:middle] + b"\x00" + data[middle + 1:]}[damage]()


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_cut_short_or_damaged_safetensors_is_the_damaged_weights_error(
        model, tmp_path, damage, capsysbinary):
    """The one-line error a flipped bit gives, naming the file, from every loader (it was
    safetensors' raw SafetensorError, and a traceback in the generate CLI)."""
    fhf = _hf()
    fhf.FastRWAForCausalLM.from_bytelm(model).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    path.write_bytes(_damaged(path.read_bytes(), damage))
    words = f"{path}: the weights are damaged"
    with pytest.raises(ValueError, match="the weights are damaged") as error:
        load_pretrained(tmp_path / "m")
    assert str(error.value).startswith(words) and "\n" not in str(error.value)
    assert words in _cli_error(tmp_path / "m", capsysbinary)
    with pytest.raises(ValueError, match="the weights are damaged") as error:
        _auto(tmp_path / "m")
    assert str(error.value).startswith(words)


def test_a_cut_short_model_pt_is_a_one_line_error_naming_it(model, tmp_path, capsysbinary):
    """The other weights file, a run's: every record's CRC-32 (already so: kept)."""
    save_pretrained(model, tmp_path / "m")
    path = tmp_path / "m" / "model.pt"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=re.escape(f"{path} is corrupt")):
        load_pretrained(tmp_path / "m")
    assert f"{path} is corrupt" in _cli_error(tmp_path / "m", capsysbinary)


# -- item 13: file modes -----------------------------------------------------------------
@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)], ids=["022", "027"])
def test_the_files_written_honour_the_umask(model, tmp_path, umask, mode):
    """As an ordinary file: model.safetensors was 0600 whatever the umask (safetensors'
    writer), so others could not read a shared export."""
    fhf = _hf()
    from fastrwa.hf.export import main as export_main

    before = os.umask(umask)
    try:
        save_pretrained(model, tmp_path / "run" / "model")
        fhf.FastRWAForCausalLM.from_bytelm(model).save_pretrained(tmp_path / "direct")
        assert export_main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(before)
    for directory in (tmp_path / "run" / "model", tmp_path / "direct", tmp_path / "hf"):
        modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in directory.iterdir()}
        assert set(modes.values()) == {oct(mode)}, (directory.name, modes)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o777 & ~umask


# -- write_atomically --------------------------------------------------------------------
@pytest.mark.parametrize("raised", [KeyboardInterrupt, ZeroDivisionError])
def test_an_interrupted_write_leaves_no_tmp_file(tmp_path, raised):
    """A ``KeyboardInterrupt`` (or any exception but the ``OSError``/``RuntimeError`` that
    become a :class:`WriteError`) in the middle of a write removes ``NAME.tmp`` and is
    raised as it is; the earlier file is kept (it left ``config.json.tmp`` behind)."""
    path = tmp_path / "config.json"
    path.write_bytes(b"earlier")

    def write(f):
        f.write(b"half")
        raise raised

    with pytest.raises(raised):
        write_atomically(path, write)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert path.read_bytes() == b"earlier"


# -- exported weights carry CRCs, and a damaged export is refused --------------------------
def _record_data_offset(path: Path, suffix: str) -> int:
    """Where the bytes of the zip record whose name ends with ``suffix`` start."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = int.from_bytes(header[26:28], "little"), \
        int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def test_an_export_with_a_flipped_byte_is_refused(tmp_path):
    from fastrwa.models import LMConfig, build, load_pretrained, save_pretrained

    model = build(LMConfig(d_model=8, n_layers=1))
    save_pretrained(model, tmp_path / "m")
    weights = tmp_path / "m" / "model.pt"
    data = bytearray(weights.read_bytes())
    data[_record_data_offset(weights, "data/0") + 3] ^= 0x7F   # the embedding's first value
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.pt is corrupt.*CRC"):
        load_pretrained(tmp_path / "m")


def test_our_saves_write_crcs_and_a_file_without_crcs_is_unverified_not_corrupt(tmp_path):
    from fastrwa.models import LMConfig, build, load_pretrained, save_pretrained

    model = build(LMConfig(d_model=8, n_layers=1))
    serialization = torch.serialization
    serialization.set_crc32_options(False)
    try:
        save_pretrained(model, tmp_path / "m")           # ours: CRCs written anyway
        assert serialization.get_crc32_options() is False          # and the option restored
        with zipfile.ZipFile(tmp_path / "m" / "model.pt") as z:
            assert all(i.CRC != 0 for i in z.infolist() if i.file_size > 0)
        torch.save(model.state_dict(), tmp_path / "m" / "model.pt")   # someone else's
    finally:
        serialization.set_crc32_options(True)
    with pytest.warns(UserWarning, match="written without CRCs.*cannot be verified"):
        load_pretrained(tmp_path / "m")


def test_an_unreadable_archive_is_an_oserror_not_corrupt(tmp_path, monkeypatch):
    import errno as errno_
    from fastrwa.models import storage

    path = tmp_path / "checkpoint.pt"
    torch.save({"a": torch.ones(2)}, path)

    def denied(*args, **kwargs):
        raise PermissionError(errno_.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(storage.zipfile, "ZipFile", denied)
    with pytest.raises(PermissionError, match="Permission denied"):
        storage.check_archive(path, "checkpoint")
