"""Device code of fastrwa: the Triton GPU kernels and the numba CPU kernels (``cpu_*.py``).

Installed as ``fastrwa.kernels`` (see ``pyproject.toml``). Modules here import ``triton`` or
``numba`` and nothing from ``fastrwa`` or ``torch.nn``; the host launchers in ``fastrwa``
(``triton_backend.py``, ``cpu_backend.py``) call them. docs/kernels.md describes both sets.
"""
