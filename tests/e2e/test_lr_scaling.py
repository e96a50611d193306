"""``--ga-lr-scaling sqrt`` in Megatron-LM's own training loop (pretrain_gpt.py through the drop-in
entry), DP 2 on the CPU over gloo, against the same step-schedule launch without it
(test_pretrain_gpt.py's, microbatch mode).

Megatron logs at iteration k the rate its scheduler wrote after step k, which step k + 1 trains at,
so the factor of the logged rate is the one of the GBS at the samples consumed after step k (the
next step's batch):

    logged lr(k) = unscaled lr(k) x sqrt(GBS(consumed after k) / first GBS)       to 1e-9 relative

Across a resume of a --ga-batch-size-warmup auto run, the resumed iterations equal the uninterrupted
run's (the first resumed step trains at the restored stage's rate, which no log line shows: its loss
and grad norm do).

Where a skipped step (here the zero-token skip of iteration 3, the first stage's last) was the last
of its stage, Megatron has written no rate after it: the rate each step trained with (the recorder's
``trained_lr``, read when torch's optimizer steps) is the unscaled run's times its own batch's
factor, the next stage's first step too.
"""

from __future__ import annotations

import math

import pytest

from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from tests.e2e.test_batch_warmup import FLAGS as WARMUP_FLAGS
from tests.e2e.test_batch_warmup import GBS as WARMUP_GBS
from tests.e2e.test_batch_warmup import SAVE_AT as WARMUP_SAVE_AT
from tests.e2e.test_pretrain_gpt import (
    MICROBATCH,
    PLANS,
    SCHEDULE,
    SCHEDULE_TEXT,
    TOKEN,
    record,
    schedule_run,
)
from tests.support.plans import planned_steps, ran_steps
from tests.support.pretrain_runs import SEQ_LENGTH
from tools.compatibility import source_name

pytestmark = pytest.mark.e2e


def test_sqrt_scaling_follows_the_plan(launches, newest_source, record_property):
    unscaled, _ = schedule_run(launches, newest_source, "dp2")
    run = launches.get(
        newest_source,
        "dp2",
        "schedule-lr-sqrt",
        [*MICROBATCH, *SCHEDULE, "--ga-lr-scaling", "sqrt"],
    )
    assert run.rc == 0 and run.error is None, run.describe()
    assert unscaled.rc == 0 and unscaled.error is None, unscaled.describe()
    plan = planned_steps(*PLANS["schedule"])
    assert ran_steps(run) == plan == ran_steps(unscaled), (ran_steps(run), plan)
    assert (
        "--ga-lr-scaling sqrt: the learning rate x 1 from sample 0 (GBS 16), x 1.22474 from "
        "sample 48 (GBS 24), x 1.41421 from sample 96 (GBS 32)" in run.output
    ), run.describe()

    schedule = StepSchedule.parse(SCHEDULE_TEXT, SEQ_LENGTH)
    first = schedule.entries[0].global_batch_size
    factors = []
    for ours, theirs in zip(run.iterations, unscaled.iterations, strict=True):
        factor = math.sqrt(schedule.global_batch_size_at(ours["consumed_samples"]) / first)
        assert ours["learning_rate"] == pytest.approx(
            theirs["learning_rate"] * factor, rel=1e-9, abs=0
        ), (ours, theirs)
        factors.append(factor)
    assert sorted(set(factors)) == [
        1.0,
        math.sqrt(1.5),
        math.sqrt(2.0),
    ]  # every stage's factor was checked
    record(
        record_property,
        source_name(newest_source),
        "dp2",
        [
            {
                "mode": "microbatch",
                "case": "schedule, --ga-lr-scaling sqrt",
                "iterations": f"{len(plan)} = plan",
                "samples": f"{plan[-1][1]} = plan",
                "lr_end": "unscaled x sqrt(GBS / 16), rel 1e-9",
            }
        ],
    )


def test_sqrt_scaling_across_a_batch_warmup_resume(launches, newest_source):
    """--ga-batch-size-warmup auto with --ga-lr-scaling sqrt, saved at iteration 2 and resumed: the
    first resumed step trains at the restored stage's rate (Megatron's scheduler writes the rates
    while loading, before the stages are restored), so iterations 3-5 equal the uninterrupted run's
    in GBS, LR, loss and grad norm."""
    checkpoints = launches.workdir / newest_source.name / "dp2" / "warmup-lr-sqrt-checkpoints"
    flags = [*WARMUP_FLAGS, "--ga-lr-scaling", "sqrt", "--ckpt-format", "torch"]
    run = launches.get(
        newest_source,
        "dp2",
        "warmup-lr-sqrt",
        [*flags, "--save", str(checkpoints), "--save-interval", str(WARMUP_SAVE_AT)],
    )
    assert run.rc == 0 and run.error is None, run.describe()
    resumed = launches.get(
        newest_source,
        "dp2",
        "warmup-lr-sqrt-resumed",
        [*flags, "--load", str(checkpoints), "--ckpt-step", str(WARMUP_SAVE_AT)],
    )
    assert resumed.rc == 0 and resumed.error is None, resumed.describe()
    assert [r["global_batch_size"] for r in run.iterations] == WARMUP_GBS, run.iterations
    whole, again = run.iterations[WARMUP_SAVE_AT:], resumed.iterations
    assert [r["iteration"] for r in again] == [r["iteration"] for r in whole], (again, whole)
    for ours, theirs in zip(again, whole, strict=True):
        assert (
            ours["global_batch_size"],
            ours["learning_rate"],
            ours["loss"],
            ours["grad_norm"],
        ) == (
            theirs["global_batch_size"],
            theirs["learning_rate"],
            theirs["loss"],
            theirs["grad_norm"],
        ), (ours, theirs)


def test_after_a_skipped_last_step_of_a_stage_the_next_trains_at_its_factor(
    launches, newest_source
):
    skip = ["--ga-zero-token-policy", "skip"]
    fault = {
        "MEGATRON_GA_FAULT": "zero-tokens-at:3"
    }  # 3 x GBS 16 = 48 samples: the first stage's last step
    unscaled = launches.get(
        newest_source, "dp2", "schedule-skip-3", [*TOKEN, *SCHEDULE, *skip], env=fault
    )
    run = launches.get(
        newest_source,
        "dp2",
        "schedule-skip-3-lr-sqrt",
        [*TOKEN, *SCHEDULE, *skip, "--ga-lr-scaling", "sqrt"],
        env=fault,
    )
    for launched in (unscaled, run):
        assert launched.rc == 0 and launched.error is None, launched.describe()
    rows = {r["iteration"]: r for r in run.iterations}
    assert rows[3]["skipped"] == 1 and rows[3]["trained_lr"] is None, rows[3]
    assert (rows[3]["global_batch_size"], rows[4]["global_batch_size"]) == (16, 24), rows
    trained = 0
    for ours, theirs in zip(run.iterations, unscaled.iterations, strict=True):
        if ours["iteration"] == 3:
            continue
        factor = math.sqrt(ours["global_batch_size"] / 16)
        assert ours["trained_lr"] == pytest.approx(
            theirs["trained_lr"] * factor, rel=1e-9, abs=0
        ), (ours, theirs)
        trained += 1
    assert trained == len(run.iterations) - 1
