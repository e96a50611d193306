"""megatron-ga-ext: exact batch arithmetic for Megatron-LM. The public API, nothing else.

``install`` and ``uninstall`` load the Megatron integration (torch) on first use, so the pure-Python
commands (``megatron-ga ledger | check | schedule``), which import this package first, never load
torch.
"""

from typing import TYPE_CHECKING, Any

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

__all__ = [
    "BatchLayout",
    "BatchSizeError",
    "CompatError",
    "CoreLoop",
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


if TYPE_CHECKING:
    from megatron_ga_ext.integration.core_loop import CoreLoop
    from megatron_ga_ext.integration.lifecycle import install, uninstall


def __getattr__(name: str) -> Any:
    if name in ("install", "uninstall"):
        from megatron_ga_ext.integration import lifecycle as module

        return getattr(module, name)
    if name == "CoreLoop":
        from megatron_ga_ext.integration.core_loop import CoreLoop

        return CoreLoop
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
