"""GAConfig: what install() turns on, read from Megatron's parsed args. Pure Python."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_ga_ext.config.flags import (
    BATCH_SIZE_WARMUP,
    BATCH_SIZE_WARMUP_MAX,
    BATCH_SIZE_WARMUP_TRUST,
    CHECKS,
    CONVERT_RAMPUP,
    GUARDS,
    LOSS_REDUCTION,
    LR_SCALING,
    NOISE_SCALE,
    NOISE_SCALE_DECAY,
    NOISE_SCALE_TRACE,
    STRICT,
    ZERO_TOKEN_POLICY,
    check_choice,
)
from megatron_ga_ext.config.rules import check_batch_size_warmup, check_checks, check_noise_scale
from megatron_ga_ext.core.schedule.rampup import rampup_triple


@dataclass(kw_only=True, frozen=True)
class GAConfig:
    """What install() turns on; ``from_args`` reads it from Megatron's parsed args.

    The first thirteen fields are the ``--ga-*`` flags (:data:`GA_OPTIONS`: defaults and choices there); the
    rest are Megatron's own settings the calculator needs where its call does not pass them.
    """

    loss_reduction: str = LOSS_REDUCTION.default
    """``token`` (every non-padding token weighs the same) or ``microbatch`` (upstream's mean of means)."""
    zero_token_policy: str = ZERO_TOKEN_POLICY.default
    """A global batch with 0 tokens: ``error``, or ``skip`` (the optimizer skips that step; a warning)."""
    strict: bool = STRICT.default
    """Refuse upstream functions whose source fingerprint is unknown (else warn and patch)."""
    convert_rampup: bool = CONVERT_RAMPUP.default
    """Turn a given rampup triple into the equivalent step schedule."""
    guards: bool = GUARDS.default
    """Check micro-batch counts and consumed samples every step."""
    checks: str = CHECKS.default
    """When token mode reads a step's checked count: ``sync`` (in finalize) or ``async`` (after the step)."""
    noise_scale: int = NOISE_SCALE.default
    """Measure the gradient noise scale every this many iterations; 0: off."""
    noise_scale_decay: float = NOISE_SCALE_DECAY.default
    """The EMA decay per measured step."""
    noise_scale_trace: str | None = NOISE_SCALE_TRACE.default
    """A JSON Lines file that gets one row per measured step."""
    lr_scaling: str = LR_SCALING.default
    """``none``, ``sqrt`` or ``linear``: the learning rate times (GBS / first GBS) ** exponent."""
    batch_size_warmup: str = BATCH_SIZE_WARMUP.default
    """``off``, or ``auto``: the doubling rule applied in the run from the measured noise scale."""
    batch_size_warmup_trust: float = BATCH_SIZE_WARMUP_TRUST.default
    """The measured B_simple is multiplied by this before it is compared with 2 x GBS."""
    batch_size_warmup_max: int | None = BATCH_SIZE_WARMUP_MAX.default
    """The cap of the adaptive warmup."""
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
    """N of the interleaved schedule (``--microbatch-group-size-per-virtual-pipeline-stage``); None means PP."""

    def __post_init__(self) -> None:
        check_choice(LOSS_REDUCTION, self.loss_reduction)
        check_choice(ZERO_TOKEN_POLICY, self.zero_token_policy)
        check_choice(CHECKS, self.checks)
        check_checks(self.checks, self.zero_token_policy)
        check_choice(LR_SCALING, self.lr_scaling)
        check_noise_scale(self.noise_scale, self.noise_scale_decay, self.loss_reduction)
        check_choice(BATCH_SIZE_WARMUP, self.batch_size_warmup)
        check_batch_size_warmup(self.batch_size_warmup, self.noise_scale, self.batch_size_warmup_trust,
                                self.batch_size_warmup_max)
        if self.rampup_batch_size is not None:
            object.__setattr__(self, "rampup_batch_size", rampup_triple(self.rampup_batch_size))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "GAConfig":
        """From an argparse namespace holding Megatron's flags and the ``--ga-*`` flags (absent ones: defaults)."""
        rampup = getattr(args, "rampup_batch_size", None)
        return cls(
            **{name: getattr(args, option.dest, option.default) for option, name in GA_FIELDS.items()},
            step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None),
            rampup_batch_size=rampup_triple(rampup) if rampup else None,
            seq_length=getattr(args, "seq_length", None),
            pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", None),
            virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
            microbatch_group_size_per_vp_stage=getattr(args, "microbatch_group_size_per_vp_stage", None),
        )


#: GAConfig field of each --ga-* flag.
GA_FIELDS = {
    LOSS_REDUCTION: "loss_reduction",
    ZERO_TOKEN_POLICY: "zero_token_policy",
    STRICT: "strict",
    CONVERT_RAMPUP: "convert_rampup",
    GUARDS: "guards",
    CHECKS: "checks",
    NOISE_SCALE: "noise_scale",
    NOISE_SCALE_DECAY: "noise_scale_decay",
    NOISE_SCALE_TRACE: "noise_scale_trace",
    LR_SCALING: "lr_scaling",
    BATCH_SIZE_WARMUP: "batch_size_warmup",
    BATCH_SIZE_WARMUP_TRUST: "batch_size_warmup_trust",
    BATCH_SIZE_WARMUP_MAX: "batch_size_warmup_max",
}

