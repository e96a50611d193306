"""Long ramps, described not listed: exact lookups, closed-form checks equal to stage-by-stage
ones."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ga_ext import StepSchedule
from megatron_ga_ext.core.schedule.checks import CheckLayout, schedule_problems, stage_error
from megatron_ga_ext.core.schedule.rampup import LISTED_RAMP, RampStages
from megatron_ga_ext.errors import InterleaveError, ScheduleError, UsageError
from megatron_ga_ext.integration.calculator import StepScheduleCalculator


def upstream_gbs(start, increment, ramp, gbs, consumed):
    """megatron-core 0.16.1's RampupBatchsizeNumMicroBatchesCalculator.update, written out."""
    if consumed > ramp:
        return gbs
    per = ramp / ((gbs - start) // increment)
    return start + int(consumed / per) * increment


def test_a_ramp_past_the_listed_limit_is_described():
    schedule = StepSchedule.from_rampup(1, 1, 10**6, 10**12)
    assert isinstance(schedule.entries, RampStages) and len(schedule.stages) == 10**12
    assert str(schedule).startswith("1,000,000,000,000 stages: 0:1 1:2 ... ")
    with pytest.raises(
        UsageError,
        match=r"too many to be written as --step-batch-size-schedule.*--ga-convert-rampup",
    ):
        schedule.to_string()
    with pytest.raises(UsageError, match=r"more than the 10,000 a table lists"):
        schedule.table(1, 1)
    small = StepSchedule.from_rampup(16, 8, 300000, 1024)
    assert isinstance(small.entries, tuple) and len(small.stages) == 127


@pytest.mark.parametrize(
    "ramp",
    [
        (1, 1, 10**6, 10**12),
        (16, 8, 300000, 10**12),
        (1, 1, 10**15, 10**12),
        (3, 2, 10**12 + 7, 2 * 10**5 + 3),
        (5, 5, 12345, 5 * 20001),
    ],
)
def test_lookups_follow_upstreams_float_arithmetic(ramp):
    samples = ramp[2]
    schedule = StepSchedule.from_rampup(*ramp)
    assert isinstance(schedule.entries, RampStages)
    probes = {0, 1, 2, samples - 1, samples, samples + 1, samples + 2} | {
        samples * k // 97 for k in range(97)
    }
    for k in (1, 2, 3, len(schedule.stages) // 3, len(schedule.stages) - 1):
        threshold = schedule.stages[k][0]
        probes |= {threshold - 1, threshold, threshold + 1}
    for consumed in sorted(p for p in probes if p >= 0):
        assert schedule.global_batch_size_at(consumed) == upstream_gbs(*ramp, consumed), consumed


def test_each_stage_starts_where_upstream_first_reaches_its_batch():
    ramp = (3, 2, 10**7 + 3, 2 * 20_000 + 3)  # 20,000 increments of about 500 samples
    schedule = StepSchedule.from_rampup(*ramp)
    for k in (1, 2, 777, 19_999, 20_000):
        threshold, batch = schedule.stages[k]
        assert upstream_gbs(*ramp, threshold) == batch > upstream_gbs(*ramp, threshold - 1)


def test_compact_and_listed_forms_agree_where_both_apply(monkeypatch):
    import megatron_ga_ext.core.schedule.step_schedule as schedule_module

    ramp = (16, 8, 300000, 1024)
    listed = StepSchedule.from_rampup(*ramp)
    monkeypatch.setattr(schedule_module, "LISTED_RAMP", 10)
    compact = StepSchedule.from_rampup(*ramp)
    assert isinstance(compact.entries, RampStages) and compact.stages == listed.stages
    for consumed in range(0, 300_010, 7):
        assert compact.global_batch_size_at(consumed) == listed.global_batch_size_at(consumed)


def _brute_force(ramp: RampStages, current: int, layout: CheckLayout):
    """(first index, count, error type) per rule, stage by stage, as for a listed schedule."""
    found = {}
    for index in range(current, len(ramp)):
        planned = dict.fromkeys(
            d for d in layout.planned_data_parallel_sizes if d != layout.data_parallel_size
        )
        sizes = [layout.data_parallel_size] + (list(planned) if index > current else [])
        for dp in sizes:
            error = stage_error(ramp[index], layout, dp)
            if error is None:
                continue
            unit = layout.micro_batch_size * dp
            batch = ramp.batch(index)
            rule = "zero" if batch < unit else "multiple" if batch % unit else "interleave"
            key = (rule, dp, index > current)
            first, count = found.get(key, (index, 0))
            found[key] = (first, count + 1)
    return sorted((first, count) for first, count in found.values())


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 24),
    st.integers(1, 60),
    st.integers(1, 4),
    st.integers(1, 8),
    st.sampled_from([(1, 1, None), (2, 2, None), (4, 2, None), (4, 2, 6), (3, 3, 5)]),
    st.data(),
)
def test_closed_form_problems_equal_stage_by_stage(
    start, increment, steps, mbs, dp, pipeline, data
):
    pp, vpp, group = pipeline
    ramp = RampStages(start, increment, 997, start + steps * increment)
    current = data.draw(st.integers(0, steps))
    planned = data.draw(st.lists(st.integers(1, 8), max_size=2))
    layout = CheckLayout.checked(mbs, dp, pp, vpp, planned, group)
    found = schedule_problems(ramp, current, layout)
    assert sorted((p.index, p.count) for p in found) == _brute_force(ramp, current, layout)
    for problem in found:
        assert problem.future == (problem.index > current)


def test_closed_form_checks_of_a_trillion_stages_are_instant():
    schedule = StepSchedule.from_rampup(16, 8, 300000, 10**12)
    start = time.perf_counter()
    found = schedule.problems(4, 6, pipeline_model_parallel_size=4, virtual_pipeline_size=2)
    assert time.perf_counter() - start < 1.0
    # b_k = 16 + 8k against MBS x DP = 24: k = 0 is below 24; b_k % 24 == 0 exactly for k = 1 (mod
    # 3), where M = 1 + t (k = 1 + 3t) runs interleaved only for M % 4 == 0.
    n = (10**12 - 16) // 8
    multiples = (n - 1) // 3 + 1
    assert [(p.index, p.count, type(p.error)) for p in found] == [
        (0, 1, ScheduleError),
        (1, multiples - multiples // 4, InterleaveError),
        (2, n - multiples, ScheduleError),
    ]
    assert str(found[2].error).endswith(f"(So do {n - multiples - 1:,} later stages of the ramp.)")
    others = n - multiples // 4 - 1 + 1
    with pytest.raises(ScheduleError, match=rf"\({others:,} more problems in later stages"):
        schedule.validate(4, 6, pipeline_model_parallel_size=4, virtual_pipeline_size=2)


def test_calculator_runs_a_long_ramp_in_constant_time_per_update():
    calc = StepScheduleCalculator.build(0, [8, 8, 10**9], 8 * 10**6, 8, 1)
    assert isinstance(calc.step_schedule.entries, RampStages) and len(calc.schedule) == 10**6
    calc.update(0, consistency_check=True)  # validates 1,000,001 stages in closed form
    start = time.perf_counter()
    for consumed in range(0, 10**9, 10**5):
        calc.update(consumed, consistency_check=True)
        assert calc.get_current_global_batch_size() == upstream_gbs(
            8, 8, 10**9, 8 * 10**6, consumed
        )
    assert time.perf_counter() - start < 1.0
    assert LISTED_RAMP < 10**6


def test_run_length_of_a_long_ramp_steps_through_the_stages_it_uses():
    """The calculator's plan (install's --train-samples): equal to stepping with upstream's
    arithmetic."""
    ramp = (8, 8, 10**9, 8 * 10**6)
    calc = StepScheduleCalculator.build(0, list(ramp[:3]), ramp[3], 8, 1)
    consumed, steps = 0, 0
    while consumed < 2 * 10**9:
        consumed += upstream_gbs(*ramp, consumed) // 8 * 8
        steps += 1
    start = time.perf_counter()
    assert calc.plan(2 * 10**9) == (steps, consumed)
    assert time.perf_counter() - start < 1.0
