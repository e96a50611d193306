"""--ga-noise-scale as a feature (features.py): the meter (noise_scale.py) at its phases, and its
EMAs across a resume (the sidecar's ``noise_scale`` part, layout 1: ``{"ema":
NoiseScaleEMA.state_dict(), "measurements": M}``).

The EMAs are kept only under one ``--ga-noise-scale-decay``: the bias correction 1 - decay^n holds
for one decay throughout, so EMAs kept under another start afresh."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from megatron_ga_ext.errors import NoiseScaleError
from megatron_ga_ext.integration.features import (
    Feature,
    Finalizing,
    Handle,
    Loaded,
    OptimizerStep,
    Step,
)
from megatron_ga_ext.integration.hook_rows import Hook
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.logs import get_logger
from megatron_ga_ext.science.core.noise_scale import NoiseScaleEMA
from megatron_ga_ext.science.integration.noise_scale import NoiseScaleMeter, check_core_layout

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = ["NoiseScale", "counting_bucket_group"]

logger = get_logger(__name__)


def counting_bucket_group(original: Callable, state: Installation) -> Callable:
    """``_ParamAndGradBucketGroup.start_grad_sync``: the meter reads the bucket group's gradients
    first, on a measured step (``state``: the Installation, whose NoiseScale feature keeps the
    meter)."""

    @functools.wraps(original)
    def start_grad_sync(group: Any, *args: Any, **kwargs: Any) -> Any:
        feature = state.feature(NoiseScale) if state.active else None
        # upstream returns at once where the first batch's collective is already dispatched
        if feature is not None and not (
            group.is_first_batch and group.grad_reduce_handle is not None
        ):
            feature.before_grad_sync(group)
        return original(group, *args, **kwargs)

    return start_grad_sync


class NoiseScale(Feature):
    """The in-run measurement of B_simple; its line printed after the loop's."""

    name = "noise_scale"
    version = 1
    flags = ("--ga-noise-scale", "--ga-noise-scale-decay", "--ga-noise-scale-trace")
    reads_replica_tokens = True
    hooks = (
        Hook(
            "finalize",
            "megatron.core.distributed.param_and_grad_buffer",
            "_ParamAndGradBucketGroup.start_grad_sync",
            counting_bucket_group,
            does="--ga-noise-scale, measured steps: the replica's squared norm before the "
            "reduction",
        ),
    )

    def __init__(self, handle: Handle) -> None:
        super().__init__(handle)
        self.meter = NoiseScaleMeter(handle.config)
        self.first_chunk: weakref.ref[torch.nn.Module] | None = None
        """The last schedule call's first model chunk, for the names of its parameters."""

    def begin_step(self, step: Step) -> None:
        """A megatron-core loop's layout checked at its first call (install() checks Megatron-LM's
        args)."""
        model = step.call.get("model")
        if step.startup is not None and current_host().parsed_args() is None:
            check_core_layout(self.handle.config.noise_scale, model)
        chunk = model[0] if isinstance(model, (list, tuple)) else model
        if chunk is not None:
            self.first_chunk = weakref.ref(chunk)

    def before_grad_sync(self, group: Any) -> None:
        """A bucket group's grad sync starts: its part of this replica's squared norm (measured
        steps)."""
        chunk = None if self.first_chunk is None else self.first_chunk()
        self.meter.before_grad_sync(group, () if chunk is None else (chunk,))

    def finalize(self, step: Finalizing) -> None:
        """The reduced gradient's squared norm, before the division by N, with b_r (the measured
        step's collective)."""
        if step.replica_tokens is not None:
            self.meter.after_reduction(step.model, step.replica_tokens, step.is_last_stage)

    def before_optimizer_step(self, step: OptimizerStep) -> None:
        """A measured step's loss scale kept."""
        self.meter.before_optimizer_step(step.optimizer)

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """A measured step read and reported; its trace row handed on in the step."""
        if self.meter.after_optimizer_step(step.optimizer) is not None:
            step.measurement = self.meter.last_row

    def after_log(self) -> None:
        """The held line printed after the loop's."""
        self.meter.say_held()

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.meter.ema.state_dict(), "measurements": self.meter.measurements}

    def load_state_dict(
        self, saved: dict[str, Any] | None, version: int, loaded: Loaded, where: str
    ) -> None:
        """Continue the saved EMAs; a checkpoint saved without --ga-noise-scale, or under another
        decay, starts them afresh (said in the log). Raises NoiseScaleError where the state cannot
        be read."""
        if saved is None:
            logger.info(
                "megatron-ga-ext: no noise-scale state at %s: the noise-scale EMAs start afresh",
                where,
            )
            return
        fix = "delete it to start the EMAs afresh."
        if (
            version != self.version
            or not isinstance(saved, dict)
            or set(saved) != {"ema", "measurements"}
        ):
            raise NoiseScaleError(
                f"the noise-scale state in {where} has layout {version} {saved!r}, not "
                f"{self.version} with 'ema' and 'measurements': resume with the release "
                f"that wrote it, or {fix}"
            )
        measurements = saved["measurements"]
        if isinstance(measurements, bool) or not isinstance(measurements, int) or measurements < 0:
            raise NoiseScaleError(
                f"the noise-scale state {where} has measurements {measurements!r}, not a whole "
                f"number >= 0; {fix}"
            )
        ema = NoiseScaleEMA.from_state_dict(saved["ema"])
        if ema.decay != self.meter.ema.decay:
            logger.warning(
                "megatron-ga-ext: the noise-scale EMAs in %s were kept with "
                "--ga-noise-scale-decay %s, this run has %s: they start afresh",
                where,
                ema.decay,
                self.meter.ema.decay,
            )
            return
        self.meter.ema = ema
        self.meter.measurements = measurements
        logger.info(
            "megatron-ga-ext: noise-scale EMAs continued from %s (%d measurements)",
            where,
            ema.updates,
        )
