"""GAConfig: what install() turns on, read from Megatron's parsed args. Pure Python."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from megatron_ga_ext.config.flags import GA_OPTIONS, GAFlags
from megatron_ga_ext.config.launch_rules import check_launch
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.core.schedule.rampup import rampup_triple

__all__ = ["GAConfig"]


@dataclass(kw_only=True, frozen=True)
class GAConfig(GAFlags):
    """What install() turns on; ``from_args`` reads it from Megatron's parsed args.

    The ``--ga-*`` flags are the fields of :class:`GAFlags` (config/flags.py: type, default,
    choices, rule, help there); the fields below are Megatron's own settings the calculator needs
    where its call does not pass them. Construction runs the rule pass of config/launch_rules.py
    over the flags (the rules that need Megatron's other settings run in install() and ``check``,
    through the same pass).
    """

    step_batch_size_schedule: str | None = None
    """Megatron's ``--step-batch-size-schedule`` (or the backported flag)."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """Megatron's ``--rampup-batch-size START INCREMENT SAMPLES``."""
    seq_length: int | None = None
    """Tokens per sample: schedule thresholds are tokens when set."""
    pipeline_model_parallel_size: int | None = None
    """PP, for the interleaved-schedule rule and the guards."""
    virtual_pipeline_model_parallel_size: int | None = None
    """VPP as Megatron derives it (``args.virtual_pipeline_model_parallel_size``)."""
    microbatch_group_size_per_vp_stage: int | None = None
    """N of the interleaved schedule (``--microbatch-group-size-per-virtual-pipeline-stage``); None
    means PP."""

    def __post_init__(self) -> None:
        check_launch(self.flag_values())
        if self.rampup_batch_size is not None:
            object.__setattr__(self, "rampup_batch_size", rampup_triple(self.rampup_batch_size))

    def flag_values(self) -> dict[str, Any]:
        """The ``--ga-*`` settings by field, as the rule pass reads them."""
        return {spec.name: getattr(self, spec.name) for spec in fields(GAFlags)}

    @classmethod
    def from_args(cls, args: argparse.Namespace | Mapping[str, Any] | MegatronArgs) -> GAConfig:
        """From Megatron's parsed args holding Megatron's flags and the ``--ga-*`` flags (absent
        ones: defaults)."""
        settings = MegatronArgs.of(args)
        rampup = settings.rampup_batch_size
        return cls(
            **{option.field: settings.get(option.dest) for option in GA_OPTIONS},
            step_batch_size_schedule=settings.step_batch_size_schedule,
            rampup_batch_size=rampup_triple(rampup) if rampup else None,
            seq_length=settings.seq_length,
            pipeline_model_parallel_size=settings.get("pipeline_model_parallel_size", None),
            virtual_pipeline_model_parallel_size=settings.virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage=settings.microbatch_group_size_per_vp_stage,
        )
