"""Step batch-size schedules: exact parsing, up-front validation, rampup conversion. Pure Python.

A schedule is upstream's ``--step-batch-size-schedule "THRESHOLD:BS THRESHOLD:BS ..."``: from the
first step whose consumed-sample count reaches THRESHOLD, the global batch size is BS.

    GBS(consumed)    = BS of the last stage with threshold_samples <= consumed
    num_microbatches = GBS / (MBS x DP)
    consumed        += MBS x DP x num_microbatches            (once per step)
    threshold_samples = threshold_tokens // seq_length         (token thresholds; upstream's floor)

Unlike upstream (megatron-core >= 0.18), numbers are read exactly (``2.01K`` is 2010, not 2009),
nothing is sorted, rounded or truncated, and every stage can be checked against the layout before a
run starts, instead of when training reaches it.

:class:`StepSchedule` is here; each job has its module: ``schedule_numbers`` (spelling counts),
``stages`` (entries and their order), ``rampup`` (the rampup conversion),
``checks`` (validation against a layout), ``tables`` (stepping through a run). The
names other modules import from here are re-exported.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_ga_ext.core.numbers import format_count, parse_count
from megatron_ga_ext.core.rules import require_count, require_positive_int
from megatron_ga_ext.core.schedule.checks import (
    CheckLayout,
    schedule_problems,
    stage_error,
    with_count,
)
from megatron_ga_ext.core.schedule.rampup import (
    LISTED_RAMP,
    RampStages,
    check_rampup,
    listed_rampup_stages,
)
from megatron_ga_ext.core.schedule.stages import (
    FLAG,
    ScheduleProblem,
    Stage,
    StagePairs,
    check_order,
    number_stages,
    parse_entries,
    stage_count,
)
from megatron_ga_ext.core.schedule.tables import (
    StageRow,
    iter_steps,
    run_totals,
    table,
    total_samples,
    total_steps,
)
from megatron_ga_ext.errors import (
    GAError,
    ScheduleError,
    ScheduleParseError,
    ScheduleWarning,
    UsageError,
)

__all__ = [
    "FLAG",
    "StageRow",
    "StepSchedule",
    "parse_count",
    "total_samples",
    "total_steps",
]

#: The longest schedule string written (Linux refuses a longer single argument: MAX_ARG_STRLEN).
MAX_ARGUMENT = 131_072


@dataclass(frozen=True)
class StepSchedule:
    """A checked step batch-size schedule: thresholds increasing from 0, batch sizes >= 1.

    ``entries`` is a tuple of :class:`Stage`, or for a long converted ramp a
    :class:`~megatron_ga_ext.core.schedule.rampup.RampStages` that computes each stage when it is read.
    """

    entries: Sequence[Stage]
    seq_length: int | None = None
    """Tokens per sample when thresholds were given in tokens, else None."""
    _thresholds: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.entries, RampStages):
            object.__setattr__(self, "entries", number_stages(tuple(self.entries)))
            check_order(self.entries, self.seq_length)  # type: ignore[arg-type]
            object.__setattr__(
                self, "_thresholds", tuple(s.threshold_samples for s in self.entries)
            )

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str, seq_length: int | None = None) -> StepSchedule:
        """Read upstream's format exactly; thresholds are tokens when ``seq_length`` is given.

        Token thresholds become samples by floor division, ``tokens // seq_length``, as upstream
        does, so a run switches batch size at the same step under either calculator.
        """
        if seq_length is not None:
            require_positive_int("--seq-length", seq_length)
        return cls(parse_entries(text, seq_length), seq_length)

    @classmethod
    def from_stages(cls, stages: Sequence[tuple[int, int]]) -> StepSchedule:
        """Build from ``(threshold_samples, global_batch_size)`` pairs, checked like a parsed
        schedule."""
        built = []
        for i, (threshold, batch) in enumerate(stages, 1):
            for name, value in (("threshold", threshold), ("global batch size", batch)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ScheduleParseError(f"stage {i} {name} {value!r} is not an integer.")
            built.append(Stage(threshold_samples=threshold, global_batch_size=batch, position=i))
        return cls(tuple(built))

    @classmethod
    def constant(cls, global_batch_size: int) -> StepSchedule:
        """The one-stage schedule ``0:GBS``."""
        require_positive_int("--global-batch-size", global_batch_size, below_one=ScheduleError)
        return cls.from_stages([(0, global_batch_size)])

    @classmethod
    def from_rampup(
        cls, start: int, increment: int, ramp_samples: int, global_batch_size: int
    ) -> StepSchedule:
        """The step schedule equal to megatron-core 0.16.1's
        ``RampupBatchsizeNumMicroBatchesCalculator`` (see
        :mod:`~megatron_ga_ext.core.schedule.rampup`). Where upstream divides by zero (ramp_samples
        = 0, or start = GBS), the ramp is empty: the schedule is ``0:GBS``. A ramp of more than
        10,000 increments is described, not listed (its ``entries`` compute each stage when
        read)."""
        check_rampup(start, increment, ramp_samples, global_batch_size)
        if global_batch_size == start or ramp_samples == 0:
            return cls.constant(global_batch_size)
        if (global_batch_size - start) // increment > LISTED_RAMP:
            return cls(RampStages(start, increment, ramp_samples, global_batch_size))
        return cls.from_stages(
            listed_rampup_stages(start, increment, ramp_samples, global_batch_size)
        )

    # -- reading -------------------------------------------------------------------------------

    @property
    def stages(self) -> StagePairs:
        """``(threshold_samples, global_batch_size)`` for each stage, in order (computed when
        read)."""
        return StagePairs(self.entries)

    @property
    def num_stages(self) -> int:
        """How many stages (a long ramp's may pass what ``len(entries)`` returns)."""
        return stage_count(self.entries)

    @property
    def final_global_batch_size(self) -> int:
        """The last stage's batch size (upstream's ``global_batch_size``; not necessarily the
        largest)."""
        return self.entries[-1].global_batch_size

    def stage_index_at(self, consumed_samples: int) -> int:
        """0-based index of the stage in force at ``consumed_samples``: O(log stages), O(1) for a
        long ramp."""
        consumed = require_count("consumed_samples", consumed_samples)
        if isinstance(self.entries, RampStages):
            return self.entries.index_at(consumed)
        return bisect.bisect_right(self._thresholds, consumed) - 1

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """GBS of the last stage whose threshold is <= ``consumed_samples``."""
        return self.entries[self.stage_index_at(consumed_samples)].global_batch_size

    def to_string(self, seq_length: int | None = None) -> str:
        """Upstream's format, read back by upstream's parser (and ours) to the same stages.

        Without ``seq_length``, thresholds are in this schedule's own unit (the tokens as given when
        it was parsed with a seq_length, else samples). With ``seq_length``, thresholds are tokens
        for it, which is what ``pretrain_gpt`` reads: it always passes ``--seq-length`` to the
        calculator. A long ramp has no string (UsageError): it would not fit a command line.
        """
        if seq_length is None:
            seq_length = self.seq_length
        else:
            require_positive_int("--seq-length", seq_length)
        parts = []
        for stage in self._listed("written as --step-batch-size-schedule"):
            if seq_length is None:
                threshold = stage.threshold_samples
            elif seq_length == self.seq_length and stage.threshold_tokens is not None:
                threshold = stage.threshold_tokens
            else:
                threshold = stage.threshold_samples * seq_length
            parts.append(f"{format_count(threshold)}:{stage.global_batch_size}")
        return " ".join(parts)

    def samples_string(self) -> str:
        """Upstream's format with thresholds in samples (for callers that pass
        ``seq_length=None``)."""
        return " ".join(
            f"{format_count(s.threshold_samples)}:{s.global_batch_size}"
            for s in self._listed("written as --step-batch-size-schedule")
        )

    def summary(self) -> str:
        """One line: the number of stages, the first two and the last."""
        if isinstance(self.entries, RampStages):
            return self.entries.describe()
        shown = [s.spelling for s in self.entries[:2]] + (
            ["...", self.entries[-1].spelling]
            if len(self.entries) > 3
            else [s.spelling for s in self.entries[2:]]
        )
        return (
            f"{len(self.entries):,} stage{'s' if len(self.entries) > 1 else ''}: {' '.join(shown)}"
        )

    def _listed(self, purpose: str) -> Sequence[Stage]:
        if isinstance(self.entries, RampStages):
            raise UsageError(
                f"the schedule has {self.num_stages:,} stages ({self.summary()}), too many to be "
                f"{purpose} (a ramp of up to {LISTED_RAMP:,} increments is); run the "
                "ramp with --ga-convert-rampup instead."
            )
        return self.entries

    def __str__(self) -> str:
        return self.summary() if isinstance(self.entries, RampStages) else self.to_string()

    # -- validation ----------------------------------------------------------------------------

    def problems(
        self,
        micro_batch_size: int,
        data_parallel_size: int,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_size: int | None = None,
        consumed_samples: int = 0,
        planned_data_parallel_sizes: Sequence[int] = (),
        microbatch_group_size_per_vp_stage: int | None = None,
        *,
        virtual_pipeline_given: str | None = None,
    ) -> list[ScheduleProblem]:
        """Every rule broken by the stage in force at ``consumed_samples`` and by every later stage.

        Rules (:mod:`~megatron_ga_ext.core.schedule.checks`), for each such stage and data-parallel
        size DP (today's; for stages not yet reached also each of ``planned_data_parallel_sizes``):
        GBS >= MBS x DP; GBS % (MBS x DP) == 0; with VPP > 1, M = GBS / (MBS x DP) satisfies the
        interleaved rule; and GBS never decreases. Stages already passed are not checked: after a
        scale-up they may be smaller than MBS x DP, on purpose. With VPP > 1, N < PP is a layout
        error, listed once (against the stage in force). A long ramp gives one problem per rule, for
        its first stage that breaks it (``count`` says how many do). ``virtual_pipeline_given``
        names the flags VPP came from in messages.
        """
        layout = CheckLayout.checked(
            micro_batch_size,
            data_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_size,
            planned_data_parallel_sizes,
            microbatch_group_size_per_vp_stage,
            virtual_pipeline_given,
        )
        return schedule_problems(self.entries, self.stage_index_at(consumed_samples), layout)

    def validate(
        self,
        micro_batch_size: int,
        data_parallel_size: int,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_size: int | None = None,
        consumed_samples: int = 0,
        planned_data_parallel_sizes: Sequence[int] = (),
        *,
        microbatch_group_size_per_vp_stage: int | None = None,
        strict_future: bool = True,
    ) -> list[ScheduleProblem]:
        """Raise the first broken rule (see :meth:`problems`); return the problems demoted to
        warnings.

        ``strict_future=False`` is the explicit opt-out for runs that will rescale before reaching
        later stages: errors about stages not yet reached are issued as :class:`ScheduleWarning` and
        returned. The stage in force is always held to today's layout.
        """
        found = self.problems(
            micro_batch_size,
            data_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_size,
            consumed_samples,
            planned_data_parallel_sizes,
            microbatch_group_size_per_vp_stage,
        )
        fatal = [p for p in found if strict_future or not p.future]
        if fatal:
            raise with_count(fatal[0].error, sum(p.count for p in fatal) - 1)
        for problem in found:
            warnings.warn(
                f"{problem.error} (not yet in force: warned, not raised)",
                ScheduleWarning,
                stacklevel=2,
            )
        return found

    def stage_error(
        self,
        index: int,
        micro_batch_size: int,
        data_parallel_size: int,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_size: int | None = None,
        microbatch_group_size_per_vp_stage: int | None = None,
    ) -> GAError | None:
        """The first rule the stage ``entries[index]`` breaks for today's layout, or None: O(1)."""
        layout = CheckLayout.checked(
            micro_batch_size,
            data_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_size,
            microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        )
        return stage_error(self.entries[index], layout)

    # -- accounting ----------------------------------------------------------------------------

    iter_steps = iter_steps  # tables.iter_steps(schedule, ...): the steps a run takes
    table = table  # tables.table(schedule, ...): one row per stage
    run_totals = run_totals  # tables.run_totals(schedule, ...): (steps, samples) of a run

    def iterations(self, micro_batch_size: int, data_parallel_size: int, train_samples: int) -> int:
        """Steps training runs for ``--train-samples``: while consumed < train_samples, one more
        step."""
        return self.run_totals(micro_batch_size, data_parallel_size, train_samples)[0]
