"""How the numba backend spreads a kernel's tasks over threads.

A kernel call covers tasks ``[0, n)`` (one per sequence and channel block) and always runs
the kernel's compiled C entry point (:mod:`.team`), so the numbers do not depend on the
split. Small calls run on the caller's thread. Larger ones are cut into
``torch.get_num_threads()`` ranges of about equal work and run on:

* **PyTorch's own OpenMP team** where PyTorch loaded a runtime with the GNU entry points
  (``libgomp``, and the LLVM and Intel runtimes, which export them too): through
  ``GOMP_parallel`` and the C entry points of :mod:`.team`. PyTorch's idle
  OpenMP threads keep spinning for a while after each of its parallel ops; a kernel started
  on other threads right after one (in a model, a projection precedes every scan) then
  shares the cores with them. Measured on a 2-core machine right after a ``copy_``: rwa
  forward 1.3-1.5x and RDA forward+backward 1.1-1.25x faster than on a separate pool
  (docs/benchmarks.md).
* otherwise a thread pool (plain threads that sleep when idle).
  ``FASTRWA_CPU_THREADS=pool`` forces it (for comparison), read once per process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import team

# Elements below which a call runs on the caller's thread alone: waking other threads costs
# about 30 microseconds, more than it saves below ~100K elements (measured: B=1, D=256,
# T=256 breaks even, T=512 saves 20%).
SERIAL_BELOW = 1 << 17

@dataclasses.dataclass
class PoolState:
    """The fallback thread pool and the process that made it (a forked child inherits the
    pool object but not its threads: a call from another pid makes a new pool)."""

    executor: ThreadPoolExecutor | None = None
    pid: int = -1


POOL = PoolState()
_pool_lock = threading.Lock()


_forked_child = False


def _after_fork_in_child() -> None:
    global _forked_child
    _forked_child = True
    torch.set_num_threads(1)


# A child forked from a process whose OpenMP team has run hangs in its next parallel region
# (GOMP_parallel, ours or PyTorch's): fork does not copy the team's threads. In the child,
# fastrwa's calls run on the child's own thread, and PyTorch's intra-op threads are set to 1
# (as PyTorch's DataLoader does in its workers), so its own ops do not hang either.
os.register_at_fork(after_in_child=_after_fork_in_child)


def threads() -> int:
    """How many threads a call may use: PyTorch's intra-op setting (one in a forked child)."""
    return 1 if _forked_child else max(1, torch.get_num_threads())


@functools.lru_cache(maxsize=1)
def gomp_parallel():
    """``GOMP_parallel`` of the OpenMP runtime PyTorch loaded (as a ctypes function), or None
    (then large calls run on the thread pool)."""
    if os.environ.get("FASTRWA_CPU_THREADS", "") == "pool":
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:     # not Linux: macOS and Windows wheels use other runtimes
        return None
    # PyTorch's own first (a numba or system OpenMP runtime could be loaded too)
    torch_dir = os.path.dirname(torch.__file__)      # .../torch: also matches torch.libs
    for path in sorted(paths, key=lambda p: (not p.startswith(torch_dir), p)):
        try:
            fn = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0)).GOMP_parallel
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        fn.restype = None
        return fn
    return None


def uses_openmp_team() -> bool:
    """Whether large calls run on PyTorch's OpenMP team (else on fastrwa's thread pool)."""
    return gomp_parallel() is not None


def _ranges(work: np.ndarray, n_blk: int, k: int) -> list[int]:
    """Bounds of ``k`` contiguous task ranges of about equal work (``work``: steps per
    sequence; each sequence has ``n_blk`` tasks)."""
    per_task = np.repeat(np.maximum(work, 1), n_blk)
    share = np.cumsum(per_task) / per_task.sum()
    bounds = [0] + [int(np.searchsorted(share, i / k)) + 1 for i in range(1, k)]
    return sorted(set(min(max(b, 0), len(per_task)) for b in bounds + [len(per_task)]))


def run(name: str, dtype: torch.dtype, work: np.ndarray, n_blk: int, D: int,
        io: tuple, st: tuple, ix: tuple, flags: np.ndarray) -> None:
    """Kernel ``name`` ("forward"/"backward") over all tasks ``[0, len(work) * n_blk)``, on
    one thread or many. The groups are tuples of flat contiguous NumPy arrays
    (:mod:`.layout`). Every path calls the same compiled C entry point of :mod:`.team` (on
    this thread, on PyTorch's OpenMP team, or on the pool's threads), so a result does not
    depend on how the call was split: one machine code, bit for bit the same numbers."""
    n_tasks = len(work) * n_blk
    k = min(threads(), n_tasks)
    family = {torch.bfloat16: "bfloat16", torch.float64: "float64"}.get(dtype, "float32")
    entry = team.entry(name, family)
    groups = (io, st, ix)
    if k <= 1 or int(work.sum()) * D < SERIAL_BELOW:
        _check(_call(entry, _packet([0, n_tasks], groups, flags)), name, groups)
        return
    bounds = _ranges(work, n_blk, k)
    parallel = gomp_parallel()
    if parallel is not None:
        packet = _packet(bounds, groups, flags)
        parallel(entry, packet.ctypes.data, len(bounds) - 1, 0)
        _check(packet, name, groups)
        return
    _run_on_pool(entry, bounds, groups, flags, name)


def _call(entry: int, packet: np.ndarray) -> np.ndarray:
    """Run the C entry point at address ``entry`` on ``packet`` on this thread (ctypes
    releases the GIL for the call)."""
    _C_ENTRY(entry)(packet.ctypes.data)
    return packet


_C_ENTRY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _check(packet: np.ndarray, name: str, groups: tuple) -> None:
    if packet[team.STATUS] != 0:
        raise RuntimeError(f"fastrwa: the {name} kernel's entry point refused its argument "
                           f"packet (group sizes {[len(x) for x in groups]})")


def _slots(x: np.ndarray) -> list[int]:
    if x.ndim != 1 or not x.flags.c_contiguous:
        raise ValueError("kernel arrays must be flat and contiguous")
    return [x.ctypes.data, x.shape[0]]


def _packet(bounds: list[int], groups: tuple, flags: np.ndarray) -> np.ndarray:
    """The int64 packet :mod:`.team` reads (its docstring has the layout). It holds the
    arrays' addresses: the caller keeps them alive for the call."""
    slots = []
    for arrays in groups:
        slots.append(len(arrays))
        for x in arrays:
            slots += _slots(x)
    slots += _slots(flags)
    packet = np.array([0, len(bounds) - 1, 0, 0, *bounds, *slots], dtype=np.int64)
    packet[0] = len(packet)
    return packet


def _run_on_pool(entry: int, bounds: list[int], groups: tuple, flags: np.ndarray,
                 name: str) -> None:
    k = len(bounds) - 1
    with _pool_lock:
        if POOL.executor is None or POOL.executor._max_workers < k - 1 \
                or POOL.pid != os.getpid():
            POOL.executor = ThreadPoolExecutor(max_workers=max(k - 1, os.cpu_count() or 1),
                                               thread_name_prefix="fastrwa")
            POOL.pid = os.getpid()
    packets = [_packet([lo, hi], groups, flags) for lo, hi in zip(bounds[:-1], bounds[1:])]
    futures = [POOL.executor.submit(_call, entry, p) for p in packets[1:]]
    _call(entry, packets[0])
    for future in futures:
        _check(future.result(), name, groups)
    _check(packets[0], name, groups)
