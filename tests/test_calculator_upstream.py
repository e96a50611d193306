"""Equality with upstream's calculators, each on the leg whose megatron-core has it.

* Python 3.12 leg (megatron-core 0.19.2): ``StepBatchsizeNumMicroBatchesCalculator`` (0.18+) against
  StepSchedule / StepScheduleCalculator: parsing, (GBS, num_microbatches) at every update, and
  upstream's own unit tests run against our class.
* Python 3.11 leg (megatron-core 0.16.1): ``RampupBatchsizeNumMicroBatchesCalculator`` against
  ``StepSchedule.from_rampup`` at every consumed-sample count of several ramps, past their end.

The upstream module is loaded from the installed wheel's file on its own: it imports only logging,
abc and typing, and ``import megatron.core`` would cost 5-12 s of torch import per test process.
"""

import contextlib
import importlib.util
import logging
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ga_ext import StepSchedule
from megatron_ga_ext.errors import BatchSizeError, GAError, ScheduleError
from megatron_ga_ext.integration.calculator import StepScheduleCalculator


def _load_upstream() -> ModuleType | None:
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root, "core", "num_microbatches_calculator.py")
        if path.exists():
            module_spec = importlib.util.spec_from_file_location(
                "_upstream_num_microbatches_calculator", path
            )
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
    return None


UPSTREAM = _load_upstream()
logging.getLogger("_upstream_num_microbatches_calculator").setLevel(logging.WARNING)

needs_step = pytest.mark.skipif(
    not hasattr(UPSTREAM, "StepBatchsizeNumMicroBatchesCalculator"),
    reason="StepBatchsizeNumMicroBatchesCalculator exists from megatron-core 0.18 (the Python "
    "3.12 leg)",
)
needs_rampup = pytest.mark.skipif(
    not hasattr(UPSTREAM, "RampupBatchsizeNumMicroBatchesCalculator"),
    reason="RampupBatchsizeNumMicroBatchesCalculator exists up to megatron-core 0.17 (the Python "
    "3.11 leg)",
)


def upstream_refuses(text: str):
    """Upstream validates a schedule with assert, which python -O strips: there it accepts what it
    refuses otherwise (an empty schedule fails as an IndexError), while ours still raises."""
    if __debug__:
        return pytest.raises(AssertionError)
    return (
        pytest.raises(IndexError)
        if not text.replace(",", " ").split()
        else contextlib.nullcontext()
    )


def test_the_leg_has_one_of_the_two():
    assert UPSTREAM is not None, "megatron-core is not installed"
    assert hasattr(UPSTREAM, "StepBatchsizeNumMicroBatchesCalculator") or hasattr(
        UPSTREAM, "RampupBatchsizeNumMicroBatchesCalculator"
    )


# -- 0.18+: step schedules ---------------------------------------------------------------------


def _upstream_step(schedule: str, mbs: int, dp: int, seq_length: int | None = None):
    return UPSTREAM.StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size=mbs,
        data_parallel_size=dp,
        decrease_batch_size_if_needed=False,
        rank=1,
        schedule=schedule,
        seq_length=seq_length,
    )


@st.composite
def schedules(draw):
    """A schedule upstream handles correctly: thresholds increasing from 0, batch sizes >= 1, plain
    or suffixed."""
    count = draw(st.integers(1, 6))
    gaps = draw(st.lists(st.integers(1, 5000), min_size=count - 1, max_size=count - 1))
    thresholds = [0]
    for gap in gaps:
        thresholds.append(thresholds[-1] + gap)
    batches = draw(st.lists(st.integers(1, 512), min_size=count, max_size=count))
    spell = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    parts = []
    for t, b, suffixed in zip(thresholds, batches, spell):
        text = f"{t // 1000}k" if suffixed and t % 1000 == 0 and t else str(t)
        parts.append(f"{text}:{b}")
    return " ".join(parts)


@needs_step
@settings(max_examples=150, deadline=None)
@given(
    schedules(), st.sampled_from([None, 1, 7, 100]), st.integers(1, 8), st.integers(1, 8), st.data()
)
def test_parse_and_updates_equal_upstream(text, seq_length, mbs, dp, data):
    try:
        ours = StepScheduleCalculator(StepSchedule.parse(text, seq_length), mbs, dp, rank=1)
    except GAError:
        # Only token thresholds that collapse are refused (upstream asserts too).
        with upstream_refuses(text):
            _upstream_step(text, mbs, dp, seq_length)
        return
    theirs = _upstream_step(text, mbs, dp, seq_length)
    assert ours.schedule == theirs.schedule
    assert ours.global_batch_size == theirs.global_batch_size
    assert StepSchedule.parse(str(ours.step_schedule), seq_length).stages == theirs.schedule
    assert theirs._parse_schedule(str(ours.step_schedule), seq_length) == theirs.schedule
    last = theirs.schedule[-1][0]
    for consumed in sorted(data.draw(st.lists(st.integers(0, last + 100), max_size=30))) + [
        0,
        last,
        last + 1,
    ]:
        ours.update(consumed, consistency_check=False)
        theirs.update(consumed, consistency_check=False)
        assert (
            ours.get(),
            ours.get_current_global_batch_size(),
            ours.get_current_running_global_batch_size(),
        ) == (
            theirs.get(),
            theirs.get_current_global_batch_size(),
            theirs.get_current_running_global_batch_size(),
        )


@needs_step
@settings(max_examples=100, deadline=None)
@given(schedules(), st.integers(1, 4), st.integers(1, 4), st.data())
def test_checked_updates_agree_or_fail_earlier(text, mbs, dp, data):
    """Where upstream's checked update passes on a valid run, ours gives the same numbers; where
    upstream would assert at some stage, ours has raised an AssertionError no later (at the first
    checked update)."""
    ours = StepScheduleCalculator(StepSchedule.parse(text), mbs, dp, rank=1)
    theirs = _upstream_step(text, mbs, dp)
    ours_failed = False
    for consumed in sorted(
        data.draw(st.lists(st.integers(0, theirs.schedule[-1][0] + 10), min_size=1, max_size=20))
    ):
        try:
            theirs.update(consumed, consistency_check=True)
        except AssertionError:
            if not ours_failed:
                with pytest.raises(
                    (ScheduleError, BatchSizeError), match="--step-batch-size-schedule entry"
                ):
                    ours.update(consumed, consistency_check=True)
            return
        if ours_failed:
            continue
        try:
            ours.update(consumed, consistency_check=True)
        except (ScheduleError, BatchSizeError):
            ours_failed = True  # a later stage is bad (divisibility, 0 micro-batches or a decrease)
            continue
        assert (ours.get(), ours.get_current_global_batch_size()) == (
            theirs.get(),
            theirs.get_current_global_batch_size(),
        )


@needs_step
def test_known_upstream_float_truncation_is_where_we_differ():
    assert _upstream_step("0:8 2.01K:16", 1, 8).schedule == [(0, 8), (2009, 16)]
    assert StepSchedule.parse("0:8 2.01K:16").stages == [(0, 8), (2010, 16)]
    assert _upstream_step("0:16.9", 1, 8).schedule == [(0, 16)]  # ours: ScheduleParseError


@needs_step
def test_upstream_unit_tests_pass_against_our_class():
    """Upstream's tests for StepBatchsizeNumMicroBatchesCalculator (tests/unit_tests/
    test_num_microbatches_calculator.py), with the class swapped for ours."""
    calc = StepScheduleCalculator.from_megatron(
        micro_batch_size=1,
        data_parallel_size=512,
        decrease_batch_size_if_needed=False,
        rank=0,
        schedule="0:256 200000:512 600000:1024 1500000:2048 3000000:4096 6000000:6144",
    )
    assert calc.current_global_batch_size == 256
    calc.update(200000, consistency_check=True)
    assert calc.current_global_batch_size == 512
    assert calc.num_micro_batches == 1
    calc.update(1500000, consistency_check=True)
    assert calc.current_global_batch_size == 2048
    assert calc.num_micro_batches == 4
    calc.update(6000000, consistency_check=True)
    assert calc.current_global_batch_size == 6144
    assert calc.num_micro_batches == 12

    calc = StepScheduleCalculator.from_megatron(
        micro_batch_size=1,
        data_parallel_size=512,
        decrease_batch_size_if_needed=False,
        rank=0,
        schedule="0:256 200000:512 600000:1024",
    )
    with pytest.raises(ScheduleError, match=r"entry 1 '0:256' .* gives 0 micro-batches per step"):
        calc.update(0, consistency_check=True)

    with pytest.raises(ScheduleError, match="--decrease-batch-size-if-needed cannot be combined"):
        StepScheduleCalculator.from_megatron(
            micro_batch_size=1,
            data_parallel_size=512,
            decrease_batch_size_if_needed=True,
            rank=0,
            schedule="0:256 200000:512 600000:1024",
        )


@needs_step
@pytest.mark.parametrize("text", ["", "10:8", "0:8 0:16", "0:0", "-5:4 0:8", "0:8 100:16 5000:32"])
def test_upstream_assertion_errors_stay_assertion_errors(text):
    seq_length = 4096 if text == "0:8 100:16 5000:32" else None
    with upstream_refuses(text):
        _upstream_step(text, 1, 8, seq_length)
    with pytest.raises(ScheduleError, match="--step-batch-size-schedule") as info:
        StepScheduleCalculator.from_megatron(1, 8, False, 0, text, seq_length)
    assert isinstance(info.value, AssertionError)  # what upstream raised, for its callers


# -- 0.16.1: rampup ----------------------------------------------------------------------------

RAMPS = [
    (16, 8, 300000, 1024),  # Megatron's docs example: 126 increments of 2380.95... samples
    (16, 16, 96, 32),  # upstream's own test_ramp_up
    (16, 16, 48, 32),
    (1, 1, 7, 10),
    (5, 5, 3, 100),  # more increments than samples: several per sample
    (3, 2, 1000, 21),
    (7, 3, 10, 100),
    (2, 1, 99991, 1000),  # a prime number of samples
    (8, 8, 1, 64),
]


def _upstream_rampup(start, increment, ramp, gbs, mbs=1, dp=1):
    return UPSTREAM.RampupBatchsizeNumMicroBatchesCalculator(
        gbs, mbs, dp, False, 1, start, increment, ramp
    )


@needs_rampup
@pytest.mark.parametrize("ramp", RAMPS, ids=[":".join(map(str, r)) for r in RAMPS])
def test_rampup_equal_at_every_consumed_count(ramp):
    *_, ramp_samples, gbs = ramp
    ours = StepSchedule.from_rampup(*ramp)
    theirs = _upstream_rampup(*ramp)
    for consumed in range(0, ramp_samples + 2 * gbs + 2):
        theirs.update(consumed, consistency_check=False)
        assert ours.global_batch_size_at(consumed) == theirs.get_current_global_batch_size(), (
            consumed
        )


@needs_rampup
@pytest.mark.parametrize(
    "ramp", [(16, 8, 10**15 + 7, 1024), (1, 1, 3 * 10**12 + 1, 4097), (32, 32, 2**53 + 3, 2048)]
)
def test_rampup_equal_around_every_boundary_of_huge_ramps(ramp):
    """Where float rounding matters most: at and next to every stage boundary, and past the end."""
    ours = StepSchedule.from_rampup(*ramp)
    theirs = _upstream_rampup(*ramp)
    probes = {c + d for c, _ in ours.stages for d in (-2, -1, 0, 1, 2)} | {
        ramp[2] + d for d in range(-3, 5)
    }
    for consumed in sorted(p for p in probes if p >= 0):
        theirs.update(consumed, consistency_check=False)
        assert ours.global_batch_size_at(consumed) == theirs.get_current_global_batch_size(), (
            consumed
        )


@needs_rampup
@pytest.mark.parametrize(
    "ramp",
    [
        (1, 1, 10**6, 10**12),
        (16, 8, 300000, 10**12),
        (1, 1, 10**15, 10**12),
        (3, 2, 10**12 + 7, 2 * 10**5 + 3),
        (7, 3, 2**53 + 5, 7 + 3 * 50000),
    ],
)
def test_long_ramps_described_not_listed_equal_upstream(ramp):
    """Ramps of more than 10,000 increments (RampStages): random counts and both sides of sampled
    boundaries."""
    import random

    ours = StepSchedule.from_rampup(*ramp)
    assert len(ours.stages) > 10_000
    theirs = _upstream_rampup(*ramp)
    rng = random.Random(0)
    probes = {rng.randrange(0, ramp[2] + 10) for _ in range(2000)}
    for k in rng.sample(range(1, len(ours.stages)), 100):
        threshold = ours.stages[k][0]
        probes |= {threshold - 1, threshold, threshold + 1}
    for consumed in sorted(p for p in probes if p >= 0):
        theirs.update(consumed, consistency_check=False)
        assert ours.global_batch_size_at(consumed) == theirs.get_current_global_batch_size(), (
            consumed
        )


@needs_rampup
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16), st.integers(0, 40), st.integers(1, 3000))
def test_rampup_equal_random(start, increment, steps, ramp_samples):
    gbs = start + steps * increment
    if steps == 0:
        with pytest.raises(
            ZeroDivisionError
        ):  # upstream cannot build an empty ramp; ours is the constant
            _upstream_rampup(start, increment, ramp_samples, gbs)
        assert StepSchedule.from_rampup(start, increment, ramp_samples, gbs).stages == [(0, gbs)]
        return
    ours = StepSchedule.from_rampup(start, increment, ramp_samples, gbs)
    theirs = _upstream_rampup(start, increment, ramp_samples, gbs)
    for consumed in range(0, ramp_samples + 3):
        theirs.update(consumed, consistency_check=False)
        assert ours.global_batch_size_at(consumed) == theirs.get_current_global_batch_size(), (
            consumed
        )


@needs_rampup
def test_upstream_divides_by_zero_where_we_return_the_constant():
    with pytest.raises(ZeroDivisionError):
        _upstream_rampup(16, 8, 0, 1024)
    assert StepSchedule.from_rampup(16, 8, 0, 1024).stages == [(0, 1024)]


@needs_rampup
def test_calculator_equals_rampup_calculator_through_training():
    """The training loop (consumed += DP x MBS x M; checked update) with both calculators, past the
    ramp."""
    for start, increment, ramp_samples, gbs, mbs, dp in [
        (16, 8, 300000, 1024, 4, 2),
        (16, 16, 96, 32, 8, 2),
        (32, 32, 5000, 512, 2, 16),
    ]:
        ours = StepScheduleCalculator.build(0, [start, increment, ramp_samples], gbs, mbs, dp)
        theirs = _upstream_rampup(start, increment, ramp_samples, gbs, mbs, dp)
        consumed = 0
        while consumed < ramp_samples + 5 * gbs:
            ours.update(consumed, consistency_check=True)
            theirs.update(consumed, consistency_check=True)
            assert (ours.get(), ours.get_current_global_batch_size()) == (
                theirs.get(),
                theirs.get_current_global_batch_size(),
            )
            consumed += dp * mbs * ours.get()


@needs_rampup
def test_upstream_ramp_up_test_against_our_calculator():
    """Upstream 0.16.1's test_ramp_up ([16, 16, 96], GBS 32, MBS 8, DP 2) with our calculator."""
    calc = StepScheduleCalculator.build(0, [16, 16, 96], 32, 8, 2)
    consumed_samples, count = 0, 0
    expected = [0, 16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256]
    while consumed_samples < 256:
        consumed_samples += calc.get_current_global_batch_size()
        count += 1
        assert consumed_samples == expected[count]
        calc.update(consumed_samples, True)
