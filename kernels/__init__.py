"""Device code of fastrwa: Triton kernels only.

Installed as ``fastrwa.kernels`` (see ``pyproject.toml``). Modules here import ``triton``
and nothing from ``fastrwa`` or ``torch.nn``; the host launchers in ``fastrwa`` call them.
The Triton kernels arrive with the Triton-backend issue; until then this package is empty.
"""
