"""Where a program's sequence and chunk live: dense ``(B, T, D)`` or packed (``cu_seqlens``)."""

import triton
import triton.language as tl


@triton.jit
def channels(D: tl.constexpr, BD: tl.constexpr):
    """The channels ``[BD]`` of this program's block and their mask (all true, known at compile
    time, when ``BD`` divides ``D``)."""
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)                             # [BD]
    if D % BD == 0:
        mask_d = tl.full([BD], 1, tl.int1)                                     # [BD]
    else:
        mask_d = o_d < D                                                       # [BD]
    return o_d, mask_d


@triton.jit
def sequence(i, cu_ptr, T, IS_VARLEN: tl.constexpr):
    """``(bos, length)`` of sequence ``i``: row ``bos`` of the flattened ``(B*T, D)`` input."""
    if IS_VARLEN:
        bos = tl.load(cu_ptr + i).to(tl.int64)
        eos = tl.load(cu_ptr + i + 1).to(tl.int64)
    else:
        bos = i.to(tl.int64) * T
        eos = bos + T
    return bos, eos - bos


@triton.jit
def first_chunk(i, co_ptr, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Index of sequence ``i``'s first chunk among all chunks (chunk-state buffers are per chunk)."""
    if IS_VARLEN:
        c0 = tl.load(co_ptr + i).to(tl.int64)
    else:
        c0 = i.to(tl.int64) * tl.cdiv(T, BT)
    return c0


@triton.jit
def chunk_owner(pid, co_ptr, cs_ptr, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """For global chunk ``pid``: its sequence ``i`` and its index ``c`` in scan order there."""
    if IS_VARLEN:
        i = tl.load(cs_ptr + pid).to(tl.int64)
        c = pid - tl.load(co_ptr + i).to(tl.int64)
    else:
        nc = tl.cdiv(T, BT)
        i = (pid // nc).to(tl.int64)
        c = (pid % nc).to(tl.int64)
    return i, c


@triton.jit
def chunk_program(cu_ptr, co_ptr, cs_ptr, T, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                  IS_VARLEN: tl.constexpr):
    """Prologue of a program over (global chunk, channel block): what it covers.

    Returns ``pid`` (global chunk), ``o_d``/``mask_d`` (channels ``[BD]`` and mask), the
    sequence's ``bos`` and length, and ``c``, the chunk's index in scan order there.
    """
    pid = tl.program_id(0)
    o_d, mask_d = channels(D, BD)
    i, c = chunk_owner(pid, co_ptr, cs_ptr, T, BT, IS_VARLEN)
    bos, T_i = sequence(i, cu_ptr, T, IS_VARLEN)
    return pid.to(tl.int64), o_d, mask_d, bos, T_i, c


@triton.jit
def sequence_program(cu_ptr, co_ptr, T, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
    """Prologue of a program over (sequence, channel block): what it covers.

    Returns the sequence ``i``, ``o_d``/``mask_d`` (channels ``[BD]`` and mask), the sequence's
    ``bos`` and length, and ``c0``, its first chunk among all chunks.
    """
    i = tl.program_id(0)
    o_d, mask_d = channels(D, BD)
    bos, T_i = sequence(i, cu_ptr, T, IS_VARLEN)
    c0 = first_chunk(i, co_ptr, T, BT, IS_VARLEN)
    return i, o_d, mask_d, bos, T_i, c0
