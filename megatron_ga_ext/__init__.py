"""megatron-ga-ext: exact batch arithmetic for Megatron-LM. The public API, nothing else."""

from megatron_ga_ext.errors import (
    BatchSizeError,
    CompatError,
    GAError,
    GuardError,
    InterleaveError,
    LayoutError,
    LossContractError,
    ScheduleError,
    ScheduleParseError,
    SizeError,
)
from megatron_ga_ext.install import GAConfig, add_args, args_provider, install, uninstall
from megatron_ga_ext.layout import BatchLayout
from megatron_ga_ext.schedule import StepSchedule

__all__ = [
    "BatchLayout",
    "BatchSizeError",
    "CompatError",
    "GAConfig",
    "GAError",
    "GuardError",
    "InterleaveError",
    "LayoutError",
    "LossContractError",
    "ScheduleError",
    "ScheduleParseError",
    "SizeError",
    "StepSchedule",
    "add_args",
    "args_provider",
    "install",
    "uninstall",
]
