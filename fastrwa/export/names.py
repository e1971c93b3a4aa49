"""The format of an ONNX export directory, shared by :mod:`fastrwa.export.onnx` (which
writes it) and :mod:`fastrwa.export.runtime` (which reads it; it imports neither torch nor
onnx, so this module imports only the standard library)."""

from __future__ import annotations

import hashlib


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
