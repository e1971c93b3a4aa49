"""Output allocation for the backends: huge pages for large CPU buffers, NaN poisoning for tests.

Backends allocate with :func:`empty` (never ``torch.zeros``) for buffers they fully write.
Tests switch on :func:`set_poison`, so an entry a backend forgets to write shows up as NaN.

Large CPU buffers are advised to use transparent huge pages (``madvise(MADV_HUGEPAGE)``,
Linux) before anything touches them. A fresh 64 MB tensor otherwise costs 16,384 page
faults on first write, which took longer than the whole scan on this project's machine
(docs/benchmarks.md). The advice is only that: where huge pages are off nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

_POISON = False
_MADV_HUGEPAGE = 14
_HUGE = 2 << 20            # advise buffers of at least 2 huge pages
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        _libc = None


def set_poison(enabled: bool) -> None:
    """Fill every fresh buffer with NaN (tests only)."""
    global _POISON
    _POISON = bool(enabled)


def advise_huge_pages(x: torch.Tensor) -> bool:
    """Ask the kernel to back the 2 MB-aligned part of a CPU tensor with huge pages.

    Returns whether the advice was given (Linux, a CPU tensor of at least 4 MB); a refusal
    by the kernel is ignored (the tensor is then simply backed by small pages).
    """
    nbytes = x.untyped_storage().nbytes()
    if _libc is None or x.device.type != "cpu" or nbytes < 2 * _HUGE:
        return False
    start = x.untyped_storage().data_ptr()
    lo = (start + _HUGE - 1) // _HUGE * _HUGE
    hi = (start + nbytes) // _HUGE * _HUGE
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
    return True


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(out)
    if _POISON:
        out.fill_(float("nan"))
    return out


def empty_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(x.shape, dtype or x.dtype, x.device)
