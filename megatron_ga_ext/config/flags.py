"""The ``--ga-*`` flags (ours), declared once, beside Megatron's and the launcher's (``core/megatron_flags.py``).

Everything else is derived from these declarations: ``add_args`` (config/args.py), :class:`GAConfig`, how
``megatron-ga check`` reads a launch line, and the flags table of ``docs/guide.md`` (:func:`flags_table`).
"""

from __future__ import annotations

from megatron_ga_ext.core.megatron_flags import (
    COVERED_OPTIONS,
    LAUNCHER_OPTIONS,
    MEGATRON_OPTIONS,
    STEP_SCHEDULE,
    Option,
    switch,
)
from megatron_ga_ext.errors import OptionError

#: ``--ga-loss-reduction``: every non-padding token weighs the same, or upstream's mean of means.
MODES = ("token", "microbatch")
#: ``--ga-zero-token-policy``: a global batch without a single token.
ZERO_TOKEN_POLICIES = ("error", "skip")
#: ``--ga-checks``: when token mode reads a step's checked count (finalize.py).
CHECK_TIMINGS = ("sync", "async")
#: ``--ga-lr-scaling``: the learning rate of a step-schedule stage times (GBS / first GBS) ** exponent.
LR_SCALINGS = ("none", "sqrt", "linear")
#: ``--ga-batch-size-warmup``: off, or the doubling rule applied in the run from the measured noise scale.
BATCH_SIZE_WARMUPS = ("off", "auto")


# -- the --ga-* flags (ours) ----------------------------------------------------------------------

LOSS_REDUCTION = Option(
    flag="--ga-loss-reduction", dest="ga_loss_reduction", type=str, default="token", choices=MODES,
    help="token: every non-padding token of the global batch weighs the same (install() turns on "
    "--calculate-per-token-loss; checked every step); microbatch: upstream's mean of means, chosen explicitly "
    "(without --calculate-per-token-loss).",
)
ZERO_TOKEN_POLICY = Option(
    flag="--ga-zero-token-policy", dest="ga_zero_token_policy", type=str, default="error", choices=ZERO_TOKEN_POLICIES,
    help="a global batch with 0 non-padding tokens: error (default), or skip (that optimizer step is skipped, "
    "as after an fp16 overflow: a skipped iteration, the learning rate held, a warning).",
)
STRICT = switch(
    "--ga-strict", "ga_strict", default=True, negatable=True,
    help="refuse to patch upstream functions whose source matches no tested release or main commit, whatever the "
    "version string says (--no-ga-strict: warn and patch).",
)
CONVERT_RAMPUP = switch(
    "--ga-convert-rampup", "ga_convert_rampup",
    help="run a given --rampup-batch-size as the exact equivalent step schedule (megatron-core >= 0.18 otherwise "
    "ignores the rampup without a word).",
)
GUARDS = switch(
    "--ga-guards", "ga_guards", default=True, negatable=True,
    help="check every step that each forward/backward call runs num_microbatches micro-batches per model chunk and "
    "that consumed samples advance by the global batch size; --no-ga-guards for schedules that legitimately run "
    "another number of forward passes (--hybrid-context-parallel, packed RL batches).",
)
CHECKS = Option(
    flag="--ga-checks", dest="ga_checks", type=str, default="sync", choices=CHECK_TIMINGS,
    help="token mode: sync (default) reads the step's checked token count once, in finalize, and raises before the "
    "optimizer step; async reads nothing there (gradients scaled by a device 1/max(N, 1), as upstream) and raises a "
    "broken step after the optimizer step or at the next step, naming it (not with --ga-zero-token-policy skip).",
)
NOISE_SCALE = Option(
    flag="--ga-noise-scale", dest="ga_noise_scale", type=int, default=0,
    help="measure the gradient noise scale B_simple every K-th iteration (0: off) from each data-parallel replica's "
    "gradient before the reduction and the reduced one (token mode, DP >= 2; docs/noise-scale.md): one all-reduce "
    "of 6 numbers per measured step, logged after Megatron's iteration line, to TensorBoard and W&B.",
)
NOISE_SCALE_DECAY = Option(
    flag="--ga-noise-scale-decay", dest="ga_noise_scale_decay", type=float, default=0.95,
    help="EMA decay per measured step of the gradient noise tr(Sigma) and the true gradient's squared norm, kept "
    "apart and divided (0: the last step only).",
)
NOISE_SCALE_TRACE = Option(
    flag="--ga-noise-scale-trace", dest="ga_noise_scale_trace", type=str,
    help="append each measured step to this JSON Lines file (one rank writes it): the trace `megatron-ga schedule "
    "--suggest` reads.",
)
LR_SCALING = Option(
    flag="--ga-lr-scaling", dest="ga_lr_scaling", type=str, default="none", choices=LR_SCALINGS,
    help="under a step batch-size schedule, scale the learning rate from the step a stage starts by (GBS / first "
    "GBS) ** 1/2 (sqrt, Adam's rule) or ** 1 (linear); none (default): Megatron's schedule as it is.",
)
BATCH_SIZE_WARMUP = Option(
    flag="--ga-batch-size-warmup", dest="ga_batch_size_warmup", type=str, default="off", choices=BATCH_SIZE_WARMUPS,
    help="auto: from --global-batch-size on, double the global batch at the step after a measurement where trust x "
    "B_simple (EMA, samples) >= 2 x GBS, up to --ga-batch-size-warmup-max, never in the LR warmup or a WSD final "
    "decay; each decision logged as the schedule so far and kept in the checkpoint (needs --ga-noise-scale, "
    "--train-samples).",
)
BATCH_SIZE_WARMUP_TRUST = Option(
    flag="--ga-batch-size-warmup-trust", dest="ga_batch_size_warmup_trust", type=float, default=1.0,
    help="how far --ga-batch-size-warmup auto trusts the measured B_simple: it doubles where trust x B_simple >= "
    "2 x GBS (above 1 leans on Merrill et al.'s finding that it underestimates the critical batch).",
)
BATCH_SIZE_WARMUP_MAX = Option(
    flag="--ga-batch-size-warmup-max", dest="ga_batch_size_warmup_max", type=int,
    help="the cap of --ga-batch-size-warmup auto: the global batch doubles only while 2 x GBS <= this.",
)
#: The flags add_args adds (the schedule flag only where the parser lacks it).
GA_OPTIONS = (LOSS_REDUCTION, ZERO_TOKEN_POLICY, STRICT, CONVERT_RAMPUP, GUARDS, CHECKS, NOISE_SCALE,
              NOISE_SCALE_DECAY, NOISE_SCALE_TRACE, LR_SCALING, BATCH_SIZE_WARMUP, BATCH_SIZE_WARMUP_TRUST,
              BATCH_SIZE_WARMUP_MAX)

#: Every flag by its spelling (a negatable switch under both).
OPTIONS: dict[str, Option] = {
    spelling: option
    for option in (*GA_OPTIONS, *MEGATRON_OPTIONS, *COVERED_OPTIONS, *LAUNCHER_OPTIONS)
    for spelling in option.spellings
}
BY_DEST: dict[str, Option] = {
    option.dest: option for option in (*GA_OPTIONS, *MEGATRON_OPTIONS, *COVERED_OPTIONS, *LAUNCHER_OPTIONS)
}


def check_choice(option: Option, value: object, *, error: type[OptionError] = OptionError) -> None:
    """Raise ``error`` naming ``option`` when ``value`` is not one of its choices."""
    if option.choices and value not in option.choices:
        raise error(f"{option.flag} {value!r} is not one of {', '.join(option.choices)}; pick one of them.")



def flags_table() -> str:
    """The Markdown table of the flags add_args adds (docs/guide.md holds it; a test compares)."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for option in (*GA_OPTIONS, STEP_SCHEDULE):
        rows.append(f"| {_flag_cell(option)} | {_default_cell(option)} | {option.help} |")
    return "\n".join(rows)


def _flag_cell(option: Option) -> str:
    if option.choices:
        return f"`{option.flag} {{{','.join(option.choices)}}}`"
    return " / ".join(f"`{spelling}`" for spelling in option.spellings)


def _default_cell(option: Option) -> str:
    if option.type is bool:
        return "on" if option.default else "off"
    return "" if option.default is None else f"`{option.default}`"


