"""install() in Megatron-LM's own training loop costs no measurable time: 20 iterations of pretrain_gpt.py, DP 2 on
the CPU over gloo, GA 8, without the extension (upstream's --calculate-per-token-loss), with it, and with
--ga-checks async, on the newest release of the leg.

What is asserted is behaviour: every run trains its 20 iterations, the extension's losses and grad norms equal
upstream's at every iteration (the async run's too), and the async run's N is the batch's loss tokens once its
verdicts are read. The times (median seconds between Megatron's iteration logs, the first two left out) are
measured side by side in one session and written into docs/performance.md (``MEGATRON_GA_PERFORMANCE_DOC``);
they are a measurement, not a pass mark.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
from compatibility import source_name
from plans import BOUNDED
from reliability import update

pytestmark = pytest.mark.e2e

ITERATIONS = 20
FLAGS = ["--calculate-per-token-loss", "--global-batch-size", "32", "--train-iters", str(ITERATIONS), *BOUNDED]
VARIANTS = {"upstream": ([], False), "extension": ([], True), "extension_async": (["--ga-checks", "async"], True)}


def iteration_seconds(run) -> float:
    """Median time between consecutive iteration logs, past the first two (start-up, first-step checks)."""
    times = [row["time"] for row in run.iterations]
    return statistics.median(b - a for a, b in zip(times[2:], times[3:]))


def test_twenty_iterations_with_and_without_install(launches, newest_release):
    runs = {name: launches.get(newest_release, "dp2", f"perf-{name}", [*FLAGS, *flags], extension=extension)
            for name, (flags, extension) in VARIANTS.items()}
    for name, run in runs.items():
        assert run.rc == 0, run.describe()
        assert [row["iteration"] for row in run.iterations] == list(range(1, ITERATIONS + 1)), name
    for name in ("extension", "extension_async"):
        for ours, theirs in zip(runs[name].iterations, runs["upstream"].iterations):
            assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"]), (name, ours, theirs)
    # The async run reads each step's verdict after its optimizer step, before Megatron logs the iteration.
    assert [row["num_tokens"] for row in runs["extension_async"].iterations] == runs["extension_async"].mask_tokens()
    seconds = {name: iteration_seconds(run) for name, run in runs.items()}
    doc = os.environ.get("MEGATRON_GA_PERFORMANCE_DOC")
    if doc:
        ms = {name: f"{1e3 * value:.1f}" for name, value in seconds.items()}
        update(Path(doc), "e2e", [{
            "Source": source_name(newest_release), "Layout": "DP 2, GA 8 (GBS 32, MBS 2), tiny GPT",
            "Iterations": str(ITERATIONS),
            "Upstream (ms)": ms["upstream"], "Extension (ms)": ms["extension"], "Async (ms)": ms["extension_async"],
            "Ratio (extension, async)": f"{seconds['extension'] / seconds['upstream']:.3f}, "
                                        f"{seconds['extension_async'] / seconds['upstream']:.3f}",
            "Losses": "equal to upstream at every iteration"}])
