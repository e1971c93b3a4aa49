"""Exporting fastrwa models for other runtimes (the ``onnx`` extra: ``pip install -e
'.[onnx]'`` in a fastrwa clone).

* :func:`export_onnx`: a :class:`fastrwa.models.ByteLM` (or a run or model directory) as
  ``prompt.onnx`` and ``step.onnx``, standard ONNX that onnxruntime loads as is;
  ``python -m fastrwa.export onnx RUN_OR_MODEL_DIR OUT_DIR`` from the shell.
* :func:`export_layer_step`: the step of a ``fastrwa.nn.RWA`` / ``RDA`` layer;
  :class:`LayerStep` and :func:`exportable_steps` put the same step into a user's own
  module exported with ``torch.onnx.export``.
* :class:`OnnxLM`: the exported files run with onnxruntime and NumPy.

docs/onnx.md. The ONNX parts import ``onnx`` and ``onnxruntime`` when first used.
"""

from __future__ import annotations

import importlib

from .steps import (ByteLMStep, LayerStep, check_exportable, exportable_steps, flat_state,
                    layer_step, nested_state, state_names)

_LAZY = {"export_onnx": ".onnx", "bytelm_onnx": ".onnx", "export_layer_step": ".onnx",
         "layer_step_onnx": ".onnx", "prompt_from_step": ".onnx", "quantize_int8": ".onnx",
         "float16_weights": ".onnx", "OnnxLM": ".runtime"}

__all__ = ["ByteLMStep", "LayerStep", "check_exportable", "exportable_steps", "flat_state",
           "layer_step", "nested_state", "state_names", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
