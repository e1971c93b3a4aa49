"""C entry points that run the CPU scan kernels on an OpenMP team (PyTorch's own threads).

``GOMP_parallel(fn, packet, threads, 0)`` calls ``fn(packet)`` on every thread of a team;
``fn`` is one of the numba ``cfunc`` s here (compiled on first use, cached on disk like the
kernels). The packet is a flat int64 array::

    [its length, n ranges, next range, bound_0 .. bound_n, argument slots ...]

an array argument taking two slots (address, length) and a scalar one. Each thread claims
ranges with an atomic add on "next range" until none is left, so every range runs once
whatever size the team has (a nested or limited team can be smaller than asked for), and
calls the kernel on ``[bound_r, bound_r+1)`` with arrays rebuilt from the addresses. One
entry point per kernel and dtype family (data type, state type): a ``cfunc`` has one fixed
signature.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from .cpu_scan import forward
from .cpu_scan_bwd import backward

JIT = dict(nogil=True, cache=True)
HEAD = 3                         # slots before the bounds: length, n ranges, next range


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


@njit(**JIT)
def _packet(data):
    head = carray(data, (1,))
    return carray(data, (head[0],))


@njit(**JIT)
def _array(p, slot, dtype):
    """The array whose address and length are at ``p[slot]``, ``p[slot + 1]``, and the next
    slot."""
    return carray(_as_pointer(p[slot], dtype), (p[slot + 1],)), slot + 2


@njit(**JIT)
def _layout_args(p, c, state_t):
    """The arguments both kernels take after their data arrays, from slot ``c``: strides,
    T, D, the sequences, the initial state and ``has_init``; and the next slot."""
    strides, c = _array(p, c, np.int64)
    T, D = p[c], p[c + 1]
    seq_b, c = _array(p, c + 2, np.int64)
    seq_lo, c = _array(p, c, np.int64)
    seq_hi, c = _array(p, c, np.int64)
    state0, c = _array(p, c, state_t)
    return strides, T, D, seq_b, seq_lo, seq_hi, state0, p[c] != 0, c + 1


@njit(**JIT)
def _forward_packet(p, data_t, state_t):
    """Unpack :func:`kernels.cpu_scan.forward`'s arguments, in its order, and run ranges."""
    n = p[1]
    c = HEAD + n + 1
    z, c = _array(p, c, data_t)
    a, c = _array(p, c, data_t)
    g, c = _array(p, c, data_t)
    y, c = _array(p, c, data_t)
    strides, T, D, seq_b, seq_lo, seq_hi, state0, has_init, c = _layout_args(p, c, state_t)
    final, c = _array(p, c, state_t)
    ck, c = _array(p, c, state_t)
    ck_off, c = _array(p, c, np.int64)
    chunk, save, attention, discount = p[c], p[c + 1] != 0, p[c + 2], p[c + 3]
    reverse, block = p[c + 4] != 0, p[c + 5]
    consts, c = _array(p, c + 6, state_t)
    r = _claim(p, 2)
    while r < n:
        forward(p[HEAD + r], p[HEAD + r + 1], z, a, g, y, strides, T, D, seq_b, seq_lo, seq_hi,
                state0, has_init, final, ck, ck_off, chunk, save, attention, discount, reverse,
                block, consts)
        r = _claim(p, 2)


@njit(**JIT)
def _backward_packet(p, data_t, state_t):
    """Unpack :func:`kernels.cpu_scan_bwd.backward`'s arguments, in its order, and run ranges."""
    n = p[1]
    c = HEAD + n + 1
    z, c = _array(p, c, data_t)
    a, c = _array(p, c, data_t)
    g, c = _array(p, c, data_t)
    gy, c = _array(p, c, data_t)
    gz, c = _array(p, c, data_t)
    ga, c = _array(p, c, data_t)
    gg, c = _array(p, c, data_t)
    strides, T, D, seq_b, seq_lo, seq_hi, state0, has_init, c = _layout_args(p, c, state_t)
    g_final, c = _array(p, c, state_t)
    has_g_final = p[c] != 0
    g_init, c = _array(p, c + 1, state_t)
    ck, c = _array(p, c, state_t)
    ck_off, c = _array(p, c, np.int64)
    chunk, attention, discount = p[c], p[c + 1], p[c + 2]
    reverse, block = p[c + 3] != 0, p[c + 4]
    consts, c = _array(p, c + 5, state_t)
    r = _claim(p, 2)
    while r < n:
        backward(p[HEAD + r], p[HEAD + r + 1], z, a, g, gy, gz, ga, gg, strides, T, D, seq_b,
                 seq_lo, seq_hi, state0, has_init, g_final, has_g_final, g_init, ck, ck_off,
                 chunk, attention, discount, reverse, block, consts)
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


def entry(kernel: str, dtype: str) -> int:
    """The address of the C entry point ``void fn(int64 *packet)`` for ``kernel``
    ("forward"/"backward") on ``dtype`` ("float32", "bfloat16", "float64")."""
    key = f"{kernel}_{dtype}"
    if key not in _ENTRIES:
        _ENTRIES[key] = cfunc(types.void(types.CPointer(types.int64)), **JIT)(globals()[key])
    return _ENTRIES[key].address
