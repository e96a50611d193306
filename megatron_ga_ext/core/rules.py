"""The batch rules a constant batch and every stage of a step schedule share, written once. Pure
Python.

    whole micro-batches:      GBS % (MBS x DP) == 0
    the interleaved schedule: M = GBS / (MBS x DP) >= N and M % N in {0} or [PP, N)   (N defaults to PP)

``layout.py`` (one batch) and ``schedule/checks.py`` (every stage) build their errors here. Every
suggestion (nearest valid values, divisors) is a closed form or a bounded search, so hostile numbers
(a GBS of 10**30) answer at once.
"""

from __future__ import annotations

import math
import operator

from megatron_ga_ext.errors import BatchSizeError, GAError, InterleaveError, SizeError

__all__ = [
    "divisor_list",
    "divisors",
    "interleave_error",
    "interleaved_microbatch_problem",
    "join",
    "microbatch_group_error",
    "multiple_error",
    "nearest_multiples",
    "require_count",
    "require_positive_int",
]

#: Divisors are listed in full up to this square root, else the small ones and their cofactors.
_DIVISOR_SCAN = 4096


def require_positive_int(flag: str, value: object, *, below_one: type[GAError] = SizeError) -> int:
    """Return ``value`` if it is an int >= 1, else raise :class:`SizeError` naming ``flag``.

    ``below_one`` is the type raised for an int < 1: ScheduleError where upstream asserted the same
    thing.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        hint = ""
        if isinstance(value, float) and math.isfinite(value) and value > 0:
            hint = f", e.g. {max(1, math.floor(value))} or {math.ceil(value)}"
        raise SizeError(
            f"{flag} {value!r} is not a whole number: sizes count samples or ranks; give an "
            f"integer >= 1{hint}."
        )
    if value < 1:
        raise below_one(f"{flag} {value} must be at least 1; give an integer >= 1.")
    return value


def require_count(name: str, value: object) -> int:
    """Return ``value`` as an int if it is a whole number >= 0 (an int, or a numpy/torch integer
    scalar), else raise :class:`SizeError` naming ``name``: a count of consumed samples or
    tokens."""
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        count = -1
    if isinstance(value, bool) or count < 0:
        raise SizeError(f"{name} {value!r} must be a whole number >= 0.")
    return count


def nearest_multiples(value: int, step: int, count: int = 2) -> list[int]:
    """The ``count`` positive multiples of ``step`` nearest to ``value`` (ascending): O(count)."""
    low = (value // step) * step
    candidates = [low + step * k for k in range(-count, count + 1) if low + step * k > 0]
    candidates.sort(key=lambda m: (abs(m - value), m))
    return sorted(candidates[:count])


def divisors(n: int) -> tuple[list[int], bool]:
    """(divisors of ``n`` ascending, complete): all of them when sqrt(n) <= 4096, else those up to
    4096 and their cofactors (complete False). At most 4096 trial divisions, whatever ``n`` is."""
    root = math.isqrt(n)
    small = [d for d in range(1, min(root, _DIVISOR_SCAN) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small])), root <= _DIVISOR_SCAN


def divisor_list(n: int, limit: int = 12) -> str:
    """``1, 2, 3, 6``; ``1, 2, ...`` when cut at ``limit`` values or when the divisors are not all
    known."""
    found, complete = divisors(n)
    shown = found[:limit]
    return join(shown) + ("" if complete and len(shown) == len(found) else ", ...")


def join(values: list[int]) -> str:
    """``1, 2, 3``."""
    return ", ".join(str(v) for v in values)


def multiple_error(
    subject: str,
    batch: int,
    micro_batch_size: int,
    data_parallel_size: int,
    *,
    dp_name: str = "data-parallel size",
    dp_source: str = "",
    valid: str = "batch sizes",
    fix: str = "",
    error: type[GAError] = BatchSizeError,
) -> GAError:
    """``subject`` (a batch of ``batch`` samples) does not split into whole micro-batches of MBS x
    DP.

    ``dp_source`` says where DP comes from; ``valid`` names what the nearest multiples are; ``fix``
    adds another way out.
    """
    unit = micro_batch_size * data_parallel_size
    return error(
        f"{subject} is not a multiple of --micro-batch-size {micro_batch_size} x {dp_name} "
        f"{data_parallel_size} = {unit}{dp_source}, so it cannot split into whole "
        f"micro-batches. Nearest valid {valid}: "
        f"{join(nearest_multiples(batch, unit))}{fix}."
    )


def interleave_error(
    subject: str,
    batch: int,
    micro_batch_size: int,
    data_parallel_size: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline: str,
    microbatch_group_size: int | None = None,
    valid: str = "batch sizes",
) -> InterleaveError | None:
    """The interleaved schedule's rule on M = ``batch`` / (MBS x DP) (see
    :func:`interleaved_microbatch_problem`), as an error about ``subject``; None if it runs.
    ``virtual_pipeline`` names the VPP as given, e.g. ``--num-virtual-stages-per-pipeline-rank
    2``."""
    unit = micro_batch_size * data_parallel_size
    problem = interleaved_microbatch_problem(
        batch // unit, pipeline_model_parallel_size, microbatch_group_size
    )
    if problem is None:
        return None
    rule, nearest_m = problem
    return InterleaveError(
        f"{subject} gives num_microbatches = {batch} / (MBS {micro_batch_size} x DP "
        f"{data_parallel_size}) = {batch // unit} with {virtual_pipeline} and "
        f"--pipeline-model-parallel-size {pipeline_model_parallel_size}: {rule}. Nearest "
        f"valid {valid}: {join([m * unit for m in nearest_m])}."
    )


def microbatch_group_error(
    microbatch_group_size: int, pipeline_model_parallel_size: int
) -> InterleaveError | None:
    """The error for N < PP, which the interleaved schedule cannot run (N = micro-batches per
    virtual stage)."""
    group, pp = microbatch_group_size, pipeline_model_parallel_size
    if group >= pp:
        return None
    return InterleaveError(
        f"--microbatch-group-size-per-virtual-pipeline-stage {group} is below "
        f"--pipeline-model-parallel-size {pp}; the interleaved schedule needs N >= PP. "
        f"Use N >= {pp}."
    )


def interleaved_microbatch_problem(
    num_microbatches: int,
    pipeline_model_parallel_size: int,
    microbatch_group_size: int | None = None,
) -> tuple[str, list[int]] | None:
    """The rule the interleaved schedule breaks with M micro-batches, and the two valid M nearest to
    it; None if it runs.

    With N = microbatch_group_size (default PP), schedules.py needs M >= N and M % N in {0} or [PP,
    N). N < PP is a separate error, reported by the caller. O(1): the nearest valid M are found per
    block of N.
    """
    pp, m = pipeline_model_parallel_size, num_microbatches
    group = microbatch_group_size or pp
    if _interleave_runs(m, pp, group):
        return None
    rule = (
        f"the interleaved schedule needs num_microbatches >= N = {group} and num_microbatches % N "
        + ("== 0 (N defaults to PP)" if group == pp else f"in {{0}} or [{pp}, {group})")
    )
    below = _valid_at_most(m, pp, group)
    above = _valid_at_least(m, pp, group)
    candidates = {above, _valid_at_least(above + 1, pp, group)}
    if below is not None:
        candidates.add(below)
        lower = _valid_at_most(below - 1, pp, group)
        if lower is not None:
            candidates.add(lower)
    return rule, sorted(sorted(candidates, key=lambda c: (abs(c - m), c))[:2])


def _interleave_runs(m: int, pp: int, group: int) -> bool:
    return m >= group and not 0 < m % group < pp


def _valid_at_least(m: int, pp: int, group: int) -> int:
    """The least valid M >= m: per block [qN, (q+1)N) the valid ones are qN and [qN + PP, qN +
    N)."""
    if m <= group:
        return group
    q, r = divmod(m, group)
    if r == 0 or r >= pp:
        return m
    return q * group + pp if pp < group else (q + 1) * group


def _valid_at_most(m: int, pp: int, group: int) -> int | None:
    """The largest valid M <= m, or None below N."""
    if m < group:
        return None
    q, r = divmod(m, group)
    return m if r == 0 or r >= pp else q * group
