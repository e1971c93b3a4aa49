"""Save and read a language model as a directory of ``config.json`` and ``model.pt`` or
``model.safetensors`` (the format of :mod:`fastrwa.models.directory`: what a training run
and the Hugging Face export write), without building a model: the model classes save and
load themselves through this module, and :mod:`fastrwa.models.pretrained` (above them)
builds any of them from a directory."""

from __future__ import annotations

import errno
import json
import os
import warnings
import zipfile
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch import nn

from ..extras import install_hint
from . import directory as fmt
from .files import WriteError, write_atomically  # noqa: F401 (WriteError: callers import it here)
from .config import FIELDS_BEFORE_THEY_EXISTED, SCAN_LAYERS, LMConfig

WEIGHTS, CONFIG = "model.pt", "config.json"
SAFETENSORS = "model.safetensors"          # (the Hugging Face export's weights)


class Saved(NamedTuple):
    """What a model directory holds (:func:`read_pretrained`): its configuration, its
    weights (a state dict) and the two files they were read from."""

    config: LMConfig
    weights: dict
    weights_path: Path
    config_path: Path


def save_with_crcs(obj, f) -> None:
    """``torch.save(obj, f)`` with CRC-32s written for every record, whatever
    ``torch.serialization.set_crc32_options`` says (the option is restored after; a torch
    without it always writes them): what :func:`check_archive` verifies on reading."""
    serialization = torch.serialization
    if not (hasattr(serialization, "get_crc32_options")
            and hasattr(serialization, "set_crc32_options")):
        torch.save(obj, f)
        return
    before = serialization.get_crc32_options()
    serialization.set_crc32_options(True)
    try:
        torch.save(obj, f)
    finally:
        serialization.set_crc32_options(before)


def check_archive(path: Path, what: str) -> None:
    """Refuse (``ValueError``, naming ``path``) a file that is not a ``torch.save`` zip whose
    every record matches the CRC-32 stored with it: an empty or cut-short file, a pickle
    (never unpickled here), one flipped byte (which would otherwise load as a silently
    different number). A file written with ``torch.serialization.set_crc32_options(False)``
    (every record's CRC-32 is 0) cannot be verified: it is accepted with a warning. An
    ``OSError`` reading it (no permission, an I/O error) is raised as it is."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = [i for i in archive.infolist() if i.file_size > 0]
            if records and all(i.CRC == 0 for i in records):
                warnings.warn(f"{what} {path} was written without CRCs "
                              f"(torch.serialization.set_crc32_options(False)): it cannot be "
                              f"verified; loading it unchecked", stacklevel=2)
                return
            bad = archive.testzip()
    except OSError as exc:
        if exc.errno not in (None, errno.EINVAL):    # EACCES, EIO ...: not the file's bytes
            raise
        raise ValueError(f"{what} {path} is corrupt or not a torch.save archive "
                         f"({type(exc).__name__}: {exc})") from exc
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as exc:
        raise ValueError(f"{what} {path} is corrupt or not a torch.save archive "
                         f"({type(exc).__name__}: {exc})") from exc
    if bad is not None:
        raise ValueError(f"{what} {path} is corrupt: record {bad} fails its CRC check "
                         f"(damaged bytes)")


def save_pretrained(model: nn.Module, directory: str | os.PathLike,
                    training: Optional[dict] = None, results: Optional[dict] = None) -> None:
    """Write ``model.config`` to ``directory/config.json`` and the weights (tensors only,
    with the configuration they are written with in the state dict's metadata:
    :data:`fastrwa.models.directory.ARCHITECTURE_KEY`) to ``directory/model.pt``, each
    through a temporary file and ``os.replace``
    (:func:`write_atomically`: a failed write raises :class:`WriteError` and leaves no
    temporary file). For a :class:`ByteLM` the directory is also a Hugging Face model
    (:mod:`fastrwa.models.directory`): ``config.json`` in ``FastRWAConfig``'s keys, the
    generation and tokenizer configurations, the ``auto_map`` modules and ``README.md``,
    the model card, with ``training`` (settings) and ``results`` (e.g. validation bpc)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    hf = model.config.layer in SCAN_LAYERS          # a ByteLM (what build makes of it)
    config = fmt.config_json(model.config) if hf else model.config.to_dict()
    files = {CONFIG: json.dumps(config, indent=2)}
    if hf:
        params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
        files.update({
            "generation_config.json": json.dumps(fmt.generation_config_json(model.config),
                                                 indent=2),
            "tokenizer_config.json": json.dumps(fmt.tokenizer_config_json(), indent=2),
            **{name: fmt.remote_code(name) for name in fmt.REMOTE_CODE},
            "README.md": fmt.model_card(model.config, params, training, results)})
    for name, text in files.items():
        data = text.encode()
        write_atomically(path / name, lambda f, data=data: f.write(data))
    state = model.state_dict()
    if getattr(state, "_metadata", None) is None:     # (nn.Module.state_dict always has it)
        state._metadata = {}
    state._metadata[fmt.ARCHITECTURE_KEY] = fmt.architecture_json(model.config)
    write_atomically(path / WEIGHTS, lambda f: save_with_crcs(state, f))


def weights_file(directory: Path) -> Optional[Path]:
    """The weights of a model directory: ``model.pt``, else ``model.safetensors``, else
    ``None``."""
    for name in (WEIGHTS, SAFETENSORS):
        if (directory / name).is_file():
            return directory / name
    return None


def read_config(directory: Path) -> LMConfig:
    """The :class:`LMConfig` of a model directory's ``config.json`` (a field it lacks, its
    value before the field existed: :data:`FIELDS_BEFORE_THEY_EXISTED`); a ``ValueError``
    naming the file if it is not one."""
    try:
        return LMConfig.from_dict({**FIELDS_BEFORE_THEY_EXISTED, **fmt.lm_config_fields(
            json.loads((directory / CONFIG).read_text()))})
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{directory / CONFIG} is not a language-model configuration "
                         f"({exc})") from exc


def _read_safetensors(path: Path, config: LMConfig) -> tuple[dict, Optional[str]]:
    """The state dict of a Hugging Face export's ``model.safetensors`` for a model of
    ``config`` (its checksum verified: :mod:`fastrwa.models.integrity`): the keys without
    the ``model.`` prefix of ``FastRWAForCausalLM``, a tied head (not stored) as the
    embedding; and the configuration recorded with it (``None``: written before that)."""
    try:
        from .integrity import read_tensors, recorded_architecture, verify
    except ImportError as exc:
        raise ValueError(f"{path} is a Hugging Face export's weights: reading them needs "
                         f"safetensors: {install_hint('hf')}") from exc
    verify(path.parent)
    weights = {k.removeprefix("model."): v for k, v in read_tensors(path).items()}
    if config.tie_embeddings and "head.weight" not in weights and "embed.weight" in weights:
        weights["head.weight"] = weights["embed.weight"]
    return weights, recorded_architecture(path.parent)


def _read_model_pt(path: Path, map_location) -> tuple[object, Optional[str]]:
    """The state dict in ``model.pt`` (every record's CRC-32 checked first:
    :func:`check_archive`) and the configuration recorded with it (``None``: written
    before that)."""
    check_archive(path, "weights")
    try:
        weights = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:       # no permission, an I/O error: its own message, not "corrupt"
        raise
    except Exception as exc:  # any unreadable file is reported the same way
        raise ValueError(f"weights {path} cannot be read ({type(exc).__name__}: "
                         f"{str(exc)[:300]})") from exc
    metadata = getattr(weights, "_metadata", None)
    return weights, (metadata.get(fmt.ARCHITECTURE_KEY) if isinstance(metadata, dict)
                     else None)


def read_pretrained(directory: str | os.PathLike, map_location=None) -> Saved:
    """The configuration and the weights saved in ``directory`` (what
    :func:`fastrwa.models.load_pretrained` builds a model of; the checks it documents are
    made here), without building a model: a :class:`Saved`."""
    path = Path(directory)
    if not (path / CONFIG).is_file() or weights_file(path) is None:
        if (path / "model" / CONFIG).is_file() and weights_file(path / "model"):
            path = path / "model"           # a training run's directory: its final model
        else:
            raise FileNotFoundError(f"{path} must hold {CONFIG} and {WEIGHTS} or {SAFETENSORS} "
                                    f"(written by save_pretrained or the Hugging Face "
                                    f"export, or a run's directory or its model/ or best/)")
    weights_path = weights_file(path)
    config = read_config(path)
    if weights_path.name == SAFETENSORS:
        weights, recorded = _read_safetensors(weights_path, config)
    else:
        weights, recorded = _read_model_pt(weights_path, map_location)
    fmt.check_architecture(recorded, config, weights_path, str(path / CONFIG))
    return Saved(config, weights, weights_path, path / CONFIG)


def load_weights(model: nn.Module, saved: Saved) -> nn.Module:
    """``model`` (built from ``saved.config``) with ``saved``'s weights, in eval mode; a
    ``ValueError`` naming both files if they do not fit it."""
    try:
        model.load_state_dict(saved.weights)
    except (RuntimeError, TypeError, AttributeError) as exc:   # another model's, or not a dict
        raise ValueError(f"weights {saved.weights_path} do not fit the model "
                         f"{saved.config_path} describes ({type(exc).__name__}: "
                         f"{str(exc)[:300]})") from exc
    return model.eval()


def run_model_dir(run_dir: str | os.PathLike, best: bool = False) -> Path:
    """The model directory of a training run (its final ``model/`` export, or ``best/``
    with ``best``), or ``run_dir`` itself when :func:`save_pretrained` wrote it; a clear
    ``FileNotFoundError`` otherwise."""
    run_dir = Path(run_dir)
    for candidate in ([run_dir / "best"] if best else [run_dir / "model", run_dir]):
        if (candidate / CONFIG).is_file() and weights_file(candidate):
            return candidate
    raise FileNotFoundError(
        f"{run_dir}: no model there " + ("(no best/ export: the run has not evaluated yet)"
                                         if best else "(a run's model/ export appears when it "
                                         "finishes; --best takes the best one so far)"))
