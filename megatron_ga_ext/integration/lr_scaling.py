"""``--ga-lr-scaling {none,sqrt,linear}``: each stage of a step batch-size schedule trains at a learning rate scaled
by its batch size.

    lr = Megatron's scheduled lr x (GBS / GBS of the first stage) ** exponent      sqrt: 1/2 (Adam), linear: 1

Megatron's ``OptimizerParamScheduler.get_lr(param_group)`` gives each param group its rate (warmup and decay from
that group's ``max_lr`` / ``min_lr``, so decoupled-LR groups too), and ``step(increment)`` writes it into the group;
the wrapper multiplies what ``get_lr`` returns. GBS is the schedule's at the scheduler's ``num_steps``, which counts
samples (Megatron's loops step it by each step's GBS): the rate ``step()`` writes after a step is the next step's, and
the next step's batch is the schedule's at the samples consumed so far, so a stage's first step already has the
stage's factor. A skipped step holds the scheduler, and with it the factor, as Megatron holds the rate. A resumed
``--ga-batch-size-warmup auto`` run restores its stages after the scheduler's ``load_state_dict`` has written the
rates; the rates are written again then (``Installation.after_load``), so the first resumed step has its stage's
factor too. The factor itself is core/lr_factor.py's, as the ``schedule`` table's hints.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_ga_ext.config.launch_rules import check_lr_scaling
from megatron_ga_ext.core.lr_factor import lr_factor
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.integration.calculator import live_step_calculator
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = ["scaled_get_lr", "stage_factors"]

logger = get_logger(__name__)

#: How many stages the start-up line lists before it elides (a converted rampup can have thousands).
LISTED_STAGES = 8


def stage_factors(schedule: StepSchedule, lr_scaling: str) -> str:
    """The factor of each stage in words, for the start-up log (the first LISTED_STAGES and the last)."""
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
        parts.append(f"x {lr_factor(stage.global_batch_size, first, lr_scaling):.6g} from sample "
                     f"{stage.threshold_samples} (GBS {stage.global_batch_size})")
    return ", ".join(parts)


def scaled_get_lr(original: Callable, state: Installation) -> Callable:
    """``OptimizerParamScheduler.get_lr``, returning the scaled rate (a class attribute: every scheduler, also one
    built before install(), looks it up there)."""
    logged: list[StepSchedule] = []  # the schedule whose factors were logged: at start-up, and again if replaced

    @functools.wraps(original)
    def get_lr(scheduler: Any, param_group: dict) -> float:
        if not state.active or state.config.lr_scaling == "none":
            return original(scheduler, param_group)
        scaling = state.config.lr_scaling
        schedule = _live_schedule(scaling)
        if not logged or logged[0] is not schedule:
            logged[:] = [schedule]
            logger.info("--ga-lr-scaling %s: the learning rate %s", scaling, stage_factors(schedule, scaling))
        first = schedule.entries[0].global_batch_size
        batch = schedule.global_batch_size_at(scheduler.num_steps)
        return original(scheduler, param_group) * lr_factor(batch, first, scaling)

    return get_lr


def _live_schedule(lr_scaling: str) -> StepSchedule:
    """The step schedule of the live calculator (under the guard); without one, the rule's OptionError."""
    live = live_step_calculator()
    if live is None:
        check_lr_scaling(lr_scaling, None)  # raises: sqrt / linear without a schedule
    return live.step_schedule
