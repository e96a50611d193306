"""megatron-ga-ext: exact batch arithmetic for Megatron-LM. The public API, nothing else."""

from megatron_ga_ext.errors import (
    BatchSizeError,
    CompatError,
    GAError,
    GuardError,
    InterleaveError,
    LayoutError,
    LayerSplitError,
    LossContractError,
    OptionError,
    ScheduleError,
    ScheduleParseError,
    SizeError,
    UsageError,
)
from megatron_ga_ext.install import install, uninstall
from megatron_ga_ext.options import GAConfig, add_args, args_provider
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
