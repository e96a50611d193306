"""Resume at every step boundary of a multi-stage batch schedule, in Megatron-LM's own training loop
(DP 2, token mode, on the newest release and the newest main commit of the leg).

One uninterrupted run saves a checkpoint after every step; one launch resumes from each of those
checkpoints (``--load ... --ckpt-step K``) but the last. Every resumed run must take the
uninterrupted run's steps from K on (iteration, consumed samples, GBS, num_microbatches: both equal
to `megatron-ga schedule`'s plan), with the same learning rate and loss at every step, and end at
the same totals (iterations, samples, train_iters).

Cases, one per source (each costs a launch per step): on the newest release a three-stage
--step-batch-size-schedule (on 0.16.1, the 3.11 leg, the backport the extension adds); on the newest
main commit a --rampup-batch-size converted by --ga-convert-rampup, the same three stages. Both take
4 steps of 8, 8, 16 and 24 samples, so resuming at 1, 2 and 3 resumes inside the first stage, at the
change to the second and at the change to the third.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ga_ext.core.megatron_flags import STEP_SCHEDULE
from megatron_ga_ext.integration.compat import UPSTREAM
from tests.support.plans import (
    BOUNDED,
    planned_steps,
    ran_steps,
    save_every_step,
    saved,
    seq_length_schedule,
)
from tools.compatibility import source_name
from tools.results import record

pytestmark = pytest.mark.e2e

TRAIN_SAMPLES = 56
SCHEDULE_TEXT = "0:8 1024:16 2048:24"
CASES = {
    "schedule": (["--step-batch-size-schedule", SCHEDULE_TEXT], seq_length_schedule(SCHEDULE_TEXT)),
    "rampup": (
        ["--rampup-batch-size", "8", "8", "32", "--global-batch-size", "24", "--ga-convert-rampup"],
        ["--from-rampup", "8", "8", "32", "--global-batch-size", "24"],
    ),
}
# Dropout off: a step's loss is then a function of the weights and the samples alone, so equal
# losses show that a resumed run trains on the same samples from the same weights.
FLAGS = [
    "--calculate-per-token-loss",
    "--train-samples",
    str(TRAIN_SAMPLES),
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    *BOUNDED,
]
STEPS = 4

_CHECKED: dict[tuple[str, str], list[int]] = {}


def uninterrupted(launches, source: Path, case: str):
    checkpoints = launches.workdir / source.name / "dp2" / f"resume-{case}-checkpoints"
    run = launches.get(
        source, "dp2", f"resume-{case}", [*CASES[case][0], *FLAGS, *save_every_step(checkpoints)]
    )
    return run, checkpoints


def is_main_commit(source: Path) -> bool:
    return any(u.name == source_name(source) and not u.is_release for u in UPSTREAM)


def backported(source: Path) -> bool:
    """A release older than Megatron's own --step-batch-size-schedule: the extension adds the
    flag."""
    refs = [u.ref for u in UPSTREAM]
    return any(
        u.name == source_name(source)
        and u.is_release
        and refs.index(u.ref) < refs.index(STEP_SCHEDULE.since)
        for u in UPSTREAM
    )


@pytest.mark.parametrize("boundary", range(1, STEPS))
def test_a_resume_at_every_step_boundary_runs_the_uninterrupted_steps(
    launches, newest_source, boundary
):
    case = "rampup" if is_main_commit(newest_source) else "schedule"
    whole, checkpoints = uninterrupted(launches, newest_source, case)
    assert whole.rc == 0 and whole.error is None, whole.describe()
    steps = ran_steps(whole)
    assert steps == planned_steps(CASES[case][1], TRAIN_SAMPLES) and len(steps) == STEPS, steps
    assert [gbs for _, _, gbs, _ in steps] == [8, 8, 16, 24]  # three stages
    assert saved(checkpoints) == (STEPS, list(range(1, STEPS + 1)))

    resumed = launches.get(
        newest_source,
        "dp2",
        f"resume-{case}-at-{boundary}",
        [
            *CASES[case][0],
            *FLAGS,
            "--load",
            str(checkpoints),
            "--ckpt-step",
            str(boundary),
            "--ckpt-format",
            "torch",
        ],
    )
    assert resumed.rc == 0 and resumed.error is None, resumed.describe()
    assert ran_steps(resumed) == steps[boundary:]
    assert ran_steps(resumed) == planned_steps(
        CASES[case][1], TRAIN_SAMPLES, steps[boundary - 1][1], boundary
    )
    for ours, theirs in zip(resumed.iterations, whole.iterations[boundary:]):
        assert (ours["learning_rate"], ours["loss"]) == (theirs["learning_rate"], theirs["loss"]), (
            ours,
            theirs,
        )
    assert _train_iters(resumed) == _train_iters(whole) == STEPS
    assert (
        "resuming from the checkpoint" not in resumed.output
    )  # the same configuration: no warning
    if backported(newest_source):
        case += " (backported)"
    _CHECKED.setdefault((source_name(newest_source), case), []).append(boundary)


def _train_iters(run) -> set[int]:
    return {
        row["train_iters"]
        for rows in run.records.values()
        for row in rows
        if row.get("event") == "end"
    }.pop()


@pytest.fixture(scope="module", autouse=True)
def _record_resumes():
    yield
    what = {
        "schedule": f'`--step-batch-size-schedule "{SCHEDULE_TEXT}"`',
        "schedule (backported)": f'`--step-batch-size-schedule "{SCHEDULE_TEXT}"` (the backport)',
        "rampup": "`--rampup-batch-size 8 8 32 --global-batch-size 24 --ga-convert-rampup`",
    }
    record(
        "resumes",
        [
            {
                "Source": source,
                "Case": f"{what[case]}, {STEPS} steps of 8, 8, 16, 24 samples",
                "Resumed at": "after step " + ", ".join(map(str, sorted(boundaries))),
                "Checked against the uninterrupted run": "every step's (iteration, consumed "
                "samples, GBS, "
                "num_microbatches), learning rate and loss equal; train_iters and the final "
                "consumed samples equal; "
                "no warning",
            }
            for (source, case), boundaries in _CHECKED.items()
        ],
    )
