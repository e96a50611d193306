"""``--ga-lr-scaling {none,sqrt,linear}``: each stage of a step batch-size schedule trains at a
learning rate scaled by its batch size.

    lr = Megatron's scheduled lr x (GBS / GBS of the first stage) ** exponent      sqrt: 1/2 (Adam), linear: 1

Megatron's ``OptimizerParamScheduler.get_lr(param_group)`` gives each param group its rate (warmup
and decay from that group's ``max_lr`` / ``min_lr``, so decoupled-LR groups too), and
``step(increment)`` writes it into the group; the wrapper multiplies what ``get_lr`` returns.

The rate ``step()`` writes is the one the next optimizer step trains with, so GBS is the batch of
that step: the schedule at the samples consumed when it runs: the samples the host loop has counted
(``Host.consumed_samples``, host.py) plus, when ``step()`` runs inside a training step, the batch of
that step, which the loop counts only after it returns (the live calculator's current GBS; "inside a
training step": a training forward/backward call ran since the scheduler's count last changed). Not
the scheduler's ``num_steps``: a skipped step (an fp16 overflow, ``--ga-zero-token-policy skip``,
``--iterations-to-skip``) holds it, while consumed samples, and with them the batch, advance, so
every later stage's factor would come late. Outside both loops' steps (a megatron-core loop) the
schedule is read at ``num_steps``, which such a loop steps by each step's GBS. Megatron writes the
rates only after a successful step: the step right after a skipped one would train at the rate
written before it, the skipped step's batch's factor, which differs where that skipped step was the
last of its stage; before each optimizer step in Megatron-LM's loop, rates written for another batch
than the step's are written again (:meth:`ScaledRates. before_step`: a comparison of two ints per
step, a rewrite only after such a skip). A resumed ``--ga-batch-size-warmup auto`` run restores its
stages after the scheduler's ``load_state_dict`` has written the rates; the rates are written again
then (``Installation.after_load``), so the first resumed step has its stage's factor too. The factor
itself is core/lr_factor.py's, as the ``schedule`` table's hints.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_ga_ext.config.launch_rules import check_lr_scaling
from megatron_ga_ext.core.lr_factor import lr_factor
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.integration.calculator import live_step_calculator
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.logs import get_logger

__all__ = ["ScaledRates", "scaled_get_lr", "stage_factors"]

logger = get_logger(__name__)

#: How many stages the start-up line lists before it elides (a converted rampup can have thousands).
LISTED_STAGES = 8


def stage_factors(schedule: StepSchedule, lr_scaling: str) -> str:
    """The factor of each stage in words, for the start-up log (the first LISTED_STAGES and the
    last)."""
    first = schedule.entries[0].global_batch_size
    count = schedule.num_stages
    shown = list(range(min(count, LISTED_STAGES)))
    if count > LISTED_STAGES:
        shown.append(count - 1)
    parts = []
    for index in shown:
        stage = schedule.entries[index]
        if index == count - 1 and count > LISTED_STAGES:
            parts.append("...")
        parts.append(
            f"x {lr_factor(stage.global_batch_size, first, lr_scaling):.6g} from sample "
            f"{stage.threshold_samples} (GBS {stage.global_batch_size})"
        )
    return ", ".join(parts)


def scaled_get_lr(
    original: Callable, live: Callable[[], tuple[ScaledRates, str, int] | None]
) -> Callable:
    """``OptimizerParamScheduler.get_lr``, returning the scaled rate (a class attribute: every
    scheduler, also one built before install(), looks it up there). ``live()``: the rates kept (the
    BatchSchedule feature's), the --ga-lr-scaling mode and the training calls so far; None where
    nothing is scaled."""

    @functools.wraps(original)
    def get_lr(scheduler: Any, param_group: dict) -> float:
        unscaled: float = original(scheduler, param_group)
        found = live()
        if found is None:
            return unscaled
        rates, scaling, training_schedules = found
        schedule = _live_schedule(scaling)
        if rates.logged is not schedule:
            rates.logged = schedule
            logger.info(
                "--ga-lr-scaling %s: the learning rate %s",
                scaling,
                stage_factors(schedule, scaling),
            )
        first = schedule.entries[0].global_batch_size
        batch = rates.rewriting
        if batch is None:
            batch = next_step_batch(schedule, scheduler, training_schedules, rates.counts)
        rates.written[scheduler] = batch
        return unscaled * lr_factor(batch, first, scaling)

    return get_lr


@dataclass
class ScaledRates:
    """What the scaled ``get_lr`` keeps between calls, per scheduler (weakly held): its last
    :class:`_Count` (see next_step_batch) and the batch whose factor it last wrote; and the schedule
    whose factors were logged (at start-up, and again if replaced)."""

    counts: weakref.WeakKeyDictionary[Any, _Count] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    written: weakref.WeakKeyDictionary[Any, int] = field(default_factory=weakref.WeakKeyDictionary)
    logged: StepSchedule | None = None
    rewriting: int | None = None
    """The batch :meth:`before_step` writes the rates for, while it does."""

    def before_step(self, optimizer: Any) -> None:
        """Before ``optimizer``'s step in Megatron-LM's loop: its schedulers whose rates were
        written for another batch than this step's (the live calculator's current GBS; the step
        before was skipped and was the last of its stage) write them again at their count, with this
        step's factor (``step(0)``, as after a load)."""
        live = live_step_calculator()
        if live is None or not self.written or current_host().consumed_samples() is None:
            return
        batch = live.get_current_global_batch_size()
        for scheduler, written in list(self.written.items()):
            if written != batch and getattr(scheduler, "optimizer", None) is optimizer:
                self.rewriting = batch
                try:
                    scheduler.step(0)
                finally:
                    self.rewriting = None


@dataclass(frozen=True)
class _Count:
    """A scheduler's ``num_steps`` and the training calls seen when it last changed, and whether a
    training call ran since the change before (then the rates it writes follow a step the loop has
    not counted yet)."""

    num_steps: int
    training_schedules: int
    in_step: bool


def next_step_batch(
    schedule: StepSchedule,
    scheduler: Any,
    training_schedules: int,
    counts: weakref.WeakKeyDictionary[Any, _Count],
) -> int:
    """The GBS of the step that trains with the rate ``scheduler`` writes now (see the module
    docstring): the schedule at Megatron's consumed samples, plus the live calculator's current GBS
    where a training call (``training_schedules``: liveness.Counts.training_schedules) ran since the
    scheduler's count last changed; without Megatron-LM's args, at ``scheduler.num_steps``.
    ``counts`` keeps each scheduler's last :class:`_Count`, so every param group of one ``step()``
    reads the same step."""
    last = counts.get(scheduler)
    if last is None or (last.num_steps, last.training_schedules) != (
        scheduler.num_steps,
        training_schedules,
    ):
        in_step = training_schedules > (last.training_schedules if last is not None else 0)
        last = counts[scheduler] = _Count(scheduler.num_steps, training_schedules, in_step)
    consumed = current_host().consumed_samples()
    if consumed is None:
        return schedule.global_batch_size_at(scheduler.num_steps)
    live = live_step_calculator()
    pending = live.get_current_global_batch_size() if last.in_step and live is not None else 0
    return schedule.global_batch_size_at(consumed + pending)


def _live_schedule(lr_scaling: str) -> StepSchedule:
    """The step schedule of the live calculator (under the guard); without one, the rule's
    OptionError."""
    live = live_step_calculator()
    if live is None:
        check_lr_scaling(lr_scaling, None)  # raises: sqrt / linear without a schedule
    return live.step_schedule  # type: ignore[union-attr]  # not None: check_lr_scaling raised
