"""fastrwa's device code, installed as ``fastrwa.kernels`` (the repository's top-level
``kernels/``): one folder per target and the codes both share.

* :mod:`.codes`: attention/discount names and codes, numeric constants (no imports).
* :mod:`.triton`: the ``@triton.jit`` kernels (GPU; CPU tensors under ``TRITON_INTERPRET=1``).
* :mod:`.cpu`: the numba kernels and their float math (CPU).

Nothing here imports the host side (``fastrwa/``); the launchers in ``fastrwa/ops/`` import
these modules. Importing this package is cheap: ``triton`` and ``numba`` load with the
target's modules.
"""
