"""The batch configuration every rank and a resumed checkpoint agree on, checked once at start-up.

At the first forward/backward call (every rank makes it, and torch.distributed is initialized by
then), never per micro-batch: the coverage table's refusals and limits (config/coverage/), then two
checks, once per installation:

* the ranks agree: each rank's batch settings (the flags that decide GBS and num_microbatches at
  every step, the loss mode, and what its calculator computes now) are all-gathered once; ranks
  launched with another ``--global-batch-size`` or schedule fail with a GuardError naming the ranks
  and the settings that differ. Without the check such ranks would train: data-parallel ranks
  average gradients of batches of different sizes and stop at different steps.
* a resumed run says what changed: Megatron-LM's ``check_checkpoint_args`` is given the checkpoint's
  args; where their batch settings differ from this run's, rank 0 warns with both and says from
  which iteration and consumed-sample count the new configuration applies (and the global batch size
  there under each). Resuming with another schedule is legitimate (a run that grows its batch), so
  it is a warning, not an error.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megatron_ga_ext.config.coverage import Verdict
from megatron_ga_ext.config.coverage import enforce as enforce_coverage
from megatron_ga_ext.config.flags import BY_DEST, CONVERT_RAMPUP, GA_OPTIONS
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.errors import GAError, GuardError
from megatron_ga_ext.integration.compat import Calculator, live_calculator
from megatron_ga_ext.logs import get_logger

__all__ = [
    "BATCH_FLAGS",
    "StartupChecks",
    "batch_settings",
    "check_ranks_agree",
    "describe_differences",
]

logger = get_logger(__name__)

#: Megatron's args that decide the batch of every step and the loss mode, and the --ga-* flags.
BATCH_FLAGS = (
    "micro_batch_size",
    "global_batch_size",
    "rampup_batch_size",
    "step_batch_size_schedule",
    "decrease_batch_size_if_needed",
    "seq_length",
    "train_samples",
    "calculate_per_token_loss",
    *(option.dest for option in GA_OPTIONS),
)
DATA_PARALLEL = "data-parallel size"


def batch_settings(
    args: argparse.Namespace | None = None,
    config: GAConfig | None = None,
    calculator: Calculator | None = None,
) -> dict[str, str]:
    """The batch settings of one rank, as text by the flag that sets them: from Megatron's ``args``
    where there are any, else from the extension's ``config``; and what the live ``calculator``
    computes now."""
    settings = {}
    if args is not None:
        view = MegatronArgs.of(args)
        for dest in BATCH_FLAGS:
            if view.has(dest):
                settings[BY_DEST[dest].flag] = _shown(view.get(dest))
        if view.get("data_parallel_size", None) is not None:
            settings[DATA_PARALLEL] = _shown(view.get("data_parallel_size"))
    elif config is not None:
        for option in GA_OPTIONS:
            settings[option.flag] = _shown(getattr(config, option.field))
        for dest in ("step_batch_size_schedule", "rampup_batch_size", "seq_length"):
            settings[BY_DEST[dest].flag] = _shown(getattr(config, dest))
    if calculator is not None:
        inner = getattr(calculator, "inner", calculator)
        schedule = getattr(inner, "step_schedule", None)
        settings["the calculator's schedule"] = (
            str(schedule) if schedule is not None else type(inner).__name__
        )
        settings["global batch size now"] = _shown(calculator.get_current_global_batch_size())
        settings["num_microbatches now"] = _shown(calculator.get())
        settings["MBS x DP of the calculator"] = _shown(
            getattr(inner, "micro_batch_times_data_parallel_size", None)
        )
    return settings


def _shown(value: Any) -> str:
    if value is None:
        return "not given"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def describe_differences(per_rank: Sequence[Mapping[str, str]]) -> list[str]:
    """``--global-batch-size is 16 on ranks 0, 2 and 32 on ranks 1, 3``: one line per setting that
    differs."""
    lines = []
    for key in dict.fromkeys(k for settings in per_rank for k in settings):
        by_value: dict[str, list[int]] = {}
        for rank, settings in enumerate(per_rank):
            by_value.setdefault(settings.get(key, "not set"), []).append(rank)
        if len(by_value) > 1:
            values = " and ".join(
                f"{value!r} on {_ranks(ranks)}" for value, ranks in by_value.items()
            )
            lines.append(f"{key} is {values}")
    return lines


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def check_ranks_agree(settings: Mapping[str, str]) -> None:
    """All-gather every rank's ``settings`` once (the default group) and raise GuardError where they
    differ."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(settings))
    differences = describe_differences(gathered)
    if differences:
        raise GuardError(
            "the ranks were launched with different batch configurations (compared once, at the "
            "first "
            f"forward/backward call): {'; '.join(differences)}. Data-parallel ranks that run "
            "different batches average gradients of batches of different sizes and stop at "
            "different steps. Launch every rank with "
            f"the same batch flags."
        )


class StartupChecks:
    """The checks of the module docstring, made once per installation; the checkpoint's args on the
    way."""

    def __init__(self) -> None:
        self.done = False
        self.checkpoint_settings: dict[str, str] | None = None
        self.checkpoint_batch_size: Callable[[int], int | None] | None = None

    def run_once(self, config: GAConfig, args: argparse.Namespace | None) -> Verdict | None:
        """At the first forward/backward call: the coverage table's refusals, the ranks agree, and a
        resumed run says what changed. Returns the coverage verdict the first time, else None."""
        if self.done:
            return None
        verdict = enforce_coverage(args, config)
        self.done = True
        check_ranks_agree(batch_settings(args, config, live_calculator()))
        if self.checkpoint_settings is not None and args is not None:
            self._warn_if_changed(args, self.checkpoint_settings)
        return verdict

    def recording(self, original: Callable) -> Callable:
        """Megatron-LM's ``check_checkpoint_args`` on load: the checkpoint's args recorded on the
        way."""

        @functools.wraps(original)
        def check_checkpoint_args(checkpoint_args: Any, *args: Any, **kwargs: Any) -> Any:
            self.checkpoint_settings = batch_settings(checkpoint_args)
            self.checkpoint_batch_size = functools.partial(_batch_size_at, checkpoint_args)
            return original(checkpoint_args, *args, **kwargs)

        return check_checkpoint_args

    def _warn_if_changed(self, args: argparse.Namespace, saved: Mapping[str, str]) -> None:
        """A warning where the run resumes with batch settings other than ``saved`` (the
        checkpoint's)."""
        now = batch_settings(args)
        changed = [
            f"{key} {was!r} when it was saved, {now[key]!r} now"
            for key, was in saved.items()
            if key in now and now[key] != was
        ]
        if not changed:
            return
        view = MegatronArgs.of(args)
        consumed, iteration = view.consumed_train_samples, view.iteration
        calculator = live_calculator()
        batch = (
            ""
            if calculator is None
            else (
                f": global batch size {calculator.get_current_global_batch_size()} "
                f"({calculator.get()} micro-batches)"
            )
        )
        before = self.checkpoint_batch_size(consumed) if self.checkpoint_batch_size else None
        if batch and before is not None:
            batch += f", where the checkpoint's configuration has {before}"
        logger.warning(
            "resuming from the checkpoint of iteration %d (consumed samples %d) with another "
            "batch configuration than it was saved with: %s. The new configuration "
            "applies from iteration %d (consumed samples %d) on%s. If that is not "
            "intended, resume with the flags the checkpoint was saved with.",
            iteration,
            consumed,
            "; ".join(changed),
            iteration + 1,
            consumed,
            batch,
        )


def _batch_size_at(args: argparse.Namespace, consumed: int) -> int | None:
    """The global batch size ``args`` (a checkpoint's) give at ``consumed`` samples; None where
    unknown (an unconverted rampup, a configuration that no longer reads)."""
    view = MegatronArgs.of(args)
    convert = bool(view.get(CONVERT_RAMPUP.dest, False))
    if view.rampup_batch_size and not convert:
        return None
    try:
        schedule = resolve_schedule(
            ScheduleInputs(
                step_batch_size_schedule=view.step_batch_size_schedule,
                rampup_batch_size=view.rampup_batch_size,
                global_batch_size=view.global_batch_size,
                seq_length=view.seq_length,
                convert_rampup=convert,
            )
        )
    except GAError:
        return None
    if schedule is None:
        return view.global_batch_size
    return schedule.global_batch_size_at(consumed)
