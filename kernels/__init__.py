"""Device code of fastrwa: the Triton GPU kernels and the numba CPU kernels (``cpu_*.py``).

Installed as ``fastrwa.kernels`` (see ``pyproject.toml``). Modules here import ``triton`` or
``numba`` and nothing from ``fastrwa`` or ``torch.nn``; the host launchers in ``fastrwa``
(``triton_backend.py``, ``cpu_backend.py``) call them. docs/kernels.md describes both sets.
"""

import hashlib
from pathlib import Path


def _drop_stale_numba_cache() -> None:
    """numba keys each cached kernel on its own source file only, but the CPU kernels call
    one another across files (``cpu_team`` -> ``cpu_scan`` -> ``cpu_rows`` -> ``cpu_math``):
    after an edit of one file, the others would load machine code built from the old one.
    A hash of all ``cpu_*.py`` is kept beside the in-tree cache; when it differs, the cached
    CPU kernels are dropped and recompile on first use. (An installed package that cannot
    write here caches elsewhere; a reinstall rewrites every file, which numba sees.)"""
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(here.glob("cpu_*.py"))))
    cache, text = here / "__pycache__", digest.hexdigest()
    stamp = cache / "fastrwa-cpu-kernels.sha256"
    try:
        if stamp.read_text() == text:
            return
    except OSError:
        pass
    try:
        for old in cache.glob("cpu_*.nb[ic]"):
            old.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(text)
    except OSError:
        pass


_drop_stale_numba_cache()
