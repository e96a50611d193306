"""Step batch-size schedules: exact parsing, up-front validation, rampup conversion. Pure Python.

A schedule is upstream's ``--step-batch-size-schedule "THRESHOLD:BS THRESHOLD:BS ..."``: from the first
step whose consumed-sample count reaches THRESHOLD, the global batch size is BS.

    GBS(consumed)    = BS of the last stage with threshold_samples <= consumed
    num_microbatches = GBS / (MBS x DP)
    consumed        += MBS x DP x num_microbatches            (once per step)
    threshold_samples = threshold_tokens // seq_length         (token thresholds; upstream's floor)

Unlike upstream (megatron-core >= 0.18), numbers are read exactly (``2.01K`` is 2010, not 2009), nothing
is sorted, rounded or truncated, and every stage can be checked against the layout before a run starts,
instead of when training reaches it.
"""

from __future__ import annotations

import bisect
import math
import operator
import warnings
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Callable, Iterator, Sequence

from megatron_ga_ext.errors import GAError, InterleaveError, ScheduleError, ScheduleParseError, SizeError
from megatron_ga_ext.layout import (
    divisors,
    interleaved_microbatch_problem,
    microbatch_group_error,
    nearest_multiples,
    require_positive_int,
)

__all__ = [
    "SUFFIXES",
    "ScheduleWarning",
    "ScheduleProblem",
    "Stage",
    "StageRow",
    "StepInfo",
    "StepSchedule",
    "format_count",
    "parse_count",
    "rampup_triple",
    "total_samples",
    "total_steps",
]

FLAG = "--step-batch-size-schedule"

#: Upstream's suffixes (case-insensitive), as exact integers.
SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}

#: Values above 10**30 are refused: far past any sample or token count, and cheap to keep exact.
_MAX_EXPONENT = 30


class ScheduleWarning(UserWarning):
    """A stage not yet reached breaks a rule, and the caller opted to be warned instead of stopped."""


# -- numbers -----------------------------------------------------------------------------------


def parse_count(text: str, what: str = "value", *, signed: bool = False) -> Fraction:
    """Read ``text`` exactly: a decimal number with an optional suffix K, M, B or T (either case).

    ``what`` names the value in error messages. Returns a Fraction >= 0 (it may be fractional; the
    caller decides whether it must be whole). Raises ScheduleParseError for anything else (unknown
    suffix, nan, inf, not a number) and ScheduleError for a negative value, unless ``signed``: then a
    negative value is returned, for a caller with its own range and message.
    """
    body, multiplier = _split_suffix(text)
    if body and body[-1].isalpha() and _is_decimal(body[:-1]):
        raise ScheduleParseError(
            f"{what} {text!r} has an unknown suffix {body[-1]!r}; the suffixes are K (1e3), M (1e6), B (1e9) "
            f"and T (1e12), in either case."
        )
    try:
        number = Decimal(body)
    except InvalidOperation:
        raise ScheduleParseError(
            f"{what} {text!r} is not a number; write digits with an optional suffix K, M, B or T, e.g. 250B."
        ) from None
    if not number.is_finite():  # nan, snan (with payloads such as nan5), inf, in any sign: before any comparison
        raise ScheduleParseError(f"{what} {text!r} is not a finite number; give a whole number such as 1000 or 1K.")
    if number.is_signed() and number != 0 and not signed:
        raise ScheduleError(f"{what} {text!r} is negative; thresholds and batch sizes count samples, so use >= 0.")
    if number != 0 and number.as_tuple().exponent < -_MAX_EXPONENT:  # type: ignore[operator]
        raise ScheduleParseError(f"{what} {text!r} has more than {_MAX_EXPONENT} decimal places; write it plainly.")
    if number != 0 and number.adjusted() + len(str(multiplier)) - 1 > _MAX_EXPONENT:
        raise ScheduleParseError(f"{what} {text!r} is larger than 1e{_MAX_EXPONENT}; no run consumes that much.")
    return Fraction(number) * multiplier


def _split_suffix(text: str) -> tuple[str, int]:
    """``text`` stripped and upper-cased, less a known suffix, and that suffix's multiplier (1 if none)."""
    body = text.strip().upper()
    if body and body[-1] in SUFFIXES:
        return body[:-1], SUFFIXES[body[-1]]
    return body, 1


def _is_decimal(text: str) -> bool:
    try:
        Decimal(text)
    except InvalidOperation:
        return False
    return True


def _upstream_count(text: str) -> int:
    """What megatron-core >= 0.18 reads for ``text``: int(float(number) * multiplier) (for comparison only)."""
    body, multiplier = _split_suffix(text)
    return int(float(body) * multiplier)


def format_count(value: int) -> str:
    """The shortest spelling of ``value`` that both this parser and upstream's float parser read exactly."""
    for suffix, multiplier in sorted(SUFFIXES.items(), key=lambda item: -item[1]):
        if value and value % multiplier == 0:
            text = f"{value // multiplier}{suffix}"
            if _upstream_count(text) == value:
                return text
    return str(value)


# -- the schedule ------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class Stage:
    """One entry of a schedule."""

    threshold_samples: int
    """Consumed samples from which this stage is in force."""
    global_batch_size: int
    """Samples per optimizer step while in force."""
    threshold_tokens: int | None = None
    """The token threshold as given (thresholds in tokens only)."""
    entry: str | None = None
    """The entry as written, or None for a built schedule."""
    position: int = 0
    """1-based position in the schedule; 0 (the default) is filled in by :class:`StepSchedule`."""

    @property
    def spelling(self) -> str:
        """The entry as written, or ``THRESHOLD:GBS`` in samples for a built schedule."""
        return self.entry or f"{format_count(self.threshold_samples)}:{self.global_batch_size}"

    @property
    def threshold_given(self) -> int:
        """The threshold in the unit it was given in: tokens when parsed with a seq_length, else samples."""
        return self.threshold_tokens if self.threshold_tokens is not None else self.threshold_samples

    def describe(self) -> str:
        text = self.spelling
        unit = f"{self.threshold_samples:,} samples"
        if self.threshold_tokens is not None:
            unit = f"{self.threshold_tokens:,} tokens = {unit}"
        return f"{FLAG} entry {self.position} {text!r} (from {unit}, global batch size {self.global_batch_size})"


@dataclass(kw_only=True, frozen=True)
class StageRow:
    """One stage as a run would see it, for tables, JSON and plots (see StepSchedule.table)."""

    position: int
    entry: str
    threshold_samples: int
    threshold_tokens: int | None
    global_batch_size: int
    num_microbatches: int
    """GBS // (MBS x DP)."""
    first_sample: int | None
    """Consumed samples at the first step that uses this stage (>= threshold); None if never used."""
    first_token: int | None
    """first_sample x seq_length: the exact token count where the switch happens."""
    first_step: int | None
    """0-based iteration of that first step, counted from where stepping began (``consumed_samples``)."""
    steps: int | None
    """Steps run in this stage; None when open-ended (no train length given)."""
    samples: int | None
    tokens: int | None
    lr_linear: float | None = None
    """Hint only: lr x GBS / base batch size (Goyal et al. linear rule)."""
    lr_sqrt: float | None = None
    """Hint only: lr x sqrt(GBS / base batch size) (square-root rule)."""


@dataclass(kw_only=True, frozen=True)
class StepInfo:
    """One optimizer step: iteration (0-based, from where stepping began), consumed samples before it, GBS, M."""

    iteration: int
    consumed_samples: int
    global_batch_size: int
    num_microbatches: int
    samples: int
    """MBS x DP x num_microbatches: what the step adds to consumed_samples."""


@dataclass(kw_only=True, frozen=True)
class ScheduleProblem:
    """A rule a stage breaks for a layout; ``future`` when the stage is not yet in force."""

    stage: Stage
    index: int
    """0-based index of ``stage`` in ``StepSchedule.entries``."""
    future: bool
    error: GAError


@dataclass(frozen=True)
class StepSchedule:
    """A checked step batch-size schedule: thresholds strictly increasing from 0, batch sizes >= 1."""

    entries: tuple[Stage, ...]
    seq_length: int | None = None
    """Tokens per sample when thresholds were given in tokens, else None."""
    _thresholds: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", _numbered(self.entries))
        _check_structure(self.entries, self.seq_length)
        object.__setattr__(self, "_thresholds", tuple(s.threshold_samples for s in self.entries))

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str, seq_length: int | None = None) -> "StepSchedule":
        """Read upstream's format exactly; thresholds are tokens when ``seq_length`` is given.

        Token thresholds become samples by floor division, ``tokens // seq_length``, as upstream does,
        so a run switches batch size at the same step under either calculator.
        """
        if seq_length is not None:
            require_positive_int("--seq-length", seq_length)
        if not isinstance(text, str):
            raise ScheduleParseError(f"{FLAG} must be a string, got {type(text).__name__} {text!r}.")
        pieces = text.replace(",", " ").split()
        stages = tuple(_parse_entry(piece, i, seq_length) for i, piece in enumerate(pieces, 1))
        return cls(stages, seq_length)

    @classmethod
    def from_stages(cls, stages: Sequence[tuple[int, int]]) -> "StepSchedule":
        """Build from ``(threshold_samples, global_batch_size)`` pairs, checked like a parsed schedule."""
        built = []
        for i, (threshold, batch) in enumerate(stages, 1):
            for name, value in (("threshold", threshold), ("global batch size", batch)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ScheduleParseError(f"stage {i} {name} {value!r} is not an integer.")
            built.append(Stage(threshold_samples=threshold, global_batch_size=batch, position=i))
        return cls(tuple(built))

    @classmethod
    def constant(cls, global_batch_size: int) -> "StepSchedule":
        """The one-stage schedule ``0:GBS``."""
        require_positive_int("--global-batch-size", global_batch_size, below_one=ScheduleError)
        return cls.from_stages([(0, global_batch_size)])

    @classmethod
    def from_rampup(
        cls, start: int, increment: int, ramp_samples: int, global_batch_size: int
    ) -> "StepSchedule":
        """The step schedule equal to megatron-core 0.16.1's ``RampupBatchsizeNumMicroBatchesCalculator``.

        Upstream, with n = (GBS - start) / increment and per = ramp_samples / n (a float)::

            GBS(c) = GBS                                    if c > ramp_samples
                   = start + int(c / per) x increment       otherwise

        Stage k (batch start + k x increment) begins at the least integer c with GBS(c) reaching it; the
        float arithmetic is followed exactly, so the boundaries match upstream's to the sample. Stages
        that collide (per < 1) keep the larger batch, as upstream reaches it at that count. Where upstream
        divides by zero (ramp_samples = 0, or start = GBS), the ramp is empty: the schedule is ``0:GBS``.
        """
        flag = "--rampup-batch-size"
        # Upstream 0.16.1 asserts start > 0, increment > 0, ramp >= 0 and GBS > 0: ScheduleError is an AssertionError.
        require_positive_int(f"{flag} start batch size", start, below_one=ScheduleError)
        require_positive_int(f"{flag} batch size increment", increment, below_one=ScheduleError)
        require_positive_int("--global-batch-size", global_batch_size, below_one=ScheduleError)
        whole = isinstance(ramp_samples, int) and not isinstance(ramp_samples, bool)
        if not whole or ramp_samples < 0:
            raise (ScheduleError if whole else SizeError)(
                f"{flag} ramp-up samples {ramp_samples!r} must be a whole number >= 0; give 0 for no ramp, or the "
                f"samples to ramp over."
            )
        diff = global_batch_size - start
        if diff < 0:
            raise ScheduleError(
                f"{flag} start batch size {start} exceeds --global-batch-size {global_batch_size}; a ramp only "
                f"grows. Use a start <= {global_batch_size}."
            )
        if diff % increment:
            valid = divisors(diff)
            raise ScheduleError(
                f"{flag} increment {increment} does not divide --global-batch-size {global_batch_size} - start "
                f"{start} = {diff}, so the ramp never lands on the global batch size. Use an increment in "
                f"{{{', '.join(str(d) for d in valid[:8])}{', ...' if len(valid) > 8 else ''}}}."
            )
        if diff == 0 or ramp_samples == 0:
            return cls.constant(global_batch_size)
        return cls.from_stages(_rampup_stages(start, increment, ramp_samples, global_batch_size))

    # -- reading -------------------------------------------------------------------------------

    @property
    def stages(self) -> list[tuple[int, int]]:
        """``(threshold_samples, global_batch_size)`` for each stage, in order."""
        return [(s.threshold_samples, s.global_batch_size) for s in self.entries]

    @property
    def final_global_batch_size(self) -> int:
        """The last stage's batch size (upstream's ``global_batch_size``; not necessarily the largest)."""
        return self.entries[-1].global_batch_size

    def stage_index_at(self, consumed_samples: int) -> int:
        """0-based index of the stage in force at ``consumed_samples``: O(log stages)."""
        try:
            consumed = operator.index(consumed_samples)  # int, or numpy/torch integer scalars
        except TypeError:
            consumed = -1
        if isinstance(consumed_samples, bool) or consumed < 0:
            raise SizeError(f"consumed_samples {consumed_samples!r} must be a whole number >= 0.")
        return bisect.bisect_right(self._thresholds, consumed) - 1

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """GBS of the last stage whose threshold is <= ``consumed_samples``."""
        return self.entries[self.stage_index_at(consumed_samples)].global_batch_size

    def to_string(self, seq_length: int | None = None) -> str:
        """Upstream's format, read back by upstream's parser (and ours) to the same stages.

        Without ``seq_length``, thresholds are in this schedule's own unit (the tokens as given when it was
        parsed with a seq_length, else samples). With ``seq_length``, thresholds are tokens for it, which
        is what ``pretrain_gpt`` reads: it always passes ``--seq-length`` to the calculator.
        """
        if seq_length is None:
            seq_length = self.seq_length
        else:
            require_positive_int("--seq-length", seq_length)
        parts = []
        for stage in self.entries:
            if seq_length is None:
                threshold = stage.threshold_samples
            elif seq_length == self.seq_length and stage.threshold_tokens is not None:
                threshold = stage.threshold_tokens
            else:
                threshold = stage.threshold_samples * seq_length
            parts.append(f"{format_count(threshold)}:{stage.global_batch_size}")
        return " ".join(parts)

    def samples_string(self) -> str:
        """Upstream's format with thresholds in samples (for callers that pass ``seq_length=None``)."""
        return " ".join(f"{format_count(t)}:{b}" for t, b in self.stages)

    def __str__(self) -> str:
        return self.to_string()

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
    ) -> list[ScheduleProblem]:
        """Every rule broken by the stage in force at ``consumed_samples`` and by every later stage.

        Rules, for each such stage and data-parallel size DP (today's; for stages not yet reached also each
        of ``planned_data_parallel_sizes``): GBS >= MBS x DP (at least one micro-batch); GBS % (MBS x DP)
        == 0; with VPP > 1, M = GBS / (MBS x DP) satisfies the interleaved rule; and GBS never decreases
        from one stage to the next (upstream asserts "should not decrease" at the transition). Stages
        already passed are not checked: after a scale-up they may be smaller than MBS x DP, on purpose.
        With VPP > 1, N < PP is a layout error, listed once (against the stage in force).
        """
        mbs = require_positive_int("--micro-batch-size", micro_batch_size)
        dp = require_positive_int("--data-parallel-size", data_parallel_size)
        pp = require_positive_int("--pipeline-model-parallel-size", pipeline_model_parallel_size)
        vpp = 1 if virtual_pipeline_size is None else require_positive_int(
            "--virtual-pipeline-model-parallel-size", virtual_pipeline_size
        )
        group = pp if microbatch_group_size_per_vp_stage is None else require_positive_int(
            "--microbatch-group-size-per-virtual-pipeline-stage", microbatch_group_size_per_vp_stage
        )
        planned = [require_positive_int("planned data-parallel size", d) for d in planned_data_parallel_sizes]
        current = self.stage_index_at(consumed_samples)
        found = []
        group_error = microbatch_group_error(group, pp) if vpp > 1 else None
        if group_error is not None:
            found.append(ScheduleProblem(stage=self.entries[current], index=current, future=False, error=group_error))
            vpp = 1  # the rule on num_microbatches presumes N >= PP; the stages' divisibility is still checked
        for index in range(current, len(self.entries)):
            stage, future = self.entries[index], index > current
            for size in [dp] + ([d for d in planned if d != dp] if future else []):
                error = _layout_error(stage, mbs, size, pp, vpp, group, size != dp)
                if error is not None:
                    found.append(ScheduleProblem(stage=stage, index=index, future=future, error=error))
            if future and stage.global_batch_size < self.entries[index - 1].global_batch_size:
                error = _decrease_error(self.entries[index - 1], stage)
                found.append(ScheduleProblem(stage=stage, index=index, future=True, error=error))
        return found

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
        """Raise the first broken rule (see :meth:`problems`); return the problems demoted to warnings.

        ``strict_future=False`` is the explicit opt-out for runs that will rescale before reaching later
        stages: errors about stages not yet reached are issued as :class:`ScheduleWarning` and returned.
        The stage in force is always held to today's layout.
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
            raise _with_count(fatal[0].error, len(fatal) - 1)
        for problem in found:
            warnings.warn(f"{problem.error} (not yet in force: warned, not raised)", ScheduleWarning, stacklevel=2)
        return found

    # -- accounting ----------------------------------------------------------------------------

    def iter_steps(
        self,
        micro_batch_size: int,
        data_parallel_size: int,
        consumed_samples: int = 0,
        train_samples: int | None = None,
    ) -> Iterator[StepInfo]:
        """The steps training runs from ``consumed_samples`` on, until ``train_samples`` (or forever).

        Each step uses the stage in force at its start; consumed += MBS x DP x num_microbatches.
        """
        unit = require_positive_int("--micro-batch-size", micro_batch_size) * require_positive_int(
            "--data-parallel-size", data_parallel_size
        )
        consumed, iteration = consumed_samples, 0
        while train_samples is None or consumed < train_samples:
            batch = self.global_batch_size_at(consumed)
            samples = (batch // unit) * unit
            if samples == 0:
                stage = self.entries[self.stage_index_at(consumed)]
                raise _zero_microbatch_error(stage, micro_batch_size, data_parallel_size)
            yield StepInfo(
                iteration=iteration, consumed_samples=consumed, global_batch_size=batch,
                num_microbatches=batch // unit, samples=samples,
            )
            consumed += samples
            iteration += 1

    def table(
        self,
        micro_batch_size: int,
        data_parallel_size: int,
        seq_length: int | None = None,
        train_samples: int | None = None,
        lr: float | None = None,
        lr_base_batch_size: int | None = None,
        consumed_samples: int = 0,
    ) -> list[StageRow]:
        """One row per stage, stepping from ``consumed_samples`` as training does, in O(stages).

        In a stage of batch B (per step S = MBS x DP x (B // (MBS x DP))) entered at consumed c, the run
        takes ceil((end - c) / S) steps, end = min(next threshold, train_samples); the last one may
        overshoot the next threshold, so a stage starts at its first step's count, which can be past its
        threshold, and a stage can be skipped entirely (steps 0). A resumed run starts at the stage in force
        at ``consumed_samples``: stages already passed get steps 0 and are not held to today's MBS x DP.
        ``seq_length`` defaults to the schedule's own. ``lr`` and ``lr_base_batch_size`` add the linear and
        square-root hints.
        """
        mbs = require_positive_int("--micro-batch-size", micro_batch_size)
        dp = require_positive_int("--data-parallel-size", data_parallel_size)
        seq = self.seq_length if seq_length is None else require_positive_int("--seq-length", seq_length)
        if train_samples is not None:
            require_positive_int("--train-samples", train_samples)
        if lr_base_batch_size is not None:
            require_positive_int("--lr-base-batch-size", lr_base_batch_size)
        self.stage_index_at(consumed_samples)  # refuses a negative or non-integer count
        rows, consumed, iteration = [], consumed_samples, 0
        for index, stage in enumerate(self.entries):
            ends = [self.entries[index + 1].threshold_samples] if index + 1 < len(self.entries) else []
            ends += [train_samples] if train_samples is not None else []
            end = min(ends) if ends else None
            per_step = (stage.global_batch_size // (mbs * dp)) * mbs * dp
            used = consumed >= stage.threshold_samples and (end is None or consumed < end)
            if used and per_step == 0:
                raise _zero_microbatch_error(stage, mbs, dp)
            steps = (None if end is None else -(-(end - consumed) // per_step)) if used else 0
            first = consumed if used else None
            first_step = iteration if used else None
            rows.append(_row(stage, mbs * dp, seq, first, first_step, steps, per_step, lr, lr_base_batch_size))
            if steps:
                consumed, iteration = consumed + steps * per_step, iteration + steps
        return rows

    def iterations(self, micro_batch_size: int, data_parallel_size: int, train_samples: int) -> int:
        """Steps training runs for ``--train-samples``: while consumed < train_samples, one more step."""
        rows = self.table(micro_batch_size, data_parallel_size, train_samples=train_samples)
        return total_steps(rows)


def total_steps(rows: Sequence[StageRow]) -> int:
    """Steps over all rows of :meth:`StepSchedule.table` (open-ended rows count 0)."""
    return sum(row.steps or 0 for row in rows)


def total_samples(rows: Sequence[StageRow]) -> int:
    """Samples those steps consume (open-ended rows count 0)."""
    return sum(row.samples or 0 for row in rows)


# -- parsing helpers ---------------------------------------------------------------------------


def _parse_entry(piece: str, position: int, seq_length: int | None) -> Stage:
    where = f"{FLAG} entry {position} {piece!r}"
    if piece.count(":") != 1 or piece.startswith(":") or piece.endswith(":"):
        raise ScheduleParseError(
            f"{where} is not THRESHOLD:BATCH_SIZE (one colon, a number on each side), e.g. '0:256' or "
            f"'250B:512'; separate entries with spaces or commas."
        )
    threshold_text, batch_text = piece.split(":")
    unit = "tokens" if seq_length is not None else "samples"
    threshold = parse_count(threshold_text, f"{where}: threshold")
    batch = parse_count(batch_text, f"{where}: batch size")
    if threshold.denominator != 1:
        raise ScheduleParseError(
            f"{where}: threshold {threshold_text!r} = {float(threshold):g} is not a whole number of {unit}; "
            f"write {math.floor(threshold)} or {math.ceil(threshold)}."
        )
    if batch.denominator != 1:
        raise ScheduleParseError(
            f"{where}: batch size {batch_text!r} = {float(batch):g} is not a whole number of samples (upstream "
            f"would silently truncate it to {int(_upstream_count(batch_text))}); write "
            f"{max(1, math.floor(batch))} or {math.ceil(batch)}."
        )
    if batch == 0:
        raise ScheduleError(f"{where}: batch size is 0; every stage needs a global batch size >= 1.")
    tokens = int(threshold) if seq_length is not None else None
    samples = int(threshold) // seq_length if seq_length is not None else int(threshold)
    return Stage(
        threshold_samples=samples, global_batch_size=int(batch), threshold_tokens=tokens, entry=piece, position=position
    )


def _numbered(entries: Sequence[Stage]) -> tuple[Stage, ...]:
    """``entries`` with each unset position (0) filled in with its 1-based place; a wrong one is refused."""
    numbered = []
    for place, stage in enumerate(entries, 1):
        if stage.position not in (0, place):
            raise ScheduleParseError(
                f"{FLAG} entry {place} ({stage.threshold_samples}:{stage.global_batch_size}) has position "
                f"{stage.position}; Stage.position is the 1-based place in the schedule ({place}), or 0 to have it "
                f"filled in."
            )
        numbered.append(stage if stage.position else replace(stage, position=place))
    return tuple(numbered)


def _check_structure(entries: tuple[Stage, ...], seq_length: int | None) -> None:
    if not entries:
        raise ScheduleError(f"{FLAG} is empty; give at least one THRESHOLD:BATCH_SIZE entry, starting with '0:<GBS>'.")
    for stage in entries:
        if stage.global_batch_size < 1 or stage.threshold_samples < 0:
            raise ScheduleError(f"{stage.describe()}: thresholds must be >= 0 and batch sizes >= 1.")
    first = entries[0]
    given = first.threshold_given
    if given != 0 and first.threshold_samples == 0:
        raise ScheduleError(
            f"{first.describe()} is the first entry; its threshold of {given:,} tokens becomes 0 samples ({given} // "
            f"--seq-length {seq_length}), the start of training, but the first threshold must be written as 0. "
            f"Write '0:{first.global_batch_size}'."
        )
    if given != 0:
        raise ScheduleError(
            f"{first.describe()} is the first entry but its threshold is not 0, so no batch size is set for the "
            f"start of training. Begin the schedule with '0:{first.global_batch_size}' (or the batch size to start "
            f"with)."
        )
    for previous, stage in zip(entries, entries[1:]):
        _check_pair(previous, stage, entries, seq_length)


def _check_pair(previous: Stage, stage: Stage, entries: tuple[Stage, ...], seq_length: int | None) -> None:
    if stage.threshold_given < previous.threshold_given:
        order = " ".join(s.spelling for s in sorted(entries, key=lambda s: s.threshold_given))
        raise ScheduleError(
            f"{stage.describe()} comes after entry {previous.position} {previous.entry!r}, whose threshold is "
            f"larger; thresholds must increase from entry to entry (upstream would sort them silently). Write "
            f"them in order, e.g. {order!r}."
        )
    if stage.threshold_given == previous.threshold_given:
        raise ScheduleError(
            f"{stage.describe()} repeats the threshold of entry {previous.position} {previous.entry!r}; each "
            f"threshold must be larger than the one before. Drop one of the two."
        )
    if stage.threshold_samples == previous.threshold_samples:
        raise ScheduleError(
            f"{stage.describe()} and entry {previous.position} {previous.entry!r} both become sample threshold "
            f"{stage.threshold_samples:,} with --seq-length {seq_length} (tokens // seq_length), so the earlier "
            f"one would never be in force. Move this entry to at least "
            f"{format_count((stage.threshold_samples + 1) * (seq_length or 1))} tokens, or drop one of them."
        )


# -- rampup ------------------------------------------------------------------------------------


def rampup_triple(values: Sequence[int | str]) -> tuple[int, int, int]:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as three ints (argparse and launch lines give strings)."""
    if len(values) != 3:
        raise SizeError(
            f"--rampup-batch-size takes three values, START INCREMENT SAMPLES (e.g. 16 8 300000); got "
            f"{len(values)}: {' '.join(map(str, values))}."
        )
    triple = []
    for name, value in zip(("start batch size", "increment", "ramp-up samples"), values):
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SizeError(f"--rampup-batch-size {name} {value!r} is not a whole number.")
        triple.append(value)
    return triple[0], triple[1], triple[2]


def _rampup_stages(start: int, increment: int, ramp_samples: int, global_batch_size: int) -> list[tuple[int, int]]:
    increments = (global_batch_size - start) // increment
    per_increment = ramp_samples / increments  # float, as upstream computes it

    def upstream_increments(consumed: int) -> int:
        if consumed > ramp_samples:
            return increments
        return int(consumed / per_increment)

    stages: list[tuple[int, int]] = [(0, start)]
    low = 0
    for k in range(1, increments + 1):
        low = _least(lambda c: upstream_increments(c) >= k, low, ramp_samples + 1, k * ramp_samples // increments)
        batch = start + upstream_increments(low) * increment
        if stages[-1][0] == low:
            stages[-1] = (low, batch)
        elif batch != stages[-1][1]:
            stages.append((low, batch))
    return stages


def _least(reached: Callable[[int], bool], low: int, high: int, guess: int) -> int:
    """The least c in [low, high] with reached(c), for a monotone ``reached`` true at ``high``.

    Gallops out from ``guess`` (an estimate that is off by a few samples at most), then bisects.
    """
    guess, step = min(max(guess, low), high), 1
    if reached(guess):
        hit, miss = guess, guess - 1
        while miss >= low and reached(miss):
            hit, step = miss, step * 2
            miss = hit - step
        miss = max(miss, low - 1)
    else:
        miss, hit = guess, min(high, guess + 1)
        while not reached(hit):
            miss, step = hit, step * 2
            hit = min(high, miss + step)
    while hit - miss > 1:
        middle = (hit + miss) // 2
        hit, miss = (middle, miss) if reached(middle) else (hit, middle)
    return hit


# -- validation helpers ------------------------------------------------------------------------


def _layout_error(stage: Stage, mbs: int, dp: int, pp: int, vpp: int, group: int, planned: bool) -> GAError | None:
    unit = mbs * dp
    batch = stage.global_batch_size
    dp_text = f"{'planned ' if planned else ''}data-parallel size {dp}"
    if batch < unit:
        return _zero_microbatch_error(stage, mbs, dp, planned)
    if batch % unit:
        return ScheduleError(
            f"{stage.describe()} is not a multiple of --micro-batch-size {mbs} x {dp_text} = {unit}, so it "
            f"does not split into whole micro-batches (upstream floors it to {batch // unit} and asserts when "
            f"training reaches it). Nearest valid batch sizes: {', '.join(map(str, nearest_multiples(batch, unit)))}."
        )
    if vpp > 1:
        problem = interleaved_microbatch_problem(batch // unit, pp, group)
        if problem is not None:
            rule, nearest_m = problem
            return InterleaveError(
                f"{stage.describe()} gives num_microbatches = {batch} / (MBS {mbs} x DP {dp}) = {batch // unit} "
                f"with --virtual-pipeline-model-parallel-size {vpp} and --pipeline-model-parallel-size {pp}: "
                f"{rule}. Nearest valid batch sizes: {', '.join(str(m * unit) for m in nearest_m)}."
            )
    return None


def _zero_microbatch_error(stage: Stage, mbs: int, dp: int, planned: bool = False) -> ScheduleError:
    unit = mbs * dp
    return ScheduleError(
        f"{stage.describe()} is smaller than --micro-batch-size {mbs} x {'planned ' if planned else ''}"
        f"data-parallel size {dp} = {unit}, so it gives 0 micro-batches per step (upstream does not catch "
        f"this). Use a batch size that is a multiple of {unit}, e.g. {unit}."
    )


def _decrease_error(previous: Stage, stage: Stage) -> ScheduleError:
    return ScheduleError(
        f"{stage.describe()} is smaller than entry {previous.position}'s {previous.global_batch_size}; the batch "
        f"size must never decrease (Megatron's training loop asserts the number of micro-batches \"should not "
        f"decrease\" when it reaches this stage). Use a batch size >= {previous.global_batch_size}."
    )


def _with_count(error: GAError, others: int) -> GAError:
    if others == 0:
        return error
    more = f" ({others} more problem{'s' if others > 1 else ''} in later stages; `megatron-ga schedule` lists them.)"
    return type(error)(f"{error}{more}")


def _row(
    stage: Stage,
    unit: int,
    seq: int | None,
    first: int | None,
    first_step: int | None,
    steps: int | None,
    per_step: int,
    lr: float | None,
    lr_base: int | None,
) -> StageRow:
    samples = None if steps is None else steps * per_step
    ratio = None if lr is None or lr_base is None else stage.global_batch_size / lr_base
    return StageRow(
        position=stage.position,
        entry=stage.spelling,
        threshold_samples=stage.threshold_samples,
        threshold_tokens=stage.threshold_tokens if stage.threshold_tokens is not None else (
            None if seq is None else stage.threshold_samples * seq
        ),
        global_batch_size=stage.global_batch_size,
        num_microbatches=stage.global_batch_size // unit,
        first_sample=first,
        first_token=None if first is None or seq is None else first * seq,
        first_step=first_step,
        steps=steps,
        samples=samples,
        tokens=None if samples is None or seq is None else samples * seq,
        lr_linear=None if ratio is None else lr * ratio,
        lr_sqrt=None if ratio is None else lr * math.sqrt(ratio),
    )

