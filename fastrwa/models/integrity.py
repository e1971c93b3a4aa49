"""A checksum of an export's weights, kept in the safetensors file's own metadata: written
by ``FastRWAForCausalLM.save_pretrained``, verified by its ``from_pretrained`` and by
:func:`fastrwa.models.load_pretrained` (a flipped
bit in a weight loaded silently before; ``model.pt`` has its CRC-32s, docs/hf.md).

The digest is SHA-256 over every tensor of the file in name order: its name, dtype, shape
and raw bytes. A file without it (written elsewhere, or before) loads with a warning.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DIGEST_KEY = "fastrwa_sha256"


def digest(path: Path) -> str:
    """The SHA-256 of the tensors in the safetensors file ``path`` (module doc)."""
    h = hashlib.sha256()
    tensors = load_file(str(path))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sign(directory: Path) -> None:
    """Rewrite every ``*.safetensors`` of ``directory`` with its digest in the metadata
    (the tensors and the other metadata unchanged; written beside and renamed into place)."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            metadata = dict(f.metadata() or {})
        metadata[DIGEST_KEY] = digest(path)
        tmp = path.with_name(path.name + ".tmp")
        save_file(load_file(str(path)), str(tmp), metadata=metadata)
        tmp.replace(path)


def verify(directory: Path) -> None:
    """Check every ``*.safetensors`` of ``directory`` against its digest: ``ValueError`` on
    a mismatch, a warning for a file without one."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            stored = (f.metadata() or {}).get(DIGEST_KEY)
        if stored is None:
            warnings.warn(f"{path} has no {DIGEST_KEY} checksum (written by another tool, or "
                          f"before fastrwa kept one): its weights cannot be verified",
                          stacklevel=3)
        elif digest(path) != stored:
            raise ValueError(f"{path}: the weights do not match the checksum stored with them "
                             f"(the file is damaged: a flipped bit, a partial copy); export "
                             f"the model again with python -m fastrwa.hf.export")
