"""The backends of the weighted scan, one package each: ``torch`` (PyTorch ops, any device),
``triton`` (GPU kernels), ``numba`` (compiled CPU kernels).

Each package holds its host code (``host.py``, the :class:`fastrwa.ops.contract.Backend`)
beside its device code, and exports ``ENTRY``, which :mod:`fastrwa.ops.registry` lists.
Importing a package is cheap: ``host.py`` (and ``triton``/``numba``) load on first use.
"""
