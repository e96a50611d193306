"""benchmarks/overhead.py's statistics, on numbers whose answer is known (the timings themselves run
in the benchmark, not here)."""

import importlib.util
import math
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "overhead", Path(__file__).resolve().parent.parent / "benchmarks" / "overhead.py"
)
overhead = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(overhead)


@pytest.mark.parametrize(("n", "ranks"), [(24, (7, 18)), (10, (2, 9)), (12, (3, 10)), (5, (1, 5))])
def test_median_interval_is_the_binomial_order_statistics(n, ranks):
    """k is the largest rank with P(Binomial(n, 1/2) < k) <= 2.5%; n = 5 is too small for one (the
    whole range)."""
    values = [float(v) for v in range(n, 0, -1)]  # any order: the interval is of the sorted values
    assert overhead.median_ci95(values) == (float(ranks[0]), float(ranks[1]))
    if n > 5:
        k = ranks[0]
        below = sum(math.comb(n, i) for i in range(k)) / 2**n
        assert below <= 0.025 < below + math.comb(n, k) / 2**n


def test_summary_pairs_each_round_with_its_own_upstream():
    """Ratios and differences are per round (a slow round slows every variant of it), medians over
    rounds."""
    upstream = [0.100, 0.200, 0.100]  # the second round ran on a slow moment
    measured = {
        "times": {
            "upstream": upstream,
            "extension": [0.101, 0.202, 0.101],
            "extension_async": [0.100, 0.200, 0.100],
            "upstream_control": [0.100, 0.200, 0.100],
        },
        "counts": {v: {"host_reads": 1, "collectives": 3} for v in overhead.VARIANTS},
        "own_us": {
            "microbatch": 5.0,
            "step": 100.0,
            "paired": {"microbatch": 6.0, "step": 160.0},
            "upstream_microbatch": 30.0,
            "upstream_step": 400.0,
            "in_step": {"step": 200.0, "paired": {"step": 280.0}, "upstream_step": 20000.0},
        },
    }
    row = overhead.summarize(4, "gpt", measured)
    assert row["ratio_median"] == {"extension": 1.01, "extension_async": 1.0}
    assert (
        row["extra_us_per_microbatch"]["extension"] == 250.0
    )  # median of 250, 500, 250 us over GA 4
    assert row["control"]["ratio_median"] == 1.0
    assert row["own_us"]["per_microbatch_at_this_ga"] == 30.0  # 5 + 100 / 4
    assert row["own_us"]["paired"]["per_microbatch_at_this_ga"] == 46.0  # 6 + 160 / 4
    assert row["ratio_from_own_work"] == 1.0012  # 120 us / 0.1 s
    assert "| tiny GPT | 4 | 100.00 | 1.010 [1.010, 1.010] | 250.0 |" in overhead.table([row])
    assert row["own_us"]["in_step"]["per_microbatch_at_this_ga"] == {
        "step": 50.0,
        "paired": 70.0,
    }  # 200, 280 / 4
    assert row["ratio_in_step"] == {"minima": 1.01, "paired": 1.014}  # 200 us, 280 us / 20 ms


def test_regions_split_whole_steps_into_the_calls_they_time(monkeypatch):
    """On a clock that moves only where the step says: four micro-batch calls 2 us dearer each, a
    finalize 3 us dearer, the rest equal. The schedule module's function is put back afterwards."""
    import sys
    import types

    from megatron_ga_ext.integration.compat import SCHEDULES

    clock = [0.0]
    monkeypatch.setattr(overhead, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def advance(extension, upstream_s, extension_s):
        clock[0] += extension_s if extension else upstream_s

    module = types.ModuleType("schedules")
    module.forward_step_calc_loss = lambda extension: advance(extension, 5e-6, 7e-6)
    monkeypatch.setitem(sys.modules, SCHEDULES, module)
    original = module.forward_step_calc_loss

    def whole_step(active, finalizes):
        start = clock[0]
        for _ in range(4):
            sys.modules[SCHEDULES].forward_step_calc_loss(active)
        finalizes[active](active)
        advance(active, 100e-6, 100e-6)
        return clock[0] - start

    finalize = lambda extension: advance(extension, 10e-6, 13e-6)  # noqa: E731
    regions = overhead._regions(whole_step, (finalize, finalize), seconds=0)
    assert regions == {
        "forward_step_calc_loss": {"minima": 8.0, "paired": 8.0},
        "finalize": {"minima": 3.0, "paired": 3.0},
        "rest": {"minima": 0.0, "paired": 0.0},
        "repeats": overhead.OWN_REPEATS,
    }
    assert module.forward_step_calc_loss is original
