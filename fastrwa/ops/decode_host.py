"""The launcher of the fused CPU decode step (``kernels/cpu/decode.py``): weight storage
formats, and one call that advances a batch's rows by one token or a prompt.

The model side (which module's weights go where) is :class:`fastrwa.models.PackedLM`; this
module knows arrays only. Formats of a weight matrix ``(out, in)`` (the arithmetic is
float32 in every one):

* ``float32``: as trained;
* ``bfloat16``: rounded to nearest even, kept as the ``uint16`` bits (half the bytes);
* ``int8``: per output row ``scale = max|w| / 127`` and ``q = round(w / scale)`` in
  ``[-127, 127]`` (a quarter of the bytes), ``w ~ q * scale``.

A call with ``B >= 8`` rows runs up to ``torch.get_num_threads()`` ranges of 4 rows or more
at once (one on the caller's thread, the others on the numba backend's pool: the kernel
releases the GIL), each starting at a multiple of 4 rows. A smaller batch of a model whose
matrices hold ``SPLIT_ABOVE`` bytes a part or more (:func:`parts_for`; not on Windows)
shares each call among the threads instead: the
caller and helpers on a pool of their own each take a share of every product's outputs and
of the channels between products and meet at barriers; the caller starts alone, does the
share of a helper that has not started in time (a busy machine) and returns when every
share is done (``kernels/cpu/sync.py``). Such calls share their step only while that is
faster than running it alone (:class:`Choice`: another program on the cores makes it
slower). One such call runs at a time in a process (another runs alone on its caller's
thread). Results are the same bits whatever the split and the thread count.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

import numpy as np
import torch

from ..kernels.cpu.decode import check_tokens, decode as decode_kernel, serve
from ..kernels.cpu.sampling import sample_rows, sample_rows_each
from ..kernels.cpu.sync import (BUSY, CONTROL_SIZE, MAX_PARTS, PARKED, POSTED, STATE,
                                SYNC_SIZE, cancel, claim_parked, dismiss, post)
from .numba_common import flat, kernel_consts, pool, threads

WEIGHT_FORMATS = ("float32", "bfloat16", "int8")
INT8_LEVELS = 127
PREFILL_ROWS = 256      # (batch row, position) pairs per call of a prompt: its work buffers
ROW_BLOCK = 4       # rows kernels/cpu/decode.py's linear multiplies by one weight row at once
# Bytes of weight matrices a step reads above which a small batch shares the step among the
# threads (below it a step takes about what waking a thread does: tens of microseconds),
# and per part beyond the first (a part's share of a small model is not worth a barrier).
SPLIT_ABOVE = 1 << 21
SHARE = "auto"          # a small batch's step: shared or alone, whichever is faster (Choice)
PROBE_EVERY = 256       # calls between timings of the way not in use
PROBE_FIRST = 8         # calls before the first timing of a step alone
SMOOTHING = 0.125       # weight of a call's time in the smoothed time of its way
_split_lock = threading.Lock()      # one shared step at a time
_UNSHARED = np.zeros(SYNC_SIZE, dtype=np.int64)     # (a call alone never touches it)


def check_format(weights: object) -> str:
    """``weights`` if it names a format of :data:`WEIGHT_FORMATS`, else ``ValueError``."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    return weights


def quantize(weight: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of float32 matrices ``weight`` ``(..., out, in)`` stored as
    ``weights`` (module doc): ``data`` float32, bfloat16 or int8 of ``weight``'s shape,
    ``scale`` float32 ``(..., out)`` (ones but for int8). A row holding NaN gets a NaN scale
    (its outputs are NaN, as the float32 row's would be); an all-zero row a scale of 1."""
    weight = weight.detach().to(torch.float32).contiguous()
    ones = torch.ones(weight.shape[:-1], dtype=torch.float32)
    if weights == "float32":
        return weight.clone(), ones
    if weights == "bfloat16":
        return weight.to(torch.bfloat16), ones
    top = weight.abs().amax(dim=-1)                       # (NaN propagates)
    scale = torch.where(top == 0, torch.ones_like(top), top / INT8_LEVELS)
    q = torch.nan_to_num(torch.round(weight / scale[..., None]), nan=0.0)
    return q.clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrices the kernel multiplies by: ``data * scale`` (exact: one rounding
    of a product of an int8 and a float32, as the kernel's ``acc * scale`` is of a sum)."""
    if data.dtype == torch.int8:
        return data.to(torch.float32) * scale[..., None]
    return data.to(torch.float32)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes and codes the kernel is called with (``kernels/cpu/decode.py``)."""

    L: int          # blocks
    D: int          # d_model (= the scan's width)
    G: int          # gates per block: 3 (RWA), 4 (RDA)
    R: int          # MLP width
    V: int          # vocabulary
    token_shift: bool
    gated: bool
    attention: int
    discount: int
    f_h: int
    f_o: int

    @property
    def F(self) -> int:
        return 2 * self.D if self.token_shift else self.D


@dataclasses.dataclass
class Weights:
    """Every array the kernel reads, flat: the matrices with their scales and biases, the
    norms' weights and epsilons, the float32 embedding."""

    shapes: Shapes
    embed: np.ndarray
    norms: np.ndarray
    eps: np.ndarray
    matrices: tuple        # (proj, gate, up, down, head), each (data, scale, bias)

    @property
    def matrix_bytes(self) -> int:
        """Bytes of the weight matrices one step reads (the head included, the embedding row
        aside)."""
        return sum(data.nbytes for data, _, _ in self.matrices)


def work_buffers(shapes: Shapes, batch: int, positions: int = 1) -> dict[str, torch.Tensor]:
    """The kernel's work buffers (float32 CPU tensors) for calls of up to ``positions``
    tokens per row of ``batch`` rows: one row per (batch row, position), and the logits
    ``(batch, V)``."""
    s = shapes
    widths = dict(x=s.D, normed=s.D, inp=s.F, proj=s.G * s.D, z=s.D, y=s.D, h=s.D, gate=s.D,
                  hidden=s.R, tb=2 * s.D)
    work = {name: torch.empty(batch * positions, width, dtype=torch.float32)
            for name, width in widths.items()}
    work["logits"] = torch.empty(batch, s.V, dtype=torch.float32)
    return work


@dataclasses.dataclass
class _Helpers:
    """The helpers serving the shared calls of one argument set (a stream of decode steps of
    one cache): they park between calls (``kernels/cpu/sync.py``), so a call wakes no
    thread. ``key``: the ids of the arguments, which stay alive while a helper runs with
    them (once every helper has left, a match finds them gone and starts a new set);
    ``tokens``, ``sync``: the calls' token ids and work-sharing array, rewritten per call; a
    control array and a future per helper; ``calls``: the calls it has shared."""

    key: tuple
    tokens: np.ndarray
    sync: np.ndarray
    controls: list
    futures: list
    calls: int = 0


def _dismiss(h: _Helpers) -> None:
    """Send a set of helpers away (they leave at their next look)."""
    for control in h.controls:
        dismiss(control)


_helpers: _Helpers | None = None


def _cores() -> int:
    """Cores this process may run on: a shared step never has more parts (its parts spin
    while they wait for one another). 1 on Windows, whose waits cannot yield the core
    (``kernels/cpu/sync.py``)."""
    if sys.platform == "win32":
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # (not on every platform)
        return os.cpu_count() or 1


def parts_for(weights: "Weights") -> int:
    """The parts a small batch's call shares its step among: as many as PyTorch's threads,
    the cores and the model's size (``SPLIT_ABOVE`` bytes of matrices a part) allow; 1: not
    shared."""
    return max(1, min(threads(), _cores(), MAX_PARTS, weights.matrix_bytes // SPLIT_ABOVE))


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's helper threads, and a lock another of the
    parent's threads held would stay held: start afresh."""
    global _split_lock, _helpers
    _split_lock, _helpers = threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclasses.dataclass
class Choice:
    """Whether a small batch's calls share their step among the threads or run it alone on
    the caller's: whichever has been faster lately. A shared step waits at its barriers for
    every part, so one whose thread loses its core to another program holds the whole step
    up (measured with a busy loop on the other core: the default model's bfloat16 stream at
    3,357 bytes/s shared against 7,861 alone); then the step runs alone until sharing is
    faster again. Seconds of a call each way, smoothed over the calls made that way
    (``SMOOTHING``), starting from a probe of sharing; a probe is two calls one way, of
    which the second's time replaces that way's (the first may start the helpers); the way
    not in use is probed after ``PROBE_EVERY`` calls (alone the first time after
    ``PROBE_FIRST``). ``SHARE``: ``"auto"`` (this), ``"always"`` or ``"never"``."""

    shared_s: float = 0.0       # (0: not timed yet)
    alone_s: float = 0.0
    calls: int = 0              # since the way not in use was last timed
    probe: int = 2              # calls of a probe left (the first: shared, helpers starting)
    probe_shared: bool = True

    def share(self) -> bool:
        """Whether the next call shares its step."""
        if SHARE != "auto":
            if SHARE not in ("always", "never"):
                raise ValueError(f"fastrwa.ops.decode_host.SHARE must be 'auto', 'always' "
                                 f"or 'never', got {SHARE!r}")
            return SHARE == "always"
        if self.probe:
            return self.probe_shared
        best = not self.shared_s or not self.alone_s or self.shared_s <= self.alone_s
        self.calls += 1
        if self.calls >= (PROBE_EVERY if self.alone_s else PROBE_FIRST):
            self.calls, self.probe, self.probe_shared = 0, 2, not best
            return not best
        return best

    def record(self, shared: bool, seconds: float) -> None:
        """A call made as :meth:`share` said took ``seconds``."""
        name = "shared_s" if shared else "alone_s"
        if self.probe:          # (its last call's time stands: the first may start helpers)
            self.probe -= 1
            setattr(self, name, seconds)
            return
        old = getattr(self, name)
        setattr(self, name, seconds if old == 0.0 else old + SMOOTHING * (seconds - old))


@dataclasses.dataclass(frozen=True, eq=False)
class Bound:
    """The kernel's arguments after the token ids, for one set of state and work arrays
    (:func:`bind`), built once and reused by every call with them: ``rest``, ``ids`` (the
    same with every array replaced by its identity: what parked helpers are matched by),
    ``logits``, the flat ``(B, V)`` array the calls write, and ``positions``, the most
    tokens per row a call may advance (the work arrays' rows)."""

    weights: Weights
    batch: int
    positions: int
    rest: tuple
    ids: tuple
    logits: np.ndarray
    choice: Choice = dataclasses.field(default_factory=Choice)


def bind(weights: Weights, state: tuple, arrays: dict, batch: int) -> Bound:
    """The :class:`Bound` arguments of calls for ``batch`` rows with ``state`` (flat ``m, n,
    d, last`` arrays ``(L, B, D)``, ``last`` empty without token shift) and ``arrays`` (flat
    views of :func:`work_buffers`); they stay in use as long as the result."""
    s = weights.shapes
    (proj, gate, up, down, head) = weights.matrices
    w = arrays
    rest = (s.L, batch, s.D, s.G, s.R, s.V, s.F, s.token_shift, s.gated, s.attention,
            s.discount, s.f_h, s.f_o, weights.embed, weights.norms, weights.eps,
            *proj, *gate, *up, *down, *head, *state,
            w["x"], w["normed"], w["inp"], w["proj"], w["z"], w["y"], w["h"], w["gate"],
            w["hidden"], w["tb"], w["logits"], kernel_consts(torch.float32))
    return Bound(weights, batch, w["x"].shape[0] // max(1, batch * s.D), rest,
                 tuple(id(a) if isinstance(a, np.ndarray) else a for a in rest), w["logits"])


def _shared(args: tuple, bound: Bound, parts: int) -> None:
    """One call of the decode kernel shared by ``parts`` parts: the caller and the helpers
    parked since the last call with the same arguments, or a new set of helpers. The caller
    returns when every part's share is written. A helper that raised is found at a later
    call (its future, done, is checked then)."""
    global _helpers
    tokens, t_stride, T, lo, hi = args
    rest = bound.rest
    key = (t_stride, T, lo, hi, parts, tokens.shape, bound.ids)
    h, _helpers = _helpers, None        # (set again below once this call is under way)
    if h is not None:
        failed = next((f for f in h.futures if f.done() and f.exception() is not None), None)
        claimed = [claim_parked(c) for c in h.controls] if h.key == key and not failed else []
        if failed or h.key != key or any(state != PARKED for state in claimed):
            _dismiss(h)                 # (one left, is late or raised: a new set)
            if failed:
                failed.result()         # (raises what the helper raised, once)
            h = None
    try:
        if h is None:
            h = _Helpers(key, tokens.copy(), np.zeros(SYNC_SIZE, dtype=np.int64),
                         [np.zeros(CONTROL_SIZE, dtype=np.int64) for _ in range(parts - 1)],
                         [])
            for p, control in enumerate(h.controls, start=1):
                control[STATE], control[POSTED] = BUSY, 1           # (its first call)
                h.futures.append(pool(2 * (parts - 1), "helpers").submit(
                    serve, h.tokens, t_stride, T, lo, hi, *rest, p, parts, h.sync, control))
        else:
            h.tokens[:] = tokens
            h.sync[:] = 0
            for control in h.controls:
                post(control)
        h.calls += 1
        decode_kernel(h.tokens, t_stride, T, lo, hi, *rest, 0, parts, h.sync)
    except BaseException:       # (an interrupt before the caller's part: no helper waits;
        if h is not None:       # after it, the helpers are done and this changes nothing)
            cancel(h.sync)
            _dismiss(h)
        raise
    _helpers = h


def run(bound: Bound, tokens: np.ndarray) -> int:
    """Advance the ``B`` rows of ``bound`` (:func:`bind`) by their ``T`` tokens (``tokens``
    flat int64, ``(B, T)`` row-major; its work arrays hold ``T`` positions or more) and write
    the logits after the last into its logits. Returns -1, or the first row holding an id
    outside the vocabulary: then nothing was written."""
    weights, batch, rest = bound.weights, bound.batch, bound.rest
    if batch == 0:
        return -1
    T = tokens.shape[0] // batch
    if T > bound.positions:
        raise ValueError(f"tokens: {T} a row, more than the {bound.positions} the bound work "
                         f"arrays hold")
    bad = check_tokens(tokens, T, T, 0, batch, weights.shapes.V)
    if bad >= 0:
        return bad
    args = (tokens, T, T)
    # Ranges start at multiples of the kernel's block of rows: a row is summed in the same
    # block (and order) whatever the split, so the result does not depend on the threads.
    k = min(threads(), batch // ROW_BLOCK)         # (ranges of 4 rows or more)
    bounds = sorted({0, batch, *(min(batch, ROW_BLOCK * round(batch * i / k / ROW_BLOCK))
                                 for i in range(1, k))})
    alone = (0, 1, _UNSHARED)                               # (part, parts, sync)
    if len(bounds) == 2:
        parts = parts_for(weights)
        if parts == 1 or not _split_lock.acquire(blocking=False):
            decode_kernel(*args, 0, batch, *rest, *alone)
            return -1
        try:
            shared = bound.choice.share()
            began = time.perf_counter()
            if shared:
                _shared((*args, 0, batch), bound, parts)
            else:
                decode_kernel(*args, 0, batch, *rest, *alone)
            bound.choice.record(shared, time.perf_counter() - began)
        finally:
            _split_lock.release()
        return -1
    futures = [pool(len(bounds) - 2).submit(decode_kernel, *args, lo, hi, *rest, *alone)
               for lo, hi in zip(bounds[1:-1], bounds[2:])]
    decode_kernel(*args, bounds[0], bounds[1], *rest, *alone)
    for future in futures:
        future.result()
    return -1


def draw(logits: np.ndarray, B: int, V: int, temperature: float, top_k: int | None,
         top_p: float | None, uniforms: np.ndarray, forbidden: int, out: np.ndarray,
         scratch: np.ndarray) -> int:
    """Write into ``out`` (int64 ``(B,)``) one id per row of ``logits`` (flat float32 ``(B,
    V)``) drawn at ``uniforms`` (float64 ``(B,)``), never one ``>= forbidden``
    (``kernels/cpu/sampling.py``); ``scratch``: ``V`` float32. Returns -1, or the first row
    nothing can be drawn from (then ``out`` is incomplete)."""
    return sample_rows(logits, B, V, forbidden, np.float32(temperature),
                       min(top_k or 0, V), 1.0 if top_p is None else float(top_p),
                       uniforms, out, scratch)


def draw_each(logits: np.ndarray, B: int, V: int, temperatures: np.ndarray,
              top_ks: np.ndarray, top_ps: np.ndarray, uniforms: np.ndarray, forbidden: int,
              out: np.ndarray, scratch: np.ndarray) -> int:
    """:func:`draw` with each row's own settings, in one call: row ``b`` at
    ``temperatures[b]`` (float32), ``top_ks[b]`` (int64, 0: no top-k; below 0: the row is
    skipped, ``out[b]`` left as it is) and ``top_ps[b]`` (float64, 1: no top-p), at
    ``uniforms[b]`` (float64). A row nothing can be drawn from gets -1 in ``out``; returns
    how many did."""
    return sample_rows_each(logits, B, V, forbidden, temperatures, top_ks, top_ps, uniforms,
                            out, scratch)
