"""The public scan and step functions: ``weighted_scan``, ``rwa_scan``, ``rda_scan``,
``rwa_step``, ``rda_step`` and the in-place steps ``rwa_step_``, ``rda_step_``.

Each validates its arguments (:mod:`fastrwa.checks`), resolves the backend once
(:func:`fastrwa.ops.dispatch.resolve`) and calls the custom op (:mod:`fastrwa.ops.autograd`)
with the backend's name."""

from __future__ import annotations

import torch

from .checks import (check_attention, check_context_group, check_cu_seqlens, check_flag,
                     check_inputs, check_no_overlap, check_state)
from .ops.autograd import step_inplace, weighted_scan_op
from .ops.context import context_parallel_scan, packed_over_ranks, refuse_together
from .ops.contract import ScanArgs, state_dtype
from .ops.dispatch import resolve
from .state import ScanState


def _run(named, attention, discount, initial_state, output_final_state, reverse,
         cu_seqlens=None, context_group=None):
    """Validate ``(B, T, D)`` inputs ``named`` = [(name, tensor) for z, a[, g]] and run the op
    (over the ranks of ``context_group`` when given: :mod:`fastrwa.ops.context`)."""
    if context_group is not None:
        check_context_group(context_group)
        try:
            args = _checked(named, attention, discount, initial_state, output_final_state,
                            reverse, cu_seqlens, whole=cu_seqlens is None)
            backend = resolve(args.z.device, args.z.dtype)
        except (TypeError, ValueError, RuntimeError) as exc:
            refuse_together(exc, context_group)     # (every rank raises; none waits)
        if cu_seqlens is None:
            y, final = context_parallel_scan(args, backend, context_group)
        else:
            y, final = packed_over_ranks(args, backend, context_group)
        return y, (ScanState(*final) if output_final_state else None)
    args = _checked(named, attention, discount, initial_state, output_final_state, reverse,
                    cu_seqlens)
    z = args.z
    if z.shape[1] == 0:
        y = z[:, :0].clone()            # (a node of the graph: y.sum().backward() works)
        if not output_final_state:
            return y, None
        state = args.initial_state
        if state is None:
            n_states = z.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
            state = ScanState.empty(n_states, z.shape[2], dtype=state_dtype(z.dtype),
                                    device=z.device)
        return y, ScanState(*state)
    y, final = weighted_scan_op(args, resolve(z.device, z.dtype))
    return y, (ScanState(*final) if output_final_state else None)


def _checked(named, attention, discount, initial_state, output_final_state, reverse,
             cu_seqlens, whole: bool = True) -> ScanArgs:
    """The op's arguments, every one checked (``TypeError``/``ValueError`` naming it);
    ``whole=False``: ``cu_seqlens`` are a context-parallel call's global offsets, which end
    at the whole sequence's length, not this slice's (checked over the ranks)."""
    z = check_inputs(named, "BTD")
    check_flag(output_final_state, "output_final_state")
    check_flag(reverse, "reverse")
    B, T, D = z.shape
    n_states = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, z, whole)
    state = check_state(initial_state, "initial_state", z, n_states, D)
    g = named[2][1] if len(named) > 2 else None
    return ScanArgs(z, named[1][1], g, attention, discount,
                    None if state is None else tuple(state), reverse, cu_seqlens)


def weighted_scan(
    z: torch.Tensor,
    log_w: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    initial_state: ScanState | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    context_group: "torch.distributed.ProcessGroup | None" = None,
) -> tuple[torch.Tensor, ScanState | None]:
    """The primitive: a causal, per-channel softmax-weighted average with optional decay.

    ``n_t = exp(log_decay_t) n_{t-1} + exp(log_w_t) z_t``, ``d_t`` likewise with ``z = 1``,
    ``y_t = n_t / d_t`` (``0`` while every weight so far is ``exp(-inf) = 0``), computed
    in a max-stabilised log space so that no logit overflows (docs/math.md).

    Args:
        z: ``(B, T, D)`` values; float16, bfloat16, float32 or float64.
        log_w: ``(B, T, D)`` log attention weights, same dtype and device; ``-inf`` masks a step.
        log_decay: ``(B, T, D)`` log discount (usually ``<= 0``; ``-inf`` forgets the past)
            or ``None`` for no discount.
        initial_state: a :class:`ScanState` of ``(B, D)`` tensors to continue from, or ``None``.
        output_final_state: also return the state after the last step.
        reverse: scan from the last step to the first (``y_t`` averages steps ``t..T-1``).
        cu_seqlens: packed variable-length sequences: ``B = 1`` and sequence ``i`` is
            ``[:, cu_seqlens[i]:cu_seqlens[i+1]]`` (int32/int64, starts at 0, ends at ``T``).
            Each sequence scans on its own; ``initial_state`` and the returned state are
            then ``(N, D)``, one row per sequence.
        context_group: a ``torch.distributed`` process group over which the sequence is
            split along time (context parallelism): rank ``k`` passes the ``k``-th
            contiguous slice of ``T`` (lengths may differ) and gets its slice of ``y``;
            the output and every gradient equal one scan of the whole sequence. Every rank
            calls with the same ``B``, ``D``, dtype and options, and runs the backward;
            ``initial_state`` is given on the first rank in scan order only (rank 0, or the
            last with ``reverse``); the returned state is the one after this rank's slice
            (the last rank in scan order holds the whole sequence's). With ``cu_seqlens``:
            ``z`` is this rank's slice ``(1, T_k, D)`` of the packed row, ``cu_seqlens`` the
            whole row's offsets on every rank (a sequence may span ranks),
            ``initial_state`` ``(N, D)`` given on every rank or none, and the returned state
            ``(1, D)`` the one after this slice of the sequence it ends in. docs/math.md §7.

    Returns:
        ``(y, state)``: ``y`` is ``(B, T, D)`` in the input dtype; ``state`` is a
        :class:`ScanState` (float32, or float64 for float64 inputs) if
        ``output_final_state`` else ``None``. Differentiable in every tensor argument.

    Example:
        >>> import torch, fastrwa
        >>> z, lw = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
        >>> y, state = fastrwa.weighted_scan(z, lw, output_final_state=True)
        >>> y.shape, state.n.shape
        (torch.Size([2, 16, 8]), torch.Size([2, 8]))
    """
    named = [("z", z), ("log_w", log_w)]
    if log_decay is not None:
        named.append(("log_decay", log_decay))
    return _run(named, "exp", None if log_decay is None else "log", initial_state,
                output_final_state, reverse, cu_seqlens, context_group)


def rwa_scan(
    z: torch.Tensor,
    a: torch.Tensor,
    initial_state: ScanState | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    context_group: "torch.distributed.ProcessGroup | None" = None,
) -> tuple[torch.Tensor, ScanState | None]:
    """Recurrent Weighted Average: ``y_t = sum_{i<=t} exp(a_i) z_i / sum_{i<=t} exp(a_i)``.

    Args:
        z: ``(B, T, D)`` values (e.g. ``u * tanh(g)``); float16, bfloat16, float32, float64.
        a: ``(B, T, D)`` attention logits, same dtype and device; ``-inf`` masks a step.
        initial_state, output_final_state, reverse, cu_seqlens, context_group: as for
            :func:`weighted_scan`.

    Returns:
        ``(y, state)``: ``y`` is the raw average ``n / d`` (no ``tanh``; layers apply
        ``f_h``) of shape ``(B, T, D)`` in the input dtype; ``state`` or ``None``.

    Example:
        >>> import torch, fastrwa
        >>> z, a = torch.randn(2, 32, 4), torch.randn(2, 32, 4)
        >>> y, _ = fastrwa.rwa_scan(z, a)
        >>> y.shape
        torch.Size([2, 32, 4])
    """
    return _run([("z", z), ("a", a)], "exp", None, initial_state, output_final_state, reverse,
                cu_seqlens, context_group)


def rda_scan(
    z: torch.Tensor,
    a: torch.Tensor,
    g: torch.Tensor,
    attention: str = "exp",
    initial_state: ScanState | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    context_group: "torch.distributed.ProcessGroup | None" = None,
) -> tuple[torch.Tensor, ScanState | None]:
    """Recurrent Discounted Attention: ``n_t = gamma_t n_{t-1} + f_a(a_t) z_t``, ``d_t`` alike.

    Args:
        z: ``(B, T, D)`` values; float16, bfloat16, float32 or float64.
        a: ``(B, T, D)`` attention logits.
        g: ``(B, T, D)`` discount logits; ``gamma = sigmoid(g)``.
        attention: ``f_a``, one of "exp", "sigmoid", "softplus", "relu".
        initial_state, output_final_state, reverse, cu_seqlens, context_group: as for
            :func:`weighted_scan`.

    Returns:
        ``(y, state)`` with ``y = n / d`` of shape ``(B, T, D)`` in the input dtype
        (``0`` where no weight has been seen, e.g. "relu" with ``a <= 0`` so far).

    Example:
        >>> import torch, fastrwa
        >>> z, a, g = (torch.randn(1, 10, 3) for _ in range(3))
        >>> y, st = fastrwa.rda_scan(z, a, g, attention="sigmoid", output_final_state=True)
        >>> y.shape
        torch.Size([1, 10, 3])
    """
    attention = check_attention(attention)
    return _run([("z", z), ("a", a), ("g", g)], attention, "sigmoid", initial_state,
                output_final_state, reverse, cu_seqlens, context_group)


def _step(named, attention, discount, state):
    z_t = check_inputs(named, "BD")
    B, D = z_t.shape
    state = check_state(state, "state", z_t, B, D)
    seq = [(name, x.unsqueeze(1)) for name, x in named]
    y, new_state = _run(seq, attention, discount, state, True, False)
    return y.squeeze(1), new_state


def rwa_step(
    z_t: torch.Tensor, a_t: torch.Tensor, state: ScanState | None = None
) -> tuple[torch.Tensor, ScanState]:
    """One streaming step of :func:`rwa_scan`: O(D) state, whatever the length so far.

    Args:
        z_t: ``(B, D)`` value of this step.
        a_t: ``(B, D)`` attention logit of this step.
        state: the :class:`ScanState` from the previous step or scan, or ``None`` to start.

    Returns:
        ``(y_t, state)``: ``(B, D)`` output in the input dtype and the new state.

    Example:
        >>> import torch, fastrwa
        >>> z, a = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
        >>> st = None
        >>> for t in range(5):
        ...     y_t, st = fastrwa.rwa_step(z[:, t], a[:, t], st)
        >>> torch.allclose(y_t, fastrwa.rwa_scan(z, a)[0][:, -1], atol=1e-6)
        True
    """
    return _step([("z_t", z_t), ("a_t", a_t)], "exp", None, state)


def rda_step(
    z_t: torch.Tensor,
    a_t: torch.Tensor,
    g_t: torch.Tensor,
    state: ScanState | None = None,
    attention: str = "exp",
) -> tuple[torch.Tensor, ScanState]:
    """One streaming step of :func:`rda_scan` (``gamma_t = sigmoid(g_t)``).

    Args:
        z_t, a_t, g_t: ``(B, D)`` value, attention logit and discount logit of this step.
        state: the :class:`ScanState` so far, or ``None`` to start.
        attention: ``f_a``, one of "exp", "sigmoid", "softplus", "relu".

    Returns:
        ``(y_t, state)``: ``(B, D)`` output in the input dtype and the new state.

    Example:
        >>> import torch, fastrwa
        >>> z, a, g = (torch.randn(1, 8, 4) for _ in range(3))
        >>> _, st = fastrwa.rda_scan(z[:, :5], a[:, :5], g[:, :5], output_final_state=True)
        >>> y_5, st = fastrwa.rda_step(z[:, 5], a[:, 5], g[:, 5], st)
        >>> y_5.shape
        torch.Size([1, 4])
    """
    attention = check_attention(attention)
    return _step([("z_t", z_t), ("a_t", a_t), ("g_t", g_t)], attention, "sigmoid", state)


# Layouts of in-place step arguments that passed the checks below (each tensor's address,
# shape, strides, dtype and device: all the checks other than the gradient one depend on).
# A decode loop steps the same buffers every token; checking them once saves most of a
# small step's cost. Bounded: emptied when full.
_CHECKED: set = set()
_CHECKED_MAX = 4096


def _layout(named, state, out) -> tuple | None:
    """The key of :data:`_CHECKED` for these arguments (``None`` when one is not a tensor)."""
    try:
        return tuple((x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
                     for x in (*(x for _, x in named), *state, out))
    except (AttributeError, TypeError):
        return None


def _check_step_inplace(named, state, out) -> tuple[list, ScanState]:
    """The checks of the in-place steps; ``(tensors, state)``. The checks of shapes, dtypes,
    devices and overlap run once per layout (:data:`_CHECKED`); the gradient one always."""
    tensors = [x for _, x in named] + ([None] if len(named) == 2 else [])
    if isinstance(state, ScanState) and not torch.compiler.is_compiling():
        key = _layout(named, state, out)
        if key in _CHECKED:
            _check_no_grad(named, state, out)
            return tensors, state
    else:
        key = None
    z_t = check_inputs(named, "BD")
    B, D = z_t.shape
    if state is None:
        raise TypeError("state must be a fastrwa.ScanState to update in place, got None; "
                        "start from fastrwa.ScanState.empty(B, D)")
    state = check_state(state, "state", z_t, B, D)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (B, D) \
            or out.dtype != z_t.dtype or out.device != z_t.device:
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) \
            else type(out).__name__
        raise ValueError(f"out must be a tensor of shape (B, D) = {(B, D)}, dtype {z_t.dtype}, "
                         f"on {z_t.device}, got {got}")
    _check_no_grad(named, state, out)
    if not torch.compiler.is_compiling():   # (a compiled graph has no storage to compare)
        check_no_overlap([("out", out), ("state.m", state.m), ("state.n", state.n),
                          ("state.d", state.d)], named)
    if key is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED.add(key)
    return tensors, state


def _check_no_grad(named, state: ScanState, out: torch.Tensor) -> None:
    """Under autograd, no tensor of an in-place step may require grad: the step records no
    graph (and the tensors it writes, ``state`` and ``out``, would be leaves changed in place)."""
    if not torch.is_grad_enabled():
        return
    written = [("out", out)] + [(f"state.{f}", x) for f, x in zip(ScanState._fields, state)]
    grad = [name for name, x in (*named, *written) if x.requires_grad]
    if grad:
        raise RuntimeError(f"{', '.join(grad)} require{'s' if len(grad) == 1 else ''} grad, "
                           f"and the in-place steps (rwa_step_, rda_step_) are for inference: "
                           f"run them under torch.no_grad() (or pass detached tensors), or "
                           f"use rwa_step/rda_step to train")


def _step_inplace(named, attention, discount, state, out):
    (z, a, g), state = _check_step_inplace(named, state, out)
    # (under no_grad a tensor may still require grad: its detached view is the same memory)
    detach = lambda x: None if x is None else x.detach()                      # noqa: E731
    step_inplace(detach(z), detach(a), detach(g), tuple(x.detach() for x in state),
                 out.detach(), attention, discount, resolve(z.device, z.dtype))
    return out


def rwa_step_(z_t: torch.Tensor, a_t: torch.Tensor, state: ScanState,
              out: torch.Tensor) -> torch.Tensor:
    """:func:`rwa_step` in place, for decode loops: updates ``state``'s tensors where they lie
    and writes ``y_t`` into ``out``; returns ``out``.

    On CPU (the "numba" backend, contiguous float32/bfloat16/float64 tensors) nothing is
    allocated; elsewhere it computes :func:`rwa_step` and copies. Inference only (no autograd).

    Args:
        z_t, a_t: ``(B, D)`` value and attention logit of this step.
        state: a :class:`ScanState` of ``(B, D)`` tensors (float32, or float64 for float64
            inputs), e.g. ``ScanState.empty(B, D)`` or a scan's final state; updated in place.
        out: ``(B, D)`` tensor of the inputs' dtype that receives ``y_t``.

    Example:
        >>> import torch, fastrwa
        >>> st, y = fastrwa.ScanState.empty(2, 3), torch.empty(2, 3)
        >>> with torch.no_grad():
        ...     _ = fastrwa.rwa_step_(torch.randn(2, 3), torch.randn(2, 3), st, y)
        >>> bool((st.d > 0).all())
        True
    """
    return _step_inplace([("z_t", z_t), ("a_t", a_t)], "exp", None, state, out)


def rda_step_(z_t: torch.Tensor, a_t: torch.Tensor, g_t: torch.Tensor, state: ScanState,
              out: torch.Tensor, attention: str = "exp") -> torch.Tensor:
    """:func:`rda_step` in place (see :func:`rwa_step_`): ``state`` updated, ``y_t`` in ``out``.

    Args:
        z_t, a_t, g_t: ``(B, D)`` value, attention logit and discount logit of this step.
        state: :class:`ScanState` of ``(B, D)`` tensors, updated in place.
        out: ``(B, D)`` tensor of the inputs' dtype that receives ``y_t``.
        attention: ``f_a``, one of "exp", "sigmoid", "softplus", "relu".

    Example:
        >>> import torch, fastrwa
        >>> st, y = fastrwa.ScanState.empty(1, 4), torch.empty(1, 4)
        >>> with torch.no_grad():
        ...     _ = fastrwa.rda_step_(*torch.randn(3, 1, 4), st, y, attention="sigmoid")
        >>> y.shape
        torch.Size([1, 4])
    """
    attention = check_attention(attention)
    return _step_inplace([("z_t", z_t), ("a_t", a_t), ("g_t", g_t)], attention, "sigmoid",
                         state, out)
