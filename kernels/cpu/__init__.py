"""The CPU kernels, compiled by numba: ``scan_fwd`` (forward and the in-place streaming step
of the weighted scan), ``scan_bwd`` (its backward), ``decode`` (the fused decode step of the
byte LM, with the activations of ``activations``, shared among threads by ``sync``), on the
row operations of ``rows`` and the vectorisable float math of ``fmath``. Launched by
``fastrwa/ops/numba_host.py`` (the scan), which runs a call's tasks on one thread or on a
pool of plain threads (the kernels release the GIL), and ``fastrwa/ops/decode_host.py``.

This module holds how they are compiled: the numba options (one place), and the on-disk
cache kept consistent across the kernel files. Every kernel module imports :data:`kernel`.

Options: ``nogil`` (calls run on several threads at once), ``cache`` (machine code kept on
disk beside the package), ``error_model="numpy"`` (a division by zero gives inf/NaN as in
NumPy: no exception test in the loops, which would keep LLVM from vectorising them),
``fastmath={"contract"}`` (fused multiply-add allowed; nothing that reorders arithmetic,
so results do not depend on the vector width).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from numba import njit

OPTIONS = dict(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
kernel = njit(**OPTIONS)
# Kernels whose sums may be reordered (``reassoc``): the dot products of the decode step
# (decode.py), which vectorise only so. Their results depend on the vector width, within
# float32 rounding; the scan kernels never use this.
reducing_kernel = njit(**dict(OPTIONS, fastmath={"contract", "reassoc"}))


def drop_stale_cache() -> None:
    """numba keys each cached function on its own source file only, but the kernels call one
    another across files (``scan_bwd`` -> ``scan_fwd`` -> ``rows`` -> ``fmath``): after an edit
    of one file, the others would load machine code built from the old one. A hash of every
    ``*.py`` here is kept beside the cache; when it differs, the cached functions are dropped
    and recompile on first use. (An installed package that cannot write here caches
    elsewhere; a reinstall rewrites every file, which numba sees.)"""
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(here.glob("*.py"))))
    cache, text = here / "__pycache__", digest.hexdigest()
    stamp = cache / "fastrwa-numba-kernels.sha256"
    try:
        if stamp.read_text() == text:
            return
    except OSError:
        pass
    try:
        for old in cache.glob("*.nb[ic]"):
            old.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(text)
    except OSError:
        pass


drop_stale_cache()
