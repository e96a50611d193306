"""Every stage of a step schedule checked against a layout, before a run reaches it.

Rules, for the stage in force and every later one, with DP today's data-parallel size (and, for
stages not yet reached, each planned one):

    GBS >= MBS x DP                        (at least one micro-batch; upstream does not catch it)
    GBS % (MBS x DP) == 0                  (upstream floors and asserts when training reaches it)
    M = GBS / (MBS x DP) runs interleaved  (VPP > 1: M >= N, M % N in {0} or [PP, N); layout.py's rule)
    GBS never decreases                    (upstream asserts "should not decrease" at the transition)

A listed schedule is checked stage by stage. A long ramp (schedule_rampup.RampStages, batch start +
k x increment at stage k) is checked in closed form: for each rule, the first stage that breaks it
and how many do, in O(log) whatever the number of stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from megatron_ga_ext.core.rules import (
    interleave_error,
    microbatch_group_error,
    multiple_error,
    require_positive_int,
)
from megatron_ga_ext.core.schedule.rampup import RampStages
from megatron_ga_ext.core.schedule.stages import ScheduleProblem, Stage
from megatron_ga_ext.errors import GAError, ScheduleError

__all__ = [
    "CheckLayout",
    "decreasing_stage_error",
    "schedule_problems",
    "stage_error",
    "with_count",
    "zero_microbatch_error",
]


@dataclass(kw_only=True, frozen=True)
class CheckLayout:
    """What the stages are checked against (sizes already checked positive)."""

    micro_batch_size: int
    data_parallel_size: int
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_size: int = 1
    microbatch_group_size: int = 1
    """N: micro-batches per virtual stage (PP when not given)."""
    planned_data_parallel_sizes: tuple[int, ...] = ()
    virtual_pipeline_given: str | None = None
    """How the launch gave VPP, for messages; default ``--virtual-pipeline-model-parallel-size
    V``."""

    @classmethod
    def checked(
        cls,
        micro_batch_size: int,
        data_parallel_size: int,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_size: int | None = None,
        planned_data_parallel_sizes: Sequence[int] = (),
        microbatch_group_size_per_vp_stage: int | None = None,
        virtual_pipeline_given: str | None = None,
    ) -> CheckLayout:
        """Each size refused unless it is an int >= 1 (SizeError naming its flag)."""
        pp = require_positive_int("--pipeline-model-parallel-size", pipeline_model_parallel_size)
        return cls(
            micro_batch_size=require_positive_int("--micro-batch-size", micro_batch_size),
            data_parallel_size=require_positive_int("--data-parallel-size", data_parallel_size),
            pipeline_model_parallel_size=pp,
            virtual_pipeline_size=1
            if virtual_pipeline_size is None
            else require_positive_int(
                "--virtual-pipeline-model-parallel-size", virtual_pipeline_size
            ),
            microbatch_group_size=pp
            if microbatch_group_size_per_vp_stage is None
            else require_positive_int(
                "--microbatch-group-size-per-virtual-pipeline-stage",
                microbatch_group_size_per_vp_stage,
            ),
            planned_data_parallel_sizes=tuple(
                require_positive_int("planned data-parallel size", d)
                for d in planned_data_parallel_sizes
            ),
            virtual_pipeline_given=virtual_pipeline_given,
        )

    @property
    def interleaved(self) -> bool:
        return self.virtual_pipeline_size > 1


def schedule_problems(
    entries: Sequence[Stage], current: int, layout: CheckLayout
) -> list[ScheduleProblem]:
    """Every rule broken by ``entries[current]`` (the stage in force) and every later stage.

    With VPP > 1, N < PP is a layout error, listed once (against the stage in force); the stages are
    then checked for whole micro-batches only.
    """
    found = []
    group_error = (
        microbatch_group_error(layout.microbatch_group_size, layout.pipeline_model_parallel_size)
        if layout.interleaved
        else None
    )
    if group_error is not None:
        found.append(
            ScheduleProblem(stage=entries[current], index=current, future=False, error=group_error)
        )
        layout = replace(layout, virtual_pipeline_size=1)  # the rule on M presumes N >= PP
    if isinstance(entries, RampStages):
        return found + _ramp_problems(entries, current, layout)
    for index in range(current, len(entries)):
        stage, future = entries[index], index > current
        for size in _sizes(layout, future):
            error = stage_error(stage, layout, size)
            if error is not None:
                found.append(ScheduleProblem(stage=stage, index=index, future=future, error=error))
        if future and stage.global_batch_size < entries[index - 1].global_batch_size:
            error = decreasing_stage_error(entries[index - 1], stage)
            found.append(ScheduleProblem(stage=stage, index=index, future=True, error=error))
    return found


def _sizes(layout: CheckLayout, future: bool) -> list[int]:
    """Today's DP, and for a stage not yet reached each planned one too."""
    dp = layout.data_parallel_size
    planned = dict.fromkeys(
        d for d in layout.planned_data_parallel_sizes if d != dp
    )  # once each, in order
    return [dp] + (list(planned) if future else [])


def stage_error(
    stage: Stage, layout: CheckLayout, data_parallel_size: int | None = None
) -> GAError | None:
    """The first rule ``stage`` breaks at ``data_parallel_size`` (default today's), in the order of
    the module docstring; None if it runs."""
    dp = layout.data_parallel_size if data_parallel_size is None else data_parallel_size
    planned = dp != layout.data_parallel_size
    mbs, batch = layout.micro_batch_size, stage.global_batch_size
    unit = mbs * dp
    if batch < unit:
        return zero_microbatch_error(stage, mbs, dp, planned)
    if batch % unit:
        return multiple_error(
            stage.describe(),
            batch,
            mbs,
            dp,
            dp_name=f"{'planned ' if planned else ''}data-parallel size",
            dp_source=f" (upstream floors it to {batch // unit} micro-batches and asserts when "
            "training reaches it)",
            error=ScheduleError,
        )
    if layout.interleaved:
        given = (
            layout.virtual_pipeline_given
            or f"--virtual-pipeline-model-parallel-size {layout.virtual_pipeline_size}"
        )
        return interleave_error(
            stage.describe(),
            batch,
            mbs,
            dp,
            layout.pipeline_model_parallel_size,
            given,
            layout.microbatch_group_size,
        )
    return None


def zero_microbatch_error(stage: Stage, mbs: int, dp: int, planned: bool = False) -> ScheduleError:
    unit = mbs * dp
    return ScheduleError(
        f"{stage.describe()} is smaller than --micro-batch-size {mbs} x "
        f"{'planned ' if planned else ''}data-parallel size {dp} = {unit}, so it gives 0 "
        "micro-batches per step (upstream does not catch "
        f"this). Use a batch size that is a multiple of {unit}, e.g. {unit}."
    )


def decreasing_stage_error(previous: Stage, stage: Stage) -> ScheduleError:
    return ScheduleError(
        f"{stage.describe()} is smaller than entry {previous.position}'s "
        f"{previous.global_batch_size}; the batch "
        "size must never decrease (Megatron's training loop asserts the number of micro-batches "
        '"should not '
        f'decrease" when it reaches this stage). Use a batch size >= {previous.global_batch_size}.'
    )


def with_count(error: GAError, others: int) -> GAError:
    """``error`` with the number of further problems, for the one a caller raises."""
    if others == 0:
        return error
    more = (
        f" ({others:,} more problem{'s' if others > 1 else ''} in later stages; `megatron-ga "
        "schedule` lists them.)"
    )
    return type(error)(f"{error}{more}")


# -- a long ramp, in closed form ------------------------------------------------------------------


def _ramp_problems(ramp: RampStages, current: int, layout: CheckLayout) -> list[ScheduleProblem]:
    """The stage in force, then the later ones (also at each planned DP): one problem per rule
    broken."""
    found = []
    last = ramp.num_stages - 1
    for low, high, sizes in (
        (current, current, _sizes(layout, False)),
        (current + 1, last, _sizes(layout, True)),
    ):
        for size in sizes if low <= high else []:
            for first, count in _ramp_rule_hits(ramp, low, high, layout, size):
                stage = ramp[first]
                error = stage_error(stage, layout, size)
                if error is None:  # cannot happen: the closed forms follow stage_error's rules
                    raise AssertionError(f"closed form disagrees with stage_error at stage {first}")
                if count > 1:
                    error = type(error)(f"{error} (So do {count - 1:,} later stages of the ramp.)")
                found.append(
                    ScheduleProblem(
                        stage=stage, index=first, future=first > current, error=error, count=count
                    )
                )
    return found


def _ramp_rule_hits(
    ramp: RampStages, low: int, high: int, layout: CheckLayout, dp: int
) -> list[tuple[int, int]]:
    """(first stage, number of stages) in [low, high] for each rule of stage_error that any of them
    breaks.

    With b_k = start + k x inc and U = MBS x DP: b_k < U for k < kz; among k >= kz, b_k % U == 0
    exactly for k = r (mod m), m = U / gcd(inc, U); there M = b_k / U runs M_r + t x (inc / gcd)
    along t.
    """
    start, inc, unit = ramp.ramp.start, ramp.ramp.increment, layout.micro_batch_size * dp
    hits = []
    zero_end = min(high, -(-(unit - start) // inc) - 1)  # the last k with b_k < U
    if zero_end >= low:
        hits.append((low, zero_end - low + 1))
    low = max(low, zero_end + 1)
    if low > high:
        return hits
    g = math.gcd(inc, unit)
    if start % g:
        return hits + [(low, high - low + 1)]  # b_k = start (mod g): no stage is a multiple of U
    m = unit // g
    r = (-(start // g) * pow(inc // g, -1, m)) % m if m > 1 else 0
    good = _count_congruent(low, high, r, m)
    if good < high - low + 1:
        first_bad = low if low % m != r else low + 1
        hits.append((first_bad, high - low + 1 - good))
    if good and layout.interleaved:
        hits += _interleave_hits(ramp, low, high, r, m, unit, layout)
    return sorted(hits)


def _count_congruent(low: int, high: int, r: int, m: int) -> int:
    """How many k in [low, high] have k = r (mod m)."""
    return (high - r) // m - (low - 1 - r) // m


def _interleave_hits(
    ramp: RampStages, low: int, high: int, r: int, m: int, unit: int, layout: CheckLayout
) -> list[tuple[int, int]]:
    """Among the stages with whole micro-batches, k = r + m t, those whose M breaks the interleaved
    rule."""
    t_low, t_high = -((r - low) // m), (high - r) // m
    m_first = ramp.batch(r + m * t_low) // unit
    step = ramp.ramp.increment * m // unit
    group, pp = layout.microbatch_group_size, layout.pipeline_model_parallel_size
    below_group = max(
        0, min(t_high - t_low + 1, -(-(group - m_first) // step))
    )  # M < N for the first ones
    t_from = t_low + below_group
    count = below_group + _residue_count(
        m_first + step * below_group, step, t_high - t_from + 1, group, pp
    )
    if count == 0:
        return []
    if below_group:
        return [(r + m * t_low, count)]
    first = _first_residue(m_first, step, t_high - t_low + 1, group, pp)
    return [(r + m * (t_low + first), count)]


def _residue_count(x0: int, step: int, terms: int, group: int, pp: int) -> int:
    """How many x = x0 + step x j, j in [0, terms), have x % N in [1, PP - 1]; O(log N).

    [x % N < t] = floor(x / N) - floor((x - t) / N) for 0 <= t <= N, applied to x - 1 and t = PP -
    1.
    """
    if terms <= 0 or pp <= 1:
        return 0
    return _floor_sum(terms, group, step, x0 - 1) - _floor_sum(terms, group, step, x0 - pp)


def _first_residue(x0: int, step: int, terms: int, group: int, pp: int) -> int:
    """The least j with (x0 + step x j) % N in [1, PP - 1] (one exists): bisection on the count."""
    low, high = 0, terms - 1
    while low < high:
        middle = (low + high) // 2
        if _residue_count(x0, step, middle + 1, group, pp):
            high = middle
        else:
            low = middle + 1
    return low


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum_{i=0}^{n-1} floor((a i + b) / m) for m >= 1, any a and b, in O(log m) (the Euclid-like
    reduction)."""
    total = 0
    while n > 0:
        qa, a = divmod(a, m)
        qb, b = divmod(b, m)
        total += qa * n * (n - 1) // 2 + qb * n
        y_max = a * n + b
        if y_max < m:
            break
        n, b, m, a = y_max // m, y_max % m, a, m
    return total
