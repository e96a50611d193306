"""The doubling rule: a step batch-size schedule that follows a measured critical batch size. Pure Python.

Merrill et al. 2025 ("Critical batch size revisited") warm the batch up by doubling it whenever the measured
critical batch passes twice the current one. From a measured trace (rows of consumed samples and B_simple, the
gradient noise scale in samples; docs/noise-scale.md), in order of consumed samples:

    trusted(row) = trust x B_simple(row)
    if trusted(row) >= 2 x GBS and the row is outside every frozen range and 2 x GBS <= cap:
        GBS = 2 x GBS from threshold consumed_samples(row)

At most one doubling per row, so a jump in the estimate becomes doublings at successive measurements. Doubling
keeps GBS a multiple of MBS x DP when the first stage is one, the schedule only grows, no stage starts inside a
frozen range (the LR warmup, the final decay), and GBS never passes the cap. ``trust`` says how far to believe
the estimate: Merrill et al. found B_simple below the critical batch they measured directly, so trust > 1 leans
on that finding and trust < 1 is cautious.

The trace format (JSON: a list of rows, or {"rows": [...]}; or JSON Lines, a row per line), one row per measured
step, in increasing order of consumed samples:

    {"iteration": 1200, "consumed_samples": 614400, "b_simple_samples": 1830.5}

* ``consumed_samples`` (required): whole number >= 0, strictly increasing from row to row;
* ``b_simple_samples``: B_simple in samples (from the EMAs: a one-step ratio is noise); or
  ``b_simple_tokens`` with ``tokens_per_sample`` (the caller's --seq-length, or loss tokens per sample): where a
  row has both, ``b_simple_samples`` is used. null (not measurable: an estimate <= 0) is skipped;
* ``iteration`` (optional) and any other keys (``grad_sq``, ``trace_sigma``, ...) are kept for reading, not used.
"""

from __future__ import annotations

import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from megatron_ga_ext.core.numbers import MAX_EXPONENT
from megatron_ga_ext.core.rules import multiple_error, require_positive_int
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import NoiseScaleError, ScheduleError, UsageError

__all__ = ["Decision", "DoublingRule", "Frozen", "Held", "Suggestion", "TraceRow", "parse_trace", "read_log",
           "read_trace", "suggest_schedule"]

#: At most this many trace rows are read (a measurement every step of a million-step run).
MAX_ROWS = 1_000_000


@dataclass(frozen=True, kw_only=True)
class TraceRow:
    """One measured step of a trace."""

    position: int
    """1-based row number, for messages."""
    consumed_samples: int
    b_simple_samples: float | None
    """B_simple in samples; None where it was not measurable."""
    iteration: int | None = None


@dataclass(frozen=True, kw_only=True)
class Frozen:
    """Consumed samples [start, end) where the batch size must not change (end None: to the run's end)."""

    label: str
    start: int
    end: int | None

    def holds(self, consumed_samples: int) -> bool:
        return self.start <= consumed_samples and (self.end is None or consumed_samples < self.end)


@dataclass(frozen=True, kw_only=True)
class DoublingRule:
    """The layout and limits a suggested schedule keeps (see the module docstring for the rule)."""

    micro_batch_size: int
    data_parallel_size: int
    max_global_batch_size: int
    """The cap: GBS doubles only while 2 x GBS <= this."""
    initial_global_batch_size: int | None = None
    """The first stage; default MBS x DP, the smallest batch the layout runs. A multiple of MBS x DP."""
    trust: float = 1.0
    """The estimate is multiplied by this before it is compared with 2 x GBS."""
    frozen: tuple[Frozen, ...] = ()

    def __post_init__(self) -> None:
        require_positive_int("--micro-batch-size", self.micro_batch_size)
        require_positive_int("--data-parallel-size", self.data_parallel_size)
        require_positive_int("--max-global-batch-size", self.max_global_batch_size)
        if not (isinstance(self.trust, (int, float)) and not isinstance(self.trust, bool)
                and math.isfinite(self.trust) and self.trust > 0):
            raise UsageError(f"--trust {self.trust!r} must be a positive finite number: 1 takes the measured "
                             "B_simple as it is, 2 doubles it, 0.5 halves it.")
        start = self.first_global_batch_size
        unit = self.micro_batch_size * self.data_parallel_size
        if start % unit:
            raise multiple_error(f"--global-batch-size {start} (the first stage)", start, self.micro_batch_size,
                                 self.data_parallel_size, error=ScheduleError,
                                 fix="; doubling a multiple keeps every stage one")
        if start > self.max_global_batch_size:
            raise ScheduleError(f"--max-global-batch-size {self.max_global_batch_size} is below the first stage's "
                                f"global batch size {start}; give a cap >= {start}, or a smaller "
                                "--global-batch-size.")

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
    """A row where the estimate called for doubling but ``reason`` held the batch (a frozen range, the cap)."""

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
    """Apply the doubling rule to ``trace`` (rows in increasing consumed samples; see :func:`parse_trace`)."""
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
        if row.consumed_samples == 0:  # the first stage already starts at 0: it starts bigger instead
            stages[0] = (0, 2 * batch)
        else:
            stages.append((row.consumed_samples, 2 * batch))
        decisions.append(Decision(row=row, trusted=trusted, before=batch, after=2 * batch))
        batch *= 2
    return Suggestion(schedule=StepSchedule.from_stages(stages), decisions=tuple(decisions), held=tuple(held))


def _held_by(row: TraceRow, batch: int, rule: DoublingRule) -> str | None:
    """Why the batch may not double at this row, or None."""
    for frozen in rule.frozen:
        if frozen.holds(row.consumed_samples):
            return frozen.label
    if 2 * batch > rule.max_global_batch_size:
        return f"the cap --max-global-batch-size {rule.max_global_batch_size}"
    return None


def _require_increasing(trace: Sequence[TraceRow]) -> None:
    for earlier, later in zip(trace, trace[1:]):
        if later.consumed_samples <= earlier.consumed_samples:
            raise NoiseScaleError(
                f"trace row {later.position} has consumed_samples {later.consumed_samples}, not above row "
                f"{earlier.position}'s {earlier.consumed_samples}: rows must be in the order the run measured them "
                "(a resumed run's log repeats steps: keep the later copy)."
            )


# -- reading a trace ---------------------------------------------------------------------------

#: Megatron's iteration line (its consumed samples) and the extension's noise-scale line, which ends with the
#: consumed samples after the step (a log of an older release has no such field: Megatron's line gives them).
MEGATRON_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?consumed samples:\s+(\d+)")
NOISE_LINE = re.compile(
    r"megatron-ga-ext noise scale \| iteration (\d+) \| B_simple \(EMA\): \S+ tokens, (\S+) samples")
NOISE_CONSUMED = re.compile(r"\| consumed samples: (\d+|n/a) \|")


def read_log(lines: Iterable[str]) -> list[TraceRow]:
    """Rows from a Megatron-LM run's log (``--ga-noise-scale``): each noise-scale line's B_simple in samples, at the
    consumed samples the line gives (whatever K and Megatron's --log-interval); a line without them (an older
    release's) at those of Megatron's line of that iteration. A resumed run's log repeats iterations: the later
    copy is kept. Read line by line (a run's log may be large)."""
    logged: dict[int, int] = {}
    rows: dict[int, tuple[int, float | None]] = {}
    for number, line in enumerate(lines, 1):
        if (noise := NOISE_LINE.search(line)) is not None:
            iteration = int(noise.group(1))
            stated = NOISE_CONSUMED.search(line, noise.end())
            if stated is not None and stated.group(1) != "n/a":
                consumed = int(stated.group(1))
            elif iteration in logged:
                consumed = logged[iteration]
            else:
                raise NoiseScaleError(
                    f"log line {number}: the noise scale of iteration {iteration} gives no consumed samples and comes "
                    "before Megatron's line of that iteration, which gives them (a log of a release that did not print "
                    "them, measured at an iteration Megatron does not log: --ga-noise-scale K not a multiple of "
                    "--log-interval); give the run's --ga-noise-scale-trace file or --tensorboard-dir instead.")
            value = noise.group(2)
            try:
                rows[iteration] = (consumed, None if value == "n/a" else float(value))
            except ValueError:
                raise NoiseScaleError(f"log line {number}: B_simple {value!r} is not a number.") from None
        elif (megatron := MEGATRON_LINE.search(line)) is not None:
            logged[int(megatron.group(1))] = int(megatron.group(2))
        if len(rows) > MAX_ROWS:
            raise NoiseScaleError(f"the log measures more than {MAX_ROWS:,} iterations; measure less often.")
    if not rows:
        raise NoiseScaleError("the log has no \"megatron-ga-ext noise scale\" line: run with --ga-noise-scale K, "
                              "or give the --ga-noise-scale-trace file.")
    data = [{"iteration": i, "consumed_samples": rows[i][0], "b_simple_samples": rows[i][1]} for i in sorted(rows)]
    return parse_trace(data)


def read_trace(text: str, tokens_per_sample: float | None = None) -> list[TraceRow]:
    """Rows from a trace file's text: JSON (a list, or {"rows": [...]}) or JSON Lines (one row per line)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, an int past Python's digit limit, deep nesting
        data = _json_lines(text)
    if isinstance(data, Mapping) and "rows" in data:
        data = data["rows"]
    elif isinstance(data, Mapping):  # one JSON Lines row alone
        data = [data]
    return parse_trace(data, tokens_per_sample)


def _json_lines(text: str) -> list[object]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise NoiseScaleError(f"the trace is neither JSON nor JSON Lines: line {number}: {error.msg} "
                                  f"(column {error.colno}).") from None
        except (ValueError, RecursionError) as error:
            raise NoiseScaleError(f"the trace is neither JSON nor JSON Lines: line {number}: "
                                  f"{type(error).__name__}: {str(error)[:80]}.") from None
    return rows


def parse_trace(data: object, tokens_per_sample: float | None = None) -> list[TraceRow]:
    """Typed rows from loaded JSON (the module docstring gives the format); every malformed row is refused."""
    if not isinstance(data, list):
        raise NoiseScaleError(f"the trace is a JSON {type(data).__name__}; give a list of rows, or "
                              '{"rows": [...]}, e.g. [{"consumed_samples": 0, "b_simple_samples": 120.5}].')
    if not data:
        raise NoiseScaleError("the trace has no rows: give at least one measured step.")
    if len(data) > MAX_ROWS:
        raise NoiseScaleError(f"the trace has {len(data):,} rows, more than {MAX_ROWS:,}; measure less often.")
    if tokens_per_sample is not None and not (math.isfinite(tokens_per_sample) and tokens_per_sample > 0):
        raise UsageError(f"tokens per sample {tokens_per_sample!r} must be a positive finite number.")
    return [_row(position, item, tokens_per_sample) for position, item in enumerate(data, 1)]


def _row(position: int, item: object, tokens_per_sample: float | None) -> TraceRow:
    if not isinstance(item, Mapping):
        raise NoiseScaleError(f"trace row {position} is a JSON {type(item).__name__}, not an object with "
                              '"consumed_samples" and "b_simple_samples".')
    if "consumed_samples" not in item:
        raise NoiseScaleError(f"trace row {position} has no \"consumed_samples\" (keys: {_keys(item)}).")
    iteration = item.get("iteration")
    return TraceRow(
        position=position,
        consumed_samples=_whole(position, "consumed_samples", item["consumed_samples"]),
        b_simple_samples=_estimate(position, item, tokens_per_sample),
        iteration=None if iteration is None else _whole(position, "iteration", iteration),
    )


def _estimate(position: int, item: Mapping, tokens_per_sample: float | None) -> float | None:
    """The row's B_simple in samples: ``b_simple_samples``, else ``b_simple_tokens`` / tokens per sample."""
    if "b_simple_samples" in item:
        return _positive(position, "b_simple_samples", item["b_simple_samples"])
    if "b_simple_tokens" not in item:
        raise NoiseScaleError(f"trace row {position} has neither \"b_simple_samples\" nor \"b_simple_tokens\" "
                              f"(keys: {_keys(item)}).")
    tokens = _positive(position, "b_simple_tokens", item["b_simple_tokens"])
    if tokens is None:
        return None
    if tokens_per_sample is None:
        raise UsageError(f"trace row {position} gives \"b_simple_tokens\" only: give --seq-length (tokens per "
                         "sample) to read it in samples, or write \"b_simple_samples\" in the trace.")
    return tokens / tokens_per_sample


def _keys(item: Mapping) -> str:
    names = sorted(str(key) for key in item)
    return ", ".join(names[:8]) + (f", ... ({len(names)} keys)" if len(names) > 8 else "") or "none"


def _whole(position: int, key: str, value: object) -> int:
    """A whole number in [0, 10**30] (past any sample count, and where every schedule number is bounded)."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = -1
    if isinstance(value, bool) or not 0 <= number <= 10**MAX_EXPONENT:
        raise NoiseScaleError(f"trace row {position} {key} {_shown(value)} is not a whole number from 0 to "
                              f"10**{MAX_EXPONENT}.")
    return number


def _positive(position: int, key: str, value: object) -> float | None:
    """A finite number > 0, or None for null (the estimate was not measurable on that step)."""
    if value is None:
        return None
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int past the float range
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise NoiseScaleError(f"trace row {position} {key} {_shown(value)} is not a positive finite number; write "
                              "null for a step where B_simple was not measurable.")
    return number


def _shown(value: object) -> str:
    """``repr(value)``, cut short: a hostile trace may hold a number of thousands of digits."""
    if isinstance(value, int) and abs(value) >= 10**40:
        digits = str(value)
        return f"{digits[:12]}... ({len(digits)} digits)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
