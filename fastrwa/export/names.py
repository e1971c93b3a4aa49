"""The format of an ONNX export directory, shared by :mod:`fastrwa.export.onnx` (which
writes it) and :mod:`fastrwa.export.runtime` (which reads it; it imports neither torch nor
onnx, so this module imports only the standard library)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional


PROMPT, STEP, CONFIG = "prompt.onnx", "step.onnx", "onnx_config.json"
EXPORT_FILES = frozenset((PROMPT, STEP, CONFIG))
GRAPHS = (PROMPT, STEP)

# onnx_config.json's "format" and "version"; version 2 records each graph's size and
# SHA-256 under FILES_KEY (version 1, before it, did not).
FORMAT, VERSION = "fastrwa-onnx", 2
FILES_KEY = "files"
# Each .onnx file's metadata_props[PROPS_KEY]: these fields of onnx_config.json, as JSON.
PROPS_KEY = "fastrwa"
PROPS = ("format", "version", "weights", "vocab_size", "bos_token", "bytes")

WHAT = "fastrwa ONNX export"              # (what the directory errors call it)
# The temporary files an older version wrote inside the directory (a killed run left them).
OLD_LEFTOVERS = frozenset(f".{name}.tmp" for name in EXPORT_FILES)


def file_record(content: bytes) -> dict:
    """What onnx_config.json records of a graph file of ``content``: its size and SHA-256."""
    return {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}


def foreign_files(directory: Path) -> Optional[str]:
    """``None`` if ``directory`` is an earlier ONNX export (its plain files only, an older
    version's leftover ``.NAME.tmp`` included, and an ``onnx_config.json`` of this format
    beside any graph), which ``--overwrite`` may replace; else why not, in a few words."""
    entries = list(directory.iterdir())
    names = {p.name for p in entries}
    others = sorted(names - EXPORT_FILES - OLD_LEFTOVERS)
    if others:
        more = f" and {len(others) - 1} other file{'s' * (len(others) > 2)}" \
            if len(others) > 1 else ""
        return f"it holds {others[0]}{more}"
    odd = sorted(p.name for p in entries if p.is_symlink() or not p.is_file())
    if odd:
        return f"its {odd[0]} is not a plain file"
    if names & EXPORT_FILES and CONFIG not in names:
        return f"it has no {CONFIG}"
    if CONFIG in names:
        try:
            config = json.loads((directory / CONFIG).read_text())
        except (OSError, ValueError):
            return f"its {CONFIG} cannot be read"
        if not isinstance(config, dict) or config.get("format") != FORMAT:
            return f"its {CONFIG} is not of format {FORMAT!r}"
    return None
