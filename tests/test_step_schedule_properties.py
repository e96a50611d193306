"""StepSchedule's properties: exact numbers, and the accounting of a run stepping through a schedule
(the parser's round trips and typed errors on any text: tests/test_fuzz.py's schedule_parser
surface)."""

from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_ga_ext import StepSchedule
from megatron_ga_ext.core.numbers import SUFFIXES, parse_count
from megatron_ga_ext.errors import ScheduleParseError
from megatron_ga_ext.integration.calculator import StepScheduleCalculator


@st.composite
def valid_runs(draw):
    """(schedule, MBS, DP): every stage a multiple of MBS x DP, never decreasing."""
    mbs, dp = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    unit = mbs * dp
    count = draw(st.integers(1, 6))
    multiples = sorted(draw(st.lists(st.integers(1, 16), min_size=count, max_size=count)))
    gaps = draw(st.lists(st.integers(1, 40 * unit), min_size=count - 1, max_size=count - 1))
    thresholds = [0]
    for gap in gaps:
        thresholds.append(thresholds[-1] + gap)
    schedule = StepSchedule.from_stages([(t, m * unit) for t, m in zip(thresholds, multiples)])
    return schedule, mbs, dp


def _training_loop(
    schedule: StepSchedule, mbs: int, dp: int, train_samples: int, consumed: int = 0
):
    """What Megatron's loop does: update, run a step of DP x MBS x num_microbatches, repeat."""
    calculator = StepScheduleCalculator(schedule, mbs, dp)
    seen = []
    while consumed < train_samples:
        calculator.update(consumed, consistency_check=True)
        seen.append((consumed, calculator.get_current_global_batch_size(), calculator.get()))
        consumed += dp * mbs * calculator.get()
    return seen, consumed


@settings(max_examples=150, deadline=None)
@given(valid_runs(), st.integers(1, 5000))
def test_iteration_count_and_table_match_the_training_loop(run, train_samples):
    schedule, mbs, dp = run
    seen, final = _training_loop(schedule, mbs, dp, train_samples)
    rows = schedule.table(mbs, dp, train_samples=train_samples)
    assert schedule.iterations(mbs, dp, train_samples) == len(seen) == sum(r.steps for r in rows)
    assert sum(r.samples for r in rows) == final
    # no sample skipped or counted twice: every step starts where the previous ended
    starts = [c for c, _, _ in seen]
    assert starts == [0] + [c + g for c, g, _ in seen[:-1]]
    assert final - seen[-1][1] < train_samples <= final
    # each row's first step is the loop's first step in that stage
    for row in rows:
        if row.steps:
            assert seen[row.first_step][0] == row.first_sample
            assert seen[row.first_step][1] == row.global_batch_size
    assert [
        (s.consumed_samples, s.global_batch_size, s.num_microbatches)
        for s in schedule.iter_steps(mbs, dp, train_samples=train_samples)
    ] == seen
    assert schedule.run_totals(mbs, dp, train_samples) == (len(seen), final)
    assert StepScheduleCalculator(schedule, mbs, dp).plan(train_samples) == (len(seen), final)


@settings(max_examples=150, deadline=None)
@given(valid_runs(), st.integers(1, 3000), st.data())
def test_resume_at_any_step_boundary_reproduces_the_rest(run, train_samples, data):
    schedule, mbs, dp = run
    seen, final = _training_loop(schedule, mbs, dp, train_samples)
    k = data.draw(st.integers(0, len(seen)))
    resume_at = seen[k][0] if k < len(seen) else final
    rest, final_again = _training_loop(schedule, mbs, dp, train_samples, consumed=resume_at)
    assert rest == seen[k:] and final_again == final


@settings(max_examples=150, deadline=None)
@given(valid_runs(), st.integers(0, 3000), st.integers(1, 5000))
def test_table_from_any_consumed_count_matches_the_training_loop(run, consumed, train_samples):
    schedule, mbs, dp = run
    seen, final = _training_loop(schedule, mbs, dp, train_samples, consumed=consumed)
    rows = schedule.table(mbs, dp, train_samples=train_samples, consumed_samples=consumed)
    assert sum(r.steps or 0 for r in rows) == len(seen)
    assert consumed + sum(r.samples or 0 for r in rows) == final
    for row in rows:
        if row.steps:
            assert seen[row.first_step][:2] == (row.first_sample, row.global_batch_size)


@settings(max_examples=200, deadline=None)
@given(valid_runs(), st.integers(0, 10**6))
def test_lookup_matches_a_linear_scan(run, consumed):
    schedule = run[0]
    expected = [b for t, b in schedule.stages if t <= consumed][-1]
    assert schedule.global_batch_size_at(consumed) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.decimals(min_value=0, max_value=10**9, places=6, allow_nan=False, allow_infinity=False),
    st.sampled_from([""] + sorted(SUFFIXES)),
    st.booleans(),
)
def test_numbers_are_exact(number, suffix, lower):
    text = f"{number}{suffix.lower() if lower else suffix}"
    expected = Fraction(Decimal(str(number))) * SUFFIXES.get(suffix, 1)
    assert parse_count(text) == expected


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(1, 16),
    st.integers(1, 30),
    st.integers(0, 5000),
    st.integers(1, 4),
)
def test_rampup_schedule_is_monotone_and_ends_at_gbs(start, increment, steps, ramp_samples, dp):
    gbs = start + steps * increment
    schedule = StepSchedule.from_rampup(start, increment, ramp_samples, gbs)
    batches = [b for _, b in schedule.stages]
    assert batches == sorted(set(batches)) and batches[-1] == gbs
    assert schedule.global_batch_size_at(ramp_samples + 1) == gbs
    assume(ramp_samples > 0)
    assert schedule.global_batch_size_at(0) == start


@pytest.mark.parametrize(
    "text, match",
    [("0:8 1e-1000000000:16", "decimal places"), ("0:8 1e1000000000:16", "larger than 1e30")],
)
def test_extreme_exponents_are_refused(text, match):
    with pytest.raises(ScheduleParseError, match=match):
        StepSchedule.parse(text)
