"""The one resolver of a launch's batch schedule: given, converted from a rampup, or upstream's own.
Pure Python."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.launch_rules import decrease_if_needed_error, rampup_ignored_message
from megatron_ga_ext.core.schedule.rampup import rampup_triple
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import ScheduleError, SizeError
from megatron_ga_ext.logs import get_logger

logger = get_logger(__name__)


@dataclass(kw_only=True, frozen=True)
class ScheduleInputs:
    """What decides the batch schedule of a launch, and the layout its stages are checked
    against."""

    step_batch_size_schedule: str | None = None
    rampup_batch_size: Sequence[int | str] | None = None
    global_batch_size: int | None = None
    """The GBS a rampup ends at (a schedule sets its own)."""
    seq_length: int | None = None
    """Tokens per sample: schedule thresholds are tokens when set (pretrain_gpt always sets it)."""
    convert_rampup: bool = False
    rampup_ignored_upstream: bool = False
    """The megatron-core in use drops a rampup (0.18+): :func:`resolve_schedule` warns when it is
    not converted."""
    micro_batch_size: int | None = None
    data_parallel_size: int | None = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None
    decrease_batch_size_if_needed: bool = False
    batch_size_warmup: bool = False
    """``--ga-batch-size-warmup auto``: without a schedule, the constant one it adds stages to as it
    measures."""

    @classmethod
    def from_calculator_call(cls, config: GAConfig, arguments: Mapping[str, Any]) -> ScheduleInputs:
        """From the bound arguments of megatron-core's
        ``_configure_global_num_microbatches_calculator`` (any release) and the config: upstream's
        arguments win, the config fills in what a release does not pass."""
        return cls(
            step_batch_size_schedule=arguments.get("step_batch_size_schedule")
            or config.step_batch_size_schedule,
            rampup_batch_size=arguments.get("rampup_batch_size") or config.rampup_batch_size,
            global_batch_size=arguments.get("global_batch_size"),
            seq_length=arguments.get("seq_length") or config.seq_length,
            convert_rampup=config.convert_rampup,
            rampup_ignored_upstream="rampup_batch_size" not in arguments,
            micro_batch_size=arguments.get("micro_batch_size"),
            data_parallel_size=arguments.get("data_parallel_size"),
            pipeline_model_parallel_size=config.pipeline_model_parallel_size or 1,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage=config.microbatch_group_size_per_vp_stage,
            decrease_batch_size_if_needed=bool(arguments.get("decrease_batch_size_if_needed")),
            batch_size_warmup=config.batch_size_warmup == "auto",
        )

    def layout(self) -> dict[str, int | None]:
        """The keywords of :meth:`StepSchedule.problems` and the calculator for this launch's
        layout."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "data_parallel_size": self.data_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_pipeline_size": self.virtual_pipeline_model_parallel_size,
            "microbatch_group_size_per_vp_stage": self.microbatch_group_size_per_vp_stage,
        }


def resolve_schedule(inputs: ScheduleInputs) -> StepSchedule | None:
    """The step batch-size schedule a launch runs, or None for upstream's constant calculator.

        a schedule                  -> that schedule, read exactly (thresholds in tokens with a seq_length)
        a rampup, converted         -> the exactly equivalent schedule (StepSchedule.from_rampup)
        a rampup, not converted     -> None (upstream's own; 0.18+ drops it: warned when rampup_ignored_upstream)
        --ga-batch-size-warmup auto -> 0:GBS, which the warmup extends as it measures
        neither                     -> None

    Raises ScheduleError for a schedule together with a rampup (they set the same thing) and for
    --decrease-batch-size-if-needed with a schedule; SizeError for a rampup value that is not a
    whole number; and every parse or conversion error of the schedule itself. The stages are checked
    against the layout by :meth:`StepSchedule.problems` (``schedule.problems(**inputs.layout())``),
    which check, schedule, the calculator and install all call with the same layout.
    """
    # schedule's modules read their flag names from here
    from megatron_ga_ext.core.schedule.step_schedule import (
        StepSchedule,
    )

    text, rampup = inputs.step_batch_size_schedule, inputs.rampup_batch_size
    if text is not None and rampup is not None:
        raise ScheduleError(
            f"--rampup-batch-size {' '.join(map(str, rampup))} and --step-batch-size-schedule "
            "are both given; they set the same thing. Keep the schedule (`megatron-ga schedule "
            "--from-rampup` prints the rampup's "
            f"equivalent)."
        )
    if text is None and (rampup is None or not inputs.convert_rampup):
        if rampup is not None and inputs.rampup_ignored_upstream:
            logger.warning(rampup_ignored_message(rampup, inputs.global_batch_size))
        if not (
            inputs.batch_size_warmup and rampup is None and inputs.global_batch_size is not None
        ):
            return None
    if inputs.decrease_batch_size_if_needed:
        raise decrease_if_needed_error()
    if text is not None:
        return StepSchedule.parse(text, seq_length=inputs.seq_length)
    if rampup is None:  # --ga-batch-size-warmup auto's first stage
        return StepSchedule.constant(inputs.global_batch_size)  # type: ignore[arg-type]
    if inputs.global_batch_size is None:
        raise SizeError(
            "--global-batch-size is required with --rampup-batch-size: the batch size the ramp "
            "ends at."
        )
    return StepSchedule.from_rampup(*rampup_triple(rampup), inputs.global_batch_size)
