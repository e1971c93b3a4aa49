"""The "numba" backend: compiled CPU kernels (``scan_fwd``, ``scan_bwd``, ``step``, on the
row operations of ``rows`` and the vectorisable float32 math of ``fmath``), their launcher
(``host``), and how calls are spread over threads (``threads``, ``team``).

Runs on CPU tensors of every float dtype; "auto" takes it for CPU tensors when numba imports
(and can cache its machine code). ``cache`` keeps numba's on-disk cache consistent across
the kernel files.
"""

from __future__ import annotations

import importlib

import torch

from ...contract import BackendEntry


def _refusal(device: torch.device, dtype: torch.dtype) -> Exception | None:
    if device.type != "cpu":
        return RuntimeError(f"fastrwa backend 'numba' runs on CPU tensors, got tensors on "
                            f"{device}; use fastrwa.use_backend('triton'), 'torch' or 'auto'")
    return None


ENTRY = BackendEntry(
    name="numba",
    refusal=_refusal,
    auto=lambda device, dtype: device.type == "cpu",
    load=lambda: importlib.import_module(".host", __name__),
)
