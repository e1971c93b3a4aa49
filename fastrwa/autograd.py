"""The weighted scan as PyTorch custom ops with a registered autograd formula.

``fastrwa::weighted_scan`` runs a backend's forward; ``fastrwa::weighted_scan_backward`` its
analytic backward. Registering them with ``torch.library`` (fake implementations for shape
propagation, ``register_autograd`` for the gradient) makes them opaque single nodes to
``torch.compile``: a model using fastrwa compiles with ``fullgraph=True`` and no graph break.
Eager calls take the same path, so there is one autograd implementation.

The backend is resolved when the op runs (:func:`fastrwa.backend.resolve`): inside the op, so
``use_backend`` and ``FASTRWA_BACKEND`` work the same in eager and compiled code.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import backend as _backend

_NONE = "none"   # the op schema has no Optional[str]: "none" stands for no discount


def _discount(name: str) -> str | None:
    return None if name == _NONE else name


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("fastrwa::weighted_scan", mutates_args=())
def scan_op(z: Tensor, a: Tensor, g: Optional[Tensor], m0: Optional[Tensor],
            n0: Optional[Tensor], d0: Optional[Tensor], cu_seqlens: Optional[Tensor],
            attention: str, discount: str, reverse: bool, save: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """``(y, m, n, d, saved)``: the output, the final state, and what the backward needs."""
    impl = _backend.resolve(z.device, z.dtype)
    init = None if m0 is None else (m0, n0, d0)
    y, final, saved = impl.forward(z, a, g, attention, _discount(discount), init, True, reverse,
                                   cu_seqlens, save)
    m, n, d = final
    return y, m, n, d, list(saved)


@scan_op.register_fake
def _scan_fake(z, a, g, m0, n0, d0, cu_seqlens, attention, discount, reverse, save):
    n_seq = z.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = [z.new_empty((n_seq, z.shape[2]), dtype=_state_dtype(z.dtype)) for _ in range(3)]
    impl = _backend.resolve(z.device, z.dtype)
    saved = impl.fake_saved(z, cu_seqlens) if save else []
    return (torch.empty_like(z), *state, saved)


@torch.library.custom_op("fastrwa::weighted_scan_backward", mutates_args=())
def scan_backward_op(z: Tensor, a: Tensor, g: Optional[Tensor], m0: Optional[Tensor],
                     n0: Optional[Tensor], d0: Optional[Tensor], cu_seqlens: Optional[Tensor],
                     saved: list[Tensor], m_final: Tensor, gy: Tensor, gn: Optional[Tensor],
                     gd: Optional[Tensor], attention: str, discount: str, reverse: bool
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(gz, ga, gg, gm0, gn0, gd0)``; empty tensors stand for gradients of absent inputs."""
    impl = _backend.resolve(z.device, z.dtype)
    init = None if m0 is None else (m0, n0, d0)
    g_final = None if gn is None and gd is None else (None, gn, gd)
    gz, ga, gg, g_init = impl.backward(z, a, g, attention, _discount(discount), init, reverse,
                                       cu_seqlens, tuple(saved), m_final, gy, g_final)
    absent = lambda: z.new_empty(0)  # one fresh tensor each: outputs may not alias
    gg = absent() if gg is None else gg
    gm0, gn0, gd0 = (absent(), absent(), absent()) if g_init is None else g_init
    return gz, ga, gg, gm0, gn0, gd0


@scan_backward_op.register_fake
def _scan_backward_fake(z, a, g, m0, n0, d0, cu_seqlens, saved, m_final, gy, gn, gd, attention,
                        discount, reverse):
    gg = z.new_empty(0) if g is None else torch.empty_like(g)
    g_init = [z.new_empty(0) for _ in range(3)] if m0 is None else \
        [torch.empty_like(m0), torch.empty_like(n0), torch.empty_like(d0)]
    return (torch.empty_like(z), torch.empty_like(a), gg, *g_init)


def _setup_context(ctx, inputs, output):
    z, a, g, m0, n0, d0, cu_seqlens, attention, discount, reverse, save = inputs
    _, m, _, _, saved = output
    ctx.save_for_backward(z, a, g, m0, n0, d0, cu_seqlens, m, *saved)
    ctx.options = (attention, discount, reverse)


def _backward(ctx, gy, gm, gn, gd, g_saved):
    z, a, g, m0, n0, d0, cu_seqlens, m_final, *saved = ctx.saved_tensors
    attention, discount, reverse = ctx.options
    if gy is None:
        gy = torch.zeros_like(z)
    # gm is not used: gradients through a state are taken with respect to what it represents
    # (docs/math.md §4, "Final state"); n and d carry all of it for such losses.
    gz, ga, gg, gm0, gn0, gd0 = scan_backward_op(z, a, g, m0, n0, d0, cu_seqlens, saved,
                                                 m_final, gy, gn, gd, attention, discount,
                                                 reverse)
    if g is None:
        gg = None
    if m0 is None:
        gm0 = gn0 = gd0 = None
    return gz, ga, gg, gm0, gn0, gd0, None, None, None, None, None


torch.library.register_autograd("fastrwa::weighted_scan", _backward, setup_context=_setup_context)


def weighted_scan_op(z, a, g, state, cu_seqlens, attention, discount, reverse):
    """Run the op; ``(y, (m, n, d))``. Saves for the backward only when a gradient can flow."""
    m0, n0, d0 = (None, None, None) if state is None else state
    save = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (z, a, g, m0, n0, d0))
    if not save and not torch.compiler.is_compiling():
        # Inference in eager mode: the same backend call the op makes, without the custom-op
        # dispatch (tens of microseconds, a quarter of a B=1, T=1K call).
        impl = _backend.resolve(z.device, z.dtype)
        y, final, _ = impl.forward(z, a, g, attention, discount, state, True, reverse,
                                   cu_seqlens, False)
        return y, final
    y, m, n, d, _ = scan_op(z, a, g, m0, n0, d0, cu_seqlens, attention,
                            _NONE if discount is None else discount, reverse, save)
    return y, (m, n, d)
