"""A probe of the machine for the cost model's DRAM term (docs/kernels.md, "Cost model"):
three ``(B, T, D)`` tensors read the way the scan kernels read them, with nothing computed
but a sum.

:func:`read` launches one program of one warp per (sequence, segment of ``cps`` chunks,
block of :data:`BD` channels), as ``fwd_kernel`` does: the looped algorithm's layout with
``cps`` every chunk of a sequence, the segments algorithm's with
``triton_host.segment_chunks``. Each thread walks its channel's column a :data:`BT`-step
chunk at a time, issuing the next chunk's loads before it adds up this one (the forward's
register double buffer), and writes its column's sum. Timed beside a ``copy_`` of the same
bytes (``python -m bench.gpu_sweep --only streams``), it says what bandwidth that many
such streams reach. That is what the model's DRAM term should divide by; ``copy_`` is
only an upper bound.

Example (under ``TRITON_INTERPRET=1`` on CPU tensors, or on a GPU)::

    z, a, g = torch.ones(3, 2, 40, 8).unbind(0)
    read(z, a, g, cps=1)        # (2 sequences x 3 segments, 8): 48.0 in each full segment
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrwa.ops.triton_host import Options

BT, BD = Options().block_t, Options().block_d   # the launcher's default chunk, channel block


@triton.jit
def _chunk(z_ptr, a_ptr, g_ptr, bos, c, c_hi, T, o_r, o_d, mask_d, D: tl.constexpr,
           BT: tl.constexpr):
    """``z, a, g`` ``[BT, BD]`` of chunk ``c`` as float32 (masked from chunk ``c_hi`` on)."""
    o = ((bos + c * BT) * D + o_d)[None, :] + (o_r * D)[:, None]              # [BT, BD]
    mask = ((c * BT + o_r) < tl.minimum(T, c_hi * BT))[:, None] & mask_d[None, :]  # [BT, BD]
    b_z = tl.load(z_ptr + o, mask=mask, other=0.0).to(tl.float32)             # [BT, BD]
    b_a = tl.load(a_ptr + o, mask=mask, other=0.0).to(tl.float32)             # [BT, BD]
    b_g = tl.load(g_ptr + o, mask=mask, other=0.0).to(tl.float32)             # [BT, BD]
    return b_z, b_a, b_g


@triton.jit
def read_kernel(z_ptr, a_ptr, g_ptr, out_ptr, T, CPS, NPS, D: tl.constexpr,
                BT: tl.constexpr, BD: tl.constexpr):
    """Program ``(p, j)``: sequence ``p // NPS``'s segment ``p % NPS`` (chunks ``[k CPS,
    (k + 1) CPS)``), channels ``[j BD, (j + 1) BD)``; each channel's sum of ``z + a + g``
    over the segment into row ``p`` of ``out``."""
    pid = tl.program_id(0)
    i, k = pid // NPS, pid % NPS
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)                             # [BD]
    o_d = tl.multiple_of(o_d, 1)       # (one channel a thread, as sequence.channels says)
    mask_d = o_d < D                                                           # [BD]
    o_r = tl.arange(0, BT)                                                     # [BT]
    bos = i.to(tl.int64) * T
    c_lo = k * CPS
    c_hi = tl.minimum(c_lo + CPS, tl.cdiv(T, BT))
    b_acc = tl.zeros([BT, BD], tl.float32)                                     # [BT, BD]
    b_z, b_a, b_g = _chunk(z_ptr, a_ptr, g_ptr, bos, c_lo, c_hi, T, o_r, o_d, mask_d, D,
                           BT)                                                 # [BT, BD] x3
    for c in range(c_lo, c_hi):
        n_z, n_a, n_g = _chunk(z_ptr, a_ptr, g_ptr, bos, c + 1, c_hi, T, o_r, o_d, mask_d,
                               D, BT)                                          # [BT, BD] x3
        b_acc += b_z + b_a + b_g
        b_z, b_a, b_g = n_z, n_a, n_g
    tl.store(out_ptr + pid.to(tl.int64) * D + o_d, tl.sum(b_acc, 0), mask=mask_d)


def read(z: torch.Tensor, a: torch.Tensor, g: torch.Tensor, cps: int) -> torch.Tensor:
    """Read ``z, a, g`` (``(B, T, D)``, contiguous, one dtype, on one device) as the scan
    kernels do, in segments of ``cps`` chunks of :data:`BT` steps (at least 1). Returns
    each (sequence, segment)'s per-channel sum of ``z + a + g``, ``(B * segments, D)``
    float32, sequence-major: what the probe read, for checking it."""
    if not (z.shape == a.shape == g.shape and z.dim() == 3):
        raise ValueError(f"z, a, g must be (B, T, D) of one shape, got {tuple(z.shape)}, "
                         f"{tuple(a.shape)}, {tuple(g.shape)}")
    if cps < 1:
        raise ValueError(f"cps must be at least 1, got {cps}")
    B, T, D = z.shape
    nps = max(1, triton.cdiv(triton.cdiv(T, BT), cps))
    out = torch.empty((B * nps, D), dtype=torch.float32, device=z.device)
    read_kernel[(B * nps, triton.cdiv(D, BD))](
        z.contiguous(), a.contiguous(), g.contiguous(), out, T, cps, nps, D=D, BT=BT, BD=BD,
        num_warps=1)
    return out
