"""StepSchedule: exact parsing, every error by type and message, validation, rampup conversion,
tables."""

import itertools
import warnings

import pytest

from megatron_ga_ext import StepSchedule
from megatron_ga_ext.core.numbers import format_count, upstream_count
from megatron_ga_ext.core.schedule.stages import Stage
from megatron_ga_ext.errors import (
    GAError,
    InterleaveError,
    ScheduleError,
    ScheduleParseError,
    ScheduleWarning,
    SizeError,
)

# -- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, stages",
    [
        ("0:8", [(0, 8)]),
        ("0:8 2.01K:16", [(0, 8), (2010, 16)]),
        ("0:8,100:16 , 1k:32", [(0, 8), (100, 16), (1000, 32)]),
        ("0:8 1e3:16 +2000:32", [(0, 8), (1000, 16), (2000, 32)]),
        (
            "0:8 9007199254740993:16",
            [(0, 8), (9007199254740993, 16)],
        ),  # above 2**53: exact, unlike float
        ("  0:768\t61035156:1536\n", [(0, 768), (61035156, 1536)]),
    ],
)
def test_parse_reads_exact_values(text, stages):
    assert StepSchedule.parse(text).stages == stages


def test_decimal_suffix_is_exact_where_upstream_float_is_not():
    assert StepSchedule.parse("0:8 2.01K:16").stages[1][0] == 2010
    assert upstream_count("2.01K") == 2009  # what megatron-core >= 0.18 reads


def test_suffix_cases_and_both_sides():
    assert StepSchedule.parse("0:1K 1.5m:2k 2B:4K 3t:8k").stages == [
        (0, 1000),
        (1_500_000, 2000),
        (2_000_000_000, 4000),
        (3_000_000_000_000, 8000),
    ]


def test_token_thresholds_floor_to_samples_like_upstream():
    schedule = StepSchedule.parse("0:768 250B:1536 500B:3072 750B:6144", seq_length=4096)
    assert schedule.stages == [(0, 768), (61035156, 1536), (122070312, 3072), (183105468, 6144)]
    assert [s.threshold_tokens for s in schedule.entries] == [
        0,
        250 * 10**9,
        500 * 10**9,
        750 * 10**9,
    ]
    assert str(schedule) == "0:768 250B:1536 500B:3072 750B:6144"
    assert schedule.samples_string() == "0:768 61035156:1536 122070312:3072 183105468:6144"


E = "--step-batch-size-schedule entry"


@pytest.mark.parametrize(
    "text, seq_length, error, message",
    [
        (
            "0:8 100:16.5",
            None,
            ScheduleParseError,
            rf"{E} 2 '100:16.5': batch size '16.5' = 16.5 is not a whole number of samples "
            r"\(upstream would silently truncate it to 16\); write 16 or 17",
        ),
        (
            "0:8 1.5:16",
            None,
            ScheduleParseError,
            rf"{E} 2 '1.5:16': threshold '1.5' = 1.5 is not a whole number of samples; write 1 "
            r"or 2",
        ),
        (
            "0:8 1.5:16",
            4096,
            ScheduleParseError,
            r"threshold '1.5' = 1.5 is not a whole number of tokens",
        ),
        (
            "0:nan",
            None,
            ScheduleParseError,
            rf"{E} 1 '0:nan': batch size 'nan' is not a finite number",
        ),
        (
            "0:8 NaN:16",
            None,
            ScheduleParseError,
            rf"{E} 2 'NaN:16': threshold 'NaN' is not a finite number",
        ),
        (
            "0:8 inf:16",
            None,
            ScheduleParseError,
            rf"{E} 2 'inf:16': threshold 'inf' is not a finite number",
        ),
        ("0:-Infinity", None, ScheduleParseError, r"batch size '-Infinity' is not a finite number"),
        (
            "0:8 1000:nan5",
            None,
            ScheduleParseError,
            rf"{E} 2 '1000:nan5': batch size 'nan5' is not a finite number",
        ),
        (
            "0:snan1",
            None,
            ScheduleParseError,
            rf"{E} 1 '0:snan1': batch size 'snan1' is not a finite number",
        ),
        (
            "0:8 -nan2:16",
            None,
            ScheduleParseError,
            rf"{E} 2 '-nan2:16': threshold '-nan2' is not a finite number",
        ),
        ("0:8 -sNaN:16", None, ScheduleParseError, r"threshold '-sNaN' is not a finite number"),
        ("0:8 nanK:16", None, ScheduleParseError, r"threshold 'nanK' is not a finite number"),
        (
            "0:8 -100:16",
            None,
            ScheduleError,
            rf"{E} 2 '-100:16': threshold '-100' is negative.*use >= 0",
        ),
        ("0:-8", None, ScheduleError, rf"{E} 1 '0:-8': batch size '-8' is negative"),
        (
            "0:8 1G:16",
            None,
            ScheduleParseError,
            rf"{E} 2 '1G:16': threshold '1G' has an unknown suffix 'G'; the suffixes are K "
            r"\(1e3\), M \(1e6\), B \(1e9\) and T \(1e12\)",
        ),
        (
            "0:8 100:abc",
            None,
            ScheduleParseError,
            rf"{E} 2 '100:abc': batch size 'abc' is not a number",
        ),
        ("0:8 1e400:16", None, ScheduleParseError, r"threshold '1e400' is larger than 1e30"),
        (
            "",
            None,
            ScheduleError,
            r"--step-batch-size-schedule is empty; give at least one THRESHOLD:BATCH_SIZE entry",
        ),
        (" , ", None, ScheduleError, r"--step-batch-size-schedule is empty"),
        (
            "100:8 200:16",
            None,
            ScheduleError,
            rf"{E} 1 '100:8' \(from 100 samples, global batch size 8\) is the first entry but "
            r"its threshold is not 0.*Begin the schedule with '0:8'",
        ),
        (
            "100:8",
            4096,
            ScheduleError,
            r"^--step-batch-size-schedule entry 1 '100:8' \(from 100 tokens = 0 samples, global "
            r"batch size 8\) is the first entry; its threshold of 100 tokens becomes 0 "
            r"samples \(100 // --seq-length 4096\), the start of training, but the first "
            r"threshold must be written as 0\. Write '0:8'\.$",
        ),
        (
            "8192:8",
            4096,
            ScheduleError,
            r"entry 1 '8192:8' \(from 8,192 tokens = 2 samples.*threshold is not 0, so no batch "
            r"size is set for the start of training",
        ),
        (
            "0:8 300:32 200:16",
            None,
            ScheduleError,
            rf"{E} 3 '200:16' \(from 200 samples, global batch size 16\) comes after entry 2 "
            r"'300:32', whose threshold is larger.*upstream would sort them silently.*'0:8 "
            r"200:16 300:32'",
        ),
        (
            "0:8 1K:16 1000:32",
            None,
            ScheduleError,
            rf"{E} 3 '1000:32' .* repeats the threshold of entry 2 '1K:16'.*Drop one of the two",
        ),
        (
            "0:8 0:16",
            None,
            ScheduleError,
            rf"{E} 2 '0:16' .* repeats the threshold of entry 1 '0:8'",
        ),
        (
            "0:8 5000:16 6000:32",
            4096,
            ScheduleError,
            rf"{E} 3 '6000:32' \(from 6,000 tokens = 1 samples, global batch size 32\) and entry "
            r"2 '5000:16' both become sample threshold 1 with --seq-length 4096 \(tokens // "
            r"seq_length\).*at least 8192 tokens",
        ),
        (
            "0:8 100:16",
            4096,
            ScheduleError,
            rf"{E} 2 '100:16' .* and entry 1 '0:8' both become sample threshold 0",
        ),
        ("0:8 100", None, ScheduleParseError, rf"{E} 2 '100' is not THRESHOLD:BATCH_SIZE"),
        ("0:8:16", None, ScheduleParseError, rf"{E} 1 '0:8:16' is not THRESHOLD:BATCH_SIZE"),
        ("0:8 100:", None, ScheduleParseError, rf"{E} 2 '100:' is not THRESHOLD:BATCH_SIZE"),
        (
            "0:0",
            None,
            ScheduleError,
            rf"{E} 1 '0:0': batch size is 0; every stage needs a global batch size >= 1",
        ),
    ],
)
def test_parse_errors_name_entry_position_and_fix(text, seq_length, error, message):
    with pytest.raises(error, match=message) as caught:
        StepSchedule.parse(text, seq_length=seq_length)
    assert type(caught.value) is error  # pytest.raises also passes a subclass


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "is empty"),
        ("10:8", "is the first entry but its threshold is not 0"),
        ("0:8 0:16", "repeats the threshold of entry 1"),
        ("0:0", "batch size is 0"),
        ("-5:4 0:8", "threshold '-5' is negative"),
        ("0:8 100:16 200:8 150:4", "comes after entry 3 '200:8', whose threshold is larger"),
    ],
)
def test_semantic_errors_also_catchable_as_assertion_error_like_upstream(text, match):
    with pytest.raises(ScheduleError, match=match) as info:
        StepSchedule.parse(text)
    assert isinstance(info.value, AssertionError)  # what upstream's callers catch


def test_non_string_and_bad_seq_length():
    with pytest.raises(ScheduleParseError, match="must be a string"):
        StepSchedule.parse(None)  # type: ignore[arg-type]
    with pytest.raises(SizeError, match="--seq-length 0 must be at least 1"):
        StepSchedule.parse("0:8", seq_length=0)


@pytest.mark.parametrize(
    "text, seq_length",
    [
        ("0:8 2.01K:16 1M:32", None),
        ("0:768 250B:1536 500.5B:3072", 4096),
        ("0:8 9007199254740992:16", None),
        ("0:16 123456789:32 1T:64", None),
        ("0:8 3K:16", 7),
    ],
)
def test_str_round_trips(text, seq_length):
    schedule = StepSchedule.parse(text, seq_length)
    again = StepSchedule.parse(str(schedule), seq_length)
    assert again.stages == schedule.stages
    assert [upstream_count(e.split(":")[0]) for e in str(schedule).split()] == [
        s.threshold_tokens if seq_length else s.threshold_samples for s in schedule.entries
    ]


def test_to_string_in_tokens_for_pretrain():
    schedule = StepSchedule.from_rampup(16, 8, 300000, 1024)
    tokens = schedule.to_string(seq_length=4096)
    assert StepSchedule.parse(tokens, seq_length=4096).stages == schedule.stages
    assert tokens.split()[1] == f"{format_count(2381 * 4096)}:24"


def test_format_count_uses_suffix_only_when_upstream_reads_it_exactly():
    assert format_count(250 * 10**9) == "250B"
    assert format_count(2010) == "2010"
    assert format_count(0) == "0"
    assert format_count(1500) == "1500"


# -- lookup ------------------------------------------------------------------------------------


def test_global_batch_size_at():
    schedule = StepSchedule.parse("0:8 100:16 1K:32")
    assert [schedule.global_batch_size_at(c) for c in (0, 99, 100, 999, 1000, 10**12)] == [
        8,
        8,
        16,
        16,
        32,
        32,
    ]
    with pytest.raises(SizeError, match="consumed_samples -1 must be a whole number >= 0"):
        schedule.global_batch_size_at(-1)


def test_from_stages_and_constant():
    assert StepSchedule.constant(64).stages == [(0, 64)]
    assert str(StepSchedule.from_stages([(0, 8), (2000, 16)])) == "0:8 2K:16"
    with pytest.raises(ScheduleError, match="comes after entry 2"):
        StepSchedule.from_stages([(0, 8), (20, 16), (10, 32)])
    with pytest.raises(ScheduleParseError, match=r"stage 2 threshold 1\.5 is not an integer"):
        StepSchedule.from_stages([(0, 8), (1.5, 16)])


def test_stage_positions_are_filled_in_and_checked():
    schedule = StepSchedule(
        (
            Stage(threshold_samples=0, global_batch_size=8),
            Stage(threshold_samples=100, global_batch_size=16),
        )
    )
    assert [s.position for s in schedule.entries] == [1, 2]
    problems = schedule.problems(4, 4)
    assert [(p.index, p.stage.position) for p in problems] == [(0, 1)]
    with pytest.raises(
        ScheduleParseError,
        match=r"entry 2 .* has position 3; Stage.position is the 1-based place "
        r"in the schedule \(2\), or 0 to have it filled in",
    ):
        StepSchedule(
            (
                Stage(threshold_samples=0, global_batch_size=8, position=1),
                Stage(threshold_samples=100, global_batch_size=16, position=3),
            )
        )


# -- rampup ------------------------------------------------------------------------------------


def test_rampup_docs_example():
    """Megatron's docs: [16, 8, 300000] with GBS 1024 is 126 increments of about 2380 samples."""
    schedule = StepSchedule.from_rampup(16, 8, 300000, 1024)
    stages = schedule.stages
    assert len(stages) == 127
    assert stages[0] == (0, 16) and stages[-1][1] == 1024
    assert [b for _, b in stages] == list(range(16, 1025, 8))
    gaps = {b[0] - a[0] for a, b in itertools.pairwise(stages)}
    assert gaps <= {2380, 2381}
    assert stages[1] == (2381, 24)  # int(c / 2380.95...) first reaches 1 at c = 2381


@pytest.mark.parametrize(
    "args, stages",
    [
        ((16, 8, 0, 1024), [(0, 1024)]),  # upstream: ZeroDivisionError (0 / 0.0) at construction
        ((64, 8, 1000, 64), [(0, 64)]),  # upstream: ZeroDivisionError (no increments)
        ((16, 16, 48, 32), [(0, 16), (48, 32)]),
        ((5, 5, 3, 100), [(0, 5), (1, 35), (2, 65), (3, 100)]),  # several increments per sample
        ((8, 8, 1, 64), [(0, 8), (1, 64)]),
    ],
)
def test_rampup_boundaries(args, stages):
    assert StepSchedule.from_rampup(*args).stages == stages


@pytest.mark.parametrize(
    "args, error, message",
    [
        (
            (0, 8, 100, 64),
            ScheduleError,
            r"--rampup-batch-size start batch size 0 must be at least 1; give an integer",
        ),
        (
            (16, -8, 100, 64),
            ScheduleError,
            r"--rampup-batch-size batch size increment -8 must be at least 1",
        ),
        (
            (16, 8, -1, 64),
            ScheduleError,
            r"--rampup-batch-size ramp-up samples -1 must be a whole number >= 0; give 0 for no "
            r"ramp",
        ),
        ((16, 8, 100, 0), ScheduleError, r"--global-batch-size 0 must be at least 1"),
        (
            (16, 8, 1.5, 64),
            SizeError,
            r"--rampup-batch-size ramp-up samples 1.5 must be a whole number >= 0",
        ),
        (
            (128, 8, 100, 64),
            ScheduleError,
            r"start batch size 128 exceeds --global-batch-size 64; a ramp only grows",
        ),
        (
            (16, 10, 100, 64),
            ScheduleError,
            r"increment 10 does not divide --global-batch-size 64 - start 16 = 48.*Use an "
            r"increment in \{1, 2, 3, 4, 6, 8",
        ),
    ],
)
def test_rampup_errors(args, error, message):
    # upstream 0.16.1 asserts start > 0, increment > 0, ramp >= 0 and GBS > 0: those are caught as
    # upstream's callers catch them; a fractional count is a SizeError, which upstream never
    # asserted
    with pytest.raises(
        AssertionError if error is ScheduleError else error, match=message
    ) as caught:
        StepSchedule.from_rampup(*args)
    assert type(caught.value) is error


def test_constant_zero_batch_is_an_assertion_error_like_upstream():
    with pytest.raises(ScheduleError, match=r"--global-batch-size 0 must be at least 1"):
        StepSchedule.constant(0)


# -- validation --------------------------------------------------------------------------------

SCALE_UP = "0:256 200000:512 600000:1024 1500000:2048 3000000:4096 6000000:6144"


def test_validate_passes_and_past_stages_may_be_smaller_than_dp():
    schedule = StepSchedule.parse(SCALE_UP)
    assert schedule.validate(1, 256) == []
    assert schedule.validate(1, 512, consumed_samples=200000) == []  # 256 < 512 is already passed
    with pytest.raises(
        ScheduleError,
        match=r"entry 1 '0:256' .* is smaller than --micro-batch-size 1 x "
        r"data-parallel size 512 = 512, so it gives 0 micro-batches",
    ):
        schedule.validate(1, 512, consumed_samples=199999)


def test_validate_divisibility_names_stage_and_nearest():
    # upstream asserted divisibility: its callers catch AssertionError
    with pytest.raises(
        AssertionError,
        match=r"entry 2 '100:96' \(from 100 samples, global batch size 96\) is not a "
        r"multiple of --micro-batch-size 4 x data-parallel size 16 = 64.*"
        r"Nearest valid batch sizes: 64, 128",
    ) as caught:
        StepSchedule.parse("0:64 100:96").validate(4, 16)
    assert type(caught.value) is ScheduleError


def test_validate_never_decreasing():
    with pytest.raises(
        ScheduleError,
        match=r"entry 3 '200:64' .* is smaller than entry 2's 128; the batch size "
        r"must never decrease.*should not decrease",
    ):
        StepSchedule.parse("0:64 100:128 200:64").validate(8, 8)
    StepSchedule.parse("0:64 100:128 200:64").validate(
        8, 8, consumed_samples=200
    )  # the decrease is past


def test_validate_interleaved_rule():
    schedule = StepSchedule.parse("0:32 100:48")
    with pytest.raises(
        InterleaveError,
        match=r"entry 2 '100:48' .* gives num_microbatches = 48 / \(MBS 1 x DP 8\) = "
        r"6 with --virtual-pipeline-model-parallel-size 2 and "
        r"--pipeline-model-parallel-size 4.*Nearest valid batch sizes: 32, 64",
    ):
        schedule.validate(1, 8, pipeline_model_parallel_size=4, virtual_pipeline_size=2)
    schedule.validate(1, 8, pipeline_model_parallel_size=4)  # not interleaved: any M
    StepSchedule.parse("0:48 100:80").validate(  # M = 6, 10 with N = 6: M % N in {0} or [PP, N)
        1,
        8,
        pipeline_model_parallel_size=4,
        virtual_pipeline_size=2,
        microbatch_group_size_per_vp_stage=6,
    )


def test_microbatch_group_below_pp_is_one_problem_not_one_per_stage():
    schedule = StepSchedule.parse("0:32 100:64 200:128")
    layout = dict(
        pipeline_model_parallel_size=4,
        virtual_pipeline_size=2,
        microbatch_group_size_per_vp_stage=2,
    )
    with pytest.raises(
        InterleaveError,
        match=r"^--microbatch-group-size-per-virtual-pipeline-stage 2 is below "
        r"--pipeline-model-parallel-size 4; the interleaved schedule needs "
        r"N >= PP\. Use N >= 4\.$",
    ):
        schedule.validate(1, 8, planned_data_parallel_sizes=[16], **layout)
    problems = schedule.problems(1, 8, planned_data_parallel_sizes=[16], **layout)
    assert [(p.index, p.future, type(p.error)) for p in problems] == [(0, False, InterleaveError)]


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            dict(virtual_pipeline_size=0),
            "--virtual-pipeline-model-parallel-size 0 must be at least 1",
        ),
        (
            dict(virtual_pipeline_size=2, microbatch_group_size_per_vp_stage=0),
            "--microbatch-group-size-per-virtual-pipeline-stage 0 must be at least 1",
        ),
    ],
)
def test_zero_virtual_pipeline_or_group_size_is_refused(layout, message):
    with pytest.raises(SizeError, match=message):
        StepSchedule.parse("0:32").validate(1, 8, pipeline_model_parallel_size=4, **layout)


def test_planned_dp_and_opt_out():
    schedule = StepSchedule.parse("0:256 100:384 200:1024")
    schedule.validate(1, 128)
    with pytest.raises(
        ScheduleError, match=r"entry 2 '100:384' .* planned data-parallel size 256 = 256"
    ):
        schedule.validate(1, 128, planned_data_parallel_sizes=[256])
    with pytest.warns(ScheduleWarning, match=r"planned data-parallel size 256.*not yet in force"):
        demoted = schedule.validate(1, 128, planned_data_parallel_sizes=[256], strict_future=False)
    assert [p.stage.position for p in demoted] == [2]
    with pytest.raises(
        ScheduleError, match=r"entry 1 '0:256'"
    ):  # the stage in force is never demoted
        schedule.validate(1, 512, strict_future=False)


def test_validate_counts_further_problems_and_checks_sizes():
    with pytest.raises(ScheduleError, match=r"\(3 more problems in later stages"):
        StepSchedule.parse("0:8 100:12 200:20 300:4").validate(8, 1)
    with pytest.raises(SizeError, match="--micro-batch-size 0 must be at least 1"):
        StepSchedule.parse("0:8").validate(0, 1)


def test_problems_lists_everything():
    problems = StepSchedule.parse("0:8 100:12 200:4").problems(8, 1)
    assert [(p.stage.position, p.future, type(p.error)) for p in problems] == [
        (2, True, ScheduleError),
        (3, True, ScheduleError),
        (3, True, ScheduleError),
    ]


# -- table and accounting ----------------------------------------------------------------------


def test_table_rows():
    schedule = StepSchedule.parse("0:768 250B:1536 500B:3072", seq_length=4096)
    rows = schedule.table(4, 64, train_samples=200_000_000, lr=3e-4, lr_base_batch_size=768)
    assert [r.num_microbatches for r in rows] == [3, 6, 12]
    first, second, third = rows
    assert first.first_step == 0 and first.steps == -(-61035156 // 768)
    assert second.first_sample == first.steps * 768 >= 61035156
    assert second.first_token == second.first_sample * 4096
    assert second.first_step == first.steps
    assert (
        sum(r.samples for r in rows)
        >= 200_000_000
        > sum(r.samples for r in rows) - third.global_batch_size
    )
    assert second.lr_linear == pytest.approx(6e-4) and second.lr_sqrt == pytest.approx(
        3e-4 * 2**0.5
    )


def test_table_skipped_stage_and_open_end():
    rows = StepSchedule.parse("0:8 10:16 12:32").table(1, 8)
    assert [(r.first_sample, r.steps) for r in rows] == [(0, 2), (None, 0), (16, None)]


def test_table_from_consumed_samples_starts_at_the_stage_in_force():
    """A resumed, scaled-up run: stage 1 (8 < MBS 4 x DP 16) is past and must not stop the table."""
    schedule = StepSchedule.parse("0:8 1000:64")
    rows = schedule.table(4, 16, train_samples=3000, consumed_samples=2000)
    assert [(r.first_sample, r.first_step, r.steps, r.samples) for r in rows] == [
        (None, None, 0, 0),
        (2000, 0, 16, 1024),
    ]
    rows = schedule.table(4, 16, consumed_samples=1000)
    assert [(r.first_sample, r.steps) for r in rows] == [(None, 0), (1000, None)]
    with pytest.raises(ScheduleError, match=r"entry 1 '0:8' .* gives 0 micro-batches"):
        schedule.table(4, 16, consumed_samples=999)
    with pytest.raises(SizeError, match="consumed_samples -1 must be a whole number >= 0"):
        schedule.table(4, 16, consumed_samples=-1)


def test_iter_steps_matches_upstream_training_loop_arithmetic():
    steps = list(StepSchedule.parse("0:8 20:16 50:32").iter_steps(2, 4, train_samples=100))
    assert [s.consumed_samples for s in steps] == [0, 8, 16, 24, 40, 56, 88]
    assert [s.num_microbatches for s in steps] == [1, 1, 1, 2, 2, 4, 4]
    assert StepSchedule.parse("0:8 20:16 50:32").iterations(2, 4, train_samples=100) == 7


def test_iter_steps_refuses_zero_microbatches():
    with pytest.raises(ScheduleError, match="gives 0 micro-batches"):
        next(StepSchedule.parse("0:4").iter_steps(8, 1))


def test_all_errors_are_ga_errors():
    for text in ("0:8 1G:16", "10:8", "0:nan"):
        with pytest.raises(GAError):
            StepSchedule.parse(text)


def test_no_warning_when_strict():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StepSchedule.parse(SCALE_UP).validate(1, 256)
