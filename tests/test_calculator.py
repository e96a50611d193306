"""StepScheduleCalculator on its own: Megatron's interface, start-up validation, O(log stages)
updates."""

import logging

import pytest

from megatron_ga_ext import StepSchedule
from megatron_ga_ext.core.schedule.stages import Stage
from megatron_ga_ext.errors import InterleaveError, ScheduleError, ScheduleWarning, SizeError
from megatron_ga_ext.integration.calculator import StepScheduleCalculator

SCALE_UP = "0:256 200000:512 600000:1024 1500000:2048 3000000:4096 6000000:6144"


def test_interface_after_construction():
    calc = StepScheduleCalculator(StepSchedule.parse("0:16 100:32"), 4, 2)
    assert (calc.get(), calc.get_current_global_batch_size(), calc.get_micro_batch_size()) == (
        2,
        16,
        4,
    )
    assert calc.get_current_running_global_batch_size() == 16
    assert calc.global_batch_size == 32 and calc.schedule == [(0, 16), (100, 32)]
    calc.update(100, consistency_check=True)
    assert (calc.get(), calc.get_current_global_batch_size()) == (4, 32)


def test_first_checked_update_validates_every_remaining_stage():
    calc = StepScheduleCalculator(StepSchedule.parse("0:16 100:32 10000:36"), 4, 2)
    calc.update(50, consistency_check=False)  # unchecked: floors like upstream
    with pytest.raises(
        AssertionError,
        match=r"entry 3 '10000:36' .* not a multiple of --micro-batch-size 4 x "
        r"data-parallel size 2 = 8",
    ) as caught:
        calc.update(
            50, consistency_check=True
        )  # the bad stage is 10000 samples away: fails at start-up
    assert type(caught.value) is ScheduleError  # caught as upstream's callers catch its assert


def test_past_stages_smaller_than_dp_are_allowed():
    calc = StepScheduleCalculator(StepSchedule.parse(SCALE_UP), 1, 512)
    assert (
        calc.get_current_global_batch_size() == 256 and calc.get() == 0
    )  # unchecked init, as upstream
    calc.update(200000, consistency_check=True)
    assert (calc.get_current_global_batch_size(), calc.get()) == (512, 1)
    calc.update(6000000, consistency_check=True)
    assert calc.get() == 12
    with pytest.raises(
        ScheduleError,
        match=r"entry 1 '0:256' .* smaller than --micro-batch-size 1 x data-parallel "
        r"size 512 = 512, so it gives 0 micro-batches",
    ):
        StepScheduleCalculator(StepSchedule.parse(SCALE_UP), 1, 512).update(
            0, consistency_check=True
        )


def test_interleaved_rule_checked_at_start_up():
    calc = StepScheduleCalculator(
        StepSchedule.parse("0:32 100:48"),
        1,
        8,
        pipeline_model_parallel_size=4,
        virtual_pipeline_size=2,
    )
    with pytest.raises(InterleaveError, match="entry 2 '100:48'"):
        calc.update(0, consistency_check=True)


def test_opt_out_warns_then_fails_when_the_stage_is_reached():
    calc = StepScheduleCalculator(
        StepSchedule.parse("0:16 100:24"),
        4,
        2,
        strict_future=False,
        planned_data_parallel_sizes=[4],
    )
    with pytest.warns(ScheduleWarning, match=r"entry 2 '100:24'.*planned data-parallel size 4"):
        calc.update(0, consistency_check=True)
    calc.update(100, consistency_check=True)  # DP is still 2: 24 % 8 == 0, fine
    calc = StepScheduleCalculator(StepSchedule.parse("0:16 100:20"), 4, 2, strict_future=False)
    with pytest.warns(ScheduleWarning):
        calc.update(0, consistency_check=True)
    with pytest.raises(ScheduleError, match="entry 2 '100:20'"):
        calc.update(100, consistency_check=True)  # not rescaled after all: fails as upstream would


def test_build_from_megatron_arguments():
    calc = StepScheduleCalculator.build(0, [16, 8, 300000], 1024, 4, 2)
    assert calc.schedule[:2] == [(0, 16), (2381, 24)] and calc.get() == 2
    calc = StepScheduleCalculator.build(0, ["16", "16", "48"], 32, 8, 2)
    assert calc.schedule == [(0, 16), (48, 32)]
    calc = StepScheduleCalculator.build(0, None, 64, 4, 2)
    assert (calc.schedule, calc.get()) == ([(0, 64)], 8)
    calc = StepScheduleCalculator.build(
        0, None, 8, 4, 2, step_batch_size_schedule="0:8 250K:16", seq_length=1000
    )
    assert calc.schedule == [(0, 8), (250, 16)]
    calc = StepScheduleCalculator.build(
        0,
        None,
        None,
        1,
        8,
        step_batch_size_schedule="0:32 100:48",
        pipeline_model_parallel_size=4,
        virtual_pipeline_size=2,
    )
    with pytest.raises(InterleaveError):
        calc.update(0, True)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(rampup_batch_size=[16, 8], global_batch_size=64), SizeError, "takes three values"),
        (
            dict(rampup_batch_size=[16, 8, "1e5"], global_batch_size=64),
            SizeError,
            "ramp-up samples '1e5' is not a whole",
        ),
        (dict(rampup_batch_size=[16, 8, 100]), SizeError, "--global-batch-size is required"),
        (
            dict(rampup_batch_size=[16, 8, 100], step_batch_size_schedule="0:8"),
            ScheduleError,
            "both given",
        ),
        (
            dict(global_batch_size=64, decrease_batch_size_if_needed=True),
            ScheduleError,
            "--decrease-batch-size-if-needed cannot be combined",
        ),
    ],
)
def test_build_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        StepScheduleCalculator.build(0, micro_batch_size=4, data_parallel_size=2, **kwargs)


def test_from_megatron_signature_and_decrease_refused():
    calc = StepScheduleCalculator.from_megatron(
        micro_batch_size=1,
        data_parallel_size=512,
        decrease_batch_size_if_needed=False,
        rank=0,
        schedule=SCALE_UP,
    )
    assert calc.current_global_batch_size == 256
    with pytest.raises(
        ScheduleError,
        match=r"^--decrease-batch-size-if-needed cannot be combined with a step "
        r"batch-size schedule \(upstream refuses it too\)",
    ):
        StepScheduleCalculator.from_megatron(1, 512, True, 0, SCALE_UP)


def test_logs_only_on_rank_zero_when_verbose(caplog):
    with caplog.at_level(logging.INFO, logger="megatron_ga_ext.integration.calculator"):
        calc = StepScheduleCalculator(StepSchedule.parse("0:16 100:32"), 4, 2, rank=1)
        calc.update(100, False, verbose=True)
    assert not caplog.records
    with caplog.at_level(logging.INFO, logger="megatron_ga_ext.integration.calculator"):
        calc = StepScheduleCalculator(StepSchedule.parse("0:16 100:32"), 4, 2, rank=0)
        calc.update(100, False, verbose=True)
    assert "global batch size 16 -> 32 at 100 consumed samples (4 micro-batches)" in caplog.text


def test_update_is_logarithmic_in_stages():
    """update() bisects: 200,000 stages, 20,000 updates well under a second."""
    import time

    schedule = StepSchedule.from_stages([(i * 10, 8 * (i + 1)) for i in range(200_000)])
    calc = StepScheduleCalculator(schedule, 1, 8)
    calc.update(0, True)  # the one O(stages) validation
    start = time.perf_counter()
    for consumed in range(0, 2_000_000, 100):
        calc.update(consumed, True)
    assert time.perf_counter() - start < 1.0
    assert calc.get_current_global_batch_size() == 8 * 199_991


def test_schedule_built_from_stage_objects_keys_warnings_by_stage():
    """Stage.position defaults to 0: a warned stage must still be checked when it comes into
    force."""
    schedule = StepSchedule(
        (
            Stage(threshold_samples=0, global_batch_size=8),
            Stage(threshold_samples=100, global_batch_size=12),
        )
    )
    calc = StepScheduleCalculator(schedule, 4, 2, strict_future=False)
    with pytest.warns(ScheduleWarning, match=r"entry 2 '100:12'"):
        calc.update(0, consistency_check=True)
    with pytest.raises(
        ScheduleError,
        match=r"entry 2 '100:12' \(from 100 samples, global batch size 12\) is not a "
        r"multiple of --micro-batch-size 4 x data-parallel size 2 = 8",
    ):
        calc.update(100, consistency_check=True)  # 12 would be floored to 1 micro-batch of 8


@pytest.mark.parametrize(
    "mbs, dp, message",
    [
        (0, 2, "--micro-batch-size 0 must be at least 1"),
        (4, -2, "--data-parallel-size -2 must be at least 1"),
    ],
)
def test_nonpositive_sizes_are_assertion_errors_like_upstream(mbs, dp, message):
    """Upstream: assert micro_batch_times_data_parallel_size > 0."""
    with pytest.raises(AssertionError, match=message) as caught:
        StepScheduleCalculator(StepSchedule.parse("0:16"), mbs, dp)
    assert type(caught.value) is ScheduleError
    with pytest.raises(SizeError, match=r"--micro-batch-size 4\.0 is not a whole number"):
        StepScheduleCalculator(StepSchedule.parse("0:16"), 4.0, 2)  # type: ignore[arg-type]
