"""Fuzzing every input surface: only the project's typed errors (GAError) escape, and every example
answers within 1 s of CPU time, less garbage collection (example(): an example that takes longer
fails the test).

Surfaces: the schedule parser (and ``megatron-ga schedule``), the number spelling, the ledger's
arguments (BatchLayout and ``megatron-ga ledger``), ``megatron-ga check`` on launch lines built from
Megatron's own flag names, the rampup converter, and the calculator's ``update`` over
consumed-sample sequences. Inputs: tests/support/fuzz_inputs.py. Where an input is accepted, the
answer is checked too (round trips, GBS = MBS x DP x GA, upstream's rampup arithmetic, the
calculator against its schedule, JSON output), and a command answers with exit status 0, 1 or 2,
never a traceback.

The default suite runs 200 examples per surface; ``make fuzz`` runs 10,000
(``MEGATRON_GA_FUZZ_EXAMPLES``) and records the counts (tools/results.py, ``MEGATRON_GA_RESULTS``)
for ``make docs`` to render into docs/reliability.md. Each surface fails unless it ran at least that
many examples. What fuzzing found is pinned in tests/test_fuzz_found.py.
"""

from __future__ import annotations

import contextlib
import gc
import io
import itertools
import json
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ga_ext import BatchLayout, StepSchedule
from megatron_ga_ext.cli.main import main
from megatron_ga_ext.core.numbers import (
    MAX_EXPONENT,
    format_count,
    parse_count,
    read_int,
    upstream_count,
)
from megatron_ga_ext.core.schedule.rampup import rampup_triple
from megatron_ga_ext.errors import GAError, GuardError, ScheduleWarning
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.integration.guards import GuardedCalculator
from tests.support.fuzz_inputs import (
    check_argv,
    consumed_counts,
    layout_kwargs,
    ledger_argv,
    mostly,
    numbers,
    python_sizes,
    ramp_values,
    runnable_calculators,
    schedule_options,
    schedule_texts,
    seq_lengths,
    sizes,
    valid_schedule_texts,
)
from tools.results import record

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("MEGATRON_GA_FUZZ_EXAMPLES", "200"))
LIMIT_S = 1.0
#: The limit is example()'s CPU-time timer: hypothesis' deadline is wall-clock time, which other
#: processes on a 2-core machine stretch several-fold.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Surface:
    """What one surface's examples did: how many ran, the slowest, and how each was answered."""

    name: str
    entry: str
    examples: int = 0
    slowest: float = 0.0
    answers: Counter = field(default_factory=Counter)
    passed: bool = False


_SURFACES: dict[str, Surface] = {}


class _GarbageCollection:
    """Seconds spent in the garbage collector: a full collection of the heap hypothesis builds over
    10,000 examples takes about a second, whichever example it falls in (hypothesis' own deadline
    leaves it out too)."""

    seconds = 0.0
    _started = 0.0

    @classmethod
    def callback(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._started = time.process_time()
        else:
            cls.seconds += time.process_time() - cls._started


gc.callbacks.append(_GarbageCollection.callback)


@contextlib.contextmanager
def example(surface: str):
    """Count one example of ``surface`` and hold it to LIMIT_S of CPU time, less garbage collection
    (the process's time, so a loaded machine does not fail it, nor hide a slow answer);
    ScheduleWarnings are kept out."""
    start, collecting = time.process_time(), _GarbageCollection.seconds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleWarning)
        yield
    seconds = time.process_time() - start - (_GarbageCollection.seconds - collecting)
    stats = _SURFACES[surface]
    stats.examples += 1
    stats.slowest = max(stats.slowest, seconds)
    assert seconds < LIMIT_S, (
        f"{surface}: this example took {seconds:.2f} s of CPU time (limit {LIMIT_S} s)"
    )


def answer(surface: str, call: Callable, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, or the GAError it raised; any other exception escapes (and fails
    the test)."""
    try:
        result = call(*args, **kwargs)
    except GAError as error:
        _SURFACES[surface].answers[type(error).__name__] += 1
        return error
    _SURFACES[surface].answers["accepted"] += 1
    return result


def run_surface(fuzzed: Callable, entry: str) -> None:
    """Run a surface's hypothesis test and check it ran at least EXAMPLES examples."""
    _SURFACES[fuzzed.__name__] = Surface(fuzzed.__name__, entry)
    fuzzed()
    stats = _SURFACES[fuzzed.__name__]
    assert stats.examples >= EXAMPLES, (
        f"{fuzzed.__name__}: {stats.examples} examples, fewer than {EXAMPLES}"
    )
    stats.passed = True


def failed(value: Any) -> bool:
    return isinstance(value, GAError)


def cli(surface: str, argv: list[str]) -> tuple[int, Any]:
    """``megatron-ga ARGV`` in-process: its exit status (0, 1 problems, 2 an error: one line, no
    traceback) and its output, read as JSON where ARGV holds --json (before any launch line)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = main(argv)
    _SURFACES[surface].answers[f"megatron-ga {argv[0]} exit {status}"] += 1
    assert status in (0, 1, 2)
    own = argv[: argv.index("--")] if "--" in argv else argv
    return status, json.loads(out.getvalue()) if "--json" in own else out.getvalue()


# -- the schedule parser
# -----------------------------------------------------------------------------


@FUZZ
@given(mostly(valid_schedule_texts(), schedule_texts(), odds=1), seq_lengths(), schedule_options())
def schedule_parser(text, seq_length, options):
    with example("schedule_parser"):
        schedule = answer("schedule_parser", StepSchedule.parse, text, seq_length)
        if failed(schedule):
            assert str(schedule).startswith("--"), schedule  # a sentence that names the flag
        else:
            stages = list(schedule.stages)
            assert stages[0][0] == 0 and all(b >= 1 for _, b in stages)
            assert all(a[0] < b[0] for a, b in itertools.pairwise(stages))
            assert (
                StepSchedule.parse(schedule.to_string(), seq_length).stages == stages
            )  # exact round trips
            assert StepSchedule.parse(schedule.samples_string()).stages == stages
            assert StepSchedule.parse(str(schedule), seq_length).stages == stages
            if seq_length is not None:  # thresholds in tokens read back as the same samples
                assert (
                    StepSchedule.parse(schedule.to_string(seq_length=seq_length), seq_length).stages
                    == stages
                )
        if isinstance(text, str):
            cli("schedule_parser", ["schedule", *options, "--", text])


def test_schedule_parser():
    run_surface(
        schedule_parser,
        "StepSchedule.parse(text, seq_length); megatron-ga schedule [options] -- TEXT",
    )


# -- the number spelling
# -----------------------------------------------------------------------------


@FUZZ
@given(numbers(), st.booleans(), st.integers(0, 10**MAX_EXPONENT))
def number_spelling(text, signed, value):
    with example("number_spelling"):
        spelled = format_count(
            value
        )  # what every message and converted schedule writes: read back exactly
        assert parse_count(spelled) == value, spelled
        assert upstream_count(spelled) == value or value > 2**53, (
            spelled
        )  # upstream's float(), where it can
        count = answer("number_spelling", parse_count, text, "value", signed=signed)
        if not failed(count):
            assert abs(count) <= 10**MAX_EXPONENT and (signed or count >= 0)
        integer = answer("number_spelling", read_int, "--flag", text)
        if not failed(integer):
            assert isinstance(integer, int) and abs(integer) <= 10**MAX_EXPONENT


def test_number_spelling():
    run_surface(number_spelling, "parse_count, read_int, format_count")


# -- the ledger's arguments
# --------------------------------------------------------------------------


@FUZZ
@given(layout_kwargs(), ledger_argv())
def ledger_arguments(kwargs, argv):
    with example("ledger_arguments"):
        layout = answer("ledger_arguments", BatchLayout, **kwargs)
        _, problems = BatchLayout.problems(**kwargs)
        assert failed(layout) == bool(problems) and all(isinstance(p, GAError) for p in problems)
        if not failed(layout):
            ledger = layout.ledger()
            dp, ga = ledger["data_parallel_size"], ledger["num_microbatches"]
            assert ledger["global_batch_size"] == layout.micro_batch_size * dp * ga and ga >= 1
            assert dp * layout.model_parallel_size == layout.world_size
        status, out = cli("ledger_arguments", ["ledger", *argv])
        assert status in (0, 2)
        if status == 0 and "--json" in argv:
            assert out["num_microbatches"] >= 1


def test_ledger_arguments():
    run_surface(ledger_arguments, "BatchLayout(**sizes); megatron-ga ledger --flag=value ...")


# -- megatron-ga check on launch lines
# ----------------------------------------------------------------


@FUZZ
@given(check_argv())
def check_launch_lines(argv):
    with example("check_launch_lines"):
        status, report = cli("check_launch_lines", argv)
        if status == 2:
            assert report["error"] and report["ledger"] is None
        else:
            problems = report["problems"]
            assert all(
                isinstance(p["message"], str) and p["message"] and p["rule"] for p in problems
            )
            assert (status == 1) == bool(problems)


def test_check_launch_lines():
    run_surface(check_launch_lines, "megatron-ga check --json [--world-size N] -- <launch line>")


# -- the rampup converter
# ----------------------------------------------------------------------------


def upstream_rampup_batch_size(
    start: int, increment: int, ramp_samples: int, gbs: int, consumed: int
) -> int:
    """megatron-core 0.16.1's RampupBatchsizeNumMicroBatchesCalculator.update, in its float
    arithmetic."""
    increments = (gbs - start) // increment
    if consumed > ramp_samples or increments == 0 or ramp_samples == 0:
        return gbs
    per_increment = ramp_samples / increments
    return start + min(increments, int(consumed / per_increment)) * increment


@FUZZ
@given(
    ramp_values(),
    st.lists(consumed_counts(), max_size=6),
    st.tuples(
        python_sizes(), python_sizes(), st.sampled_from((1, 2, 4)), st.sampled_from((None, 1, 2, 3))
    ),
    st.lists(sizes(), min_size=3, max_size=3),
)
def rampup_converter(ramp, consumed, layout, triple):
    with example("rampup_converter"):
        answer("rampup_converter", rampup_triple, triple)
        schedule = answer("rampup_converter", StepSchedule.from_rampup, *ramp)
        if failed(schedule):
            return
        for count in consumed:
            batch = answer("rampup_converter", schedule.global_batch_size_at, count)
            if not failed(batch):
                assert batch == upstream_rampup_batch_size(*ramp, count), (ramp, count)
        answer("rampup_converter", schedule.problems, *layout)
        assert schedule.summary() and schedule.final_global_batch_size == ramp[3]


def test_rampup_converter():
    run_surface(rampup_converter, "StepSchedule.from_rampup, rampup_triple, problems(layout)")


# -- the calculator's update over consumed-sample sequences
# -------------------------------------------

#: An update: ("step",) is what Megatron's loop does (consumed += the running GBS, an unchecked then
#: a checked update); ("jump", consumed, consistency_check) anything else.
UPDATES = st.lists(
    st.one_of(st.just(("step",)), st.tuples(st.just("jump"), consumed_counts(), st.booleans())),
    max_size=12,
)


def calculators() -> st.SearchStrategy[dict]:
    """The arguments of init_num_microbatches_calculator (any release), and a layout for the
    interleave rule."""
    return st.fixed_dictionaries(
        {
            "rank": st.sampled_from((0, 1)),
            "micro_batch_size": st.sampled_from((1, 2, 4)) | python_sizes(),
            "data_parallel_size": st.sampled_from((1, 2, 8)) | python_sizes(),
        },
        optional={
            "step_batch_size_schedule": valid_schedule_texts() | schedule_texts(),
            "rampup_batch_size": st.lists(
                st.integers(1, 64) | python_sizes(), min_size=3, max_size=3
            )
            | st.lists(sizes(), max_size=4),
            "global_batch_size": st.sampled_from((8, 16, 64, 128)) | python_sizes(),
            "decrease_batch_size_if_needed": st.booleans(),
            "seq_length": seq_lengths(),
            "pipeline_model_parallel_size": st.sampled_from((1, 2, 4)),
            "virtual_pipeline_size": st.sampled_from((None, 2)),
            "strict_future": st.booleans(),
        },
    )


@FUZZ
@given(mostly(runnable_calculators(), calculators(), odds=2), UPDATES)
def calculator_update(arguments, updates):
    with example("calculator_update"):
        calculator = answer("calculator_update", StepScheduleCalculator.build, **arguments)
        if failed(calculator):
            return
        guarded = GuardedCalculator(calculator, arguments.get("pipeline_model_parallel_size", 1))
        unit = calculator.micro_batch_size * calculator.data_parallel_size
        consumed, healthy = 0, True  # the last count updated to, and whether that update succeeded
        for update in updates:
            if update[0] == "step":
                step = consumed + guarded.get_current_running_global_batch_size()
                calls = [(step, False), (step, True)]
            else:
                calls = [update[1:]]
            for count, check in calls:
                done = answer("calculator_update", guarded.update, count, check)
                if failed(done):
                    # Megatron's own step never trips the guard while the calculator is healthy.
                    assert not (update[0] == "step" and healthy and isinstance(done, GuardError)), (
                        done
                    )
                    healthy = False
                    break
                consumed, healthy = count, True
                batch = calculator.get_current_global_batch_size()
                assert batch == calculator.step_schedule.global_batch_size_at(count)
                assert calculator.get() == batch // unit == guarded.get()
                if check:
                    assert (
                        calculator.get() >= 1 and batch % unit == 0
                    )  # the stage in force always runs
            if not healthy and update[0] == "step":
                break


def test_calculator_update():
    run_surface(
        calculator_update,
        "StepScheduleCalculator.build(...), then update(consumed, check) under the guard",
    )


# -- the counts, for docs/reliability.md
# -------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _record_counts():
    yield
    rows = []
    for stats in (s for s in _SURFACES.values() if s.passed):  # a surface that failed has no row
        answers = ", ".join(f"{name} {count:,}" for name, count in stats.answers.most_common())
        rows.append(
            {
                "Surface": stats.name.replace("_", " "),
                "Input": f"`{stats.entry}`",
                "Examples": f"{stats.examples:,}",
                "Slowest example": f"{stats.slowest * 1000:.1f} ms",
                "Answers": answers,
            }
        )
    record("fuzz", rows)
