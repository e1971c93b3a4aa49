"""How many threads a CPU run computes on (``--threads``).

PyTorch's OpenMP threads spin while they wait for each other, and fastrwa's scans split
their work over the same number of threads. Where another program keeps a core busy, a
thread that shares that core holds up every parallel op: on a 2-core machine with one core
busy, a training step took 7x (ByteLM) to 14x (the Transformer) its idle time on 2 threads,
and 1.7-1.9x on 1 thread, the core that is left (``bench/busy_core.py``, docs/training.md).
``--threads auto`` (the default) therefore looks at how busy the machine is when a run starts
and leaves the busy cores to their programs.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

STAT = Path("/proc/stat")
# Cores' worth of other programs' work below which a core still counts as free (background
# noise of the system); above it the run gives that core up.
FREE_BELOW = 0.25


def parse_threads(text: str) -> int | str:
    """``--threads``: "auto" or a positive int."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive int, got {text!r}")
    return value


def _cpu_times(stat: Path) -> tuple[int, int, int] | None:
    """``(busy, total, cores)`` from ``/proc/stat``: the jiffies of every core spent busy and
    in all, and the number of cores; ``None`` where the file is not there (not Linux)."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    fields = [int(v) for v in lines[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)      # idle + iowait
    total = sum(fields[:8])                                        # (guest time is in user)
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return total - idle, total, cores


def busy_cores(seconds: float = 0.15, stat: Path = STAT) -> tuple[float, int] | None:
    """How many cores' worth of work other programs did over the next ``seconds`` (this
    process sleeps meanwhile), and the machine's cores; ``None`` where it cannot tell."""
    before = _cpu_times(stat)
    time.sleep(seconds)
    after = _cpu_times(stat)
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * after[2], after[2]


def choose(available: int, others: float, cores: int) -> int:
    """The threads to use: at most ``available``, and no more than the cores the other
    programs leave free (at least 1)."""
    free = math.floor(cores - others + FREE_BELOW)
    return max(1, min(available, free))


def pick(flag: int | str, available: int) -> tuple[int, str | None]:
    """The thread count for ``--threads flag`` where PyTorch would use ``available``, and the
    line to print when ``auto`` leaves busy cores out (else ``None``)."""
    if flag != "auto":
        return int(flag), None
    seen = busy_cores() if available > 1 else None
    if seen is None:
        return available, None
    others, cores = seen
    threads = choose(available, others, cores)
    if threads == available:
        return threads, None
    return threads, (f"threads: {threads} of {available} (other programs keep {others:.1f} of "
                     f"this machine's {cores} cores busy, and threads that share a core wait "
                     f"on each other: docs/training.md); --threads {available} uses them all")

