"""The "torch" backend: forward and analytic backward of the weighted scan on PyTorch ops.

Satisfies :class:`fastrwa.ops.dispatch.Backend`. Runs on any device PyTorch supports (on
CPU "auto" prefers the compiled "numba" backend, when numba imports). Both passes use the
chunked scan of :mod:`.chunked`. Arithmetic and state are float32 (float64 for float64
inputs).

Memory/recompute choice: the forward saves nothing but its inputs; the backward re-runs the
forward to get ``m_t``, ``d~_t`` and ``y_t`` (one extra forward) and then runs the adjoint,
a linear recurrence in normal space, as one reverse scan (docs/math.md §4). Saving the
forward's states would cost float32 tensors of the input's size for a saving of one forward
pass; the other backends make the same choice for the same reason.
"""

from __future__ import annotations

import dataclasses

import torch

from .buffers import empty as _empty
from .contract import ForwardResult, Gradients, Knobs, ScanArgs, state_dtype
from . import chunked
from .chunked import decayed_max, exp_nonpositive_, safe_average
from .transforms import attention_grad, decay_grad, log_decay, log_weight


@dataclasses.dataclass(frozen=True)
class Options:
    """Knobs of the torch backend; tests force them, users keep the defaults."""

    chunk_size: int | None = None    # steps per chunk; None: ~sqrt(T) (chunked.default_chunk_size)


_knobs = Knobs(Options)
options, set_options = _knobs.get, _knobs.set


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

    # 1. Re-run the forward, keeping m_t, d~_t and y_t in buffers with one extra slot for the
    #    state before the first step (slot 0, or slot T when reversed).
    here = 0 if reverse else 1                     # buffer index of position 0
    before = 1 if reverse else 0                   # buffer index of "previous" of position 0
    m_buf, d_buf, y_buf = (_empty((B, T + 1, D), cdt, dev) for _ in range(3))
    slot0 = T if reverse else 0
    if init is None:
        m_buf[:, slot0], d_buf[:, slot0], y_buf[:, slot0] = float("-inf"), 0, 0
    else:
        m0, n0, d0 = init
        m_buf[:, slot0], d_buf[:, slot0], y_buf[:, slot0] = m0, d0, safe_average(n0, d0)
    m_now, d_now, y_now = (x[:, here:here + T] for x in (m_buf, d_buf, y_buf))
    m_prev, d_prev, y_prev = (x[:, before:before + T] for x in (m_buf, d_buf, y_buf))

    def emit_forward(sel, m, vals, d):
        m_now[:, sel], d_now[:, sel], y_now[:, sel] = m, d, safe_average(vals[0], d)

    init_state = None if init is None else (init[0], [init[1]], init[2])
    chunked.scan(l, lam, [z], init_state, True, reverse, emit_forward, chunk_size)

    # 2. Every step's weights, as the forward step took them: take_t = exp(l_t - m_t),
    #    keep_t = exp(m_{t-1} + lam_t - m_t) (the limits of _step_log_weight).
    # (log keep <= 0 up to rounding between the chunks' re-runs: clamped, so that the adjoint
    # scan below keeps its scale at exactly 0)
    log_keep = _step_log_weight(m_prev if lam is None else decayed_max(m_prev, lam), m_now)
    log_keep = log_keep.clamp_(max=0)
    keep = exp_nonpositive_(log_keep.clone())
    take = exp_nonpositive_(_step_log_weight(l, m_now))

    # 3. The adjoint, run the other way: rho_t = keep_{t+1} rho_{t+1} + gy_t / d~_t and
    #    sigma_t = keep_{t+1} sigma_{t+1} + gy_t y_t / d~_t (rho = dLoss/dn~, sigma =
    #    -dLoss/dd~; docs/math.md §4), a scan with log-weight 0 and log-decay log keep_{t+1}.
    #    Its states go to buffers whose extra slot holds the gradient of the final state.
    gy = torch.zeros((B, T, D), dtype=cdt, device=dev) if gy is None else gy.to(cdt)
    gi = safe_average(gy, d_now)
    rho_buf, sigma_buf = (torch.zeros((B, T + 1, D), dtype=cdt, device=dev) for _ in range(2))
    slot_end = 0 if reverse else T
    if g_final is not None:
        gn, gd = g_final
        if gn is not None:
            rho_buf[:, slot_end] = gn
        if gd is not None:
            sigma_buf[:, slot_end] = -gd.to(cdt)
    at, later = (1, 0) if reverse else (0, 1)
    rho_now, sigma_now = rho_buf[:, at:at + T], sigma_buf[:, at:at + T]
    rho_later, sigma_later = rho_buf[:, later:later + T], sigma_buf[:, later:later + T]

    def emit_adjoint(sel, M, vals, _):
        rho_now[:, sel], sigma_now[:, sel] = vals

    log_keep_next = _shift_decay(log_keep, reverse)     # log keep_{t+1}; 0 after the end
    adj_init = (torch.zeros((B, D), dtype=cdt, device=dev),
                [rho_buf[:, slot_end].clone(), sigma_buf[:, slot_end].clone()], None)
    chunked.scan(torch.zeros_like(l), log_keep_next, [gi, gi * y_now], adj_init, False,
                 not reverse, emit_adjoint, chunk_size)

    # 4. Gradients. The later steps' part of rho and sigma is kept apart from this step's own
    #    gy_t / d~_t, and z_t - y_t is formed as keep_t d~_{t-1} (z_t - y_{t-1}) / d~_t: gl_t
    #    then has no cancellation (a small logit that is the only weight so far keeps its
    #    gradient; docs/math.md §4).
    keep_next = exp_nonpositive_(log_keep_next)
    r_later, s_later = keep_next * rho_later, keep_next * sigma_later
    zc = z.to(cdt)
    z_minus_y = safe_average(keep * d_prev * (zc - y_prev), d_now)
    gz = (take * rho_now).to(z.dtype)
    ga = attention_grad((zc * r_later - s_later) + gi * z_minus_y, take, m_now, a.to(cdt),
                        attention).to(a.dtype)                  # (gl = take * that)
    gg = None
    if g is not None:
        glam = keep * d_prev * (y_prev * rho_now - sigma_now)
        gg = decay_grad(glam, g.to(cdt), discount).to(g.dtype)

    # 5. Initial state: the pseudo-step before position 0 (its keep is the first step's).
    g_init = None
    if init is not None:
        m0, n0, d0 = init
        first = T - 1 if reverse else 0
        w0 = keep[:, first]
        gn0, gd0 = w0 * rho_now[:, first], -w0 * sigma_now[:, first]
        g_init = (n0 * gn0 + d0 * gd0, gn0, gd0)
    return gz, ga, gg, g_init


def _step_log_weight(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x - m`` for ``x <= m = max(...)``, with the forward step's limits: ``-inf`` where
    ``x = -inf`` (no weight), ``0`` where ``x = m`` (equal infinities included). NaN stays."""
    out = torch.where(x == m, 0, x - m)
    return out.masked_fill_(torch.isneginf(x), float("-inf"))
