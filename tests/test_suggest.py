"""The doubling rule (science/core/suggest.py): from a measured trace to a step schedule."""

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ga_ext.errors import NoiseScaleError, ScheduleError, SizeError, UsageError
from megatron_ga_ext.science.core.lr_windows import Frozen
from megatron_ga_ext.science.core.noise_trace import TraceRow, parse_trace, read_log, read_trace
from megatron_ga_ext.science.core.suggest import DoublingRule, suggest_schedule


def trace(*pairs):
    return [
        TraceRow(position=i, consumed_samples=c, b_simple_samples=b)
        for i, (c, b) in enumerate(pairs, 1)
    ]


RISING = trace(
    (0, 5),
    (1000, 70),
    (2000, 130),
    (3000, 200),
    (4000, 300),
    (5000, 600),
    (6000, 1200),
    (7000, 2500),
)


def rule(**kw):
    return DoublingRule(
        **{"micro_batch_size": 2, "data_parallel_size": 16, "max_global_batch_size": 4096, **kw}
    )


def test_doubles_where_the_estimate_passes_twice_the_batch():
    s = suggest_schedule(RISING, rule())
    assert s.schedule.stages == [
        (0, 32),
        (1000, 64),
        (2000, 128),
        (4000, 256),
        (5000, 512),
        (6000, 1024),
        (7000, 2048),
    ]
    assert [(d.row.consumed_samples, d.before, d.after) for d in s.decisions][:2] == [
        (1000, 32, 64),
        (2000, 64, 128),
    ]
    # 200 at 3000 is below 2 x 128: no doubling there
    assert all(d.row.consumed_samples != 3000 for d in s.decisions)


def test_one_doubling_per_row_even_after_a_jump():
    s = suggest_schedule(trace((100, 10_000), (200, 10_000), (300, 10_000)), rule())
    assert s.schedule.stages == [(0, 32), (100, 64), (200, 128), (300, 256)]


def test_trust_scales_the_estimate():
    cautious = suggest_schedule(RISING, rule(trust=0.5)).schedule.stages
    bold = suggest_schedule(RISING, rule(trust=2.0)).schedule.stages
    assert cautious[1] == (2000, 64) and cautious[-1] == (7000, 1024)
    assert bold[1] == (1000, 64) and bold[-1][1] == 4096


def test_the_cap_stops_doubling_and_says_so():
    s = suggest_schedule(RISING, rule(max_global_batch_size=300))
    assert s.schedule.stages[-1] == (4000, 256)
    assert s.held and all(h.reason == "the cap --max-global-batch-size 300" for h in s.held)


def test_no_stage_starts_in_the_warmup_or_the_final_decay():
    frozen = (
        Frozen(label="LR warmup", start=0, end=2500),
        Frozen(label="final decay", start=5500, end=None),
    )
    s = suggest_schedule(RISING, rule(frozen=frozen))
    assert s.schedule.stages == [(0, 32), (3000, 64), (4000, 128), (5000, 256)]
    assert {h.reason for h in s.held} == {"LR warmup", "final decay"}


def test_a_first_row_at_zero_sets_the_first_stage():
    s = suggest_schedule(trace((0, 100), (10, 1)), rule())
    assert s.schedule.stages == [(0, 64)]


def test_unmeasurable_rows_are_skipped():
    s = suggest_schedule(trace((100, None), (200, 80)), rule())
    assert s.schedule.stages == [(0, 32), (200, 64)]


@settings(max_examples=60, deadline=None)
@given(
    estimates=st.lists(st.one_of(st.none(), st.floats(0.1, 1e6)), min_size=1, max_size=40),
    gaps=st.lists(st.integers(1, 10_000), min_size=40, max_size=40),
    mbs=st.sampled_from([1, 2, 4]),
    dp=st.sampled_from([1, 3, 8]),
    start_units=st.integers(1, 4),
    cap_units=st.integers(4, 4096),
    trust=st.floats(0.1, 10),
    warmup=st.integers(0, 50_000),
    decay=st.one_of(st.none(), st.integers(0, 400_000)),
)
def test_every_suggestion_keeps_the_rules(
    estimates, gaps, mbs, dp, start_units, cap_units, trust, warmup, decay
):
    unit = mbs * dp
    consumed = [sum(gaps[:i]) for i in range(len(estimates))]
    frozen = (Frozen(label="w", start=0, end=warmup),) + (
        () if decay is None else (Frozen(label="d", start=decay, end=None),)
    )
    r = DoublingRule(
        micro_batch_size=mbs,
        data_parallel_size=dp,
        max_global_batch_size=cap_units * unit,
        initial_global_batch_size=start_units * unit,
        trust=trust,
        frozen=frozen,
    )
    s = suggest_schedule(trace(*zip(consumed, estimates)), r)
    stages = s.schedule.stages
    batches = [b for _, b in stages]
    assert all(b % unit == 0 for b in batches)
    assert all(later == 2 * earlier for earlier, later in itertools.pairwise(batches))
    assert batches[-1] <= max(cap_units * unit, start_units * unit)
    for threshold, _ in stages[1:]:
        assert not any(f.holds(threshold) for f in frozen)
    s.schedule.validate(mbs, dp)
    for d in s.decisions:
        assert d.trusted >= 2 * d.before and d.trusted == trust * d.row.b_simple_samples


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (
            {"initial_global_batch_size": 48},
            ScheduleError,
            (
                r"--global-batch-size 48 \(the first stage\) is not a multiple of "
                r"--micro-batch-size 2 x data-parallel size 16 = 32.*Nearest valid batch "
                r"sizes: 32, 64"
            ),
        ),
        (
            {"max_global_batch_size": 16},
            ScheduleError,
            r"--max-global-batch-size 16 is below the first stage's",
        ),
        ({"trust": 0}, UsageError, r"--trust 0 must be a positive finite number"),
        ({"trust": math.nan}, UsageError, r"--trust nan"),
        ({"micro_batch_size": 0}, SizeError, r"--micro-batch-size 0 must be at least 1"),
    ],
)
def test_a_bad_rule_is_refused(kw, error, match):
    with pytest.raises(error, match=match):
        rule(**kw)


def test_rows_out_of_order_are_refused():
    with pytest.raises(
        NoiseScaleError, match=r"trace row 2 has consumed_samples 100, not above row 1's 100"
    ):
        suggest_schedule(trace((100, 1), (100, 2)), rule())


# -- the trace format ----------------------------------------------------------------------


def test_json_list_object_and_lines_read_the_same():
    rows = [
        {"iteration": 1, "consumed_samples": 32, "b_simple_samples": 10.5},
        {"iteration": 2, "consumed_samples": 64, "b_simple_tokens": 4096, "grad_sq": 0.1},
    ]
    as_list = read_trace(json.dumps(rows), tokens_per_sample=1024)
    assert read_trace(json.dumps({"rows": rows}), 1024) == as_list
    assert read_trace("\n".join(map(json.dumps, rows)) + "\n", 1024) == as_list
    assert [r.b_simple_samples for r in as_list] == [10.5, 4.0] and as_list[1].iteration == 2


def test_samples_win_over_tokens_in_a_row_that_has_both():
    row = parse_trace([{"consumed_samples": 0, "b_simple_samples": 3, "b_simple_tokens": 99}], 1)[0]
    assert row.b_simple_samples == 3


@pytest.mark.parametrize(
    "data, error, match",
    [
        ({"rows": []}, NoiseScaleError, r"the trace is a JSON dict; give a list of rows"),
        (
            [{"consumed_samples": 0, "a": 1}],
            NoiseScaleError,
            r'has neither "b_simple_samples" nor "b_simple_tokens"',
        ),
        ("text", NoiseScaleError, r"the trace is a JSON str; give a list of rows"),
        ([], NoiseScaleError, r"the trace has no rows"),
        ([3], NoiseScaleError, r"trace row 1 is a JSON int"),
        ([{"b_simple_samples": 3}], NoiseScaleError, r"trace row 1 has no \"consumed_samples\""),
        (
            [{"consumed_samples": -1, "b_simple_samples": 3}],
            NoiseScaleError,
            r"consumed_samples -1 is not a whole",
        ),
        (
            [{"consumed_samples": 1.5, "b_simple_samples": 3}],
            NoiseScaleError,
            r"consumed_samples 1.5 is not a whole",
        ),
        (
            [{"consumed_samples": 0, "b_simple_samples": -3}],
            NoiseScaleError,
            r"b_simple_samples -3 is not a positive",
        ),
        ([{"consumed_samples": 0, "b_simple_samples": math.inf}], NoiseScaleError, r"write null"),
        (
            [{"consumed_samples": 0, "b_simple_samples": "12"}],
            NoiseScaleError,
            r"b_simple_samples '12'",
        ),
        (
            [{"consumed_samples": 0, "b_simple_tokens": 12}],
            UsageError,
            r"gives \"b_simple_tokens\" only: give --seq-length",
        ),
    ],
)
def test_a_malformed_trace_is_refused(data, error, match):
    with pytest.raises(error, match=match):
        parse_trace(data)


def test_text_that_is_not_json_names_its_line():
    with pytest.raises(NoiseScaleError, match=r"neither JSON nor JSON Lines: line 2"):
        read_trace('{"consumed_samples": 0, "b_simple_samples": 1}\n{oops\n')


@pytest.mark.parametrize(
    "text, match",
    [
        ("[" * 100_000, r"line 1: RecursionError"),
        (
            '[{"consumed_samples": ' + "1" * 5000 + ', "b_simple_samples": 1}]',
            r"line 1: ValueError: Exceeds the limit",
        ),
        (
            '[{"consumed_samples": 1, "b_simple_samples": 1' + "0" * 400 + "}]",
            r"100000000000\.\.\. \(401 digits\)",
        ),
        (
            '[{"consumed_samples": 1' + "0" * 31 + ', "b_simple_samples": 1}]',
            r"not a whole number from 0 to 10\*\*30",
        ),
        (
            '[{"consumed_samples": 1, "b_simple_samples": NaN}]',
            r"b_simple_samples nan is not a positive finite",
        ),
    ],
)
def test_hostile_text_is_refused_in_one_line(text, match):
    with pytest.raises(NoiseScaleError, match=match):
        read_trace(text)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4)
    ),
    max_leaves=12,
)
ROW = st.fixed_dictionaries(
    {"consumed_samples": JSON | st.integers(0, 10**6)},
    optional={
        "b_simple_samples": JSON | st.floats(0, 1e6),
        "b_simple_tokens": JSON,
        "iteration": JSON,
    },
)


@settings(max_examples=150, deadline=None)
@given(st.one_of(JSON, st.lists(ROW, max_size=5), st.text(max_size=40)))
def test_any_json_is_read_or_refused_with_a_typed_error(data):
    """Whatever the file holds, the reader returns typed rows or raises a GAError: nothing else
    escapes."""
    text = data if isinstance(data, str) else json.dumps(data)
    try:
        rows = read_trace(text, tokens_per_sample=128.0)
    except (NoiseScaleError, UsageError):
        return
    assert all(
        isinstance(r.consumed_samples, int)
        and (r.b_simple_samples is None or r.b_simple_samples > 0)
        for r in rows
    )


def megatron_line(iteration: int, consumed: int) -> str:
    return (
        f" [2026-12-02 08:12:50] iteration {iteration:8d}/      10 | consumed samples: "
        f"{consumed:12d} | elapsed time per iteration (ms): 302.9 | global batch size:   "
        " 16 | lm loss: 6.31E+00 |"
    )


def noise_line(iteration: int, samples: str, consumed: int | str | None = None) -> str:
    """The extension's line; ``consumed`` None: as an older release printed it, without its consumed
    samples."""
    end = (
        ""
        if consumed is None
        else f" loss tokens: 898 over 2 replicas | consumed samples: {consumed} |"
    )
    return (
        f" megatron-ga-ext noise scale | iteration {iteration} | B_simple (EMA): 9.7495E+00 "
        f"tokens, {samples} "
        "samples | |G|^2: 6.5495E+00 (EMA 1.0023E+01) | tr(Sigma): 5.0895E+01 (EMA 9.7714E+01) "
        f"|{end}"
    )


def test_a_run_log_gives_the_rows_the_later_copy_of_a_resumed_iteration_kept():
    lines = [
        megatron_line(1, 16),
        noise_line(1, "n/a"),
        "some other line",
        megatron_line(2, 32),
        noise_line(2, "1.5000E+01"),
        megatron_line(3, 48),
        noise_line(3, "2.0000E+01"),
        # resumed from iteration 2: iteration 3 again
        megatron_line(3, 48),
        noise_line(3, "2.5000E+01"),
    ]
    rows = read_log(lines)
    assert [(r.iteration, r.consumed_samples, r.b_simple_samples) for r in rows] == [
        (1, 16, None),
        (2, 32, 15.0),
        (3, 48, 25.0),
    ]


def test_a_log_measured_between_megatrons_lines_is_read_from_the_noise_lines():
    """--log-interval 10 --ga-noise-scale 5: Megatron logs iterations 10 and 20 only; each
    noise-scale line gives its own consumed samples (and is read before Megatron's line of the
    iteration too)."""
    lines = []
    for iteration in range(5, 25, 5):
        if iteration % 10 == 0:
            lines.append(megatron_line(iteration, 16 * iteration))
        lines.append(noise_line(iteration, f"{iteration}.0E+00", 16 * iteration))
    lines.insert(
        0, noise_line(1, "n/a", "n/a")
    )  # consumed samples unknown (no Megatron args): Megatron's line's
    lines.insert(0, megatron_line(1, 16))
    rows = read_log(lines)
    assert [(r.iteration, r.consumed_samples, r.b_simple_samples) for r in rows] == [
        (1, 16, None),
        (5, 80, 5.0),
        (10, 160, 10.0),
        (15, 240, 15.0),
        (20, 320, 20.0),
    ]
    rows = read_log(
        [noise_line(3, "1.0E+00", 48), megatron_line(3, 48)]
    )  # the line's own, before Megatron's
    assert [(r.iteration, r.consumed_samples) for r in rows] == [(3, 48)]


def test_a_log_without_noise_lines_or_out_of_order_is_refused():
    with pytest.raises(
        NoiseScaleError, match='no "megatron-ga-ext noise scale" line: run with --ga-noise-scale K'
    ):
        read_log([megatron_line(1, 16)])
    # an older release's line, without its consumed samples, measured where Megatron logs no line
    with pytest.raises(
        NoiseScaleError,
        match="log line 1: the noise scale of iteration 1 gives no consumed samples "
        "and comes before Megatron's line of that iteration",
    ):
        read_log([noise_line(1, "1.0E+00"), megatron_line(1, 16)])
