"""Drawing one token per row of logits on CPU, in one compiled call (the fused decode step's
sampler: ``fastrwa.models.sampling.sample_fused``). The distribution is that of
``fastrwa.models.sampling.sample``, the eager reference::

    p ~ exp((logits - max) / temperature) over ids < forbidden (the maximum's weight is 1)
    top_k: ids whose logit is below the k-th largest get 0
    top_p: the fewest most likely ids whose probability reaches p are kept (among ids of
           equal probability, the lower first; the eager sort's order among ties is its own)

and the draw is the inverse of the cumulative weights at ``u * total`` for a uniform ``u``
of the row (from the caller's ``torch.Generator``).
"""

from __future__ import annotations

import numpy as np

from . import kernel
from .fmath import F32, fexp


@kernel
def sample_rows(logits, B, V, forbidden, temperature, top_k, top_p, uniforms, out, weights):
    """Write ``out[b]``, the id drawn for row ``b`` of ``logits`` (flat ``(B, V)`` float32),
    for every row; ``weights`` is scratch of ``V`` float32. ``top_k <= 0``: no top-k;
    ``top_p >= 1``: no top-p. Returns -1, or the first row whose largest logit below
    ``forbidden`` is not finite (NaN anywhere there, ``+inf``, or all ``-inf``): then
    nothing can be drawn from it and ``out`` is left incomplete."""
    zero, one = F32(0.0), F32(1.0)
    ninf = F32(-np.inf)
    n = min(forbidden, V)
    for b in range(B):
        base = b * V
        top = ninf
        for j in range(n):
            v = logits[base + j]
            if v != v:
                return b
            top = max(top, v)
        if not (top > ninf and top < F32(np.inf)):
            return b
        for j in range(n):
            v = logits[base + j]
            # (the maximum itself: weight 1, also when the temperature underflows the quotient)
            weights[j] = one if v == top else fexp((v - top) / temperature)
        if 0 < top_k < n:
            kth = np.sort(logits[base:base + n])[n - top_k]
            for j in range(n):
                if logits[base + j] < kth:
                    weights[j] = zero
        if top_p < 1.0:
            total = zero
            for j in range(n):
                total += weights[j]
            order = np.argsort(-weights[:n], kind="mergesort")   # (ties: the lower id first)
            cum, reach = zero, F32(top_p) * total
            for k in range(n):
                j = order[k]
                if k > 0 and cum >= reach:       # (the ids before reached p: drop the rest;
                    weights[j] = zero            # the most likely is always kept)
                cum += weights[j]
        total = zero
        for j in range(n):
            total += weights[j]
        target = F32(uniforms[b]) * total
        cum, pick = zero, -1
        for j in range(n):
            if weights[j] > zero:
                pick = j                     # (the last with weight: rounding at the top end)
                cum += weights[j]
                if cum > target:
                    break
        if pick < 0:            # (no id with a weight: cannot happen, the top's is 1)
            return b
        out[b] = pick
    return -1
