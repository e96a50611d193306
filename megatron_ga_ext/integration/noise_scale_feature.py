"""--ga-noise-scale as a feature (features.py): the meter (noise_scale.py) at its phases, and its EMAs across a
resume (the sidecar's ``noise_scale`` part, layout 1: ``{"ema": NoiseScaleEMA.state_dict(), "measurements": M}``).

The EMAs are kept only under one ``--ga-noise-scale-decay``: the bias correction 1 - decay^n holds for one decay
throughout, so EMAs kept under another start afresh."""

from __future__ import annotations

from typing import Any

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.core.noise_scale import NoiseScaleEMA
from megatron_ga_ext.errors import NoiseScaleError
from megatron_ga_ext.integration.features import Feature, Loaded, OptimizerStep, Step
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.integration.noise_scale import NoiseScaleMeter, check_core_layout
from megatron_ga_ext.logs import get_logger

__all__ = ["NoiseScale"]

logger = get_logger(__name__)


class NoiseScale(Feature):
    """The in-run measurement of B_simple; its line printed after the loop's."""

    name = "noise_scale"
    version = 1
    flags = ("--ga-noise-scale", "--ga-noise-scale-decay", "--ga-noise-scale-trace")

    def __init__(self, state: Any) -> None:
        super().__init__(state)
        self.meter = NoiseScaleMeter(state.config)

    @classmethod
    def wanted(cls, config: GAConfig) -> bool:
        return bool(config.noise_scale)

    def begin_step(self, step: Step) -> None:
        """A megatron-core loop's layout checked at its first call (install() checks Megatron-LM's args)."""
        if step.startup is not None and current_host().parsed_args() is None:
            check_core_layout(self.state.config.noise_scale, step.call.get("model"))

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

    def load_state_dict(self, saved: dict[str, Any] | None, version: int, loaded: Loaded, where: str) -> None:
        """Continue the saved EMAs; a checkpoint saved without --ga-noise-scale, or under another decay, starts them
        afresh (said in the log). Raises NoiseScaleError where the state cannot be read."""
        if saved is None:
            logger.info("megatron-ga-ext: no noise-scale state at %s: the noise-scale EMAs start afresh", where)
            return
        fix = "delete it to start the EMAs afresh."
        if version != self.version or not isinstance(saved, dict) or set(saved) != {"ema", "measurements"}:
            raise NoiseScaleError(
                f"the noise-scale state in {where} has layout {version} {saved!r}, not {self.version} with 'ema' and "
                f"'measurements': resume with the release that wrote it, or {fix}"
            )
        measurements = saved["measurements"]
        if isinstance(measurements, bool) or not isinstance(measurements, int) or measurements < 0:
            raise NoiseScaleError(
                f"the noise-scale state {where} has measurements {measurements!r}, not a whole number >= 0; {fix}"
            )
        ema = NoiseScaleEMA.from_state_dict(saved["ema"])
        if ema.decay != self.meter.ema.decay:
            logger.warning(
                "megatron-ga-ext: the noise-scale EMAs in %s were kept with --ga-noise-scale-decay %s, this "
                "run has %s: they start afresh",
                where,
                ema.decay,
                self.meter.ema.decay,
            )
            return
        self.meter.ema = ema
        self.meter.measurements = measurements
        logger.info("megatron-ga-ext: noise-scale EMAs continued from %s (%d measurements)", where, ema.updates)
