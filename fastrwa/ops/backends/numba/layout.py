"""The packed arguments of the CPU scan kernels: every slot named once, one packer (host
side) and one unpacker (kernel side).

A kernel call is ``kernel(task_lo, task_hi, io, st, ix, flags)``:

* ``io``: the ``(B, T, D)`` data arrays, flat, in the inputs' type (``uint16`` holds
  bfloat16): :data:`FORWARD_IO` or :data:`BACKWARD_IO`;
* ``st``: the state arrays and constants, in the compute type: :data:`FORWARD_STATE` or
  :data:`BACKWARD_STATE`;
* ``ix``: the int64 index arrays :data:`INDEX`;
* ``flags``: the int64 scalars :data:`FLAGS`, built by :func:`pack_flags` and read by
  :func:`unpack_flags`.

The launcher builds each group with :func:`group`, which takes the arrays by name, so an
array cannot land in another's slot.
"""

from __future__ import annotations

import numpy as np

from .jit import kernel

FORWARD_IO = ("z", "a", "g", "y")
BACKWARD_IO = ("z", "a", "g", "gy", "gz", "ga", "gg")
# state0: (3, N, D) initial (m, n~, d~); final: (3, N, D); ck: (3, chunks, D) chunk-start
# states; g_final: (2, N, D) gradients of the final n~, d~; g_init: (3, N, D) gradients of
# the initial state; consts: [floor, 0, 1, -inf] (floor stands for -inf in the kernels).
FORWARD_STATE = ("state0", "final", "ck", "consts")
BACKWARD_STATE = ("state0", "g_final", "g_init", "ck", "consts")
# strides: B and T element strides of z, a, g; sequence i is batch row seq_b[i], steps
# [seq_lo[i], seq_hi[i]); its chunk k's saved state is row ck_off[i] + k of ck.
INDEX = ("strides", "seq_b", "seq_lo", "seq_hi", "ck_off")
FLAGS = ("T", "D", "chunk", "block", "attention", "discount", "reverse", "has_init", "save",
         "has_g_final")


def group(names: tuple, **arrays: np.ndarray) -> tuple:
    """The arrays of one group in the order of ``names`` (every name exactly once)."""
    if set(arrays) != set(names):
        raise TypeError(f"kernel arrays {sorted(arrays)} do not match the slots {names}")
    return tuple(arrays[name] for name in names)


def pack_flags(**values: int) -> np.ndarray:
    """The :data:`FLAGS` as an int64 array (every flag exactly once; bools as 0/1)."""
    if set(values) != set(FLAGS):
        raise TypeError(f"kernel flags {sorted(values)} do not match {FLAGS}")
    return np.array([int(values[name]) for name in FLAGS], dtype=np.int64)


@kernel
def unpack_flags(f):
    """``(T, D, chunk, block, attention, discount, reverse, has_init, save, has_g_final)``,
    the order of :data:`FLAGS`; the last four as bools."""
    return f[0], f[1], f[2], f[3], f[4], f[5], f[6] != 0, f[7] != 0, f[8] != 0, f[9] != 0
