"""The "numba" backend: host launchers for the compiled CPU kernels in ``fastrwa.kernels``.

Same interface as :mod:`fastrwa.torch_backend`. Runs on CPU tensors: one compiled loop over
time per (sequence, channel block), vectorised across channels, the tasks split over
``torch.get_num_threads()`` threads (:mod:`fastrwa.cpu_threads`: PyTorch's own OpenMP team
where possible; the kernels release the GIL). It reads every input once and writes every
output once; the forward also saves the state entering each chunk of ``Options.chunk``
steps (``3 * D`` floats), from which the backward recomputes everything else (DESIGN.md §2).

Why numba (docs/benchmarks.md has the long form): it is a wheel on PyPI for every platform
PyTorch's CPU wheels cover, it compiles on first use with its own bundled LLVM (no C
compiler on the user's machine), and compiled kernels are cached on disk next to the
package. dtypes: float32 and bfloat16 compute in float32 (bfloat16 is widened and rounded
inside the kernel, no extra pass); float64 computes in float64; float16 is converted to
float32 around the kernels (one extra pass each way: numba has no float16 arithmetic).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import torch

from .buffers import empty as _empty
from . import cpu_threads
from .checks import state_dtype
from .kernels import cpu_scan, cpu_scan_bwd, cpu_step

ATTN_CODE = {"exp": 0, "sigmoid": 1, "softplus": 2, "relu": 3}
DISCOUNT_CODE = {None: 0, "log": 1, "sigmoid": 2}


@dataclasses.dataclass(frozen=True)
class Options:
    """Knobs of the numba backend; tests force them, users keep the defaults."""

    chunk: int = 32               # steps between saved states (the backward's recompute unit)
    block: int | None = None      # channels per task; None: all of D, halved until every
                                  # thread has two tasks (but not below 32)


_options = Options()


def set_options(**changes) -> Options:
    """Change the knobs; returns the previous :class:`Options`."""
    global _options
    previous = _options
    _options = dataclasses.replace(_options, **changes)
    return previous


@functools.lru_cache(maxsize=None)
def _consts(cdt: torch.dtype) -> np.ndarray:
    """``[floor, 0, 1, -inf]``: ``floor`` stands for ``-inf`` inside the kernels."""
    npt = np.float64 if cdt == torch.float64 else np.float32
    floor = -1e307 if cdt == torch.float64 else -3e38
    return np.array([floor, 0.0, 1.0, -np.inf], dtype=npt)


def _flat(x: torch.Tensor) -> np.ndarray:
    """A flat NumPy view of a CPU tensor's memory, from its first element to its last (all of
    it for a contiguous tensor; a strided input's rows with what lies between them);
    bfloat16 as its uint16 bits."""
    if not x.is_contiguous():
        span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride())) if x.numel() else 0
        x = x.as_strided((span,), (1,))
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    return x.numpy().reshape(-1)


def _row_strides(*inputs: torch.Tensor) -> np.ndarray:
    """Element strides along B and T of each ``(B, T, D)`` input, as the kernels take them."""
    return np.array([st for x in inputs for st in x.stride()[:2]], dtype=np.int64)


def _block(n_seq: int, D: int) -> int:
    if _options.block is not None:
        return _options.block
    block = D
    while block > 32 and n_seq * -(-D // block) < 2 * cpu_threads.threads():
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
        if x.dtype == torch.float16:
            return x.float()
        return x if x.stride(2) == 1 or x.shape[2] == 1 else x.contiguous()
    return fix(z), fix(a), fix(g)


def _state(init, n_seq, D, cdt):
    if init is None:
        return torch.empty(0, dtype=cdt), False
    return torch.stack([s.to(cdt) for s in init]).reshape(3, n_seq, D).contiguous(), True


def forward(z, a, g, attention, discount, init, output_final_state, reverse, cu_seqlens=None,
            save_for_backward=False):
    """``(y, final, saved)``: ``y`` in the input dtype, the final ``(m, n~, d~)`` (or ``None``)
    and ``saved = [states, chunk]``: the ``(3, chunks, D)`` states entering every chunk and
    the chunk length as a 1-element int64 tensor (so a later change of ``Options`` cannot
    make the backward misread them), or ``[]``."""
    dtype = z.dtype
    z, a, g = _prepare(z, a, g)
    B, T, D = z.shape
    cdt = state_dtype(dtype)
    chunk = _options.chunk
    seq_b, lo, hi, ck_off, n_ck = _layout(z, cu_seqlens, chunk)
    n_seq = len(seq_b)
    state0, has_init = _state(init, n_seq, D, cdt)
    y = _empty(z.shape, z.dtype, z.device)
    final = torch.empty((3, n_seq, D), dtype=cdt)
    ck = torch.empty((3, n_ck if save_for_backward else 0, D), dtype=cdt)
    block = _block(n_seq, D)
    cpu_threads.run(cpu_scan.forward, "forward", z.dtype, hi - lo, -(-D // block), D,
                    _flat(z), _flat(a), _flat(a if g is None else g), _flat(y),
                    _row_strides(z, a, a if g is None else g), T, D, seq_b, lo, hi,
                    _flat(state0), has_init, _flat(final), _flat(ck), ck_off, chunk,
                    save_for_backward, ATTN_CODE[attention], DISCOUNT_CODE[discount], reverse,
                    block, _consts(cdt))
    # separate tensors: a custom op's outputs may not alias one another
    out_final = tuple(x.clone() for x in final.unbind(0)) if output_final_state else None
    saved = [ck, torch.tensor([chunk], dtype=torch.int64)] if save_for_backward else []
    return y.to(dtype), out_final, saved


def fake_saved(z, cu_seqlens) -> list:
    """What :func:`forward` saves, as empty tensors of the right shapes (for ``torch.compile``)."""
    B, T, D = z.shape
    if cu_seqlens is None:
        n_ck = B * -(-T // _options.chunk)
    else:
        n_ck = torch.library.get_ctx().new_dynamic_size()
    return [z.new_empty((3, n_ck, D), dtype=state_dtype(z.dtype)),
            z.new_empty((1,), dtype=torch.int64)]


def backward(z, a, g, attention, discount, init, reverse, cu_seqlens, saved, m_final, gy,
             g_final):
    """Gradients ``(gz, ga, gg, g_init)`` as :func:`fastrwa.torch_backend.backward` returns them."""
    dtypes = (z.dtype, a.dtype, None if g is None else g.dtype)
    if not saved:   # the forward ran without saving: get the chunk states now
        saved = forward(z, a, g, attention, discount, init, False, reverse, cu_seqlens, True)[2]
    z, a, g = _prepare(z, a, g)
    gy = gy.to(z.dtype).contiguous()
    B, T, D = z.shape
    cdt = state_dtype(dtypes[0])
    ck, chunk = saved[0].contiguous(), int(saved[1].item())
    seq_b, lo, hi, ck_off, _ = _layout(z, cu_seqlens, chunk)
    n_seq = len(seq_b)
    state0, has_init = _state(init, n_seq, D, cdt)
    gn, gd = (None, None) if g_final is None else g_final[1:]
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
    cpu_threads.run(cpu_scan_bwd.backward, "backward", z.dtype, hi - lo, -(-D // block), D,
                    _flat(z), _flat(a), _flat(a if g is None else g), _flat(gy), _flat(gz),
                    _flat(ga), _flat(ga if gg is None else gg),
                    _row_strides(z, a, a if g is None else g), T, D, seq_b, lo, hi,
                    _flat(state0), has_init, _flat(g_fin), has_g_final, _flat(g_init),
                    _flat(ck), ck_off, chunk, ATTN_CODE[attention], DISCOUNT_CODE[discount],
                    reverse, block, _consts(cdt))
    gz, ga = gz.to(dtypes[0]), ga.to(dtypes[1])
    gg = None if gg is None else gg.to(dtypes[2])
    return gz, ga, gg, (tuple(x.clone() for x in g_init.unbind(0)) if has_init else None)


_scratch = threading.local()


def _step_scratch(numel: int, dtype: np.dtype) -> np.ndarray:
    """Per-thread scratch of :func:`step_`, allocated once per size (no allocation per token)."""
    key = (numel, dtype)
    cache = getattr(_scratch, "rows", None)
    if cache is None or cache[0] != key:
        _scratch.rows = cache = (key, np.zeros((5, numel), dtype))
    return cache[1]


def step_(z, a, g, attention, discount, state, out) -> bool:
    """One streaming step in place: ``state`` ``(m, n~, d~)`` updated where it lies and ``y``
    written into ``out``. Returns ``False`` (doing nothing) unless every tensor is a
    contiguous CPU tensor in a dtype the kernel reads (float32/bfloat16 inputs with a
    float32 state, or all float64); the caller then takes the allocating path."""
    m, n, d = state
    cdt = state_dtype(z.dtype)
    tensors = (z, a, out) + (() if g is None else (g,))
    if z.dtype == torch.float16 or any(x.dtype != z.dtype or not x.is_contiguous()
                                        or x.device.type != "cpu" for x in tensors):
        return False
    if any(s.dtype != cdt or not s.is_contiguous() or s.device.type != "cpu" for s in state):
        return False
    consts = _consts(cdt)
    cpu_step.step_inplace(_flat(z), _flat(a), _flat(a if g is None else g), _flat(m), _flat(n),
                          _flat(d), _flat(out), ATTN_CODE[attention], DISCOUNT_CODE[discount],
                          consts, _step_scratch(m.numel(), consts.dtype))
    return True
