"""The file names of an ONNX export directory, shared by :mod:`fastrwa.export.onnx` (which
writes them) and :mod:`fastrwa.export.runtime` (which reads them; it imports neither torch
nor onnx, so this module imports nothing)."""

PROMPT, STEP, CONFIG = "prompt.onnx", "step.onnx", "onnx_config.json"
EXPORT_FILES = frozenset((PROMPT, STEP, CONFIG))
