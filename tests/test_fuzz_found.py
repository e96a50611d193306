"""What the fuzz tests (tests/test_fuzz.py) found, each pinned by its smallest example."""

import pytest

from megatron_ga_ext import StepSchedule
from megatron_ga_ext.core.numbers import parse_count
from megatron_ga_ext.errors import ScheduleParseError, SizeError
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.integration.guards import GuardedCalculator


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["ledger", "--world-size=8", "--micro-batch-size=--"], "--micro-batch-size"),
        (["check", "--world-size=--", "--", "torchrun", "--nproc-per-node", "8"], "--world-size"),
        (
            [
                "schedule",
                "0:8",
                "--micro-batch-size",
                "1",
                "--data-parallel-size",
                "1",
                "--lr=--",
                "--lr-base-batch-size",
                "8",
            ],
            "--lr",
        ),
    ],
)
def test_a_flag_given_as_flag_equals_dashdash_is_a_usage_error(cli, argv, flag):
    """argparse reads ``--flag=--`` as an empty list: a usage error naming the flag, where read_int
    would raise AttributeError and math.isfinite TypeError."""
    answer = cli(*argv)
    assert answer.status == 2
    err = answer.err
    assert (
        f"error: {flag}=--: '--' is not a value for {flag}; give {flag} a value, or leave it out."
        in err
    )
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "text", ["9" * 31, "1.0000001e30", "1000000000000000001T", "1000000000000000000001B"]
)
def test_a_count_above_1e30_is_refused_exactly(text):
    """The bound is on the value, not its exponent: 10**31 - 1 has exponent 30 and is past 10**30
    all the same."""
    with pytest.raises(
        ScheduleParseError, match=rf"value '{text}' is larger than 1e30; no run consumes that much"
    ):
        parse_count(text, "value")
    assert parse_count("1e30") == parse_count("1000000000000000000T") == 10**30


def test_the_bound_is_the_same_for_a_schedule_entry():
    with pytest.raises(
        ScheduleParseError,
        match=r"entry 2 '1000000000000000001T:16': threshold '1000000000000000001T' "
        r"is larger than 1e30",
    ):
        StepSchedule.parse("0:8 1000000000000000001T:16")


@pytest.mark.parametrize("consumed", ["8", 1.5, -1, True, None])
def test_the_guard_refuses_a_consumed_count_that_is_not_one(consumed):
    """The guard does arithmetic on the count before any calculator sees it, so it checks the count
    first: a SizeError, not a TypeError."""
    guarded = GuardedCalculator(StepScheduleCalculator(StepSchedule.constant(8), 1, 1), 1)
    guarded.update(0, True)
    with pytest.raises(
        SizeError, match=rf"consumed_samples {consumed!r} must be a whole number >= 0\."
    ):
        guarded.update(consumed, False)


@pytest.mark.parametrize(
    "flags, problem",
    [
        (
            ["--num-layers", "0", "--num-layers-per-virtual-pipeline-stage", "0"],
            "--num-layers-per-virtual-pipeline-stage 0 must be at least 1: it sets how the "
            "layers of each pipeline stage split into virtual stages. Give a whole "
            "number >= 1, or leave --num-layers-per-virtual-pipeline-stage out.",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "8",
                "--num-virtual-stages-per-pipeline-rank",
                "0",
            ],
            "--num-virtual-stages-per-pipeline-rank 0 must be at least 1",
        ),
        (
            ["--pipeline-model-parallel-size", "0", "--num-layers", "8"],
            "--pipeline-model-parallel-size 0 must be at least 1; give an integer >= 1.",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "-8",
                "--num-layers-per-virtual-pipeline-stage",
                "3",
            ],
            "--num-layers -8 must be at least 1: a model has layers to split over the pipeline "
            "stages.",
        ),
    ],
)
def test_a_zero_pipeline_size_is_a_problem_not_a_division_by_zero(cli, flags, problem):
    """The layer split divides by these sizes, so each is checked first: a problem of check, not a
    ZeroDivisionError."""
    line = [
        "torchrun",
        "--nproc-per-node",
        "8",
        "pretrain_gpt.py",
        "--micro-batch-size",
        "1",
        "--calculate-per-token-loss",
        *flags,
    ]
    answer = cli("check", "--json", "--", *line)
    assert answer.status == 1
    assert any(problem in text for text in (p["message"] for p in answer.json()["problems"]))


def test_a_ramp_of_more_stages_than_len_can_count_is_read_and_checked():
    """A ramp of 2^63 increments (1 to 2^63 by 1) has more stages than ``len()`` can return
    (sys.maxsize, else OverflowError): its index, summary, problems and stage pairs count with
    ``num_stages``, up to 1e30."""
    schedule = StepSchedule.from_rampup(1, 1, 1, 2**63)
    assert schedule.num_stages == 2**63
    assert (
        schedule.summary() == "9,223,372,036,854,775,808 stages: 0:1 1:2 ... 1:9223372036854775808"
    )
    assert schedule.global_batch_size_at(0) == 1 and schedule.final_global_batch_size == 2**63
    assert schedule.problems(1, 1, 1, None) == []
    assert schedule.stages[-1] == (1, 2**63)
    assert repr(schedule.stages).endswith("9223372036854775808 stages)")
    ramp = StepSchedule.from_rampup(1, 1, 10**30, 10**30)
    assert ramp.num_stages == 10**30 and ramp.global_batch_size_at(10**30) == 10**30


@pytest.mark.parametrize("flag", ["--ga-noise-scale", "--ga-batch-size-warmup-max"])
def test_a_blank_integer_of_the_noise_scale_flags_is_a_usage_error(cli, flag):
    """``check`` reads them as the layout's integers are read: a usage error naming the flag, not a
    ValueError."""
    line = [
        "torchrun",
        "--nproc-per-node",
        "8",
        "pretrain_gpt.py",
        "--micro-batch-size",
        "1",
        "--calculate-per-token-loss",
        "--ga-batch-size-warmup",
        "auto",
        flag,
        " ",
    ]
    answer = cli("check", "--", *line)
    assert answer.status == 2 and flag in answer.err and "Traceback" not in answer.err, answer.err
