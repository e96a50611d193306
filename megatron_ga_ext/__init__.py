"""megatron-ga-ext: exact batch arithmetic for Megatron-LM. The public API, nothing else."""

from megatron_ga_ext.config.args import add_args, args_provider
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import (
    BatchSizeError,
    CompatError,
    GAError,
    GuardError,
    InterleaveError,
    LayerSplitError,
    LayoutError,
    LossContractError,
    OptionError,
    ScheduleError,
    ScheduleParseError,
    SizeError,
    UsageError,
)
from megatron_ga_ext.integration.install import install, uninstall

__all__ = [
    "BatchLayout",
    "BatchSizeError",
    "CompatError",
    "GAConfig",
    "GAError",
    "GuardError",
    "InterleaveError",
    "LayerSplitError",
    "LayoutError",
    "LossContractError",
    "OptionError",
    "ScheduleError",
    "ScheduleParseError",
    "SizeError",
    "StepSchedule",
    "UsageError",
    "add_args",
    "args_provider",
    "install",
    "uninstall",
]
