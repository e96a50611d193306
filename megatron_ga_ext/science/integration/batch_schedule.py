"""The batch schedule in the run as a feature (features.py): the batch size and the learning rate
change together.

``--ga-batch-size-warmup auto`` doubles the global batch from the noise scale's measurements
(batch_warmup.py), and ``--ga-lr-scaling`` scales each step's rate by that step's batch
(lr_scaling.py), as OLMo-core's batch-size scheduler changes both. Its state across a resume (the
sidecar's ``batch_schedule`` part, layout 1): ``{"stages": [[threshold_samples, GBS], ...] or
null}``, the step schedule the warmup has written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_ga_ext.errors import ScheduleStateError
from megatron_ga_ext.integration.calculator import live_step_calculator
from megatron_ga_ext.integration.features import Feature, Handle, Loaded, OptimizerStep
from megatron_ga_ext.integration.hook_rows import Hook
from megatron_ga_ext.logs import get_logger
from megatron_ga_ext.science.integration.batch_warmup import BatchSizeWarmup
from megatron_ga_ext.science.integration.lr_scaling import ScaledRates, scaled_get_lr

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = ["BatchSchedule", "scaled_rates_get_lr"]

logger = get_logger(__name__)


def scaled_rates_get_lr(original: Callable, state: Installation) -> Callable:
    """``OptimizerParamScheduler.get_lr`` scaled by this step's batch (lr_scaling.scaled_get_lr),
    with the rates the installation's BatchSchedule keeps."""

    def live() -> tuple[ScaledRates, str, int] | None:
        scaling = state.config.lr_scaling
        schedule = state.feature(BatchSchedule) if state.active and scaling != "none" else None
        return (
            None if schedule is None else (schedule.rates, scaling, state.counts.training_schedules)
        )

    return scaled_get_lr(original, live)


class BatchSchedule(Feature):
    """The warmup's decisions and the scaled rates."""

    name = "batch_schedule"
    version = 1
    flags = (
        "--ga-batch-size-warmup",
        "--ga-batch-size-warmup-trust",
        "--ga-batch-size-warmup-max",
        "--ga-lr-scaling",
    )
    hooks = (
        Hook(
            "optimizer_step",
            "megatron.core.optimizer_param_scheduler",
            "OptimizerParamScheduler.get_lr",
            scaled_rates_get_lr,
            when=lambda state: state.config.lr_scaling != "none",
            does="--ga-lr-scaling: the rate times (GBS / first GBS) ** 1/2 or ** 1",
        ),
    )

    def __init__(self, handle: Handle) -> None:
        super().__init__(handle)
        config = handle.config
        self.warmup = BatchSizeWarmup(config) if config.batch_size_warmup == "auto" else None
        self.rates = ScaledRates()
        """--ga-lr-scaling: what each scheduler's rates were written for (lr_scaling.py)."""

    def before_optimizer_step(self, step: OptimizerStep) -> None:
        """The rates of this step's batch (--ga-lr-scaling), after a skipped step too."""
        if self.handle.config.lr_scaling != "none":
            self.rates.before_step(step.optimizer)

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """The warmup's doubling decision on the step's trace row."""
        if self.warmup is not None and step.measurement is not None:
            self.warmup.decide(step.measurement, live_step_calculator())

    def extra_samples(self) -> int:
        """Under the warmup, up to its cap more than the planned steps (a schedule decided
        later)."""
        return (self.warmup.cap or 0) if self.warmup is not None else 0

    def state_dict(self) -> dict[str, Any] | None:
        return (
            None if self.warmup is None else {"stages": self.warmup.stages(live_step_calculator())}
        )

    def load_state_dict(
        self, saved: dict[str, Any] | None, version: int, loaded: Loaded, where: str
    ) -> None:
        """Restored warmup stages made live before the loop reads the loaded run's batch and rates.
        The load has already updated the calculator at the loaded consumed samples, and the
        scheduler's ``load_state_dict`` written the rates (--ga-lr-scaling's factor), both with the
        first stage only: left so, the loop's first update would see the batch change and save the
        loaded iteration again, in place, and the first step would train at the first stage's
        rate."""
        if self.warmup is None:
            return
        if saved is not None and (
            version != self.version or not isinstance(saved, dict) or set(saved) != {"stages"}
        ):
            raise ScheduleStateError(
                f"the batch-size warmup state in {where} has layout {version} {saved!r}, not "
                f"{self.version} "
                "{'stages': ...}: resume with the release that wrote it, or delete it to start "
                "the warmup afresh."
            )
        stages = None if saved is None else saved["stages"]
        if not stages:
            logger.warning(
                "megatron-ga-ext: the checkpoint of iteration %d keeps no batch-size warmup "
                "stages: --ga-batch-size-warmup auto starts again from "
                "--global-batch-size",
                loaded.iteration,
            )
            return
        self.warmup.restore(stages, live_step_calculator())
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        # through the guard: its baseline too
        update_num_microbatches(loaded.consumed_samples, consistency_check=True, verbose=True)
        if loaded.scheduler is not None:
            loaded.scheduler.step(
                0
            )  # each group's rate and weight decay written again at its count, as built
