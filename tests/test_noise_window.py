"""science/core/noise_window.py: B_simple from a centred window of trace rows (ratio of sums) and
the median ratio."""

import pytest

from megatron_ga_ext.science.core.noise_window import median_b_simple, step_parts, window_b_simple


def rows(values: list[tuple[float, float]], tokens: float = 64.0) -> list[dict]:
    """Rows every 32 samples with (tr(Sigma) per token, |G|^2)."""
    return [
        {
            "consumed_samples": 32 * (i + 1),
            "trace_sigma": s,
            "grad_sq": g,
            "tokens_per_sample": tokens,
        }
        for i, (s, g) in enumerate(values)
    ]


def test_the_window_is_centred_on_the_crossing_and_a_ratio_of_sums():
    trace = rows([(640.0, 1.0), (640.0, 3.0), (1280.0, -1.0), (640.0, 2.0), (6400.0, 1.0)])
    # crossing at 90 samples: the first row at or after it is the 3rd (96); half 1: rows 2-4
    value, count = window_b_simple(trace, 90.0, 1)
    assert count == 3 and value == pytest.approx((640 + 1280 + 640) / 64 / (3 - 1 + 2))
    # near the end the window shrinks equally on both sides: the 5th row alone
    assert window_b_simple(trace, 150.0, 2) == (pytest.approx(100.0), 1)
    assert window_b_simple(trace, 1000.0, 2) == (None, 0)
    # a window whose |G|^2 sum is not positive measures nothing
    assert window_b_simple(rows([(64.0, 1.0), (64.0, -3.0), (64.0, 1.0)]), 64.0, 1) == (None, 3)


def test_the_median_ratio_ignores_one_spike():
    steady = rows([(256.0, 1.0)] * 7)
    assert median_b_simple(steady) == pytest.approx(4.0)
    spiked = steady + rows([(256000.0, 0.001)])
    assert median_b_simple(spiked) == pytest.approx(4.0)
    sums = sum(r["trace_sigma"] for r in spiked) / 64 / sum(r["grad_sq"] for r in spiked)
    assert sums > 100  # the ratio of sums is carried away by the one step
    assert median_b_simple(rows([(64.0, -1.0)] * 3)) is None
    assert median_b_simple([{"consumed_samples": 1, "b_simple_samples": 3.0}]) is None
    assert step_parts({"trace_sigma": 1.0, "grad_sq": 2.0, "tokens_per_sample": 0}) is None
