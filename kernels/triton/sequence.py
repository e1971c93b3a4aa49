"""Where a program's sequence and chunk live: dense ``(B, T, D)`` or packed (``cu_seqlens``)."""

import triton
import triton.language as tl


@triton.jit
def channels(D: tl.constexpr, BD: tl.constexpr):
    """The channels ``[BD]`` of this program's block (its second program id) and their mask
    (:func:`channels_at`)."""
    return channels_at(tl.program_id(1), D, BD)


@triton.jit
def channels_at(blk, D: tl.constexpr, BD: tl.constexpr):
    """The channels ``[BD]`` of block ``blk`` and their mask (all true, known at compile
    time, when ``BD`` divides ``D``)."""
    o_d = blk * BD + tl.arange(0, BD)                                          # [BD]
    # Claims no alignment (a hint of 1 element), so Triton's load coalescing keeps one
    # element a thread along D: each thread owns whole channel columns and every scan along
    # time stays in its registers. Without it a launch on aligned tensors vectorises along D
    # and spreads time over threads (shuffles, barriers; bench/kernels.py counts both).
    o_d = tl.multiple_of(o_d, 1)                                               # [BD]
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
def segments(T, CPS, BT: tl.constexpr):
    """Segments of a sequence of length ``T``: ``cdiv(cdiv(T, BT), CPS)``, at least 1 (an
    empty sequence has one empty segment, which carries its initial state to its final)."""
    return tl.maximum(tl.cdiv(tl.cdiv(T, BT), CPS), 1)


@triton.jit
def segment_program(cu_ptr, co_ptr, so_ptr, ss_ptr, T, CPS, D: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr, IS_VARLEN: tl.constexpr, WHOLE: tl.constexpr):
    """Prologue of a program over (segment, channel block): what it covers.

    A segment is up to ``CPS`` consecutive chunks of one sequence: sequence ``i``'s chunks
    ``[k CPS, (k + 1) CPS)``, ``k`` the segment's index there. Dense sequences have
    :func:`segments` each; packed ones list each sequence's first segment
    (``so``) and each segment's sequence (``ss``). With ``CPS`` at least every sequence's
    chunk count, a segment is a whole sequence.

    Returns ``pid`` (the global segment), the sequence ``i``, ``o_d``/``mask_d`` (channels
    ``[BD]`` and mask), the sequence's ``bos`` and length, ``c0`` (its first chunk among all
    chunks), and the segment's chunks ``[c_lo, c_hi)`` within the sequence, in scan order.
    """
    pid = tl.program_id(0).to(tl.int64)
    o_d, mask_d = channels(D, BD)
    i, _, bos, T_i, c_lo, c_hi = segment_at(pid, cu_ptr, so_ptr, ss_ptr, T, CPS, BT, IS_VARLEN,
                                            WHOLE)
    c0 = first_chunk(i, co_ptr, T, BT, IS_VARLEN)
    return pid, i, o_d, mask_d, bos, T_i, c0, c_lo, c_hi


@triton.jit
def segment_at(pid, cu_ptr, so_ptr, ss_ptr, T, CPS, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
               WHOLE: tl.constexpr):
    """Segment ``pid`` (int64; with ``WHOLE`` sequence ``pid``, one segment): its sequence
    ``i``, its index ``k`` there, the sequence's ``bos`` and length, and its chunks
    ``[c_lo, c_hi)`` (:func:`segment_program`)."""
    if WHOLE:
        i = pid
        k = pid * 0
    elif IS_VARLEN:
        i = tl.load(ss_ptr + pid).to(tl.int64)
        k = pid - tl.load(so_ptr + i).to(tl.int64)
    else:
        n_seg = segments(T, CPS, BT)
        i = pid // n_seg
        k = pid % n_seg
    bos, T_i = sequence(i, cu_ptr, T, IS_VARLEN)
    if WHOLE:
        c_lo = k
        c_hi = tl.cdiv(T_i, BT)
    else:
        c_lo = k * CPS
        c_hi = tl.minimum(c_lo + CPS, tl.cdiv(T_i, BT))
    return i, k, bos, T_i, c_lo, c_hi


@triton.jit
def first_segment(i, so_ptr, T, CPS, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Index of sequence ``i``'s first segment among all segments."""
    if IS_VARLEN:
        s0 = tl.load(so_ptr + i).to(tl.int64)
    else:
        s0 = i.to(tl.int64) * segments(T, CPS, BT)
    return s0


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
