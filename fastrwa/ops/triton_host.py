"""The "triton" backend: the launchers of the Triton kernels in ``kernels/triton/``
(``scan_fwd.py``, ``scan_bwd.py``, ``step.py``).

Satisfies :class:`fastrwa.ops.dispatch.Backend`. Runs on CUDA tensors, or on CPU tensors
under ``TRITON_INTERPRET=1`` (how this project tests it without a GPU).

Forward algorithms (``Options.algorithm``):

* "looped": one program per (sequence, channel block) walks time in chunks; one launch.
* "segments": every sequence cut into segments of ``segment_chunks`` chunks, summarised in
  parallel, the summaries combined in order per sequence (a walk over segments, not
  chunks), every segment re-run from its incoming state; three launches, parallel over
  segments too.
* "chained" (a variant, never chosen by "auto" until a card has timed it): sequences cut
  into segments of ``chained_chunks`` chunks (short: :data:`CHAINED_SEGMENT_CHUNKS`), each
  program summarising its segment, finding the state entering it by a decoupled look-back
  over its predecessors' published summaries (``lookback_window`` at a time) and re-running
  it from there; one launch, and every input read from DRAM once, where the re-run finds
  its segment in L2 (kernels/triton/scan_chained.py). ``chained_programs_per_sm`` (its
  backward's: ``chained_programs_per_sm_backward``) at ``k >= 1`` launches ``k x SMs``
  programs that take segments in turn, so that no more segments than that wait for their
  re-run, whatever the registers allow (0, or no more segments and channel blocks than
  ``k x SMs``: a program each).
  Its backward is the same in adjoint order (``chained_backward``; False: "segments").
* Single steps (``T = 1``, no gradient needed) use one fused step kernel.
* "auto": "looped" when ``sequences * channel_blocks`` gives every SM at least
  ``PROGRAMS_PER_SM`` programs, when sequences are at most ``2 * BT`` long, or when the
  longest would be one segment (segments cannot beat one pass there); otherwise
  "segments".

The backward chooses its algorithm as the forward does, at its own ``BT`` (the same one
unless ``forward_block_t`` gives the forward a longer chunk, when the two may choose
differently). The forward saves each chunk's incoming state, ``3 * D`` floats per chunk of
``BT`` (the backward's) steps, and the backward recomputes the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch
import triton

from ..kernels.codes import (ATTENTION_CODE, DISCOUNT_CODE, ONE_PASS, OUTPUT, RELU, SIGMOID,
                             SOFTPLUS, SUMMARY)
from ..kernels.triton import scan_bwd, scan_chained, scan_fwd, step
from .buffers import empty, empty_like
from .contract import ForwardResult, Gradients, Knobs, ScanArgs, state_dtype

PROGRAMS_PER_SM = 2
# The "segments" algorithm aims at this many programs per SM, with segments of at least
# MIN_SEGMENT_CHUNKS chunks (each segment is read twice and summarised once).
SEGMENT_PROGRAMS_PER_SM = 16
MIN_SEGMENT_CHUNKS = 8
# The "chained" algorithm's segments (``Options.chained_chunks``): short, so that its second
# walk of a segment may find the inputs still in L2 (4 chunks of 16 x 32 float32 x 3
# inputs: 24 KB a program, 26 MB for the 1,056 programs of 208 registers an H100 holds at
# once, of its 50 MB; the cost model counts that as DRAM reads, above half of L2), long
# enough that the look-back (a window of ``lookback_window`` segments a hop) keeps up with
# the walks (bench/cost_model.py; docs/kernels.md). A guess for a card to settle.
CHAINED_SEGMENT_CHUNKS = 4


# Registers a thread may use (every launch on CUDA). Left to itself ptxas holds a one-warp
# forward of bfloat16 inputs at 128-139 registers and spills 16-88 bytes in 6 builds; with
# the cap lifted every build fits (python bench/kernels.py compiles with the same cap).
MAX_REGISTERS = 255


@dataclasses.dataclass(frozen=True)
class Options:
    """Launch knobs; tests and bench/gpu_sweep.py force them, users keep the defaults.

    Each thread owns whole channel columns of a ``[block_t, block_d]`` chunk when ``block_d``
    is a multiple of 32 x warps (the defaults: one warp, one column a thread), so the scans
    along time run in registers, with no shuffles, barriers or shared memory
    (``python bench/kernels.py`` counts them). With the defaults every kernel compiles for
    sm_80 and sm_90a without spills.
    """

    algorithm: str = "auto"          # "auto" | "looped" | "segments" | "chained"
    block_t: int = 16                # BT: steps per chunk (backward; forward unless below)
    forward_block_t: int = 0         # the forward's BT: 0 (block_t) or a power of 2 >= it
    block_d: int = 32                # BD: channels per program in the forward (and step)
    block_d_backward: int = 32       # BD: channels per program in the backward
    warps: int = 1                   # warps per program, forward and step kernels
    warps_backward: int = 1          # warps per program, backward kernels
    stages: int = 3                  # software-pipelining depth (Triton's num_stages)
    segment_chunks: int = 0          # chunks per segment ("segments"); 0: chosen per call
    forward_lookahead: int = 1       # chunks the forward loads ahead of its scan: 1 or 2
    carry_tile: int = 1              # segments the carry kernels load and scan at once
    chained_chunks: int = CHAINED_SEGMENT_CHUNKS    # chunks per segment ("chained")
    lookback_window: int = 32        # predecessors a "chained" look-back reads at once
    chained_prefixes: bool = True    # False: only first (backward: last) segments publish
    chained_backward: bool = True    # "chained": its backward chained too (False: "segments")
    chained_programs_per_sm: int = 0            # "chained" forward: k >= 1, k x SMs
                                                # programs taking segments in turn
    chained_programs_per_sm_backward: int = 0   # the same, the "chained" backward

    def forward(self) -> "Options":
        """The knobs the forward kernels run at: ``block_t`` is ``forward_block_t`` where that
        is set. The forward still saves the state entering every ``block_t`` steps (the
        backward's chunks), so a longer forward chunk leaves the backward as it is."""
        if not self.forward_block_t:
            return self
        return dataclasses.replace(self, block_t=self.forward_block_t, forward_block_t=0)


def _check(opts: Options) -> None:
    if opts.algorithm not in ("auto", "looped", "segments", "chained"):
        raise ValueError(f"algorithm must be 'auto', 'looped', 'segments' or 'chained', "
                         f"got {opts.algorithm!r}")
    for name in ("block_t", "block_d", "block_d_backward", "warps", "warps_backward",
                 "carry_tile", "lookback_window"):
        value = getattr(opts, name)
        if not (isinstance(value, int) and value >= 1 and value & (value - 1) == 0):
            raise ValueError(f"{name} must be a power of two, got {value!r}")
    if not (type(opts.forward_block_t) is int and (
            opts.forward_block_t == 0 or (opts.forward_block_t >= opts.block_t
                                          and opts.forward_block_t & (opts.forward_block_t - 1)
                                          == 0))):
        raise ValueError(f"forward_block_t must be 0 (block_t) or a power of two >= block_t "
                         f"({opts.block_t}), got {opts.forward_block_t!r}")
    if not (isinstance(opts.stages, int) and opts.stages >= 1):
        raise ValueError(f"stages must be an integer >= 1, got {opts.stages!r}")
    if not (type(opts.forward_lookahead) is int and opts.forward_lookahead in (1, 2)):
        raise ValueError(f"forward_lookahead must be 1 or 2, got {opts.forward_lookahead!r}")
    if not (isinstance(opts.segment_chunks, int) and opts.segment_chunks >= 0):
        raise ValueError(f"segment_chunks must be an integer >= 0, got {opts.segment_chunks!r}")
    if not (type(opts.chained_chunks) is int and opts.chained_chunks >= 1):
        raise ValueError(f"chained_chunks must be an integer >= 1, got {opts.chained_chunks!r}")
    for name in ("chained_programs_per_sm", "chained_programs_per_sm_backward"):
        if not (type(getattr(opts, name)) is int and getattr(opts, name) >= 0):
            raise ValueError(f"{name} must be an integer >= 0, got {getattr(opts, name)!r}")
    for name in ("chained_prefixes", "chained_backward"):
        if not isinstance(getattr(opts, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(opts, name)!r}")


_knobs = Knobs(Options, _check)
options, set_options = _knobs.get, _knobs.set


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 108  # what an A100 has; under the interpreter the choice only needs to be consistent


def choose_algorithm(n_seq: int, D: int, max_len: int, opts: Options, device) -> str:
    """The documented heuristic (module docstring)."""
    if opts.algorithm != "auto":
        return opts.algorithm
    programs = n_seq * triton.cdiv(D, opts.block_d)
    if programs >= PROGRAMS_PER_SM * _num_sms(device) or max_len <= 2 * opts.block_t:
        return "looped"
    cps = segment_chunks(n_seq, D, max_len, opts, device)
    if triton.cdiv(max_len, opts.block_t) <= cps:    # one segment a sequence: one pass is it
        return "looped"
    return "segments"


def segment_chunks(n_seq: int, D: int, max_len: int, opts: Options, device) -> int:
    """Chunks per segment of the "segments" algorithm: ``opts.segment_chunks``, or enough
    segments that ``sequences * segments * channel_blocks`` gives every SM
    ``SEGMENT_PROGRAMS_PER_SM`` programs, each at least ``MIN_SEGMENT_CHUNKS`` long."""
    if opts.segment_chunks:
        return opts.segment_chunks
    blocks = max(1, n_seq * triton.cdiv(D, opts.block_d))
    wanted = triton.cdiv(SEGMENT_PROGRAMS_PER_SM * _num_sms(device), blocks)
    return max(MIN_SEGMENT_CHUNKS, triton.cdiv(triton.cdiv(max_len, opts.block_t), wanted))


@dataclasses.dataclass
class _Layout:
    """How sequences and chunks are laid out for the kernels."""

    n_seq: int                       # sequences (B, or len(cu_seqlens) - 1)
    T: int                           # dense length (0 when packed)
    rows: int                        # rows of the per-chunk buffers (>= the chunk count)
    max_len: int
    cu: torch.Tensor | None          # int64 (n_seq + 1,)
    chunk_offsets: torch.Tensor | None   # int64 (n_seq,): first chunk of each sequence
    lengths: torch.Tensor | None     # int64 (n_seq,)

    def sequences(self, like: torch.Tensor) -> dict:
        """The packed sequences' tables a launch reads, by argument name: ``cu_ptr`` (their
        offsets) and ``co_ptr`` (the first chunk of each); :func:`unused` where dense."""
        return dict(cu_ptr=unused(like, self.cu), co_ptr=unused(like, self.chunk_offsets))

    def one_pass(self, like: torch.Tensor, f32: torch.dtype) -> dict:
        """What a "looped" launch reads besides the scan's own arguments, by argument name:
        one program per sequence walks all its chunks (``PHASE=ONE_PASS``; each sequence one
        segment, so the segment tables and summaries are :func:`unused`)."""
        return dict(s_ptr=unused(like, dtype=f32), so_ptr=unused(like), ss_ptr=unused(like),
                    T=self.T, CPS=1, NS=self.n_seq, NCT=self.rows, NSEG=self.n_seq,
                    PHASE=ONE_PASS)

    def segments(self, D: int, opts: Options, like: torch.Tensor) -> tuple[int, dict, dict]:
        """The "segments" algorithm's cut: the count of segments of :func:`segment_chunks`
        chunks each (kernels/triton/sequence.py ``segments``: at least one a sequence), the
        tables its launches read, by argument name: ``so_ptr`` (the first segment of each
        sequence) and ``ss_ptr`` (the sequence of each segment), :func:`unused` where
        dense; and the sizes they read (``T``, ``CPS``, ``NS``, ``NSEG``)."""
        BT, cps = opts.block_t, segment_chunks(self.n_seq, D, self.max_len, opts, like.device)
        if self.lengths is None:
            count = self.n_seq * max(1, triton.cdiv(triton.cdiv(self.T, BT), cps))
            tables = dict(so_ptr=unused(like), ss_ptr=unused(like))
        else:
            per_seq = torch.clamp((self.lengths + BT * cps - 1) // (BT * cps), min=1)
            offsets = torch.cumsum(per_seq, 0) - per_seq
            seq = torch.repeat_interleave(torch.arange(self.n_seq, device=like.device), per_seq)
            count, tables = int(per_seq.sum()), dict(so_ptr=offsets, ss_ptr=seq)
        return count, tables, dict(T=self.T, CPS=cps, NS=self.n_seq, NSEG=count)


def unused(like: torch.Tensor, tensor: torch.Tensor | None = None,
           dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``tensor``, or where it is ``None`` an empty tensor of ``dtype`` on ``like``'s device:
    what a launch passes for a pointer its constexpr flags never read (a ``PHASE`` or
    ``IS_VARLEN`` that does not use it). Kept a real pointer, not ``None``, so that every
    launch compiles the signature the static SASS report counts (``bench/kernels.py``)."""
    return like.new_empty(0, dtype=dtype) if tensor is None else tensor


def _layout(z: torch.Tensor, cu_seqlens: torch.Tensor | None, BT: int) -> _Layout:
    B, T, _ = z.shape
    if cu_seqlens is None:
        return _Layout(B, T, B * triton.cdiv(T, BT), T, None, None, None)
    # contiguous: the kernels index it as a flat array (a strided view would be misread)
    cu = cu_seqlens.to(device=z.device, dtype=torch.int64).contiguous()
    lengths = cu[1:] - cu[:-1]
    per_seq = (lengths + BT - 1) // BT
    offsets = torch.cumsum(per_seq, 0) - per_seq
    max_len = int(lengths.max()) if len(lengths) else 0
    return _Layout(len(lengths), 0, chunk_rows(z.shape[1], len(lengths), BT), max_len, cu,
                   offsets, lengths)


def chunk_rows(T: int, n_seq: int, BT: int) -> int:
    """Rows of the per-chunk buffers of packed sequences: a bound on their chunk count
    (sum of ceil(len_i / BT) <= (T + n_seq (BT - 1)) / BT) that depends on shapes only, so
    the saved tensors' shapes are known to ``torch.compile`` without reading the offsets."""
    return (T + n_seq * (BT - 1)) // BT


def _launch(warps: int, stages: int) -> dict:
    """Launch options: warps, stages and (CUDA: Triton's AMD backend has no maxnreg) the
    register cap :data:`MAX_REGISTERS`."""
    launch = dict(num_warps=warps, num_stages=stages)
    if torch.version.hip is None:
        launch["maxnreg"] = MAX_REGISTERS
    return launch


def _codes(attention, discount, g):
    return ATTENTION_CODE[attention], DISCOUNT_CODE[discount if g is not None else None]


def _interpreted(like: torch.Tensor) -> contextlib.AbstractContextManager:
    """Around a launch: on CPU tensors (``TRITON_INTERPRET=1``) NumPy's floating-point
    warnings off. The interpreter evaluates both sides of a ``tl.where`` in NumPy, so masked
    lanes make inf - inf and 0 / 0 whose values are never used; a user's warnings filters are
    left as they are. On a GPU: nothing."""
    return np.errstate(all="ignore") if like.device.type == "cpu" else contextlib.nullcontext()


def forward(args: ScanArgs, *, output_final_state: bool, save: bool) -> ForwardResult:
    """The scan (contract: :meth:`fastrwa.ops.dispatch.Backend.forward`); ``saved`` is the
    ``(3, chunks, D)`` state entering every chunk of ``block_t`` steps."""
    with _interpreted(args.z):
        return _forward(args, output_final_state, save)


def _forward(args: ScanArgs, output_final_state: bool, save: bool) -> ForwardResult:
    z, a, g, attention, discount, init, reverse, cu_seqlens = args
    save_for_backward = save
    opts = options().forward()
    BT, BD, SAVE_BT = opts.block_t, opts.block_d, options().block_t
    B, T, D = z.shape
    lay = _layout(z, cu_seqlens, SAVE_BT)      # the saved states' rows: SAVE_BT steps each
    ATTN, DISCOUNT = _codes(attention, discount, g)
    z, a = z.contiguous(), a.contiguous()
    # (without a discount, DISCOUNT == 0: no g is read)
    g = unused(z, g.contiguous() if g is not None else None, z.dtype)
    y = empty_like(z)
    f32 = state_dtype(z.dtype)
    h0 = unused(z, torch.stack(init).contiguous() if init is not None else None, f32)
    need_final = output_final_state or save_for_backward or (T == 1 and cu_seqlens is None)
    ht = empty((3, lay.n_seq, D), f32, z.device) if need_final else unused(z, dtype=f32)
    hc = empty((3, lay.rows, D), f32, z.device)
    algorithm = choose_algorithm(lay.n_seq, D, lay.max_len, opts, z.device)
    launch = _launch(opts.warps, opts.stages)
    flags = dict(D=D, IS_VARLEN=cu_seqlens is not None, BT=BT, BD=BD, **launch)
    n_d = triton.cdiv(D, BD)
    tensors = dict(z_ptr=z, a_ptr=a, g_ptr=g, y_ptr=y, h0_ptr=h0, ht_ptr=ht, hc_ptr=hc,
                   **lay.sequences(z))
    scan = dict(tensors, ATTN=ATTN, DISCOUNT=DISCOUNT, REVERSE=reverse,
                SAVE_CHUNKS=save_for_backward, LOOKAHEAD=opts.forward_lookahead,
                SAVE_BT=SAVE_BT, **flags)
    if T == 1 and cu_seqlens is None and not save_for_backward:
        # Streaming inference: one fused step launch.
        step.step_kernel[(B, n_d)](z_ptr=z, a_ptr=a, g_ptr=g, y_ptr=y, h0_ptr=h0, ht_ptr=ht,
                                   NS=B, D=D, ATTN=ATTN, DISCOUNT=DISCOUNT,
                                   HAS_INIT=init is not None, BD=BD, **launch)
    elif algorithm == "looped":
        scan_fwd.fwd_kernel[(lay.n_seq, n_d)](**scan, **lay.one_pass(z, f32),
                                              HAS_INIT=init is not None, STORE_FINAL=need_final)
    elif algorithm == "chained":
        n_seg, segs, sizes, flag = _chained(lay, D, n_d, opts, "warps", z)
        summary = empty((4, n_seg, D), f32, z.device)      # (m, n~, d~, G) of every segment
        prefix = empty((3, n_seg, D), f32, z.device)       # the state after every segment
        grid, persistent = _chained_grid(n_seg * n_d, opts.chained_programs_per_sm, z.device)
        scan_chained.fwd_chained_kernel[grid](
            **scan, **segs, **sizes, s_ptr=summary, p_ptr=prefix, f_ptr=flag, NCT=lay.rows,
            HAS_INIT=init is not None, STORE_FINAL=need_final, WINDOW=opts.lookback_window,
            PREFIX_EVERY=opts.chained_prefixes, SPIN=z.device.type == "cuda",
            PERSISTENT=persistent)
    else:
        n_seg, segs, sizes = lay.segments(D, opts, z)
        summary = empty((4, n_seg, D), f32, z.device)      # (m, n~, d~, G) of every segment
        incoming = empty((3, n_seg, D), f32, z.device)     # the state entering every segment
        scan_fwd.fwd_kernel[(n_seg, n_d)](
            **scan, **segs, **sizes, s_ptr=summary, NCT=lay.rows, PHASE=SUMMARY,
            HAS_INIT=False, STORE_FINAL=False)
        scan_fwd.fwd_carry_kernel[(lay.n_seq, n_d)](
            s_ptr=summary, hs_ptr=incoming, h0_ptr=h0, ht_ptr=ht, **lay.sequences(z),
            so_ptr=segs["so_ptr"], **sizes, HAS_INIT=init is not None,
            STORE_FINAL=need_final, KT=opts.carry_tile, **flags)
        scan_fwd.fwd_kernel[(n_seg, n_d)](
            **scan, **segs, **sizes, s_ptr=incoming, NCT=lay.rows, PHASE=OUTPUT,
            HAS_INIT=False, STORE_FINAL=False)
    final = tuple(x.clone() for x in ht.unbind(0)) if output_final_state else None
    saved = [hc] if save_for_backward else []
    return ForwardResult(y, final, saved)


def _chained(lay: _Layout, D: int, n_d: int, opts: Options, warps: str,
             like: torch.Tensor) -> tuple[int, dict, dict, torch.Tensor]:
    """The "chained" algorithm's cut (:meth:`_Layout.segments` at ``chained_chunks``) and its
    flags: every (segment, channel block)'s, then the ticket counter, zeros. ``warps``: the
    name of the pass's warps knob (``warps``, ``warps_backward``)."""
    if like.device.type == "cuda" and opts.lookback_window < 32 * getattr(opts, warps):
        # (a vector atomic's result is 0 in a thread holding a duplicated element, under
        # Triton < 3.5: triton-lang/triton#7402; the look-back would then never end)
        raise ValueError(f"the 'chained' algorithm needs lookback_window >= 32 x {warps} on a "
                         f"GPU (one flag a thread at least), got {opts.lookback_window} with "
                         f"{warps}={getattr(opts, warps)}"
                         + ("; or chained_backward=False" if warps == "warps_backward" else ""))
    chained = dataclasses.replace(opts, segment_chunks=opts.chained_chunks)
    n_seg, segs, sizes = lay.segments(D, chained, like)
    flag = torch.zeros(n_seg * n_d + 1, dtype=torch.int32, device=like.device)
    return n_seg, segs, sizes, flag


def _chained_grid(tickets: int, per_sm: int, device: torch.device) -> tuple[tuple, bool]:
    """A "chained" launch's grid and its ``PERSISTENT`` flag: a program a ticket
    (``per_sm`` 0), or ``per_sm`` programs an SM taking tickets in turn, which caps the
    segments held between their two walks at what those programs hold (the module
    docstring); a program a ticket where there are no more tickets than that."""
    programs = per_sm * _num_sms(device)
    if per_sm == 0 or tickets <= programs:
        return (tickets,), False
    return (programs,), True


def saved_like(args: ScanArgs) -> list:
    """What :func:`forward` saves, as empty tensors of the right shapes (for ``torch.compile``)."""
    z, cu_seqlens = args.z, args.cu_seqlens
    f32 = state_dtype(z.dtype)
    B, T, D = z.shape
    if cu_seqlens is None:
        n_chunks = B * triton.cdiv(T, options().block_t)
    else:
        n_chunks = chunk_rows(T, cu_seqlens.shape[0] - 1, options().block_t)
    return [z.new_empty((3, n_chunks, D), dtype=f32)]


def backward_lookahead(ATTN: int, opts: Options) -> int:
    """The backward kernel's ``LOOKAHEAD`` for attention code ``ATTN`` at launch knobs
    ``opts``: 1 (load each chunk's inputs while the chunk before works, hiding the loads'
    latency) where two chunks' inputs fit in :data:`MAX_REGISTERS` without a spill: exp
    attention and none (RWA, ``weighted_scan``) with at most 16 elements of a chunk a thread
    (the default ``BT 16 x BD 32`` on one warp). 0 otherwise: sigmoid, softplus and relu keep
    more of the chunk alive, and larger blocks hold more a thread (``python bench/kernels.py``
    reports registers and spills)."""
    per_thread = opts.block_t * opts.block_d_backward // (32 * opts.warps_backward)
    return 0 if ATTN in (SIGMOID, SOFTPLUS, RELU) or per_thread > 16 else 1


def backward(args: ScanArgs, saved: list, m_final, gy, g_final) -> Gradients:
    """Gradients (contract: :meth:`fastrwa.ops.dispatch.Backend.backward`). Without this
    backend's ``saved`` (at the current ``block_t``) the chunk states are recomputed first."""
    with _interpreted(args.z):
        return _backward(args, saved, m_final, gy, g_final)


def _backward(args: ScanArgs, saved: list, m_final, gy, g_final) -> Gradients:
    z, a, g, attention, discount, init, reverse, cu_seqlens = args
    opts = options()
    BT, BD = opts.block_t, opts.block_d_backward
    B, T, D = z.shape
    lay = _layout(z, cu_seqlens, BT)
    if not (len(saved) == 1 and saved[0].shape == (3, lay.rows, D)):
        saved = forward(args, output_final_state=False, save=True).saved
    (hc,) = saved
    ATTN, DISCOUNT = _codes(attention, discount, g)
    has_g = g is not None
    z, a = z.contiguous(), a.contiguous()
    g = unused(z, g.contiguous() if has_g else None, z.dtype)   # (DISCOUNT == 0: not read)
    gy = torch.zeros_like(z) if gy is None else gy.contiguous()
    f32 = hc.dtype
    gz, ga = empty_like(z), empty_like(a)
    gg = empty_like(g) if has_g else unused(z, dtype=z.dtype)
    h0 = unused(z, torch.stack(init).contiguous() if init is not None else None, f32)
    dh0 = empty_like(h0)
    has_final_grad = g_final is not None and any(x is not None for x in g_final)
    if has_final_grad:      # (3, N, D): row 0 (m) unused, then the gradients of n~ and d~
        zeros = torch.zeros((lay.n_seq, D), dtype=f32, device=z.device)
        dht = torch.stack([zeros] + [zeros if x is None else x for x in g_final]).contiguous()
    else:
        dht = unused(z, dtype=f32)
    algorithm = choose_algorithm(lay.n_seq, D, lay.max_len, opts, z.device)
    launch = _launch(opts.warps_backward, opts.stages)
    flags = dict(D=D, IS_VARLEN=cu_seqlens is not None, BT=BT, BD=BD, **launch)
    n_d = triton.cdiv(D, BD)
    scan = dict(z_ptr=z, a_ptr=a, g_ptr=g, gy_ptr=gy, gz_ptr=gz, ga_ptr=ga, gg_ptr=gg,
                h0_ptr=h0, dh0_ptr=dh0, dht_ptr=dht, hc_ptr=hc, **lay.sequences(z),
                ATTN=ATTN, DISCOUNT=DISCOUNT, REVERSE=reverse,
                LOOKAHEAD=backward_lookahead(ATTN, opts), **flags)
    if algorithm == "looped":
        scan_bwd.bwd_kernel[(lay.n_seq, n_d)](**scan, **lay.one_pass(z, f32),
                                              HAS_INIT=init is not None,
                                              HAS_FINAL_GRAD=has_final_grad)
    elif algorithm == "chained" and opts.chained_backward:
        n_seg, segs, sizes, flag = _chained(lay, D, n_d, opts, "warps_backward", z)
        summary = empty((3, n_seg, D), f32, z.device)      # (K, W, V) of every segment
        prefix = empty((2, n_seg, D), f32, z.device)       # (W, V) at every first row
        grid, persistent = _chained_grid(n_seg * n_d, opts.chained_programs_per_sm_backward,
                                         z.device)
        scan_chained.bwd_chained_kernel[grid](
            **scan, **segs, **sizes, s_ptr=summary, p_ptr=prefix, f_ptr=flag, NCT=lay.rows,
            HAS_INIT=init is not None, HAS_FINAL_GRAD=has_final_grad,
            WINDOW=opts.lookback_window, PREFIX_EVERY=opts.chained_prefixes,
            SPIN=z.device.type == "cuda", PERSISTENT=persistent)
    else:                   # "segments" (and "chained" without chained_backward)
        n_seg, segs, sizes = lay.segments(D, opts, z)
        summary = empty((3, n_seg, D), f32, z.device)      # (K, W, V) of every segment
        entering = empty((2, n_seg, D), f32, z.device)     # (W, V) entering every segment
        scan_bwd.bwd_kernel[(n_seg, n_d)](
            **scan, **segs, **sizes, s_ptr=summary, NCT=lay.rows, PHASE=SUMMARY,
            HAS_INIT=False, HAS_FINAL_GRAD=False)
        scan_bwd.bwd_carry_kernel[(lay.n_seq, n_d)](
            s_ptr=summary, ac_ptr=entering, h0_ptr=h0, dh0_ptr=dh0, dht_ptr=dht,
            **lay.sequences(z), so_ptr=segs["so_ptr"], **sizes, HAS_INIT=init is not None,
            HAS_FINAL_GRAD=has_final_grad, KT=opts.carry_tile, **flags)
        scan_bwd.bwd_kernel[(n_seg, n_d)](
            **scan, **segs, **sizes, s_ptr=entering, NCT=lay.rows, PHASE=OUTPUT,
            HAS_INIT=False, HAS_FINAL_GRAD=False)
    g_init = tuple(x.clone() for x in dh0.unbind(0)) if init is not None else None
    return Gradients(gz, ga, (gg if has_g else None), g_init)
