"""How many threads a CPU run computes on (``--threads``).

PyTorch's OpenMP threads spin while they wait for each other, and fastrwa's scans split
their work over the same number of threads. Where another program keeps a core busy, a
thread that shares that core holds up every parallel op: on a 2-core machine with one core
busy, a training step took 5.8x (ByteLM) and 6.1x (the Transformer) its idle time on 2
threads, and 1.7-1.9x on 1 thread, the core that is left (``bench/busy_core.py``,
docs/training.md).
``--threads auto`` (the default) therefore looks at how busy the machine is when a run starts
and leaves the busy cores to their programs.
"""

from __future__ import annotations

import argparse
import math
import os
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


def _cpu_times(stat: Path, cpus: set[int] | None) -> tuple[int, int, int] | None:
    """``(busy, total, cores)`` from ``/proc/stat``: the jiffies the cores in ``cpus`` (every
    core for ``None``) spent busy and in all, and how many they are; ``None`` where the file
    is not there (not Linux) or names none of them."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = total = cores = 0
    for line in lines:
        name, *values = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in values[:8]]       # (guest time is counted in user)
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
        busy, total, cores = busy + sum(fields) - idle, total + sum(fields), cores + 1
    return (busy, total, cores) if cores else None


def busy_cores(seconds: float = 0.15, stat: Path = STAT) -> tuple[float, int] | None:
    """How many cores' worth of work other programs did over the next ``seconds`` on the
    cores this process may run on (its affinity), and how many those are; ``None`` where it
    cannot tell. This process sleeps meanwhile; what its other threads did is left out."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    before, own, wall = _cpu_times(stat, cpus), time.process_time(), time.monotonic()
    time.sleep(seconds)
    after = _cpu_times(stat, cpus)
    own, wall = time.process_time() - own, time.monotonic() - wall
    if before is None or after is None or after[1] <= before[1] or after[2] != before[2]:
        return None
    cores = after[2]
    seen = (after[0] - before[0]) / (after[1] - before[1]) * cores
    return max(0.0, seen - own / max(wall, 1e-9)), cores


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

