"""The streaming state of a weighted scan: ``ScanState(m, n, d)``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .ops.chunked import safe_average


class ScanState(NamedTuple):
    """Stabilised per-channel state of a weighted scan (docs/math.md §2).

    The represented running sums are ``numerator = exp(m) * n`` and
    ``denominator = exp(m) * d``; the running average is ``n / d``.

    Attributes:
        m: ``(B, D)`` running maximum of the decayed log-weights; ``-inf`` while nothing
            has been seen.
        n: ``(B, D)`` scaled numerator ``n~``.
        d: ``(B, D)`` scaled denominator ``d~``; ``>= 1`` once anything has been seen,
            ``0`` for an empty state.

    All three are float32 (float64 when the inputs are float64), whatever the input dtype.
    The memory is ``3 * B * D`` floats, independent of how many steps were taken.

    Gradients through a state are taken with respect to the quantities it represents
    (``exp(m) * n`` and ``exp(m) * d``): any loss that depends on the state only through
    them (every continuation of the scan does) gets exact gradients.

    Example:
        >>> import torch, fastrwa
        >>> z, a = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
        >>> _, state = fastrwa.rwa_scan(z, a, output_final_state=True)
        >>> state.m.shape
        torch.Size([2, 3])
    """

    m: torch.Tensor
    n: torch.Tensor
    d: torch.Tensor

    @staticmethod
    def empty(
        batch: int, channels: int, *, dtype: torch.dtype = torch.float32, device=None
    ) -> "ScanState":
        """The state before anything is seen: ``m = -inf``, ``n = d = 0``, shapes ``(B, D)``."""
        m = torch.full((batch, channels), float("-inf"), dtype=dtype, device=device)
        zeros = torch.zeros((batch, channels), dtype=dtype, device=device)
        return ScanState(m, zeros, zeros.clone())

    def average(self) -> torch.Tensor:
        """``n / d``, the weighted average the state holds (``0`` where the state is empty)."""
        return safe_average(self.n, self.d)
