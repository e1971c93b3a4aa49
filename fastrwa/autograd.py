"""``torch.autograd.Function`` around a backend's forward and analytic backward."""

from __future__ import annotations

import torch


class WeightedScanFunction(torch.autograd.Function):
    """Autograd for the weighted scan; the backend does the work (no autograd through loops).

    ``apply(z, a, g, m0, n0, d0, cu_seqlens, attention, discount, output_final_state, reverse,
    backend)`` returns ``y`` or ``(y, m, n, d)``. ``backend`` is a module with ``forward`` and
    ``backward`` (:mod:`fastrwa.torch_backend`, :mod:`fastrwa.triton_backend`); whatever its
    forward returns as ``saved`` (e.g. chunk-boundary states) is handed to its backward.
    """

    @staticmethod
    def forward(ctx, z, a, g, m0, n0, d0, cu_seqlens, attention, discount, output_final_state,
                reverse, backend):
        init = None if m0 is None else (m0, n0, d0)
        needs_grad = any(ctx.needs_input_grad[:6])
        y, final, saved = backend.forward(z, a, g, attention, discount, init, output_final_state,
                                          reverse, cu_seqlens, needs_grad)
        ctx.save_for_backward(z, a, g, m0, n0, d0, cu_seqlens, *saved)
        ctx.options = (attention, discount, reverse, backend)
        if output_final_state:
            return (y, *final)
        return y

    @staticmethod
    def backward(ctx, gy, *g_final):
        z, a, g, m0, n0, d0, cu_seqlens, *saved = ctx.saved_tensors
        attention, discount, reverse, backend = ctx.options
        init = None if m0 is None else (m0, n0, d0)
        gz, ga, gg, g_init = backend.backward(z, a, g, attention, discount, init, reverse,
                                              cu_seqlens, tuple(saved), gy, g_final or None)
        gm0, gn0, gd0 = g_init if g_init is not None else (None, None, None)
        return gz, ga, gg, gm0, gn0, gd0, None, None, None, None, None, None
