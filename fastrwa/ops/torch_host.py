"""The "torch" backend: forward and analytic backward of the weighted scan on PyTorch ops.

Satisfies :class:`fastrwa.ops.dispatch.Backend`. Runs on any device PyTorch supports (on
CPU "auto" prefers the compiled "numba" backend, when numba imports). Both passes use the
chunked scan of :mod:`.chunked`. Arithmetic and state are float32 (float64 for float64
inputs).

Memory/recompute choice: the forward saves nothing but its inputs; the backward re-runs the
forward to get ``y_t`` and ``L_t = log d_t`` (one extra forward) and then runs one reverse
scan. Saving ``L`` would cost a float32 tensor of the input's size for a saving of one
forward pass; the other backends make the same choice for the same reason (docs/math.md §4).
"""

from __future__ import annotations

import dataclasses

import torch

from .buffers import empty as _empty
from .dispatch import ForwardResult, Gradients, Knobs, ScanArgs, state_dtype
from . import chunked
from .chunked import exp_nonpositive_, safe_average
from .transforms import attention_grad, decay_grad, log_decay, log_weight


@dataclasses.dataclass(frozen=True)
class Options:
    """Knobs of the torch backend; tests force them, users keep the defaults."""

    chunk_size: int | None = None    # steps per chunk; None: ~sqrt(T) (chunked.default_chunk_size)


_knobs = Knobs(Options)
options, set_options = _knobs.get, _knobs.set


def _log_total(m: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``L = log(exp(m) d)``: ``-inf`` for an empty state (``d = 0`` or ``m = -inf``)."""
    empty = d == 0
    return torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1, d)))


def _sequences(cu_seqlens: torch.Tensor) -> list[slice]:
    bounds = cu_seqlens.tolist()
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _rows(state, i):
    return None if state is None else tuple(None if x is None else x[i:i + 1] for x in state)


def forward(args: ScanArgs, *, output_final_state: bool, save: bool) -> ForwardResult:
    """The scan (contract: :meth:`fastrwa.ops.dispatch.Backend.forward`). Nothing is saved:
    the backward recomputes everything from the inputs."""
    y, final = _forward(*args[:6], output_final_state, args.reverse, args.cu_seqlens)
    return ForwardResult(y, final, [])


def saved_like(args: ScanArgs) -> list:
    """What :func:`forward` saves: nothing."""
    return []


def _forward(z, a, g, attention, discount, init, output_final_state, reverse, cu_seqlens=None):
    """``(y, final)``: ``y`` in the input dtype, the final state ``(m, n, d)`` or ``None``."""
    if cu_seqlens is not None:
        y = _empty(z.shape, z.dtype, z.device)
        finals = []
        for i, sl in enumerate(_sequences(cu_seqlens)):
            y[:, sl], final = _forward(z[:, sl], a[:, sl], None if g is None else g[:, sl],
                                       attention, discount, _rows(init, i), True, reverse)
            finals.append(final)
        final = tuple(torch.cat(parts) for parts in zip(*finals)) if output_final_state else None
        return y, final
    chunk_size = options().chunk_size
    cdt = state_dtype(z.dtype)
    l = log_weight(a.to(cdt), attention)
    lam = log_decay(None if g is None else g.to(cdt), discount)
    y = _empty(z.shape, z.dtype, z.device)

    def emit(sel, m, vals, d):
        y[:, sel] = safe_average(vals[0], d)

    init_state = None if init is None else (init[0], [init[1]], init[2])
    m, (n,), d = chunked.scan(l, lam, [z], init_state, True, reverse, emit, chunk_size)
    final = (m, n, d) if output_final_state else None
    return y, final


def _shift_decay(lam: torch.Tensor, reverse: bool) -> torch.Tensor:
    """The decay the adjoint scan applies at ``t``: ``lam[t+1]`` (``lam[t-1]`` if reversed), 0 at the end."""
    out = torch.zeros_like(lam)
    if reverse:
        out[:, 1:] = lam[:, :-1]
    else:
        out[:, :-1] = lam[:, 1:]
    return out


def backward(args: ScanArgs, saved: list, m_final, gy, g_final) -> Gradients:
    """Gradients of the scan (contract: :meth:`fastrwa.ops.dispatch.Backend.backward`);
    docs/math.md §4 derives them."""
    return Gradients(*_backward(*args, gy, g_final))


def _backward(z, a, g, attention, discount, init, reverse, cu_seqlens, gy, g_final):
    """``(gz, ga, gg, (gm0, gn0, gd0))``. ``gy``: ``(B, T, D)`` or ``None``; ``g_final``:
    ``(gn, gd)`` for the final state (entries may be ``None``) or ``None``. ``gg`` is
    ``None`` without a discount and the state gradients ``None`` without an initial state."""
    if cu_seqlens is not None:
        gz, ga = _empty(z.shape, z.dtype, z.device), _empty(a.shape, a.dtype, a.device)
        gg = None if g is None else _empty(g.shape, g.dtype, g.device)
        g_inits = []
        for i, sl in enumerate(_sequences(cu_seqlens)):
            part = lambda x: None if x is None else x[:, sl]
            gz_i, ga_i, gg_i, g_init_i = _backward(
                z[:, sl], a[:, sl], part(g), attention, discount, _rows(init, i), reverse, None,
                part(gy), _rows(g_final, i))
            gz[:, sl], ga[:, sl] = gz_i, ga_i
            if gg is not None:
                gg[:, sl] = gg_i
            g_inits.append(g_init_i)
        g_init = None if init is None else tuple(torch.cat(p) for p in zip(*g_inits))
        return gz, ga, gg, g_init
    chunk_size = options().chunk_size
    B, T, D = z.shape
    cdt = state_dtype(z.dtype)
    dev = z.device
    if T == 0:  # (a packed sequence of length 0) the state passes through unchanged
        gz, ga = _empty(z.shape, z.dtype, dev), _empty(a.shape, a.dtype, dev)
        gg = None if g is None else _empty(g.shape, g.dtype, dev)
        if init is None:
            return gz, ga, gg, None
        m0, n0, d0 = init
        gn, gd = g_final or (None, None)
        gn = torch.zeros_like(n0) if gn is None else gn.to(n0.dtype)
        gd = torch.zeros_like(d0) if gd is None else gd.to(d0.dtype)
        # Same convention as every other state gradient (docs/math.md §4): gm0 = n gn + d gd.
        return gz, ga, gg, (n0 * gn + d0 * gd, gn.clone(), gd.clone())
    l = log_weight(a.to(cdt), attention)
    lam = log_decay(None if g is None else g.to(cdt), discount)

    # 1. Re-run the forward, keeping y_t and L_t = log d_t in buffers with one extra slot
    #    for the state before the first step (slot 0, or slot T when reversed).
    here = 0 if reverse else 1                     # buffer index of position 0
    before = 1 if reverse else 0                   # buffer index of "previous" of position 0
    L_buf = _empty((B, T + 1, D), cdt, dev)
    y_buf = _empty((B, T + 1, D), cdt, dev)
    L_now, y_now = L_buf[:, here:here + T], y_buf[:, here:here + T]
    L_prev, y_prev = L_buf[:, before:before + T], y_buf[:, before:before + T]
    slot0 = T if reverse else 0
    if init is None:
        L_buf[:, slot0] = float("-inf")
        y_buf[:, slot0] = 0
    else:
        m0, n0, d0 = init
        L_buf[:, slot0] = _log_total(m0, d0)
        y_buf[:, slot0] = safe_average(n0, d0)

    def emit_forward(sel, m, vals, d):
        L_now[:, sel] = _log_total(m, d)
        y_now[:, sel] = safe_average(vals[0], d)

    init_state = None if init is None else (init[0], [init[1]], init[2])
    m_T, _, _ = chunked.scan(l, lam, [z], init_state, True, reverse, emit_forward, chunk_size)

    # 2. The adjoint scan, run the other way: R_t = decay(R_next) + (log-weight -L_t, values
    #    gy_t and gy_t y_t). R_t = (M, rho, sigma) stands for nu_t = exp(M) rho = dLoss/dn_t
    #    and -exp(M) sigma = dLoss/dd_t. Steps with L_t = -inf (nothing seen) carry no weight.
    if gy is None:
        gy = torch.zeros((B, T, D), dtype=cdt, device=dev)
    gy = gy.to(cdt)
    neg_L = torch.where(torch.isneginf(L_now), float("-inf"), -L_now)
    lam_adj = None if lam is None else _shift_decay(lam, reverse)
    adj_init = None
    if g_final is not None and any(x is not None for x in g_final):
        gn, gd = g_final
        zeros = torch.zeros((B, D), dtype=cdt, device=dev)
        rho = zeros if gn is None else gn.to(cdt).clone()
        sigma = zeros.clone() if gd is None else -gd.to(cdt)
        # dLoss/dn_T = gn exp(-m_T): the adjoint enters with log-scale -m_T.
        M = torch.where(torch.isneginf(m_T), float("-inf"), -m_T)
        adj_init = (M, [rho, sigma], None)

    gz = _empty(z.shape, z.dtype, dev)
    ga = _empty(a.shape, a.dtype, dev)
    gg = None if g is None else _empty(g.shape, g.dtype, dev)

    def emit_adjoint(sel, M, vals, _):
        rho, sigma = vals
        # exp(l_i + M_i) is the largest p_{t,i} <= 1 folded in; it never overflows.
        w = exp_nonpositive_(l[:, sel] + M)
        gz[:, sel] = w * rho
        gl = w * (z[:, sel] * rho - sigma)
        ga[:, sel] = attention_grad(gl, a[:, sel].to(cdt), attention)
        if gg is not None:
            w_prev = exp_nonpositive_(L_prev[:, sel] + lam[:, sel] + M)
            glam = w_prev * (y_prev[:, sel] * rho - sigma)
            gg[:, sel] = decay_grad(glam, g[:, sel].to(cdt), discount)

    M1, (rho1, sigma1), _ = chunked.scan(
        neg_L, lam_adj, [gy, gy * y_now], adj_init, False, not reverse, emit_adjoint, chunk_size
    )

    # 3. Initial state: it is the pseudo-step before position 0, decayed by that step's lam.
    g_init = None
    if init is not None:
        m0, n0, d0 = init
        first = T - 1 if reverse else 0
        scale = m0 + M1 if lam is None else m0 + lam[:, first] + M1
        w0 = torch.exp(scale)
        g_init = (w0 * (n0 * rho1 - d0 * sigma1), w0 * rho1, -w0 * sigma1)
    return gz, ga, gg, g_init
