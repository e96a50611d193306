"""B_simple from a window of the noise-scale trace's per-step estimates, instead of the EMA. Pure
Python.

A trace row (science/core/noise_trace.py) carries the step's unbiased estimates ``trace_sigma``
(tr(Sigma), per loss token) and ``grad_sq`` (|G|^2), and ``tokens_per_sample``; each is noisy and
``grad_sq`` is often negative on one step, so a one-step ratio means nothing. Two statistics of a
window of rows:

* :func:`window_b_simple`, at matched progress: the rows centred on the first row at or after a
  consumed-samples mark (where a run crosses a loss target), ``half`` rows on each side (fewer,
  equal on both sides, at the trace's ends), and the ratio of the window's sums,

      B_simple = sum_i (trace_sigma_i / tokens_per_sample_i) / sum_i grad_sq_i      (samples).

  The EMA (:class:`~megatron_ga_ext.science.core.noise_scale.NoiseScaleEMA`) is a |G|^2-weighted
  mean over the past only: while B_simple rises it reads low, by the lag docs/noise-scale.md
  measures; the centred window has no lag.
* :func:`median_b_simple`, robust to one outlying step: the ratio of the medians of the same two
  parts over the rows given. One step's spike moves each median by at most one order statistic, so
  with three or more rows it cannot by itself carry the statistic past a threshold the other rows'
  middle does not reach (``--ga-batch-size-warmup auto`` decides on it:
  science/integration/batch_warmup.py).

None where the denominator is not positive (the window does not measure |G|^2) or a row lacks a
part.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["centred_window", "median_b_simple", "step_parts", "window_b_simple"]


def step_parts(row: Mapping[str, Any]) -> tuple[float, float] | None:
    """(tr(Sigma) per sample, |G|^2) of one trace row, or None where it lacks one of its parts."""
    sigma, grad_sq, tokens = (
        row.get("trace_sigma"),
        row.get("grad_sq"),
        row.get("tokens_per_sample"),
    )
    if sigma is None or grad_sq is None or not tokens:
        return None
    return sigma / tokens, grad_sq


def centred_window(
    rows: Sequence[Mapping[str, Any]], at_samples: float, half: int
) -> Sequence[Mapping[str, Any]]:
    """The rows centred on the first row whose ``consumed_samples`` is at or after ``at_samples``,
    ``half`` on each side (fewer, equal on both sides, at the trace's ends); none where no row is."""
    marks = [
        i
        for i, r in enumerate(rows)
        if r.get("consumed_samples") is not None and r["consumed_samples"] >= at_samples
    ]
    if not marks:
        return []
    centre = marks[0]
    width = min(half, centre, len(rows) - 1 - centre)
    return rows[centre - width : centre + width + 1]


def window_b_simple(
    rows: Sequence[Mapping[str, Any]], at_samples: float, half: int
) -> tuple[float | None, int]:
    """(B_simple in samples from the sums of :func:`centred_window`, rows in the window) (module
    docstring); (None, 0) where no row is."""
    parts = [step_parts(r) for r in centred_window(rows, at_samples, half)]
    if not parts:
        return None, 0
    if any(p is None for p in parts):
        return None, len(parts)
    sigma = sum(p[0] for p in parts if p is not None)
    grad_sq = sum(p[1] for p in parts if p is not None)
    return (sigma / grad_sq if grad_sq > 0 else None), len(parts)


def median_b_simple(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """B_simple in samples as the ratio of the medians of the rows' two parts (module docstring)."""
    parts = [step_parts(r) for r in rows]
    if not parts or any(p is None for p in parts):
        return None
    grad_sq = statistics.median(p[1] for p in parts if p is not None)
    sigma = statistics.median(p[0] for p in parts if p is not None)
    return sigma / grad_sq if grad_sq > 0 else None
