"""The "numba" backend: the launcher of the compiled CPU kernels in ``kernels/cpu/``
(``scan_fwd.py``: ``forward`` and ``step_inplace``; ``scan_bwd.py``: ``backward``).

Satisfies :class:`fastrwa.ops.dispatch.Backend`. Runs on CPU tensors: one compiled loop over
time per (sequence, channel block), vectorised across channels. A call's tasks run on the
caller's thread when the call is small, else on it and ``torch.get_num_threads() - 1``
plain threads of a pool at once, each taking the next task when it is done with one (the
kernels release the GIL; every task runs the same machine code whichever thread takes it,
so results do not depend on the threads). It reads every input once and
writes every output once; the forward also saves the state entering each chunk of
``Options.chunk`` steps (``3 * D`` floats), from which the backward recomputes everything
else (docs/math.md §4).

Why numba (docs/benchmarks.md has the long form): it is a wheel on PyPI for every platform
PyTorch's CPU wheels cover, it compiles on first use with its own bundled LLVM (no C
compiler on the user's machine), and compiled kernels are cached on disk next to the
package. dtypes: float32 and bfloat16 compute in float32 (bfloat16 is widened and rounded
inside the kernel, no extra pass); float64 computes in float64; float16 is converted to
float32 around the kernels (one extra pass each way: numba has no float16 arithmetic).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import NamedTuple

import numpy as np
import torch

from ..kernels.codes import ATTENTION_CODE, DISCOUNT_CODE
from ..kernels.cpu.scan_bwd import backward as backward_kernel
from ..kernels.cpu.scan_fwd import forward as forward_kernel, step_inplace as step_kernel
from .buffers import empty as _empty
from .contract import ForwardResult, Gradients, Knobs, ScanArgs, state_dtype
from .numba_common import _POOLS, flat, kernel_consts, pool, threads  # noqa: F401 (_POOLS: tests)

# Elements below which a call runs on the caller's thread alone: waking other threads costs
# tens of microseconds, more than it saves below ~100K elements.
SERIAL_BELOW = 1 << 17
# Above PREFETCH_ABOVE bytes of inputs (more than a last-level cache) the forward prefetches
# the input rows PREFETCH_AHEAD steps ahead, and the backward the chunk it walks next: out
# of cache that overlaps loads with arithmetic; in cache the requests cost more than they
# save (docs/kernels.md).
PREFETCH_AHEAD = 8
PREFETCH_ABOVE = 64 << 20


def _ahead(*inputs) -> int:
    """The kernels' ``ahead``: PREFETCH_AHEAD for inputs above PREFETCH_ABOVE bytes, else 0."""
    size = sum(x.numel() * x.element_size() for x in inputs if x is not None)
    return PREFETCH_AHEAD if size > PREFETCH_ABOVE else 0


@dataclasses.dataclass(frozen=True)
class Options:
    """Knobs of the numba backend; tests force them, users keep the defaults."""

    chunk: int = 32               # steps between saved states (the backward's recompute unit)
    block: int | None = None      # channels per task; None: all of D, halved until every
                                  # thread has two tasks (but not below 32)


_knobs = Knobs(Options)
options, set_options = _knobs.get, _knobs.set


def _row_strides(*inputs: torch.Tensor) -> np.ndarray:
    """Element strides along B and T of each ``(B, T, D)`` input, as the kernels take them."""
    return np.array([st for x in inputs for st in x.stride()[:2]], dtype=np.int64)


def _block(n_seq: int, D: int) -> int:
    if options().block is not None:
        return options().block
    block = max(D, 1)
    while block > 32 and n_seq * -(-D // block) < 2 * threads():
        block = max(32, -(-block // 2))
    return block


def _layout(z: torch.Tensor, cu_seqlens: torch.Tensor | None, C: int):
    """Sequences ``(batch row, start, end)``, each one's first saved-state row, the number of
    saved states. The dense layout is cached: the kernels only read these arrays."""
    B, T, _ = z.shape
    if cu_seqlens is None:
        return _dense_layout(B, T, C)
    return _packed_layout(cu_seqlens, C)


@functools.lru_cache(maxsize=64)
def _dense_layout(B: int, T: int, C: int):
    seq_b = np.arange(B, dtype=np.int64)
    lo, hi = np.zeros(B, np.int64), np.full(B, T, np.int64)
    return _finish_layout(seq_b, lo, hi, C)


def _packed_layout(cu_seqlens: torch.Tensor, C: int):
    bounds = cu_seqlens.to(torch.int64).numpy()
    lo, hi = bounds[:-1].copy(), bounds[1:].copy()
    return _finish_layout(np.zeros(len(lo), np.int64), lo, hi, C)


def _finish_layout(seq_b, lo, hi, C: int):
    n_ck = -(-(hi - lo) // C)
    ck_off = np.concatenate([[0], np.cumsum(n_ck)[:-1]]).astype(np.int64)
    return seq_b, lo, hi, ck_off, int(n_ck.sum())


def _prepare(z, a, g):
    """Inputs in a layout and dtype the kernels read: rows may be strided (gate slices of a
    projection are read in place) but channels must be adjacent; float16 goes through
    float32."""
    def fix(x):
        if x is None:
            return None
        if x.dtype == torch.float16:        # (.float() keeps the strides: checked below too)
            x = x.float()
        return x if x.stride(2) == 1 or x.shape[2] == 1 else x.contiguous()
    return fix(z), fix(a), fix(g)


def _state(init, n_seq, D, cdt):
    if init is None:
        return torch.empty(0, dtype=cdt), False
    return torch.stack([s.to(cdt) for s in init]).reshape(3, n_seq, D).contiguous(), True


def _launch(kernel, work: np.ndarray, n_blk: int, D: int, args: tuple) -> None:
    """``kernel(claim, order, *args)`` (``args``: a :class:`ForwardLaunch` or
    :class:`BackwardLaunch`) over all tasks ``[0, len(work) * n_blk)`` (``work``:
    steps per sequence; each sequence has ``n_blk`` tasks): on this thread for small calls,
    else on this thread and ``threads() - 1`` threads of the pool at once, each taking the
    next task of ``order`` (the longest first) from the counter ``claim`` until none is left,
    so that a thread slowed down (its core shared with another program, or with PyTorch's
    OpenMP threads, which spin after a parallel op) takes fewer. A pool thread that has not
    started when the others are done is not waited for."""
    n_tasks = len(work) * n_blk
    claim = np.zeros(1, dtype=np.int64)         # [1] the next task's index (sync.next_task)
    k = min(threads(), n_tasks)
    if k <= 1 or int(work.sum()) * D < SERIAL_BELOW:    # (one thread: any order will do)
        kernel(claim, np.arange(n_tasks, dtype=np.int64), *args)
        return
    per_task = np.repeat(np.maximum(work, 1), n_blk)                    # [n_tasks]
    order = np.argsort(-per_task, kind="stable").astype(np.int64)       # [n_tasks]
    futures = [pool(k - 1).submit(kernel, claim, order, *args) for _ in range(k - 1)]
    kernel(claim, order, *args)
    for future in futures:
        if not future.cancel():     # (one not started has taken no task: every one is done)
            future.result()


class _Common(NamedTuple):
    """What both scan kernels take after their data: the index arrays (per sequence its
    batch row, first and last step, first chunk-state row), the sizes and the variant."""

    strides: np.ndarray         # (6,) int64: the B and T element strides of z, a, g
    seq_b: np.ndarray           # (N,) int64
    seq_lo: np.ndarray          # (N,) int64
    seq_hi: np.ndarray          # (N,) int64
    ck_off: np.ndarray          # (N,) int64
    T: int
    D: int
    chunk: int
    block: int
    attention: int              # ATTENTION_CODE
    discount: int               # DISCOUNT_CODE
    reverse: bool


def _common(args: ScanArgs, z, a, g, layout, T: int, D: int, chunk: int, block: int) -> dict:
    seq_b, lo, hi, ck_off, _ = layout
    return _Common(_row_strides(z, a, g), seq_b, lo, hi, ck_off, T, D, chunk, block,
                   ATTENTION_CODE[args.attention], DISCOUNT_CODE[args.discount],
                   args.reverse)._asdict()


def _launch_plan(name: str, doc: str, data: list, flags: list) -> type:
    """A named tuple of a kernel's arguments after ``(claim, tasks)``, in its order: its
    ``data`` arrays, then :class:`_Common`'s fields, then its ``flags``."""
    plan = NamedTuple(name, [(field, np.ndarray) for field in data]
                      + list(_Common.__annotations__.items()) + flags)
    plan.__doc__ = doc
    return plan


# Built by name, passed by position (a compiled kernel's call takes positions); the names
# and their order are the kernels' (tests/backends/numba checks them).
ForwardLaunch = _launch_plan(
    "ForwardLaunch", "The arguments of ``forward`` of ``kernels/cpu/scan_fwd.py`` after "
    "``(claim, tasks)`` (``g``: ``a`` where there is no g, never read then).",
    ["z", "a", "g", "y", "state0", "final", "ck", "consts"],
    [("has_init", bool), ("save", bool), ("ahead", int)])
BackwardLaunch = _launch_plan(
    "BackwardLaunch", "The arguments of ``backward`` of ``kernels/cpu/scan_bwd.py`` after "
    "``(claim, tasks)`` (``g``: ``a`` and ``gg``: ``ga`` where there is no g, never read "
    "or written then).",
    ["z", "a", "g", "gy", "gz", "ga", "gg", "state0", "g_final", "g_init", "ck", "consts"],
    [("has_init", bool), ("has_g_final", bool), ("ahead", int)])


def forward(args: ScanArgs, *, output_final_state: bool, save: bool) -> ForwardResult:
    """The scan (contract: :meth:`fastrwa.ops.dispatch.Backend.forward`). ``saved`` is
    ``[states, chunk]``: the ``(3, chunks, D)`` states entering every chunk and the chunk
    length as a 1-element int64 tensor (so that a later change of :class:`Options` cannot
    make the backward misread them)."""
    z, a, g, attention, discount, init, reverse, cu_seqlens = args
    dtype = z.dtype
    z, a, g = _prepare(z, a, g)
    B, T, D = z.shape
    cdt = state_dtype(dtype)
    chunk = options().chunk
    layout = _layout(z, cu_seqlens, chunk)
    seq_b, lo, hi, _, _ = layout
    n_seq = len(seq_b)
    state0, has_init = _state(init, n_seq, D, cdt)
    y = _empty(z.shape, z.dtype, z.device)
    final = torch.empty((3, n_seq, D), dtype=cdt)
    ck = torch.empty((3, _ck_rows(B, T, n_seq, chunk, cu_seqlens) if save else 0, D),
                     dtype=cdt)
    block = _block(n_seq, D)
    g_in = a if g is None else g        # any array of the data type where there is no g
    _launch(forward_kernel, hi - lo, -(-D // block), D, ForwardLaunch(
        z=flat(z), a=flat(a), g=flat(g_in), y=flat(y), state0=flat(state0), final=flat(final),
        ck=flat(ck), consts=kernel_consts(cdt), has_init=has_init, save=save,
        ahead=_ahead(z, a, g), **_common(args, z, a, g_in, layout, T, D, chunk, block)))
    # separate tensors: a custom op's outputs may not alias one another
    out_final = tuple(x.clone() for x in final.unbind(0)) if output_final_state else None
    saved = [ck, torch.tensor([chunk], dtype=torch.int64)] if save else []
    return ForwardResult(y.to(dtype), out_final, saved)


def saved_like(args: ScanArgs) -> list:
    """What :func:`forward` saves, as empty tensors of the right shapes (for ``torch.compile``)."""
    z, cu_seqlens = args.z, args.cu_seqlens
    B, T, D = z.shape
    n_seq = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    n_ck = _ck_rows(B, T, n_seq, options().chunk, cu_seqlens)
    return [z.new_empty((3, n_ck, D), dtype=state_dtype(z.dtype)),
            z.new_empty((1,), dtype=torch.int64)]


def backward(args: ScanArgs, saved: list, m_final, gy, g_final) -> Gradients:
    """Gradients (contract: :meth:`fastrwa.ops.dispatch.Backend.backward`). Without this
    backend's ``saved`` the chunk states are recomputed first."""
    z, a, g, attention, discount, init, reverse, cu_seqlens = args
    dtypes = (z.dtype, a.dtype, None if g is None else g.dtype)
    if not _is_own(saved):    # a forward that did not save, or another backend's
        saved = forward(args, output_final_state=False, save=True).saved
    z, a, g = _prepare(z, a, g)
    B, T, D = z.shape
    gy = torch.zeros_like(z) if gy is None else gy.to(z.dtype).contiguous()
    cdt = state_dtype(dtypes[0])
    ck, chunk = saved[0].contiguous(), int(saved[1].item())
    layout = _layout(z, cu_seqlens, chunk)
    seq_b, lo, hi, _, _ = layout
    n_seq = len(seq_b)
    state0, has_init = _state(init, n_seq, D, cdt)
    gn, gd = (None, None) if g_final is None else g_final
    has_g_final = gn is not None or gd is not None
    g_fin = torch.zeros((2, n_seq, D), dtype=cdt)
    if gn is not None:
        g_fin[0] = gn
    if gd is not None:
        g_fin[1] = gd
    gz, ga = _empty(z.shape, z.dtype, z.device), _empty(a.shape, a.dtype, a.device)
    gg = None if g is None else _empty(g.shape, g.dtype, g.device)
    g_init = torch.zeros((3, n_seq, D), dtype=cdt)
    block = _block(n_seq, D)
    g_in = a if g is None else g
    _launch(backward_kernel, hi - lo, -(-D // block), D, BackwardLaunch(
        z=flat(z), a=flat(a), g=flat(g_in), gy=flat(gy), gz=flat(gz), ga=flat(ga),
        gg=flat(ga if gg is None else gg), state0=flat(state0), g_final=flat(g_fin),
        g_init=flat(g_init), ck=flat(ck), consts=kernel_consts(cdt), has_init=has_init,
        has_g_final=has_g_final, ahead=_ahead(z, a, g),
        **_common(args, z, a, g_in, layout, T, D, chunk, block)))
    gz, ga = gz.to(dtypes[0]), ga.to(dtypes[1])
    gg = None if gg is None else gg.to(dtypes[2])
    return Gradients(gz, ga, gg,
                     tuple(x.clone() for x in g_init.unbind(0)) if has_init else None)


def _ck_rows(B: int, T: int, n_seq: int, chunk: int, cu_seqlens) -> int:
    """Rows of the saved chunk states: exact for dense inputs; for packed ones a bound on the
    chunk count (sum of ceil(len_i / chunk) <= (T + n_seq (chunk - 1)) / chunk) that needs
    no look at the offsets, so ``torch.compile`` knows the saved shape. The kernels take the
    row count from the buffer."""
    if cu_seqlens is None:
        return B * -(-T // chunk)
    return (T + n_seq * (chunk - 1)) // chunk


def _is_own(saved: list) -> bool:
    """Whether ``saved`` is what :func:`forward` saves (``[states, chunk]``)."""
    return (len(saved) == 2 and saved[0].dim() == 3 and saved[1].dtype == torch.int64
            and saved[1].shape == (1,))


def _step_applies(z, a, g, state, out) -> bool:
    """Every tensor a contiguous CPU tensor in a dtype the step kernel reads."""
    cdt = state_dtype(z.dtype)
    tensors = (z, a, out) + (() if g is None else (g,))
    if z.dtype == torch.float16 or any(x.dtype != z.dtype or not x.is_contiguous()
                                        or x.device.type != "cpu" for x in tensors):
        return False
    return all(s.dtype == cdt and s.is_contiguous() and s.device.type == "cpu" for s in state)


# The step's bound arguments (NumPy views, scratch), per set of tensors: a decode loop calls
# the step on the same buffers every token, and making the views costs more than the kernel.
# The key holds each tensor's address and strides (with the inputs' dtype and shape, which
# the public function checked the others against), so a hit is the same memory in the same
# layout, and a layout the kernel reads (it was checked when the entry was made). A view
# keeps its tensor alive (no other tensor can take its address meanwhile), so the entries
# are bounded: the oldest are dropped past _BOUND_MAX entries or _BOUND_BYTES of tensors.
_BOUND_MAX = 256
_BOUND_BYTES = 64 << 20
_bound: collections.OrderedDict = collections.OrderedDict()   # key -> (arguments, bytes)
_bound_lock = threading.Lock()


def _bind_step(z, a, g, attention, discount, state, out) -> tuple:
    m, n, d = state
    consts = kernel_consts(m.dtype)
    return (flat(z), flat(a), flat(a if g is None else g), flat(m), flat(n), flat(d),
            flat(out), ATTENTION_CODE[attention], DISCOUNT_CODE[discount], consts,
            np.zeros((5, m.numel()), consts.dtype))


def step_(z, a, g, attention, discount, state, out) -> bool:
    """One streaming step in place (contract: :meth:`fastrwa.ops.dispatch.Backend.step_`):
    ``state`` ``(m, n~, d~)`` updated where it lies and ``y`` written into ``out``. Returns
    ``False`` (doing nothing) unless every tensor is a contiguous CPU tensor in a dtype the
    kernel reads (float32/bfloat16 inputs with a float32 state, or all float64). The views
    of a set of tensors are made once and reused while the same tensors come back."""
    key = (attention, discount, z.dtype, z.shape) + tuple(
        None if x is None else (x.data_ptr(), x.stride()) for x in (z, a, g, *state, out))
    entry = _bound.get(key)
    if entry is None:
        if not _step_applies(z, a, g, state, out):
            return False
        bound = _bind_step(z, a, g, attention, discount, state, out)
        entry = bound, sum(x.nbytes for x in bound if isinstance(x, np.ndarray))
        with _bound_lock:
            _bound[key] = entry
            while len(_bound) > 1 and (len(_bound) > _BOUND_MAX or sum(
                    size for _, size in _bound.values()) > _BOUND_BYTES):
                _bound.popitem(last=False)
    step_kernel(*entry[0])
    return True
