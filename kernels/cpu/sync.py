"""Work sharing between the parts of one call running on several threads at once (the decode
step of ``decode.py`` shared among the cores; the scans' tasks taken one at a time,
:func:`next_task`): atomic operations on an ``int64`` array, as LLVM instructions (numba
has no atomics on the CPU), and the protocol built on them.

The caller is part 0; helpers 1 to ``parts - 1`` run the same kernel on other threads. The
caller starts the work alone and publishes ``READY`` when the first shared phase may begin;
a helper that starts (``join``: it swaps its ``JOIN`` entry from 0 to 1) waits for it and
does its share of that phase. The caller, after its own share, waits a bounded time
(``JOIN_SPINS``) for each helper to have joined and gives up the others (swaps their entry
from 0 to 2, so that one starting later returns at once), does the shares of those, then
publishes the roster: each joined helper's new index (``ROSTER + p``) and their number
(``GO``). From there the joined parts share every phase and meet at barriers (``barrier``),
waiting for one another without a bound: they are all running by then. No call waits on a
thread that never starts, and a share is computed the same way whichever part does it.

``sync``: ``SYNC_SIZE`` zeros, fresh per call (``GO``, ``ARRIVED``, ``READY`` and the
per-part entries a cache line apart). A call whose caller fails before its own part
begins (an interrupt between posting a call and running it) is cancelled (``cancel``:
``READY`` set to -1), and a helper waiting for it returns.

A helper may serve many calls in a row (a stream of decode steps of one cache): it parks
between them, spinning on its ``control`` array (``STATE`` and the count of calls posted,
``POSTED``) for up to ``IDLE_SPINS`` loads, and leaves when none comes (``wait_posted``).
The caller claims a parked helper for its next call (``claim_parked``: from ``PARKED`` to
``BUSY``, so that it cannot leave meanwhile) and posts the call (``post``). When a helper
cannot be claimed (it has left, or is late with the last call) the caller sends the whole
set away (``dismiss``: a parked or claimed helper leaves at its next look, a busy one when
it parks) and starts a new set with new arrays; so does a call with other arguments.
Waking a thread costs tens of microseconds, a sixth to an eighth of a decode step of the
default model.

Waits spin, and past ``SPINS_BEFORE_YIELD`` loads give the core up between loads
(POSIX ``sched_yield``), so that more spinning threads than cores still make progress; the
bounded ones (a helper's start, a parked helper's idle time) count yields past that.
Windows has no ``sched_yield`` to link by name: there the launcher does not share steps.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import kernel

GO, ARRIVED, READY, JOIN, ROSTER = 0, 8, 16, 24, 88     # (JOIN, ROSTER: an entry per part)
MAX_PARTS = 64
SYNC_SIZE = ROSTER + MAX_PARTS
SPINS_BEFORE_YIELD = 1 << 14                    # (~5-15 us of loads)
JOIN_SPINS = SPINS_BEFORE_YIELD + (1 << 8)      # the caller's wait for a helper to start
STATE, POSTED, CONTROL_SIZE = 0, 8, 16          # a helper's control array
GONE, PARKED, BUSY = 0, 1, 2                    # its states
IDLE_SPINS = SPINS_BEFORE_YIELD + (1 << 12)     # a parked helper's wait for a call


def _element(context, builder, sig, args):
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [args[1]])


@intrinsic
def atomic_add(typingctx, arr, idx, value):
    """``arr[idx] += value`` as one atomic operation; returns the old value."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _element(context, builder, sig, args), args[2],
                                  "seq_cst")
    return types.int64(arr, types.uint64, types.int64), codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """``arr[idx]``, read atomically (sequentially consistent)."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_element(context, builder, sig, args), "seq_cst", 8)
    return types.int64(arr, types.uint64), codegen


@intrinsic
def atomic_swap_if(typingctx, arr, idx, expected, value):
    """If ``arr[idx] == expected``, set it to ``value``, atomically; True if it did."""
    def codegen(context, builder, sig, args):
        pair = builder.cmpxchg(_element(context, builder, sig, args), args[2], args[3],
                               "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)
    return types.boolean(arr, types.uint64, types.int64, types.int64), codegen


@intrinsic
def atomic_store(typingctx, arr, idx, value):
    """``arr[idx] = value``, written atomically (sequentially consistent): a part that reads
    it also sees every store made before it."""
    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], _element(context, builder, sig, args), "seq_cst", 8)
        return context.get_dummy_value()
    return types.none(arr, types.uint64, types.int64), codegen


if sys.platform == "win32":
    @intrinsic
    def _yield_core(typingctx):
        """(No ``sched_yield`` on Windows, where steps are not shared: a plain spin.)"""
        def codegen(context, builder, sig, args):
            return context.get_dummy_value()
        return types.none(), codegen
else:
    @intrinsic
    def _yield_core(typingctx):
        """POSIX ``sched_yield()``: let another runnable thread have this core."""
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module,
                                                ir.FunctionType(ir.IntType(32), []),
                                                "sched_yield")
            builder.call(fn, [])
            return context.get_dummy_value()
        return types.none(), codegen


@kernel
def backoff(spins):
    """One more load of a wait: past ``SPINS_BEFORE_YIELD``, give the core up first."""
    if spins >= SPINS_BEFORE_YIELD:
        _yield_core()
    return spins + 1


@kernel
def wait_for(sync, idx):
    """Wait until ``sync[idx]`` is not 0; returns it."""
    spins = 0
    while True:
        v = atomic_load(sync, np.uint64(idx))
        if v != 0:
            return v
        spins = backoff(spins)


@kernel
def join(sync, part):
    """A helper's start: False if the caller has given it up (it must return at once)."""
    return atomic_swap_if(sync, np.uint64(JOIN + part), np.int64(0), np.int64(1))


@kernel
def keep_or_give_up(sync, part):
    """The caller's wait for helper ``part``: True if it has joined, False if it had not
    started after ``JOIN_SPINS`` loads (it is then given up: the caller does its share)."""
    spins = 0
    while spins < JOIN_SPINS and atomic_load(sync, np.uint64(JOIN + part)) == 0:
        spins = backoff(spins)
    return not atomic_swap_if(sync, np.uint64(JOIN + part), np.int64(0), np.int64(2))


@kernel
def barrier(sync, parts, k):
    """Wait until all ``parts`` parts have reached this call's barrier number ``k`` (from 1);
    returns ``k + 1``. Stores before it are seen by every part after it."""
    if parts > 1:
        atomic_add(sync, np.uint64(ARRIVED), np.int64(1))
        target = np.int64(k) * np.int64(parts)
        spins = 0
        while atomic_load(sync, np.uint64(ARRIVED)) < target:
            spins = backoff(spins)
    return k + 1


@kernel
def share(n, part, parts):
    """The ``[lo, hi)`` of ``n`` items that part ``part`` of ``parts`` takes (contiguous,
    sizes differing by at most one)."""
    return n * part // parts, n * (part + 1) // parts


@kernel
def wait_posted(control, served):
    """A parked helper's wait for call ``served + 1``: True when it is posted; False when
    none came within ``IDLE_SPINS`` loads and the helper has left (state ``GONE``)."""
    spins = 0
    while atomic_load(control, np.uint64(POSTED)) <= served:
        if atomic_load(control, np.uint64(STATE)) == GONE:
            return False                        # sent away
        if spins >= IDLE_SPINS and atomic_swap_if(control, np.uint64(STATE), np.int64(PARKED),
                                                  np.int64(GONE)):
            return False
        spins = backoff(spins)
    return True


@kernel
def claim_parked(control):
    """The caller's claim of a helper for its next call: ``PARKED`` if it was parked (it is
    now ``BUSY`` and will not leave), ``GONE`` if it has left, ``BUSY`` if it was still busy
    with the last call after ``JOIN_SPINS`` loads (late: a busy machine)."""
    spins = 0
    while spins < JOIN_SPINS:
        state = atomic_load(control, np.uint64(STATE))
        if state == GONE:
            return np.int64(GONE)
        if state == PARKED and atomic_swap_if(control, np.uint64(STATE), np.int64(PARKED),
                                              np.int64(BUSY)):
            return np.int64(PARKED)
        spins = backoff(spins)
    return np.int64(BUSY)


@kernel
def post(control):
    """Post the next call to a claimed helper (after writing everything it will read)."""
    atomic_add(control, np.uint64(POSTED), np.int64(1))


@kernel
def park(control):
    """A helper's end of a call: it waits for the next (``wait_posted``), unless it has been
    sent away meanwhile."""
    atomic_swap_if(control, np.uint64(STATE), np.int64(BUSY), np.int64(PARKED))


@kernel
def next_task(claim):
    """The next task of a call whose threads take tasks one at a time from the counter
    ``claim[0]`` (a thread that runs slower, its core shared with another program, takes
    fewer): its index, counted from 0."""
    return atomic_add(claim, np.uint64(0), np.int64(1))


@kernel
def dismiss(control):
    """Send a helper away: a parked or claimed one leaves at its next look, a busy one when
    it would park."""
    atomic_store(control, np.uint64(STATE), np.int64(GONE))


@kernel
def cancel(sync):
    """Cancel a call whose caller's part has not begun: its helpers waiting for ``READY``
    return without writing anything."""
    atomic_store(sync, np.uint64(READY), np.int64(-1))
