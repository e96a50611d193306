"""The noise-scale trace: one row per measured step, written by the run (``--ga-noise-scale K``) and
read back by ``megatron-ga schedule --suggest``. One home for its format: the row's keys, its JSON
Lines line, its log line, its TensorBoard tags, and the readers of all three. Pure Python.

The trace format (JSON: a list of rows, or {"rows": [...]}; or JSON Lines, a row per line), one row
per measured step, in increasing order of consumed samples:

    {"iteration": 1200, "consumed_samples": 614400, "b_simple_samples": 1830.5}

* ``consumed_samples`` (required): whole number >= 0, strictly increasing from row to row;
* ``b_simple_samples``: B_simple in samples (from the EMAs: a one-step ratio is noise); or
  ``b_simple_tokens`` with ``tokens_per_sample`` (the caller's --seq-length, or loss tokens per
  sample): where a row has both, ``b_simple_samples`` is used. null (not measurable: an estimate <=
  0) is skipped;
* ``iteration`` (optional) and any other keys (``grad_sq``, ``trace_sigma``, ...) are kept for
  reading, not used.

The run writes every key of :func:`trace_row` (``b_simple_samples`` = ``b_simple_tokens`` /
``tokens_per_sample``, at the step's loss tokens per sample N / GBS; null before Megatron's args
give the consumed samples).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_ga_ext.core.numbers import MAX_EXPONENT
from megatron_ga_ext.errors import NoiseScaleError, UsageError

__all__ = [
    "SCALARS",
    "TraceRow",
    "json_line",
    "log_line",
    "parse_trace",
    "read_log",
    "read_trace",
    "scalar_tag",
    "trace_row",
]

#: At most this many trace rows are read (a measurement every step of a million-step run).
MAX_ROWS = 1_000_000

#: The trace row's values logged to TensorBoard and W&B (as :func:`scalar_tag` names them).
SCALARS = (
    "b_simple_tokens",
    "b_simple_samples",
    "grad_sq",
    "trace_sigma",
    "grad_sq_ema",
    "trace_sigma_ema",
    "consumed_samples",
)


@dataclass(frozen=True, kw_only=True)
class TraceRow:
    """One measured step of a trace."""

    position: int
    """1-based row number, for messages."""
    consumed_samples: int
    b_simple_samples: float | None
    """B_simple in samples; None where it was not measurable."""
    iteration: int | None = None


# -- writing: the row, its JSON line, its log line, its TensorBoard tag ---------------------------


def trace_row(
    *,
    iteration: int | None,
    consumed_samples: int | None,
    b_simple_tokens: float | None,
    b_simple_samples: float | None,
    tokens_per_sample: float | None,
    grad_sq: float,
    trace_sigma: float,
    grad_sq_ema: float | None,
    trace_sigma_ema: float | None,
    step_b_simple_tokens: float | None,
    tokens: int,
    replicas: int,
) -> dict[str, Any]:
    """The row of one measured step, its keys in the order the trace file writes them (the module
    docstring)."""
    return {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "b_simple_tokens": b_simple_tokens,
        "b_simple_samples": b_simple_samples,
        "tokens_per_sample": tokens_per_sample,
        "grad_sq": grad_sq,
        "trace_sigma": trace_sigma,
        "grad_sq_ema": grad_sq_ema,
        "trace_sigma_ema": trace_sigma_ema,
        "step_b_simple_tokens": step_b_simple_tokens,
        "tokens": tokens,
        "replicas": replicas,
    }


def json_line(row: Mapping[str, Any]) -> str:
    """The row as the trace file (``--ga-noise-scale-trace``, JSON Lines) holds it: one JSON object
    and a newline."""
    return json.dumps(row) + "\n"


def scalar_tag(name: str) -> str:
    """The TensorBoard / W&B name of a row's value: ``noise-scale/<name with dashes>``."""
    return f"noise-scale/{name.replace('_', '-')}"


def log_line(row: Mapping[str, Any]) -> str:
    """The line the run prints after Megatron's iteration line; :data:`NOISE_LINE` and
    :data:`NOISE_CONSUMED` read it back (:func:`read_log`)."""

    def shown(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4E}"

    return (
        f" megatron-ga-ext noise scale | iteration {row['iteration']} | B_simple (EMA): "
        f"{shown(row['b_simple_tokens'])} tokens, {shown(row['b_simple_samples'])} "
        f"samples | |G|^2: {shown(row['grad_sq'])} (EMA {shown(row['grad_sq_ema'])}) | "
        f"tr(Sigma): {shown(row['trace_sigma'])} (EMA {shown(row['trace_sigma_ema'])}) | "
        f"loss tokens: {row['tokens']} over {row['replicas']} replicas | "
        "consumed samples: "
        f"{'n/a' if row['consumed_samples'] is None else row['consumed_samples']} |"
    )


# -- reading
# ----------------------------------------------------------------------------------------

#: Megatron's iteration line (its consumed samples) and the extension's noise-scale line, which ends
#: with the consumed samples after the step (a log of an older release has no such field: Megatron's
#: line gives them).
MEGATRON_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?consumed samples:\s+(\d+)")
NOISE_LINE = re.compile(
    r"megatron-ga-ext noise scale \| iteration (\d+) \| B_simple \(EMA\): \S+ tokens, (\S+) samples"
)
NOISE_CONSUMED = re.compile(r"\| consumed samples: (\d+|n/a) \|")


def read_log(lines: Iterable[str]) -> list[TraceRow]:
    """Rows from a Megatron-LM run's log (``--ga-noise-scale``): each noise-scale line's B_simple in
    samples, at the consumed samples the line gives (whatever K and Megatron's --log-interval); a
    line without them (an older release's) at those of Megatron's line of that iteration. A resumed
    run's log repeats iterations: the later copy is kept. Read line by line (a run's log may be
    large)."""
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
                    f"log line {number}: the noise scale of iteration {iteration} gives no "
                    "consumed samples and comes before Megatron's line of that iteration, which "
                    "gives them (a log of a release that did not print them, measured at "
                    "an iteration Megatron does not log: --ga-noise-scale K not a "
                    "multiple of --log-interval); give the run's --ga-noise-scale-trace "
                    "file or --tensorboard-dir instead."
                )
            value = noise.group(2)
            try:
                rows[iteration] = (consumed, None if value == "n/a" else float(value))
            except ValueError:
                raise NoiseScaleError(
                    f"log line {number}: B_simple {value!r} is not a number."
                ) from None
        elif (megatron := MEGATRON_LINE.search(line)) is not None:
            logged[int(megatron.group(1))] = int(megatron.group(2))
        if len(rows) > MAX_ROWS:
            raise NoiseScaleError(
                f"the log measures more than {MAX_ROWS:,} iterations; measure less often."
            )
    if not rows:
        raise NoiseScaleError(
            'the log has no "megatron-ga-ext noise scale" line: run with --ga-noise-scale K, '
            "or give the --ga-noise-scale-trace file."
        )
    data = [
        {"iteration": i, "consumed_samples": rows[i][0], "b_simple_samples": rows[i][1]}
        for i in sorted(rows)
    ]
    return parse_trace(data)


def read_trace(text: str, tokens_per_sample: float | None = None) -> list[TraceRow]:
    """Rows from a trace file's text: JSON (a list, or {"rows": [...]}) or JSON Lines (one row per
    line)."""
    try:
        data = json.loads(text)
    except (
        ValueError,
        RecursionError,
    ):  # JSONDecodeError, an int past Python's digit limit, deep nesting
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
            raise NoiseScaleError(
                f"the trace is neither JSON nor JSON Lines: line {number}: {error.msg} (column "
                f"{error.colno})."
            ) from None
        except (ValueError, RecursionError) as error:
            raise NoiseScaleError(
                f"the trace is neither JSON nor JSON Lines: line {number}: "
                f"{type(error).__name__}: {str(error)[:80]}."
            ) from None
    return rows


def parse_trace(data: object, tokens_per_sample: float | None = None) -> list[TraceRow]:
    """Typed rows from loaded JSON (the module docstring gives the format); every malformed row is
    refused."""
    if not isinstance(data, list):
        raise NoiseScaleError(
            f"the trace is a JSON {type(data).__name__}; give a list of rows, or "
            '{"rows": [...]}, e.g. [{"consumed_samples": 0, "b_simple_samples": 120.5}].'
        )
    if not data:
        raise NoiseScaleError("the trace has no rows: give at least one measured step.")
    if len(data) > MAX_ROWS:
        raise NoiseScaleError(
            f"the trace has {len(data):,} rows, more than {MAX_ROWS:,}; measure less often."
        )
    if tokens_per_sample is not None and not (
        math.isfinite(tokens_per_sample) and tokens_per_sample > 0
    ):
        raise UsageError(
            f"tokens per sample {tokens_per_sample!r} must be a positive finite number."
        )
    return [_row(position, item, tokens_per_sample) for position, item in enumerate(data, 1)]


def _row(position: int, item: object, tokens_per_sample: float | None) -> TraceRow:
    if not isinstance(item, Mapping):
        raise NoiseScaleError(
            f"trace row {position} is a JSON {type(item).__name__}, not an object with "
            '"consumed_samples" and "b_simple_samples".'
        )
    if "consumed_samples" not in item:
        raise NoiseScaleError(
            f'trace row {position} has no "consumed_samples" (keys: {_keys(item)}).'
        )
    iteration = item.get("iteration")
    return TraceRow(
        position=position,
        consumed_samples=_whole(position, "consumed_samples", item["consumed_samples"]),
        b_simple_samples=_estimate(position, item, tokens_per_sample),
        iteration=None if iteration is None else _whole(position, "iteration", iteration),
    )


def _estimate(position: int, item: Mapping, tokens_per_sample: float | None) -> float | None:
    """The row's B_simple in samples: ``b_simple_samples``, else ``b_simple_tokens`` / tokens per
    sample."""
    if "b_simple_samples" in item:
        return _positive(position, "b_simple_samples", item["b_simple_samples"])
    if "b_simple_tokens" not in item:
        raise NoiseScaleError(
            f'trace row {position} has neither "b_simple_samples" nor "b_simple_tokens" (keys: '
            f"{_keys(item)})."
        )
    tokens = _positive(position, "b_simple_tokens", item["b_simple_tokens"])
    if tokens is None:
        return None
    if tokens_per_sample is None:
        raise UsageError(
            f'trace row {position} gives "b_simple_tokens" only: give --seq-length (tokens per '
            'sample) to read it in samples, or write "b_simple_samples" in the trace.'
        )
    return tokens / tokens_per_sample


def _keys(item: Mapping) -> str:
    names = sorted(str(key) for key in item)
    return ", ".join(names[:8]) + (f", ... ({len(names)} keys)" if len(names) > 8 else "") or "none"


def _whole(position: int, key: str, value: object) -> int:
    """A whole number in [0, 10**30] (past any sample count, and where every schedule number is
    bounded)."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = -1
    if isinstance(value, bool) or not 0 <= number <= 10**MAX_EXPONENT:
        raise NoiseScaleError(
            f"trace row {position} {key} {_shown(value)} is not a whole number from 0 to "
            f"10**{MAX_EXPONENT}."
        )
    return number


def _positive(position: int, key: str, value: object) -> float | None:
    """A finite number > 0, or None for null (the estimate was not measurable on that step)."""
    if value is None:
        return None
    try:
        number = (
            float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else math.nan
        )
    except OverflowError:  # an int past the float range
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise NoiseScaleError(
            f"trace row {position} {key} {_shown(value)} is not a positive finite number; write "
            "null for a step where B_simple was not measurable."
        )
    return number


def _shown(value: object) -> str:
    """``repr(value)``, cut short: a hostile trace may hold a number of thousands of digits."""
    if isinstance(value, int) and abs(value) >= 10**40:
        digits = str(value)
        return f"{digits[:12]}... ({len(digits)} digits)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
