"""The weighted scan as PyTorch custom ops with a registered autograd formula.

``fastrwa::weighted_scan`` runs a backend's forward; ``fastrwa::weighted_scan_backward`` its
analytic backward; ``fastrwa::step_`` one streaming step in place. Registering them with
``torch.library`` (fake implementations for shape propagation, ``register_autograd`` for the
gradient) makes them opaque single nodes to ``torch.compile``: a model using fastrwa compiles
with ``fullgraph=True`` and no graph break. Eager calls take the same path, so there is one
autograd implementation.

Every op takes the backend's name as an argument (the public function resolved it once,
:func:`fastrwa.ops.dispatch.resolve`); the backward runs on the backend the forward ran on,
wherever ``.backward()`` is called (under ``torch.compile``, the name resolved when the
graph was traced). A backward handed another backend's saved tensors
recomputes them (:class:`fastrwa.ops.dispatch.Backend`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from .contract import ScanArgs, state_dtype

_NONE = "none"   # the op schema has no Optional[str]: "none" stands for no discount


def _op_inputs(args: ScanArgs) -> tuple:
    """``args`` as the ops' leading schema arguments ``(z, a, g, m0, n0, d0, cu_seqlens,
    attention, discount, reverse)``: the one place a call is flattened (an op's schema
    takes tensors, strings and flags); :func:`_args` rebuilds it inside the op."""
    m0, n0, d0 = (None, None, None) if args.initial_state is None else args.initial_state
    return (args.z, args.a, args.g, m0, n0, d0, args.cu_seqlens, args.attention,
            _NONE if args.discount is None else args.discount, args.reverse)


def _args(z, a, g, m0, n0, d0, cu_seqlens, attention, discount, reverse) -> ScanArgs:
    """The inverse of :func:`_op_inputs`."""
    return ScanArgs(z, a, g, attention, None if discount == _NONE else discount,
                    None if m0 is None else (m0, n0, d0), reverse, cu_seqlens)


def check_offsets(cu_seqlens: Optional[Tensor], T: int) -> None:
    """Raise ``ValueError`` unless packed offsets start at 0, never decrease and end at ``T``.

    The ops run it on every call (one read of ``N + 1`` integers): offsets outside
    ``[0, T]`` or decreasing would make a kernel read or write out of bounds, and a graph
    made by ``torch.compile`` skips the public function's checks
    (:func:`fastrwa.checks.check_cu_seqlens`, which calls this one)."""
    if cu_seqlens is None:
        return
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T = {T}, "
                         f"got {offsets if len(offsets) <= 10 else offsets[:5] + ['...']}")


# The ops are declared with torch.library.define and torch.library.impl rather than
# torch.library.custom_op: custom_op wraps an implementation so that its first call imports
# torch._dynamo (1.3 s on a 2-core machine: a fresh process's first forward paid it);
# these calls dispatch to the implementation directly. Schemas and the pt2-compliant tag
# as custom_op gives them. What custom_op also checked at run time, that no output aliases
# an input or another output, is the implementations' contract, checked by
# torch.library.opcheck in tests/op/test_compile.py; fastrwa::step_ mutates its state in place
# without bumping version counters (called directly; the layers call its implementation).
_PT2 = (torch.Tag.pt2_compliant_tag,)
torch.library.define(
    "fastrwa::weighted_scan",
    "(Tensor z, Tensor a, Tensor? g, Tensor? m0, Tensor? n0, Tensor? d0, Tensor? cu_seqlens, "
    "str attention, str discount, bool reverse, bool save, str backend) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor[])", tags=_PT2)
torch.library.define(
    "fastrwa::weighted_scan_backward",
    "(Tensor z, Tensor a, Tensor? g, Tensor? m0, Tensor? n0, Tensor? d0, Tensor? cu_seqlens, "
    "Tensor[] saved, Tensor m_final, Tensor gy, Tensor? gn, Tensor? gd, str attention, "
    "str discount, bool reverse, str backend) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", tags=_PT2)
torch.library.define(
    "fastrwa::step_",
    "(Tensor z, Tensor a, Tensor? g, Tensor(a!) m, Tensor(b!) n, Tensor(c!) d, "
    "Tensor(d!) out, str attention, str discount, str backend) -> ()", tags=_PT2)


@torch.library.impl("fastrwa::weighted_scan", "default")
def _scan(z: Tensor, a: Tensor, g: Optional[Tensor], m0: Optional[Tensor],
          n0: Optional[Tensor], d0: Optional[Tensor], cu_seqlens: Optional[Tensor],
          attention: str, discount: str, reverse: bool, save: bool, backend: str
          ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """``(y, m, n, d, saved)``: the output, the final state, and what the backward needs."""
    check_offsets(cu_seqlens, z.shape[1])
    args = _args(z, a, g, m0, n0, d0, cu_seqlens, attention, discount, reverse)
    y, (m, n, d), saved = dispatch.load(backend).forward(
        args, output_final_state=True, save=save)
    return y, m, n, d, list(saved)


@torch.library.register_fake("fastrwa::weighted_scan")
def _scan_fake(z, a, g, m0, n0, d0, cu_seqlens, attention, discount, reverse, save, backend):
    args = _args(z, a, g, m0, n0, d0, cu_seqlens, attention, discount, reverse)
    state = [z.new_empty((args.n_sequences, z.shape[2]), dtype=state_dtype(z.dtype))
             for _ in range(3)]
    saved = dispatch.load(backend).saved_like(args) if save else []
    return (torch.empty_like(z), *state, saved)


@torch.library.impl("fastrwa::weighted_scan_backward", "default")
def _scan_backward(z: Tensor, a: Tensor, g: Optional[Tensor], m0: Optional[Tensor],
                   n0: Optional[Tensor], d0: Optional[Tensor], cu_seqlens: Optional[Tensor],
                   saved: list[Tensor], m_final: Tensor, gy: Tensor, gn: Optional[Tensor],
                   gd: Optional[Tensor], attention: str, discount: str, reverse: bool,
                   backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(gz, ga, gg, gm0, gn0, gd0)``; empty tensors stand for gradients of absent inputs."""
    check_offsets(cu_seqlens, z.shape[1])
    args = _args(z, a, g, m0, n0, d0, cu_seqlens, attention, discount, reverse)
    g_final = None if gn is None and gd is None else (gn, gd)
    gz, ga, gg, g_init = dispatch.load(backend).backward(args, list(saved), m_final, gy,
                                                         g_final)
    absent = lambda: z.new_empty(0)  # one fresh tensor each: outputs may not alias
    gg = absent() if gg is None else gg
    gm0, gn0, gd0 = (absent(), absent(), absent()) if g_init is None else g_init
    return gz, ga, gg, gm0, gn0, gd0


@torch.library.register_fake("fastrwa::weighted_scan_backward")
def _scan_backward_fake(z, a, g, m0, n0, d0, cu_seqlens, saved, m_final, gy, gn, gd, attention,
                        discount, reverse, backend):
    gg = z.new_empty(0) if g is None else torch.empty_like(g)
    g_init = [z.new_empty(0) for _ in range(3)] if m0 is None else \
        [torch.empty_like(m0), torch.empty_like(n0), torch.empty_like(d0)]
    return (torch.empty_like(z), torch.empty_like(a), gg, *g_init)


scan_op = torch.ops.fastrwa.weighted_scan.default
scan_backward_op = torch.ops.fastrwa.weighted_scan_backward.default
step_op = torch.ops.fastrwa.step_.default


def _setup_context(ctx, inputs, output):
    z, a, g, m0, n0, d0, cu_seqlens, attention, discount, reverse, save, backend = inputs
    _, m, _, _, saved = output
    ctx.save_for_backward(z, a, g, m0, n0, d0, cu_seqlens, m, *saved)
    ctx.options = (attention, discount, reverse, backend)


def _backward(ctx, gy, gm, gn, gd, g_saved):
    z, a, g, m0, n0, d0, cu_seqlens, m_final, *saved = ctx.saved_tensors
    attention, discount, reverse, backend = ctx.options
    if gy is None:
        gy = torch.zeros_like(z)
    # gm is not used: gradients through a state are taken with respect to what it represents
    # (docs/math.md §4, "Final state"); n and d carry all of it for such losses.
    gz, ga, gg, gm0, gn0, gd0 = scan_backward_op(z, a, g, m0, n0, d0, cu_seqlens, saved,
                                                 m_final, gy, gn, gd, attention, discount,
                                                 reverse, backend)
    if g is None:
        gg = None
    if m0 is None:
        gm0 = gn0 = gd0 = None
    return gz, ga, gg, gm0, gn0, gd0, None, None, None, None, None, None


torch.library.register_autograd("fastrwa::weighted_scan", _backward, setup_context=_setup_context)

NO_SECOND_DERIVATIVE = (
    "fastrwa's scan has no second derivative: a backward through its gradient (double "
    "backward, e.g. create_graph=True then another backward, or a Hessian) is not supported")


def _no_double_backward(ctx, *grads):
    raise RuntimeError(NO_SECOND_DERIVATIVE)


torch.library.register_autograd("fastrwa::weighted_scan_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)

NO_FUNCTORCH = (
    "fastrwa's scan does not support torch.func transforms (grad, vmap, jacrev, jvp, ...): "
    "use torch.autograd.grad (or .backward()) for gradients, and a batch dimension instead "
    "of vmap")


def weighted_scan_op(args: ScanArgs, backend: str) -> tuple[Tensor, tuple]:
    """Run the op on validated ``args`` on ``backend``; ``(y, (m, n, d))``. Saves for the
    backward only when a gradient can flow."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(NO_FUNCTORCH)
    inputs = (args.z, args.a, args.g, *(args.initial_state or ()))
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    if not save and not torch.compiler.is_compiling():
        # Inference in eager mode: the same backend call the op makes, without the custom-op
        # dispatch (tens of microseconds, a quarter of a B=1, T=1K call).
        y, final, _ = dispatch.load(backend).forward(args, output_final_state=True, save=False)
        return y, final
    y, m, n, d, _ = scan_op(*_op_inputs(args), save, backend)
    return y, (m, n, d)


def _step_into(z: Tensor, a: Tensor, g: Optional[Tensor], attention: str,
               discount: Optional[str], state: tuple, out: Tensor, backend: str) -> None:
    """The backend's in-place step (:meth:`fastrwa.ops.dispatch.Backend.step_`) on ``(B, D)``
    inputs; where it has none or declines, its forward over a length-1 scan from ``state``
    and a copy into ``state`` and ``out``."""
    module = dispatch.load(backend)
    step = getattr(module, "step_", None)      # (optional in the contract)
    if step is not None and step(z, a, g, attention, discount, state, out):
        return
    args = ScanArgs(z[:, None], a[:, None], None if g is None else g[:, None], attention,
                    discount, state, False, None)
    y, final, _ = module.forward(args, output_final_state=True, save=False)
    for buf, value in zip(state, final):
        buf.copy_(value)
    out.copy_(y[:, 0])


@torch.library.impl("fastrwa::step_", "default")
def _step(z: Tensor, a: Tensor, g: Optional[Tensor], m: Tensor, n: Tensor, d: Tensor,
          out: Tensor, attention: str, discount: str, backend: str) -> None:
    """One streaming step on ``(B, D)`` inputs: ``(m, n, d)`` updated and ``y`` written into
    ``out``, in place. An op so that a compiled decode step keeps it as one node."""
    _step_into(z, a, g, attention, None if discount == _NONE else discount, (m, n, d), out,
               backend)


@torch.library.register_fake("fastrwa::step_")
def _step_fake(z, a, g, m, n, d, out, attention, discount, backend) -> None:
    return None


def step_inplace(z: Tensor, a: Tensor, g: Optional[Tensor], state: tuple, out: Tensor,
                 attention: str, discount: Optional[str], backend: str) -> None:
    """One in-place streaming step on validated ``(B, D)`` inputs (inference only). Eager
    calls skip the custom-op dispatch (it costs about as much as a small step); compiled code
    sees the op."""
    if torch.compiler.is_compiling():
        step_op(z, a, g, *state, out, attention, _NONE if discount is None else discount,
                backend)
        return
    _step_into(z, a, g, attention, discount, state, out, backend)
