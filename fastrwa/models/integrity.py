"""A checksum of an export's weights, and the configuration they were written with, kept in
the safetensors file's own metadata: written by ``FastRWAForCausalLM.save_pretrained``,
verified by its ``from_pretrained`` and by :func:`fastrwa.models.load_pretrained` (a flipped
bit in a weight loaded silently before; ``model.pt`` has its CRC-32s, docs/hf.md).

The digest is SHA-256 over every tensor of the file in name order: its name, dtype, shape
and raw bytes. A file without it (written elsewhere, or before) loads with a warning. A file
cut short or with a damaged header is the same error as one that fails its digest
(:func:`damaged`). The configuration (:data:`fastrwa.models.directory.ARCHITECTURE_KEY`)
is compared with ``config.json`` by the loaders
(:func:`fastrwa.models.directory.check_architecture`).
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from .config import LMConfig
from .directory import ARCHITECTURE_KEY, architecture_json
from .files import write_atomically

DIGEST_KEY = "fastrwa_sha256"


def damaged(path: Path, how: str) -> ValueError:
    """The error of a damaged weights file ``path`` (``how``: what is wrong with it)."""
    return ValueError(f"{path}: the weights are damaged ({how}); export the model again with "
                      f"python -m fastrwa.hf.export")


def _not_whole(path: Path, exc: SafetensorError) -> ValueError:
    return damaged(path, f"not a whole safetensors file: cut short, or its header damaged: "
                         f"{exc}")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``; :func:`damaged` if it cannot be read
    as one (an ``OSError``, e.g. no permission, is raised as it is)."""
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise _not_whole(path, exc) from exc


def read_metadata(path: Path) -> dict[str, str]:
    """The metadata of the safetensors file ``path`` (``{}`` if it has none); :func:`damaged`
    if its header cannot be read."""
    try:
        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except SafetensorError as exc:
        raise _not_whole(path, exc) from exc


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest(path: Path) -> str:
    """The SHA-256 of the tensors in the safetensors file ``path`` (module doc)."""
    return _digest(read_tensors(path))


def sign(directory: Path, config: LMConfig) -> None:
    """Rewrite every ``*.safetensors`` of ``directory`` with its digest and ``config`` (the
    configuration its weights were written with) in the metadata (the tensors and the other
    metadata unchanged), through a temporary file renamed into place
    (:func:`fastrwa.models.files.write_atomically`: mode 0666 less the umask, as an
    ordinary file; safetensors' own writer leaves 0600)."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors = read_tensors(path)
        metadata = {**read_metadata(path), DIGEST_KEY: _digest(tensors),
                    ARCHITECTURE_KEY: architecture_json(config)}
        data = save(tensors, metadata=metadata)
        write_atomically(path, lambda f, data=data: f.write(data))


def verify(directory: Path) -> None:
    """Check every ``*.safetensors`` of ``directory`` against its digest: :func:`damaged` on
    a mismatch or a file that is not a whole safetensors file, a warning for a file without
    a digest."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        stored = read_metadata(path).get(DIGEST_KEY)
        if stored is None:
            warnings.warn(f"{path} has no {DIGEST_KEY} checksum (written by another tool, or "
                          f"before fastrwa kept one): its weights cannot be verified",
                          stacklevel=3)
        elif digest(path) != stored:
            raise damaged(path, "they do not match the checksum stored with them: a flipped "
                                "bit, a partial copy")


def recorded_architecture(directory: Path) -> Optional[str]:
    """The configuration recorded with the weights of ``directory``'s ``*.safetensors`` (the
    first that has one), or ``None`` (written before fastrwa recorded it, or by another
    tool)."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        recorded = read_metadata(path).get(ARCHITECTURE_KEY)
        if recorded is not None:
            return recorded
    return None
