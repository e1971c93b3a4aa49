"""The "triton" backend: Triton kernels (``scan_fwd``, ``scan_bwd``, ``step``, with shared
device code in ``common`` and ``sequence``) and their launchers (``host``).

Runs on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before the
kernels were imported (how the tests run it without a GPU). Inputs of float16, bfloat16 or
float32; everything computes in float32. "auto" takes it for CUDA tensors.
"""

from __future__ import annotations

import importlib
import os

import torch

from ...contract import BackendEntry


def _refusal(device: torch.device, dtype: torch.dtype) -> Exception | None:
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return RuntimeError(
            f"fastrwa backend 'triton' needs CUDA tensors (or CPU tensors with "
            f"TRITON_INTERPRET=1 set before import), got tensors on {device}; "
            f"use fastrwa.use_backend('torch') or 'auto'")
    if dtype == torch.float64:
        return TypeError("fastrwa backend 'triton' takes float32, bfloat16 or float16 inputs "
                         "(it computes in float32), got torch.float64; use the 'torch' backend")
    return None


ENTRY = BackendEntry(
    name="triton",
    refusal=_refusal,
    auto=lambda device, dtype: device.type == "cuda",
    load=lambda: importlib.import_module(".host", __name__),
)
