"""The "torch" backend: the chunked scan and its analytic backward on PyTorch ops.

Runs on every device and dtype PyTorch supports; "auto" takes it where no faster backend
claims the tensors (CPU without numba, devices other than CUDA, float64 on CUDA).
"""

import importlib

from ...contract import BackendEntry

ENTRY = BackendEntry(
    name="torch",
    refusal=lambda device, dtype: None,
    auto=lambda device, dtype: True,
    load=lambda: importlib.import_module(".host", __name__),
)
