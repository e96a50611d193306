"""The deprecated ``--rampup-batch-size START INCREMENT SAMPLES`` as the equal step schedule.

megatron-core 0.16.1's ``RampupBatchsizeNumMicroBatchesCalculator``, with n = (GBS - start) /
increment and per = ramp_samples / n (a float)::

    GBS(c) = GBS                                      if c > ramp_samples
           = start + g(c) x increment,  g(c) = int(c / per)   otherwise

Stage k (batch start + k x increment, k = 0..n) begins at c_k, the least integer c with g(c) >= k;
the float arithmetic is followed exactly, so the boundaries match upstream's to the sample.

A ramp of up to :data:`LISTED_RAMP` increments is listed, stage by stage; stages that collide (per <
1) keep the larger batch, as upstream reaches it at that count. A longer ramp (a rampup to a GBS of
10**12 has billions of increments) is described, not listed: :class:`RampStages` computes stage k
when it is read, and the stage in force at c is stage g(c), in O(1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from megatron_ga_ext.core.numbers import MAX_EXPONENT, is_int, read_int
from megatron_ga_ext.core.rules import divisor_list, require_positive_int
from megatron_ga_ext.core.schedule.stages import Stage
from megatron_ga_ext.errors import ScheduleError, SizeError

__all__ = ["LISTED_RAMP", "RampStages", "check_rampup", "listed_rampup_stages", "rampup_triple"]

FLAG = "--rampup-batch-size"

#: Ramps with at most this many increments are listed stage by stage; longer ones are
#: :class:`RampStages`.
LISTED_RAMP = 10_000


def check_rampup(start: int, increment: int, ramp_samples: int, global_batch_size: int) -> None:
    """Upstream 0.16.1's assertions (start > 0, increment > 0, ramp >= 0, GBS > 0: ScheduleError is
    an AssertionError too) and that the ramp lands on GBS; sizes above 10**30 are refused."""
    require_positive_int(f"{FLAG} start batch size", start, below_one=ScheduleError)
    require_positive_int(f"{FLAG} batch size increment", increment, below_one=ScheduleError)
    require_positive_int("--global-batch-size", global_batch_size, below_one=ScheduleError)
    whole = isinstance(ramp_samples, int) and not isinstance(ramp_samples, bool)
    if not whole or ramp_samples < 0:
        raise (ScheduleError if whole else SizeError)(
            f"{FLAG} ramp-up samples {ramp_samples!r} must be a whole number >= 0; give 0 for no "
            "ramp, or the "
            f"samples to ramp over."
        )
    named = (
        ("ramp-up samples", ramp_samples),
        ("start batch size", start),
        ("--global-batch-size", global_batch_size),
    )
    for name, value in named:
        if value > 10**MAX_EXPONENT:
            raise SizeError(
                f"{FLAG} {name} {value} is larger than 1e{MAX_EXPONENT}; no run consumes that much."
            )
    diff = global_batch_size - start
    if diff < 0:
        raise ScheduleError(
            f"{FLAG} start batch size {start} exceeds --global-batch-size {global_batch_size}; a "
            "ramp only "
            f"grows. Use a start <= {global_batch_size}."
        )
    if diff % increment:
        raise ScheduleError(
            f"{FLAG} increment {increment} does not divide --global-batch-size "
            f"{global_batch_size} - start {start} = {diff}, so the ramp never lands on "
            "the global batch size. Use an increment in "
            f"{{{divisor_list(diff, limit=8)}}}."
        )


@dataclass(frozen=True)
class _Ramp:
    """Upstream's arithmetic of one ramp (n >= 1 increments over ramp_samples >= 1)."""

    start: int
    increment: int
    ramp_samples: int
    global_batch_size: int

    @property
    def increments(self) -> int:
        """n = (GBS - start) / increment."""
        return (self.global_batch_size - self.start) // self.increment

    def increments_at(self, consumed: int) -> int:
        """g(c): increments in force at ``consumed`` samples, upstream's float arithmetic to the
        sample."""
        if consumed > self.ramp_samples:
            return self.increments
        per_increment = self.ramp_samples / self.increments  # float, as upstream computes it
        return min(self.increments, int(consumed / per_increment))

    def threshold(self, k: int) -> int:
        """c_k: the least consumed count with g(c) >= k (c_0 = 0).

        Closed form in upstream's float arithmetic (:func:`_float_threshold`), checked against g at
        c_k and c_k - 1; should the check ever fail, a search from that estimate finds it (O(log
        ramp_samples)).
        """
        if k == 0:
            return 0
        reached = lambda c: self.increments_at(c) >= k  # noqa: E731
        high = self.ramp_samples + 1  # g(c) = n past the ramp
        guess = min(_float_threshold(k, self.ramp_samples / self.increments), high)
        if reached(guess) and (guess == 0 or not reached(guess - 1)):
            return guess
        return _least(reached, 0, high, guess)


def listed_rampup_stages(
    start: int, increment: int, ramp_samples: int, global_batch_size: int
) -> list[tuple[int, int]]:
    """Every distinct stage of a ramp of at most :data:`LISTED_RAMP` increments, as (threshold,
    GBS)."""
    ramp = _Ramp(start, increment, ramp_samples, global_batch_size)
    stages: list[tuple[int, int]] = [(0, start)]
    for k in range(1, ramp.increments + 1):
        low = ramp.threshold(k)
        batch = start + ramp.increments_at(low) * increment
        if stages[-1][0] == low:
            stages[-1] = (low, batch)
        elif batch != stages[-1][1]:
            stages.append((low, batch))
    return stages


class RampStages(Sequence[Stage]):
    """The n + 1 stages of a long ramp, stage k = (c_k, start + k x increment), computed when read.

    Where the ramp has more increments than samples (per < 1), several stages begin at the same
    sample: the last of them is the one in force (as upstream), the others never are. ``index_at``
    is exact in every case: the stage in force at c is g(c).
    """

    def __init__(
        self, start: int, increment: int, ramp_samples: int, global_batch_size: int
    ) -> None:
        self.ramp = _Ramp(start, increment, ramp_samples, global_batch_size)
        self.num_stages = self.ramp.increments + 1
        """n + 1, which may pass what ``len()`` returns (``schedule_stages.stage_count`` reads
        either)."""

    def __len__(self) -> int:
        return self.num_stages

    @overload
    def __getitem__(self, index: int) -> Stage: ...

    @overload
    def __getitem__(self, index: slice) -> list[Stage]: ...

    def __getitem__(self, index: int | slice) -> Stage | list[Stage]:
        if isinstance(index, slice):
            return [self[k] for k in range(self.num_stages)[index]]
        k = range(self.num_stages)[index]  # IndexError past the end, negative indices from the end
        return Stage(
            threshold_samples=self.ramp.threshold(k),
            global_batch_size=self.batch(k),
            position=k + 1,
        )

    def __iter__(self) -> Iterator[Stage]:
        return (self[k] for k in range(self.num_stages))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RampStages) and self.ramp == other.ramp

    def __hash__(self) -> int:
        return hash(self.ramp)

    def batch(self, k: int) -> int:
        """The global batch size of stage k: start + k x increment."""
        return self.ramp.start + k * self.ramp.increment

    def index_at(self, consumed: int) -> int:
        """The stage in force at ``consumed`` samples: g(consumed), O(1)."""
        return self.ramp.increments_at(consumed)

    def describe(self) -> str:
        """``N stages: first second ... last`` (thresholds in samples)."""
        return (
            f"{self.num_stages:,} stages: {self[0].spelling} {self[1].spelling} ... "
            f"{self[-1].spelling}"
        )


def _float_threshold(k: int, per_increment: float) -> int:
    """The least integer c with int(c / per_increment) >= k as Python computes it: c rounded to a
    float, divided in floats. First the least float x with int(x / per_increment) >= k (a step or
    two from k x per_increment), then the least integer that rounds to x or above (every integer up
    to 2^53 is a float; above, each float stands for the integers that round to it)."""
    x = k * per_increment
    while x > 0 and int(math.nextafter(x, 0.0) / per_increment) >= k:
        x = math.nextafter(x, 0.0)
    while int(x / per_increment) < k:
        x = math.nextafter(x, math.inf)
    if x <= 2.0**53:
        return math.ceil(x)
    c = (int(math.nextafter(x, 0.0)) + int(x)) // 2  # the rounding boundary below x
    while float(c) >= x:
        c -= 1
    while float(c) < x:
        c += 1
    return c


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


def rampup_triple(values: Sequence[int | str]) -> tuple[int, int, int]:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as three ints (argparse and launch lines give
    strings).

    Raises SizeError for another number of values or a value that is not a whole number; the ramp's
    own rules (start >= 1, ...) are :meth:`StepSchedule.from_rampup`'s.
    """
    if isinstance(values, (str, bytes)) or len(values) != 3:
        shown = [values] if isinstance(values, (str, bytes)) else list(values)
        raise SizeError(
            "--rampup-batch-size takes three values, START INCREMENT SAMPLES (e.g. 16 8 300000); "
            "got "
            f"{len(shown)}: {' '.join(map(str, shown))}."
        )
    triple = []
    for name, value in zip(("start batch size", "increment", "ramp-up samples"), values):
        if isinstance(value, str) and is_int(value):
            value = read_int(f"--rampup-batch-size {name}", value, error=SizeError)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SizeError(f"--rampup-batch-size {name} {value!r} is not a whole number.")
        triple.append(value)
    return triple[0], triple[1], triple[2]
