"""The ``--ga-*`` flags (ours), each declared once, beside Megatron's and the launcher's
(``core/megatron_flags.py``).

A flag is one field of :class:`GAFlags`: its name (``noise_scale`` is ``--ga-noise-scale``, argparse
destination ``ga_noise_scale``), its type (the annotation), its default, its help, its choices and
its rule (a validator of its own value). Everything else is derived from these fields:
:class:`GAConfig` (a subclass), ``add_args`` (config/args.py), how ``megatron-ga check`` reads a
launch line (launch/line.py), :data:`BY_DEST`, the rule pass (config/launch_rules.py calls
:func:`flag_errors`) and the flags table of ``docs/guide.md`` (tools/doc_tables.py). The rules
*between* flags live in config/launch_rules.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_ga_ext.core.megatron_flags import BY_DEST as MEGATRON_BY_DEST
from megatron_ga_ext.core.megatron_flags import (
    COVERED_OPTIONS,
    LAUNCHER_OPTIONS,
    MEGATRON_OPTIONS,
    RULE_OPTIONS,
    Option,
)
from megatron_ga_ext.errors import OptionError

#: ``--ga-loss-reduction``: every non-padding token weighs the same, or upstream's mean of means.
MODES = ("token", "microbatch")
#: ``--ga-zero-token-policy``: a global batch without a single token.
ZERO_TOKEN_POLICIES = ("error", "skip")
#: ``--ga-checks``: when token mode reads a step's checked count (finalize.py).
CHECK_TIMINGS = ("sync", "async")
#: ``--ga-on-violation``: a run-time check's error stops training, or is logged and counted
#: (integration/violations.py).
ON_VIOLATIONS = ("stop", "log")
#: ``--ga-lr-scaling``: the learning rate of a step-schedule stage times (GBS / first GBS) **
#: exponent.
LR_SCALINGS = ("none", "sqrt", "linear")
#: ``--ga-batch-size-warmup``: off, or the doubling rule applied in the run from the measured noise
#: scale.
BATCH_SIZE_WARMUPS = ("off", "auto")

#: A flag's own rule: raises OptionError naming the flag, the value, the rule and a fix.
Rule = Callable[["GAFlag", Any], None]


@dataclass(frozen=True, kw_only=True)
class GAFlag(Option):
    """One ``--ga-*`` flag, derived from its :class:`GAFlags` field."""

    field: str
    """The GAConfig field (``noise_scale`` for ``--ga-noise-scale``)."""
    rule: Rule | None = None
    """Its own value's rule (choices are checked apart); None: the type alone."""

    def check(self, value: Any) -> None:
        """Raise OptionError where ``value`` breaks this flag's type, choices or rule."""
        if self.choices:
            check_choice(self, value)
        elif self.rule is not None and (self.type is not str or isinstance(value, str)):
            self.rule(self, value)
        elif not (isinstance(value, self.type) or (value is None and self.default is None)):
            kind = "on or off (True or False)" if self.type is bool else f"a {self.type.__name__}"
            raise OptionError(
                f"{self.flag} {value!r} is not {kind}; give {self.flag} as the help says "
                f"(default: {self.default!r})."
            )


# -- the rules of one value
# --------------------------------------------------------------------------


def check_choice(option: Option, value: object, *, error: type[OptionError] = OptionError) -> None:
    """Raise ``error`` naming ``option`` when ``value`` is not one of its choices (with the nearest
    one by spelling, where one is near: ``did you mean 'token'?``)."""
    if option.choices and value not in option.choices:
        near = closest_choice(option, value)
        fix = f"did you mean {option.flag} {near}?" if near else "pick one of them."
        raise error(f"{option.flag} {value!r} is not one of {', '.join(option.choices)}; {fix}")


def closest_choice(option: Option, value: object) -> str | None:
    """The choice of ``option`` nearest to ``value`` by spelling (difflib's ratio >= 0.6), or
    None."""
    near = difflib.get_close_matches(str(value).lower(), option.choices, n=1, cutoff=0.6)
    return near[0] if near else None


def whole_number(minimum: int, fix: str, *, optional: bool = False) -> Rule:
    """A whole number >= ``minimum`` (None too where ``optional``); ``fix`` ends the message."""

    def rule(flag: GAFlag, value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise OptionError(f"{flag.flag} {value!r} is not a whole number >= {minimum}: {fix}")

    return rule


def _function_names(flag: GAFlag, value: Any) -> None:
    """Comma-separated Python names (``name``, ``Class.method``, ``module.function``); which of them
    install() hooks is checked where the hook rows are known (acceptance.py)."""
    names = [name.strip() for name in value.split(",")]
    if value.strip() and not all(_dotted(name) for name in names):
        raise OptionError(
            f"{flag.flag} {value!r} is not a comma-separated list of function names: give e.g. "
            "finalize_model_grads,GPTModel.forward."
        )


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def fraction(fix: str) -> Rule:
    """A number in [0, 1); ``fix`` ends the message."""

    def rule(flag: GAFlag, value: Any) -> None:
        if not (_finite(value) and 0 <= value < 1):
            raise OptionError(f"{flag.flag} {value!r} is not in [0, 1): {fix}")

    return rule


def positive(fix: str) -> Rule:
    """A finite number > 0; ``fix`` ends the message."""

    def rule(flag: GAFlag, value: Any) -> None:
        if not (_finite(value) and value > 0):
            raise OptionError(f"{flag.flag} {value!r} is not a positive finite number: {fix}")

    return rule


def ga_flag(
    default: Any,
    *,
    help: str,
    choices: tuple[str, ...] = (),
    negatable: bool = False,
    rule: Rule | None = None,
) -> Any:
    """A :class:`GAFlags` field: the flag's default, help, choices and rule (its type is the
    annotation)."""
    return dataclasses.field(
        default=default,
        metadata={"help": help, "choices": choices, "negatable": negatable, "rule": rule},
    )


# -- the --ga-* flags (ours)
# -------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class GAFlags:
    """The ``--ga-*`` flags, one field each (GAConfig adds Megatron's settings the calculator
    needs)."""

    loss_reduction: str = ga_flag(
        "token",
        choices=MODES,
        help="token: every non-padding token of the global batch weighs the same (install() "
        "turns on "
        "--calculate-per-token-loss; checked every step); microbatch: upstream's mean of means, "
        "chosen explicitly "
        "(without --calculate-per-token-loss).",
    )
    zero_token_policy: str = ga_flag(
        "error",
        choices=ZERO_TOKEN_POLICIES,
        help="a global batch with 0 non-padding tokens: error (default), or skip (that optimizer "
        "step is skipped, "
        "as after an fp16 overflow: a skipped iteration, the learning rate held, a warning).",
    )
    strict: bool = ga_flag(
        True,
        negatable=True,
        help="refuse to patch upstream functions whose source matches no tested release or main "
        "commit, whatever "
        "the version string says (--no-ga-strict: warn and patch).",
    )
    accept_source: str = ga_flag(
        "",
        rule=_function_names,
        help="comma-separated hooked functions (finalize_model_grads, GPTModel.forward, or "
        "module-qualified) that install() patches where their source matches no tested one, for a "
        "fork that knows what it changed; MEGATRON_GA_ACCEPT_SOURCE adds to it. The start-up "
        "probes still run: a measured change is refused whatever this names.",
    )
    convert_rampup: bool = ga_flag(
        False,
        help="run a given --rampup-batch-size as the exact equivalent step schedule "
        "(megatron-core >= 0.18 "
        "otherwise ignores the rampup on the training path, and logs nothing).",
    )
    guards: bool = ga_flag(
        True,
        negatable=True,
        help="check every step that each forward/backward call runs num_microbatches "
        "micro-batches per model chunk "
        "and that consumed samples advance by the global batch size; --no-ga-guards for "
        "schedules that "
        "legitimately run another number of forward passes (--hybrid-context-parallel, packed RL "
        "batches).",
    )
    checks: str = ga_flag(
        "sync",
        choices=CHECK_TIMINGS,
        help="token mode: sync (default) reads the step's checked token count once, in finalize, "
        "and raises before "
        "the optimizer step; async reads nothing there (gradients scaled by a device 1/max(N, "
        "1), as upstream) and "
        "raises a broken step after the optimizer step or at the next step, naming it (not with "
        "--ga-zero-token-policy skip).",
    )
    on_violation: str = ga_flag(
        "stop",
        choices=ON_VIOLATIONS,
        help="a run-time check that a step breaks (token counts, non-finite loss, micro-batches "
        "per chunk, consumed "
        "samples, liveness): stop (default) stops training; log logs each rule once with its "
        "iteration, counts it "
        "(ga-violations/<rule> to TensorBoard and W&B) and trains on, to pilot the checks. "
        "Start-up refusals stop "
        "either way.",
    )
    noise_scale: int = ga_flag(
        0,
        rule=whole_number(0, "give K to measure every K-th iteration, or 0 (the default) for off."),
        help="measure the gradient noise scale B_simple every K-th iteration (0: off) from each "
        "data-parallel "
        "replica's gradient before the reduction and the reduced one (token mode, DP >= 2; "
        "docs/noise-scale.md): one "
        "all-reduce of 6 numbers per measured step, logged after Megatron's iteration line, to "
        "TensorBoard and W&B.",
    )
    noise_scale_decay: float = ga_flag(
        0.95,
        rule=fraction("0 keeps the last measurement only, 0.95 (the default) averages about 20."),
        help="EMA decay per measured step of the gradient noise tr(Sigma) and the true "
        "gradient's squared norm, "
        "kept apart and divided (0: the last step only).",
    )
    noise_scale_trace: str | None = ga_flag(
        None,
        help="append each measured step to this JSON Lines file (one rank writes it): the trace "
        "`megatron-ga "
        "schedule --suggest` reads.",
    )
    lr_scaling: str = ga_flag(
        "none",
        choices=LR_SCALINGS,
        help="under a step batch-size schedule, scale the learning rate from the step a stage "
        "starts by (GBS / "
        "first GBS) ** 1/2 (sqrt, Adam's rule) or ** 1 (linear); none (default): Megatron's "
        "schedule as it is.",
    )
    batch_size_warmup: str = ga_flag(
        "off",
        choices=BATCH_SIZE_WARMUPS,
        help="auto: from --global-batch-size on, double the global batch at the step after a "
        "measurement where "
        "trust x B_simple (EMA, samples) >= 2 x GBS, up to --ga-batch-size-warmup-max, never in "
        "the LR warmup or a "
        "WSD final decay; each decision logged as the schedule so far and kept in the checkpoint "
        "(needs "
        "--ga-noise-scale, --train-samples).",
    )
    batch_size_warmup_trust: float = ga_flag(
        1.0,
        rule=positive("1 takes the measured B_simple as it is, 2 doubles it, 0.5 halves it."),
        help="how far --ga-batch-size-warmup auto trusts the measured B_simple: it doubles where "
        "trust x B_simple >= 2 x GBS. On the real-text sweep of docs/noise-scale.md B_simple at "
        "matched progress ran 1.8-2.5x above the measured critical batch (B_crit / B_simple "
        "0.48: the 18 runs of the fit, GBS 4-128; a 129k-parameter byte-level GPT at 4-12 "
        "tokens per parameter, targets 2.93-2.52 nats/byte around a byte-bigram model's 2.64, "
        "far from where LLM batch sizes are chosen), so at 1 (the default: the estimate as it "
        "is) the batch doubles there before B_crit does; below 1 is cautious, above 1 doubles "
        "sooner.",
    )
    batch_size_warmup_max: int | None = ga_flag(
        None,
        rule=whole_number(
            1, "give the global batch size --ga-batch-size-warmup auto may grow to.", optional=True
        ),
        help="the cap of --ga-batch-size-warmup auto: the global batch doubles only while 2 x "
        "GBS <= this.",
    )


def _declared(flags: type) -> tuple[GAFlag, ...]:
    """A GAFlag for each field of ``flags``: ``--ga-<name>``, destination ``ga_<name>``, the
    annotation's type."""
    hints = typing.get_type_hints(flags)
    declared = []
    for spec in dataclasses.fields(flags):
        kind = next(
            t for t in (*typing.get_args(hints[spec.name]), hints[spec.name]) if t is not type(None)
        )
        declared.append(
            GAFlag(
                flag="--ga-" + spec.name.replace("_", "-"),
                dest="ga_" + spec.name,
                field=spec.name,
                type=kind,
                nargs=0 if kind is bool else 1,
                default=spec.default,
                **spec.metadata,
            )
        )
    return tuple(declared)


#: The flags add_args adds (the schedule flag too, where the parser lacks it), in GAFlags' order.
GA_OPTIONS: tuple[GAFlag, ...] = _declared(GAFlags)
#: Each --ga-* flag by its GAConfig field.
GA_FLAGS: dict[str, GAFlag] = {option.field: option for option in GA_OPTIONS}

# The flags other modules name (a new flag needs no line here unless a rule between flags names it).
LOSS_REDUCTION = GA_FLAGS["loss_reduction"]
ZERO_TOKEN_POLICY = GA_FLAGS["zero_token_policy"]
CONVERT_RAMPUP = GA_FLAGS["convert_rampup"]
GUARDS = GA_FLAGS["guards"]
CHECKS = GA_FLAGS["checks"]
NOISE_SCALE = GA_FLAGS["noise_scale"]
NOISE_SCALE_TRACE = GA_FLAGS["noise_scale_trace"]
LR_SCALING = GA_FLAGS["lr_scaling"]
BATCH_SIZE_WARMUP = GA_FLAGS["batch_size_warmup"]
BATCH_SIZE_WARMUP_MAX = GA_FLAGS["batch_size_warmup_max"]

#: Every flag by its spelling (a negatable switch under both).
OPTIONS: dict[str, Option] = {
    spelling: option
    for option in (
        *GA_OPTIONS,
        *MEGATRON_OPTIONS,
        *RULE_OPTIONS,
        *COVERED_OPTIONS,
        *LAUNCHER_OPTIONS,
    )
    for spelling in option.spellings
}
#: Every flag by argparse destination: Megatron's and the launcher's (core/megatron_flags.py), and
#: ours.
BY_DEST: dict[str, Option] = {**MEGATRON_BY_DEST, **{option.dest: option for option in GA_OPTIONS}}


def flag_errors(values: Mapping[str, Any]) -> dict[str, OptionError]:
    """Each ``--ga-*`` flag's own rule over ``values`` (by GAConfig field; absent: the default, not
    checked): the error of each flag that breaks its rule, by field."""
    errors = {}
    for option in GA_OPTIONS:
        if option.field in values:
            try:
                option.check(values[option.field])
            except OptionError as error:
                errors[option.field] = error
    return errors
