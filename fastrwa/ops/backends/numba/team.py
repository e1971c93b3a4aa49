"""C entry points that run the CPU scan kernels on an OpenMP team (PyTorch's own threads).

``GOMP_parallel(fn, packet, threads, 0)`` calls ``fn(packet)`` on every thread of a team;
``fn`` is one of the numba ``cfunc`` s here (compiled on first use, cached on disk like the
kernels). The packet is a flat int64 array holding a kernel call's arguments
(:mod:`.layout`)::

    [its length, n ranges, next range, status, bound_0 .. bound_n,
     io group, st group, ix group, flags]

a group being its array count then ``(address, length)`` per array, and ``flags`` one
``(address, length)``. Each thread claims ranges with an atomic add on "next range" until
none is left, so every range runs once whatever size the team has (a nested or limited team
can be smaller than asked for), and calls the kernel on ``[bound_r, bound_r+1)`` with arrays
rebuilt from the addresses. A group whose count is not the kernel's sets ``status`` to 1 and
runs nothing (the launcher raises). One entry point per kernel and dtype family (data type,
state type): a ``cfunc`` has one fixed signature.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, types
from numba.extending import intrinsic

from .jit import OPTIONS, kernel
from .scan_bwd import backward
from .scan_fwd import forward

HEAD = 4                         # slots before the bounds: length, n ranges, next, status
STATUS = 3


@intrinsic
def _as_pointer(typingctx, address, dtype):
    """The int64 ``address`` as a pointer to ``dtype`` (a NumPy scalar type)."""
    target = dtype.instance_type if hasattr(dtype, "instance_type") else dtype.dtype

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
    return types.CPointer(target)(address, dtype), codegen


@intrinsic
def _claim(typingctx, arr, index):
    """Atomically add 1 to ``arr[index]`` (int64); returns the value before."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(arr, types.int64), codegen


@kernel
def _packet(data):
    head = carray(data, (1,))
    return carray(data, (head[0],))


@kernel
def _array(p, slot, dtype):
    """The array whose address and length are at ``p[slot]``, ``p[slot + 1]``."""
    return carray(_as_pointer(p[slot], dtype), (p[slot + 1],))


@kernel
def _member(p, c, k, dtype):
    """Array ``k`` of the group that starts at slot ``c``."""
    return _array(p, c + 1 + 2 * k, dtype)


@kernel
def _after(p, c):
    """The slot after the group that starts at ``c``."""
    return c + 1 + 2 * p[c]


@kernel
def _index_and_flags(p, c):
    """The ``ix`` group (5 int64 arrays) at slot ``c`` and the flags after it."""
    ix = (_member(p, c, 0, np.int64), _member(p, c, 1, np.int64), _member(p, c, 2, np.int64),
          _member(p, c, 3, np.int64), _member(p, c, 4, np.int64))
    return ix, _array(p, _after(p, c), np.int64)


@kernel
def _forward_packet(p, data_t, state_t):
    """Run :func:`.scan_fwd.forward` over the packet's ranges."""
    n = p[1]
    c_io = HEAD + n + 1
    c_st = _after(p, c_io)
    c_ix = _after(p, c_st)
    if p[c_io] != 4 or p[c_st] != 4 or p[c_ix] != 5:
        p[STATUS] = 1
        return
    io = (_member(p, c_io, 0, data_t), _member(p, c_io, 1, data_t),
          _member(p, c_io, 2, data_t), _member(p, c_io, 3, data_t))
    st = (_member(p, c_st, 0, state_t), _member(p, c_st, 1, state_t),
          _member(p, c_st, 2, state_t), _member(p, c_st, 3, state_t))
    ix, flags = _index_and_flags(p, c_ix)
    r = _claim(p, 2)
    while r < n:
        forward(p[HEAD + r], p[HEAD + r + 1], io, st, ix, flags)
        r = _claim(p, 2)


@kernel
def _backward_packet(p, data_t, state_t):
    """Run :func:`.scan_bwd.backward` over the packet's ranges."""
    n = p[1]
    c_io = HEAD + n + 1
    c_st = _after(p, c_io)
    c_ix = _after(p, c_st)
    if p[c_io] != 7 or p[c_st] != 5 or p[c_ix] != 5:
        p[STATUS] = 1
        return
    io = (_member(p, c_io, 0, data_t), _member(p, c_io, 1, data_t),
          _member(p, c_io, 2, data_t), _member(p, c_io, 3, data_t),
          _member(p, c_io, 4, data_t), _member(p, c_io, 5, data_t),
          _member(p, c_io, 6, data_t))
    st = (_member(p, c_st, 0, state_t), _member(p, c_st, 1, state_t),
          _member(p, c_st, 2, state_t), _member(p, c_st, 3, state_t),
          _member(p, c_st, 4, state_t))
    ix, flags = _index_and_flags(p, c_ix)
    r = _claim(p, 2)
    while r < n:
        backward(p[HEAD + r], p[HEAD + r + 1], io, st, ix, flags)
        r = _claim(p, 2)


# The entry points, one per (kernel, data type): float32, bfloat16 (as uint16) with float32
# state, float64. Compiled on first use by :func:`entry`.
def forward_float32(data):
    _forward_packet(_packet(data), np.float32, np.float32)


def forward_bfloat16(data):
    _forward_packet(_packet(data), np.uint16, np.float32)


def forward_float64(data):
    _forward_packet(_packet(data), np.float64, np.float64)


def backward_float32(data):
    _backward_packet(_packet(data), np.float32, np.float32)


def backward_bfloat16(data):
    _backward_packet(_packet(data), np.uint16, np.float32)


def backward_float64(data):
    _backward_packet(_packet(data), np.float64, np.float64)


_ENTRIES: dict = {}


def entry(name: str, dtype: str) -> int:
    """The address of the C entry point ``void fn(int64 *packet)`` for kernel ``name``
    ("forward"/"backward") on ``dtype`` ("float32", "bfloat16", "float64")."""
    key = f"{name}_{dtype}"
    if key not in _ENTRIES:
        _ENTRIES[key] = cfunc(types.void(types.CPointer(types.int64)), **OPTIONS)(globals()[key])
    return _ENTRIES[key].address
