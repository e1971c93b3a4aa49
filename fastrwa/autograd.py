"""``torch.autograd.Function`` around a backend's forward and analytic backward."""

from __future__ import annotations

import torch


class WeightedScanFunction(torch.autograd.Function):
    """Autograd for the weighted scan; the backend does the work (no autograd through loops).

    ``apply(z, a, g, m0, n0, d0, attention, discount, output_final_state, reverse, backend,
    chunk_size)`` returns ``y`` or ``(y, m, n, d)``.
    """

    @staticmethod
    def forward(ctx, z, a, g, m0, n0, d0, attention, discount, output_final_state, reverse,
                backend, chunk_size):
        init = None if m0 is None else (m0, n0, d0)
        y, final = backend.forward(
            z, a, g, attention, discount, init, output_final_state, reverse, chunk_size
        )
        ctx.save_for_backward(z, a, g, m0, n0, d0)
        ctx.options = (attention, discount, reverse, backend, chunk_size)
        if output_final_state:
            return (y, *final)
        return y

    @staticmethod
    def backward(ctx, gy, *g_final):
        z, a, g, m0, n0, d0 = ctx.saved_tensors
        attention, discount, reverse, backend, chunk_size = ctx.options
        init = None if m0 is None else (m0, n0, d0)
        gz, ga, gg, g_init = backend.backward(
            z, a, g, attention, discount, init, reverse, gy, g_final or None, chunk_size
        )
        gm0, gn0, gd0 = g_init if g_init is not None else (None, None, None)
        return gz, ga, gg, gm0, gn0, gd0, None, None, None, None, None, None
