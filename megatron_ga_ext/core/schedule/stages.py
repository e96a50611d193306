"""The stages of a step batch-size schedule: one entry, reading entries exactly, and the order
rules.

A schedule is upstream's ``--step-batch-size-schedule "THRESHOLD:BS THRESHOLD:BS ..."``: from the
first step whose consumed-sample count reaches THRESHOLD, the global batch size is BS; with a
seq_length the thresholds are tokens and become samples by ``tokens // seq_length`` (upstream's
floor).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import overload

from megatron_ga_ext.core.megatron_flags import STEP_SCHEDULE
from megatron_ga_ext.core.numbers import format_count, parse_count, upstream_count
from megatron_ga_ext.core.rules import require_positive_int
from megatron_ga_ext.errors import GAError, ScheduleError, ScheduleParseError

__all__ = [
    "FLAG",
    "ScheduleProblem",
    "Stage",
    "StagePairs",
    "check_order",
    "number_stages",
    "parse_entries",
    "schedule_text_errors",
    "stage_count",
]

FLAG = STEP_SCHEDULE.flag


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
        """The threshold in the unit it was given in: tokens when parsed with a seq_length, else
        samples."""
        return (
            self.threshold_tokens if self.threshold_tokens is not None else self.threshold_samples
        )

    def describe(self) -> str:
        text = self.spelling
        unit = f"{self.threshold_samples:,} samples"
        if self.threshold_tokens is not None:
            unit = f"{self.threshold_tokens:,} tokens = {unit}"
        return (
            f"{FLAG} entry {self.position} {text!r} (from {unit}, global batch size "
            f"{self.global_batch_size})"
        )


@dataclass(kw_only=True, frozen=True)
class ScheduleProblem:
    """A rule a stage breaks for a layout; ``future`` when the stage is not yet in force."""

    stage: Stage
    index: int
    """0-based index of ``stage`` in ``StepSchedule.entries``."""
    future: bool
    error: GAError
    count: int = 1
    """Stages that break the rule this way: more than 1 for the many stages of a long ramp, of which
    ``stage`` is the first."""


def stage_count(stages: Sequence) -> int:
    """How many stages: ``len()``, or a long ramp's ``num_stages``, which may pass ``sys.maxsize``
    (a ramp to 1e30 by 1), where ``len()`` raises OverflowError."""
    count = getattr(stages, "num_stages", None)
    return len(stages) if count is None else count


class StagePairs(Sequence[tuple[int, int]]):
    """``(threshold_samples, global_batch_size)`` of each stage, computed when read (a ramp of
    millions of stages is never listed); equal to any sequence of the same pairs."""

    def __init__(self, entries: Sequence[Stage]) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def __getitem__(self, index: int) -> tuple[int, int]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[int, int]]: ...

    def __getitem__(self, index: int | slice) -> tuple[int, int] | list[tuple[int, int]]:
        if isinstance(index, slice):
            return [self[i] for i in range(stage_count(self._entries))[index]]
        stage = self._entries[index]
        return stage.threshold_samples, stage.global_batch_size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((s.threshold_samples, s.global_batch_size) for s in self._entries)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StagePairs) and self._entries == other._entries:
            return True  # the same stages (two long ramps compare by their four numbers)
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return stage_count(self._entries) == stage_count(other) and all(
            tuple(a) == tuple(b) for a, b in zip(self, other)
        )

    def __repr__(self) -> str:
        shown = ", ".join(map(str, self[:3]))
        count = stage_count(self._entries)
        return f"StagePairs([{shown}{', ...' if count > 3 else ''}], {count} stages)"


def parse_entries(text: str, seq_length: int | None) -> tuple[Stage, ...]:
    """Upstream's format read exactly: entries separated by spaces or commas, each
    THRESHOLD:BATCH_SIZE."""
    if not isinstance(text, str):
        raise ScheduleParseError(f"{FLAG} must be a string, got {type(text).__name__} {text!r}.")
    _check_seq_length(seq_length)
    pieces = text.replace(",", " ").split()
    return tuple(_parse_entry(piece, i, seq_length) for i, piece in enumerate(pieces, 1))


def _check_seq_length(seq_length: int | None) -> None:
    """Token thresholds are read in samples of ``seq_length`` tokens."""
    if seq_length is not None:
        require_positive_int("--seq-length", seq_length)


def schedule_text_errors(text: str, seq_length: int | None) -> list[GAError]:
    """Every error of a schedule string, where :func:`parse_entries` and :func:`check_order` stop at
    the first: each entry that does not parse, then (all parsed) the first entry's threshold and
    each pair out of order."""
    if not isinstance(text, str):
        return [ScheduleParseError(f"{FLAG} must be a string, got {type(text).__name__} {text!r}.")]
    try:
        _check_seq_length(seq_length)
    except GAError as error:
        return [error]
    errors: list[GAError] = []
    stages = []
    for position, piece in enumerate(text.replace(",", " ").split(), 1):
        try:
            stages.append(_parse_entry(piece, position, seq_length))
        except GAError as error:
            errors.append(error)
    if errors:
        return errors
    entries = tuple(stages)
    try:
        check_order(entries[:1], seq_length)
    except GAError as error:
        errors.append(error)
    for previous, stage in itertools.pairwise(entries):
        try:
            _check_pair(previous, stage, entries, seq_length)
        except GAError as error:
            errors.append(error)
    return errors


def _parse_entry(piece: str, position: int, seq_length: int | None) -> Stage:
    where = f"{FLAG} entry {position} {piece!r}"
    if piece.count(":") != 1 or piece.startswith(":") or piece.endswith(":"):
        raise ScheduleParseError(
            f"{where} is not THRESHOLD:BATCH_SIZE (one colon, a number on each side), e.g. "
            "'0:256' or "
            f"'250B:512'; separate entries with spaces or commas."
        )
    threshold_text, batch_text = piece.split(":")
    unit = "tokens" if seq_length is not None else "samples"
    threshold = parse_count(threshold_text, f"{where}: threshold")
    batch = parse_count(batch_text, f"{where}: batch size")
    if threshold.denominator != 1:
        raise ScheduleParseError(
            f"{where}: threshold {threshold_text!r} = {float(threshold):g} is not a whole number "
            f"of {unit}; write {math.floor(threshold)} or {math.ceil(threshold)}."
        )
    if batch.denominator != 1:
        raise ScheduleParseError(
            f"{where}: batch size {batch_text!r} = {float(batch):g} is not a whole number of "
            "samples (upstream "
            f"would silently truncate it to {int(upstream_count(batch_text))}); write "
            f"{max(1, math.floor(batch))} or {math.ceil(batch)}."
        )
    if batch == 0:
        raise ScheduleError(
            f"{where}: batch size is 0; every stage needs a global batch size >= 1."
        )
    tokens = int(threshold) if seq_length is not None else None
    samples = int(threshold) // seq_length if seq_length is not None else int(threshold)
    return Stage(
        threshold_samples=samples,
        global_batch_size=int(batch),
        threshold_tokens=tokens,
        entry=piece,
        position=position,
    )


def number_stages(entries: Sequence[Stage]) -> tuple[Stage, ...]:
    """``entries`` with each unset position (0) filled in with its 1-based place; a wrong one is
    refused."""
    numbered = []
    for place, stage in enumerate(entries, 1):
        if stage.position not in (0, place):
            raise ScheduleParseError(
                f"{FLAG} entry {place} ({stage.threshold_samples}:{stage.global_batch_size}) has "
                "position "
                f"{stage.position}; Stage.position is the 1-based place in the schedule "
                f"({place}), or 0 to have it filled in."
            )
        numbered.append(stage if stage.position else replace(stage, position=place))
    return tuple(numbered)


def check_order(entries: tuple[Stage, ...], seq_length: int | None) -> None:
    """At least one entry, the first at threshold 0, thresholds strictly increasing (also as
    samples)."""
    if not entries:
        raise ScheduleError(
            f"{FLAG} is empty; give at least one THRESHOLD:BATCH_SIZE entry, starting with "
            "'0:<GBS>'."
        )
    for stage in entries:
        if stage.global_batch_size < 1 or stage.threshold_samples < 0:
            raise ScheduleError(
                f"{stage.describe()}: thresholds must be >= 0 and batch sizes >= 1."
            )
    _check_first(entries[0], seq_length)
    for previous, stage in itertools.pairwise(entries):
        _check_pair(previous, stage, entries, seq_length)


def _check_first(first: Stage, seq_length: int | None) -> None:
    given = first.threshold_given
    if given != 0 and first.threshold_samples == 0:
        raise ScheduleError(
            f"{first.describe()} is the first entry; its threshold of {given:,} tokens becomes 0 "
            f"samples ({given} // --seq-length {seq_length}), the start of training, but "
            "the first threshold must be written as 0. "
            f"Write '0:{first.global_batch_size}'."
        )
    if given != 0:
        raise ScheduleError(
            f"{first.describe()} is the first entry but its threshold is not 0, so no batch size "
            "is set for the "
            f"start of training. Begin the schedule with '0:{first.global_batch_size}' (or the "
            "batch size to start "
            f"with)."
        )


def _check_pair(
    previous: Stage, stage: Stage, entries: tuple[Stage, ...], seq_length: int | None
) -> None:
    if stage.threshold_given < previous.threshold_given:
        order = " ".join(s.spelling for s in sorted(entries, key=lambda s: s.threshold_given))
        raise ScheduleError(
            f"{stage.describe()} comes after entry {previous.position} {previous.entry!r}, whose "
            "threshold is larger; thresholds must increase from entry to entry (upstream would "
            "sort them silently). Write "
            f"them in order, e.g. {order!r}."
        )
    if stage.threshold_given == previous.threshold_given:
        raise ScheduleError(
            f"{stage.describe()} repeats the threshold of entry {previous.position} "
            f"{previous.entry!r}; each threshold must be larger than the one before. "
            "Drop one of the two."
        )
    if stage.threshold_samples == previous.threshold_samples:
        raise ScheduleError(
            f"{stage.describe()} and entry {previous.position} {previous.entry!r} both become "
            "sample threshold "
            f"{stage.threshold_samples:,} with --seq-length {seq_length} (tokens // seq_length), "
            "so the earlier one would never be in force. Move this entry to at least "
            f"{format_count((stage.threshold_samples + 1) * (seq_length or 1))} tokens, "
            "or drop one of them."
        )
