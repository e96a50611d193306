"""A profile-likelihood interval for the one nonlinear parameter of a least-squares fit, and the
Student t quantile it is calibrated by. Pure Python (stdlib only).

For a model with p parameters fitted to n points by least squares, one parameter u, and the profile
RSS(u) (the residual sum of squares with the other parameters at their best for that u), the
interval is

    { u : RSS(u) / RSS(u_hat) <= 1 + t^2 / (n - p) },    t = the (1 + level) / 2 quantile of Student's t, n - p df,

the F-calibrated likelihood-ratio interval: exact for a model linear in u with normal errors, and
for a curved model a close approximation whose coverage the caller measures (docs/critical-batch.md
gives it for B_crit). The ends are found by bisection between u_hat and the search's edges; an end
whose edge is still inside the set is not bounded (None).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron_ga_ext.errors import CriticalBatchError

__all__ = ["profile_bounds", "t_quantile", "t_within"]

#: Bisection steps for an end (the bracket shrinks 2x each).
BISECTIONS = 60
#: Points scanned outward from the best value to each edge, to find the first one outside the
#: interval.
SCAN = 64


def t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` degrees of freedom, by the finite series for a whole
    ``df`` (Abramowitz and Stegun 26.7.3-4), theta = atan(t / sqrt(df)):

        odd df:   (2 / pi) (theta + sin(theta) (cos(theta) + 2/3 cos^3(theta) + ... + (2.4...(df-3)) /
                  (1.3...(df-2)) cos^(df-2)(theta)))                    (2 theta / pi for df = 1)
        even df:  sin(theta) (1 + 1/2 cos^2(theta) + ... + (1.3...(df-3)) / (2.4...(df-2)) cos^(df-2)(theta))
    """
    if df < 1:
        raise CriticalBatchError(f"Student's t needs at least 1 degree of freedom ({df} given).")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:
        term, total = c, c if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c * c * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + s * total)
    term, total = 1.0, 1.0
    for k in range(1, df // 2):
        term *= c * c * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| <= t) = ``level`` (the two-sided ``level`` quantile), by bisection on
    :func:`t_within`."""
    if not 0 < level < 1:
        raise CriticalBatchError(
            f"the interval's level {level!r} must lie strictly between 0 and 1, e.g. 0.95."
        )
    low, high = 0.0, 1.0
    while t_within(high, df) < level:
        high *= 2
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if t_within(middle, df) < level else (low, middle)
    return (low + high) / 2


def profile_bounds(
    rss: Callable[[float], float], best: float, low: float, high: float, threshold: float
) -> tuple[float | None, float | None]:
    """The ends of {u in [low, high] : rss(u) <= threshold} around ``best`` (where rss is least):
    scanned outward to the first point above the threshold, then bisected; None for an end whose
    edge is still at or below it."""
    return _end(rss, best, low, threshold), _end(rss, best, high, threshold)


def _end(rss: Callable[[float], float], best: float, edge: float, threshold: float) -> float | None:
    inside = best
    for i in range(1, SCAN + 1):
        u = best + (edge - best) * i / SCAN
        if rss(u) > threshold:
            outside = u
            break
        inside = u
    else:
        return None
    for _ in range(BISECTIONS):
        middle = (inside + outside) / 2
        inside, outside = (middle, outside) if rss(middle) <= threshold else (inside, middle)
    return (inside + outside) / 2
