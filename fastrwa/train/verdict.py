"""Whether a run's metric beats its task's naive baseline, with a margin: a difference the
evaluation's own noise could make is "at chance", not a win.

* an accuracy over ``n`` scored predictions: an exact one-sided binomial test against the
  baseline's rate (a model at chance gets ``Binomial(n, baseline)`` right);
* any other metric (mean squared error, cross-entropy) averaged over evaluation batches: the
  standard error of that mean, from the batches' spread (two batches at least; with one the
  plain comparison, said as such), against Student's t for that many batches.

A verdict needs ``P < ALPHA`` (or a difference of more than ``t`` standard errors, the
two-sided 99% quantile of Student's t with ``batches - 1`` degrees of freedom).
"""

from __future__ import annotations

import math

ALPHA = 0.01       # the binomial test's level (one-sided)
# Student's t, quantile 0.995, by degrees of freedom (a count between two rows takes the
# lower row's: the larger margin); past the last row the normal's 2.576.
T_995 = {1: 63.657, 2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355,
         9: 3.250, 10: 3.169, 15: 2.947, 20: 2.845, 30: 2.750, 60: 2.660, 120: 2.617}
Z = 2.576


def t_quantile(dof: int) -> float:
    """Student's t's 0.995 quantile for ``dof`` degrees of freedom (:data:`T_995`)."""
    rows = [d for d in T_995 if d <= dof]
    return Z if dof > max(T_995) else T_995[max(rows)]


def binomial_tail(k: int, n: int, p: float, upper: bool) -> float:
    """``P(X >= k)`` (``upper``) or ``P(X <= k)`` for ``X ~ Binomial(n, p)``, summed in log
    space (exact for any ``n`` an evaluation has)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    ks = range(k, n + 1) if upper else range(0, k + 1)
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
            + i * math.log(p) + (n - i) * math.log1p(-p) for i in ks]
    if not logs:
        return 0.0
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def verdict(value: float, baseline: float, higher_is_better: bool, *, scored: int | None = None,
            se: float | None = None, batches: int = 0) -> str:
    """The words after "vs naive baseline B": ``beats it``, ``does not beat it`` or ``at
    chance``, with the test that decided. ``scored``: the predictions an accuracy counts;
    ``se``: the standard error of any other metric's mean over ``batches`` batches.

    >>> verdict(0.507, 0.5, True, scored=1000)
    'at chance: within the noise of 1,000 predictions (binomial P = 0.34)'
    >>> verdict(0.6, 0.5, True, scored=1000)
    'beats it (binomial P < 0.01 over 1,000 predictions)'
    """
    if scored is not None and scored > 0 and 0 < baseline < 1:
        k = round(value * scored)
        above = binomial_tail(k, scored, baseline, upper=True)
        below = binomial_tail(k, scored, baseline, upper=False)
        good, bad = (above, below) if higher_is_better else (below, above)
        if good < ALPHA:
            return f"beats it (binomial P < {ALPHA:g} over {scored:,} predictions)"
        if bad < ALPHA:
            return f"does not beat it (worse, binomial P < {ALPHA:g} over {scored:,} " \
                   f"predictions)"
        return f"at chance: within the noise of {scored:,} predictions (binomial P = " \
               f"{good:.2g})"
    better = (value > baseline) if higher_is_better else (value < baseline)
    words = "beats it" if better else "does not beat it"
    if not math.isfinite(value):
        return f"does not beat it (the metric is {value})"
    if se is None or batches < 2:
        return f"{words} (one evaluation batch: no noise estimate)"
    t = t_quantile(batches - 1)
    if se > 0 and abs(value - baseline) <= t * se:
        return f"at chance: within {t:.3g} standard errors ({se:.2g}, {batches} batches) of it"
    return f"{words} (beyond {t:.3g} standard errors of the evaluation's mean over {batches} " \
           f"batches)"
