"""What one verify launch runs: its layouts (all of one world size), modes, model, data and device.

The launcher (launches.py) builds one per world size; every rank of the launch runs it
(harness.py's ``run_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ga_ext.config.flags import MODES
from megatron_ga_ext.verify.layouts import DEFAULT_LAYOUTS, DEFAULT_LENGTHS, Layout
from megatron_ga_ext.verify.models import ModelConfig

__all__ = ["VerifyConfig"]


@dataclass(kw_only=True, frozen=True)
class VerifyConfig:
    """One launch: the layouts (all of one world size), the modes, the model and the data."""

    layouts: tuple[Layout, ...] = DEFAULT_LAYOUTS
    modes: tuple[str, ...] = MODES
    model: ModelConfig = field(default_factory=ModelConfig)
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    device: str = "cpu"
    """``cpu`` (gloo, with the CPU shims) or ``cuda`` (nccl, no shims)."""
    progress: bool = True
    """Rank 0 prints one line per layout and mode to stderr."""
    upstream: bool = False
    """megatron-core alone, install() not called, as a user of patches/upstream runs it
    (verify/upstream.py)."""
