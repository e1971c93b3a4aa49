"""Drawing one token per row of logits on CPU, in one compiled call (the fused decode step's
sampler: ``fastrwa.models.sampling.sample_fused``, and ``draw_fused_rows`` for rows each
with settings of their own, as the server's streams have). The distribution is that of
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
def sample_row(logits, base, n, temperature, top_k, top_p, u, weights):
    """The id drawn from the ``n`` logits at ``base`` (flat float32) at the float64 uniform
    ``u`` (module doc), or -1 when the largest is not finite (NaN anywhere there, ``+inf``,
    or all ``-inf``): nothing can be drawn. ``top_k <= 0``: no top-k; ``top_p >= 1``: no
    top-p; ``weights``: scratch of ``n`` float32 or more."""
    zero, one = F32(0.0), F32(1.0)
    ninf = F32(-np.inf)
    top = ninf
    for j in range(n):
        v = logits[base + j]
        if v != v:
            return -1
        top = max(top, v)
    if not (top > ninf and top < F32(np.inf)):
        return -1
    for j in range(n):
        v = logits[base + j]
        # (the maximum itself: weight 1, also when the temperature underflows the quotient)
        weights[j] = one if v == top else fexp((v - top) / temperature)
    if 0 < top_k < n:
        # the k-th largest logit (the largest: the top; else a partial sort finds it)
        kth = top if top_k == 1 else np.partition(logits[base:base + n], n - top_k)[n - top_k]
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
    target = F32(u) * total
    cum, pick = zero, -1
    for j in range(n):
        if weights[j] > zero:
            pick = j                     # (the last with weight: rounding at the top end)
            cum += weights[j]
            if cum > target:
                break
    return pick                          # (-1, no id with a weight: cannot happen)


@kernel
def sample_rows(logits, B, V, forbidden, temperature, top_k, top_p, uniforms, out, weights):
    """Write ``out[b]``, the id drawn for row ``b`` of ``logits`` (flat ``(B, V)`` float32)
    at ``uniforms[b]``, for every row, with one setting for all (:func:`sample_row`);
    ``weights`` is scratch of ``V`` float32. Returns -1, or the first row nothing can be
    drawn from: then ``out`` is left incomplete."""
    n = min(forbidden, V)
    for b in range(B):
        pick = sample_row(logits, b * V, n, temperature, top_k, top_p, uniforms[b], weights)
        if pick < 0:
            return b
        out[b] = pick
    return -1


@kernel
def sample_rows_each(logits, B, V, forbidden, temperatures, top_ks, top_ps, uniforms, out,
                     weights):
    """:func:`sample_rows` with each row's own settings: row ``b`` at ``temperatures[b]``
    (float32), ``top_ks[b]`` (int64), ``top_ps[b]`` (float64); a row with ``top_ks[b] < 0``
    is skipped (``out[b]`` left as it is), a row nothing can be drawn from gets -1. Returns
    the rows that got -1."""
    n = min(forbidden, V)
    failed = 0
    for b in range(B):
        if top_ks[b] < 0:
            continue
        pick = sample_row(logits, b * V, n, temperatures[b], top_ks[b], top_ps[b], uniforms[b],
                          weights)
        out[b] = pick
        if pick < 0:
            failed += 1
    return failed
