"""install() in Megatron-LM's own training loop costs no measurable time: 20 iterations of
pretrain_gpt.py, DP 2 on the CPU over gloo, GA 8, without the extension (upstream's
--calculate-per-token-loss), with it, and with --ga-checks async, on the newest release of the leg.

What is asserted is behaviour: every run trains its 20 iterations, the extension's losses and grad
norms equal upstream's at every iteration (the async run's too), and the async run's N is the
batch's loss tokens once its verdicts are read. Each variant runs twice, in the mirrored order
upstream, extension, async, async, extension, upstream (a drift of the machine's speed over the
session weighs on all three alike); the times (seconds between Megatron's iteration logs, the first
two of each run left out: the median, and the fastest, which a slow phase of the machine cannot
lower) are recorded (tools/results.py) for ``make docs`` to render into docs/performance.md; they
are a measurement, not a pass mark.
"""

from __future__ import annotations

import itertools
import statistics

import pytest

from tests.support.plans import BOUNDED
from tools.compatibility import source_name
from tools.results import record

pytestmark = pytest.mark.e2e

ITERATIONS = 20
FLAGS = [
    "--calculate-per-token-loss",
    "--global-batch-size",
    "32",
    "--train-iters",
    str(ITERATIONS),
    *BOUNDED,
]
VARIANTS = {
    "upstream": ([], False),
    "extension": ([], True),
    "extension_async": (["--ga-checks", "async"], True),
}


def iteration_seconds(run) -> list[float]:
    """Times between consecutive iteration logs, past the first two (start-up, first-step
    checks)."""
    times = [row["time"] for row in run.iterations]
    return [b - a for a, b in itertools.pairwise(times[2:])]


def test_twenty_iterations_with_and_without_install(launches, newest_release):
    order = [*VARIANTS, *reversed(VARIANTS)]
    runs = {
        (name, index): launches.get(
            newest_release,
            "dp2",
            f"perf-{name}-{index}",
            [*FLAGS, *VARIANTS[name][0]],
            extension=VARIANTS[name][1],
        )
        for index, name in enumerate(order)
    }
    for (name, _), run in runs.items():
        assert run.rc == 0, run.describe()
        assert [row["iteration"] for row in run.iterations] == list(range(1, ITERATIONS + 1)), name
    upstream = runs["upstream", 0].iterations
    for (name, _), run in runs.items():
        for ours, theirs in zip(run.iterations, upstream):
            assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"]), (
                name,
                ours,
                theirs,
            )
        if (
            name == "extension_async"
        ):  # each step's verdict is read after its optimizer step, before the log
            assert [row["num_tokens"] for row in run.iterations] == run.mask_tokens()
    intervals = {
        name: [t for (n, _), run in runs.items() if n == name for t in iteration_seconds(run)]
        for name in VARIANTS
    }
    median = {name: statistics.median(values) for name, values in intervals.items()}
    fastest = {name: min(values) for name, values in intervals.items()}

    def cell(name: str) -> str:
        return f"{1e3 * median[name]:.1f} ({1e3 * fastest[name]:.1f})"

    def ratios(seconds: dict[str, float]) -> str:
        return ", ".join(
            f"{seconds[name] / seconds['upstream']:.3f}"
            for name in ("extension", "extension_async")
        )

    record(
        "e2e",
        [
            {
                "Source": source_name(newest_release),
                "Layout": "DP 2, GA 8 (GBS 32, MBS 2), tiny GPT",
                "Iterations": f"2 x {ITERATIONS}",
                "Upstream (ms)": cell("upstream"),
                "Extension (ms)": cell("extension"),
                "Async (ms)": cell("extension_async"),
                "Ratio (extension, async)": f"{ratios(median)} ({ratios(fastest)})",
                "Losses": "equal to upstream at every iteration",
            }
        ],
    )
