"""The doubling rule: a step batch-size schedule that follows a measured critical batch size. Pure
Python.

Merrill et al. 2025 ("Critical batch size revisited") motivate batch-size warmup: "start the batch
size small and increase it as the CBS grows". This rule doubles the batch whenever trust x the
measured noise scale passes twice the current one. From a measured trace (rows of consumed samples
and B_simple, the gradient noise scale in samples; docs/noise-scale.md), in order of consumed
samples:

    trusted(row) = trust x B_simple(row)
    if trusted(row) >= 2 x GBS and the row is outside every frozen range and 2 x GBS <= cap:
        GBS = 2 x GBS from threshold consumed_samples(row)

At most one doubling per row, so a jump in the estimate becomes doublings at successive
measurements. Doubling keeps GBS a multiple of MBS x DP when the first stage is one, the schedule
only grows, no stage starts inside a frozen range (the LR warmup, the final decay), and GBS never
passes the cap. ``trust`` says how far to believe the estimate: above 1 grows the batch past what
was measured, below 1 is cautious; how B_simple relates to the critical batch on a real sweep is
measured in docs/noise-scale.md.

The trace's rows and their format: science/core/noise_trace.py; the frozen ranges:
science/core/lr_windows.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_ga_ext.core.rules import multiple_error, require_positive_int
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import NoiseScaleError, ScheduleError, UsageError
from megatron_ga_ext.science.core.lr_windows import Frozen
from megatron_ga_ext.science.core.noise_trace import TraceRow

__all__ = ["Decision", "DoublingRule", "Held", "Suggestion", "suggest_schedule"]


@dataclass(frozen=True, kw_only=True)
class DoublingRule:
    """The layout and limits a suggested schedule keeps (see the module docstring for the rule)."""

    micro_batch_size: int
    data_parallel_size: int
    max_global_batch_size: int
    """The cap: GBS doubles only while 2 x GBS <= this."""
    initial_global_batch_size: int | None = None
    """The first stage; default MBS x DP, the smallest batch the layout runs. A multiple of MBS x
    DP."""
    trust: float = 1.0
    """The estimate is multiplied by this before it is compared with 2 x GBS."""
    frozen: tuple[Frozen, ...] = ()

    def __post_init__(self) -> None:
        require_positive_int("--micro-batch-size", self.micro_batch_size)
        require_positive_int("--data-parallel-size", self.data_parallel_size)
        require_positive_int("--max-global-batch-size", self.max_global_batch_size)
        if not (
            isinstance(self.trust, (int, float))
            and not isinstance(self.trust, bool)
            and math.isfinite(self.trust)
            and self.trust > 0
        ):
            raise UsageError(
                f"--trust {self.trust!r} must be a positive finite number: 1 takes the measured "
                "B_simple as it is, 2 doubles it, 0.5 halves it."
            )
        start = self.first_global_batch_size
        unit = self.micro_batch_size * self.data_parallel_size
        if start % unit:
            raise multiple_error(
                f"--global-batch-size {start} (the first stage)",
                start,
                self.micro_batch_size,
                self.data_parallel_size,
                error=ScheduleError,
                fix="; doubling a multiple keeps every stage one",
            )
        if start > self.max_global_batch_size:
            raise ScheduleError(
                f"--max-global-batch-size {self.max_global_batch_size} is below the first "
                f"stage's global batch size {start}; give a cap >= {start}, or a smaller "
                "--global-batch-size."
            )

    @property
    def first_global_batch_size(self) -> int:
        return self.initial_global_batch_size or self.micro_batch_size * self.data_parallel_size


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One doubling: from ``consumed_samples`` on, GBS goes from ``before`` to ``after``."""

    row: TraceRow
    trusted: float
    before: int
    after: int


@dataclass(frozen=True, kw_only=True)
class Held:
    """A row where the estimate called for doubling but ``reason`` held the batch (a frozen range,
    the cap)."""

    row: TraceRow
    trusted: float
    global_batch_size: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    """The suggested schedule (thresholds in samples), and why each stage starts where it does."""

    schedule: StepSchedule
    decisions: tuple[Decision, ...]
    held: tuple[Held, ...]


def suggest_schedule(trace: Sequence[TraceRow], rule: DoublingRule) -> Suggestion:
    """Apply the doubling rule to ``trace`` (rows in increasing consumed samples; see
    :func:`parse_trace`)."""
    _require_increasing(trace)
    batch, stages = rule.first_global_batch_size, [(0, rule.first_global_batch_size)]
    decisions: list[Decision] = []
    held: list[Held] = []
    for row in trace:
        if row.b_simple_samples is None:
            continue
        trusted = rule.trust * row.b_simple_samples
        if trusted < 2 * batch:
            continue
        reason = _held_by(row, batch, rule)
        if reason:
            held.append(Held(row=row, trusted=trusted, global_batch_size=batch, reason=reason))
            continue
        if (
            row.consumed_samples == 0
        ):  # the first stage already starts at 0: it starts bigger instead
            stages[0] = (0, 2 * batch)
        else:
            stages.append((row.consumed_samples, 2 * batch))
        decisions.append(Decision(row=row, trusted=trusted, before=batch, after=2 * batch))
        batch *= 2
    return Suggestion(
        schedule=StepSchedule.from_stages(stages), decisions=tuple(decisions), held=tuple(held)
    )


def _held_by(row: TraceRow, batch: int, rule: DoublingRule) -> str | None:
    """Why the batch may not double at this row, or None."""
    for frozen in rule.frozen:
        if frozen.holds(row.consumed_samples):
            return frozen.label
    if 2 * batch > rule.max_global_batch_size:
        return f"the cap --max-global-batch-size {rule.max_global_batch_size}"
    return None


def _require_increasing(trace: Sequence[TraceRow]) -> None:
    for earlier, later in itertools.pairwise(trace):
        if later.consumed_samples <= earlier.consumed_samples:
            raise NoiseScaleError(
                f"trace row {later.position} has consumed_samples {later.consumed_samples}, not "
                "above row "
                f"{earlier.position}'s {earlier.consumed_samples}: rows must be in the order the "
                "run measured them (a resumed run's log repeats steps: keep the later copy)."
            )
