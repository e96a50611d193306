"""Megatron-Bridge's training loop (``megatron.bridge.training.pretrain.pretrain``) as a host: the
extension configured from Bridge's ``ConfigContainer`` instead of argparse (docs/bridge.md).

    from megatron_ga_ext.integration import bridge as ga_bridge

    cfg = ga_bridge.with_ga(recipe_config, zero_token_policy="skip")   # a GAContainer; cfg.ga: the --ga-* settings
    ga_bridge.install(cfg)
    pretrain(cfg, forward_step)

``cfg.ga`` is a :data:`GASection`: one mutable field per ``--ga-*`` flag (GAFlags' names and
defaults), so Bridge's own overrides reach it (``ga.zero_token_policy=skip`` through
``process_config_with_overrides``, a YAML ``ga:`` section read by ``GAContainer.from_yaml``).
Importing this module imports Bridge, and lets Bridge's YAML loader build this package's classes
(``register_allowed_target_prefix``).

:func:`install` does, before ``pretrain()``:

* under ``ga.convert_rampup``, writes ``train.rampup_batch_size`` as its exact
  ``train.step_batch_size_schedule`` and clears it (megatron-core 0.18 and later drop a rampup;
  Bridge refuses one with ``train.train_samples``);
* reads ``cfg.ga`` and what the container holds (``train.step_batch_size_schedule``, which Bridge
  itself never passes on; ``model.seq_length``, PP and VPP) into a GAConfig: the calculator hook
  runs the schedule, and ``GAContainer.validate()`` gives it its run length;
* token mode: sets ``model.calculate_per_token_loss`` (Bridge has no parsed args to set it in; the
  log says so);
* runs the rule pass and the coverage table of a Megatron-LM launch over the container's fields,
  read under Megatron-LM's names (``train.micro_batch_size`` is ``--micro-batch-size``). A refusal
  names Bridge's field where Megatron-LM's message names its flag;
* refuses a ``train.rampup_batch_size`` left unconverted (config/bridge_rules.py);
* says that Bridge's GPT step passes no ``loss_mask`` to the model (Bridge #6103), and that in token
  mode the extension gives the model the one ``gpt_step.get_batch`` returned (bridge_loop.py), for
  the MoE and MTP rules;
* then ``megatron_ga_ext.install(config)``: the schedule, finalize, calculator and optimizer hooks
  are megatron-core's, and Bridge's loop calls them (Bridge binds ``finalize_model_grads`` and its
  schedule by name: install() rebinds both); the noise scale's line, TensorBoard/W&B scalars and
  sidecar go through Bridge's ``train_step``, ``training_log``, GlobalState writers and
  checkpointing (bridge_loop.py's rows of the hook table).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

from megatron_ga_ext.config.bridge_rules import SECTIONS, bridge_errors, bridge_names
from megatron_ga_ext.config.flags import GA_FLAGS, GAFlags
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.install_check import check_args
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import GAError, OptionError, ScheduleError
from megatron_ga_ext.integration.installation import Installation
from megatron_ga_ext.integration.lifecycle import install as install_extension
from megatron_ga_ext.logs import get_logger

__all__ = ["GAContainer", "GASection", "ga_config", "install", "megatron_settings", "with_ga"]

logger = get_logger(__name__)

register_allowed_target_prefix("megatron_ga_ext")

#: The --ga-* settings as a mutable dataclass (Bridge's overrides write each field back with
#: setattr).
GASection = dataclasses.make_dataclass(
    "GASection",
    [
        (f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(GAFlags)
    ],
    kw_only=True,
    module=__name__,  # type: ignore[call-arg]  # Python 3.12's parameter (Bridge needs 3.12); mypy reads 3.11's
)


@dataclasses.dataclass(kw_only=True)
class GAContainer(ConfigContainer):
    """Bridge's ConfigContainer with a ``ga`` section, whose validation gives a step schedule its
    run length."""

    ga: Any = dataclasses.field(default_factory=GASection)

    def validate(self) -> None:
        """Bridge's validation (``runtime_config_update`` runs it in ``pretrain()``), then, under
        ``train.step_batch_size_schedule``: ``train.train_iters`` = the steps the schedule takes to
        ``train.train_samples`` (Bridge divides by one GBS). The LR horizons are samples (Bridge's
        sample-based scheduler, stepped by each step's batch), so the LR decay ends on the last
        step."""
        super().validate()
        text = getattr(self.train, "step_batch_size_schedule", None)
        if text is None:
            return
        samples = self.train.train_samples
        with _bridge_names(megatron_settings(self)[1]):
            schedule = StepSchedule.parse(text, seq_length=getattr(self.model, "seq_length", None))
            iterations, planned = schedule.run_totals(
                self.train.micro_batch_size, self.data_parallel_size, samples
            )
        if planned != samples:
            raise ScheduleError(
                f"train.train_samples {samples}: under train.step_batch_size_schedule {text!r} "
                "(MBS "
                f"{self.train.micro_batch_size}, DP {self.data_parallel_size}) the last of its "
                f"{iterations} steps ends at {planned} samples, and Bridge builds the "
                "training data and the LR decay for "
                f"{samples}. Set train.train_samples to {planned} (megatron-ga schedule prints "
                "the steps)."
            )
        logger.info(
            "megatron-ga-ext: train.step_batch_size_schedule %r: train.train_samples %d takes %d "
            "iterations (Bridge's %d at one GBS)",
            text,
            samples,
            iterations,
            self.train.train_iters,
        )
        self.train.train_iters = iterations


def with_ga(cfg: ConfigContainer, **settings: Any) -> GAContainer:
    """``cfg`` as a GAContainer (the same section objects) with ``ga`` holding ``settings``
    (GAFlags' field names; the others at their defaults). An unknown name is an OptionError that
    lists the known ones."""
    unknown = sorted(set(settings) - set(GA_FLAGS))
    if unknown:
        raise OptionError(
            f"ga.{unknown[0]}: not a megatron-ga-ext setting; the ga section holds "
            f"{', '.join(sorted(GA_FLAGS))} (the --ga-* flags, as fields)."
        )
    values = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init and f.name != "ga"
    }
    return GAContainer(**values, ga=GASection(**settings))


def megatron_settings(cfg: ConfigContainer) -> tuple[dict[str, Any], dict[str, str]]:
    """(Megatron-LM arg name -> value, Megatron-LM arg name -> Bridge's field) over
    :data:`SECTIONS`' dataclass fields, and the world size as Bridge reads it
    (``get_world_size_safe``: torch.distributed's, else ``WORLD_SIZE``).
    ``dataset.data_parallel_size`` is left out: Bridge sets it from the world size when it validates
    the container, so before ``pretrain()`` it holds its default 1; DP is derived as Megatron
    derives it, world / (TP x PP x CP)."""
    from megatron.bridge.utils.common_utils import get_world_size_safe

    values: dict[str, Any] = {"world_size": get_world_size_safe()}
    origin: dict[str, str] = {}
    for section in SECTIONS:
        holder = getattr(cfg, section, None)
        if holder is None or not dataclasses.is_dataclass(holder):
            continue
        for f in dataclasses.fields(holder):
            if (
                f.name not in values
                and not f.name.startswith("_")
                and f.name != "data_parallel_size"
            ):
                values[f.name] = getattr(holder, f.name)
                origin[f.name] = f"{section}.{f.name}"
    return values, origin


def ga_config(cfg: ConfigContainer) -> GAConfig:
    """The GAConfig of ``cfg``: its ``ga`` section (none: the defaults) and the container's model
    settings."""
    section = getattr(cfg, "ga", None)
    settings = (
        {}
        if section is None
        else {f.name: getattr(section, f.name) for f in dataclasses.fields(GAFlags)}
    )
    model = cfg.model
    with _bridge_names(megatron_settings(cfg)[1]):
        return GAConfig(
            **settings,
            seq_length=getattr(model, "seq_length", None),
            step_batch_size_schedule=getattr(cfg.train, "step_batch_size_schedule", None),
            pipeline_model_parallel_size=getattr(model, "pipeline_model_parallel_size", None),
            virtual_pipeline_model_parallel_size=getattr(
                model, "virtual_pipeline_model_parallel_size", None
            ),
        )


def install(cfg: ConfigContainer) -> Installation:
    """Configure, check and install the extension for ``pretrain(cfg, ...)`` (module docstring)."""
    if (
        getattr(getattr(cfg, "ga", None), "convert_rampup", False)
        and cfg.train.rampup_batch_size is not None
    ):
        _convert_rampup(cfg)
    config = ga_config(cfg)
    errors = bridge_errors(
        config.flag_values(),
        getattr(cfg.train, "rampup_batch_size", None),
        cfg.train.global_batch_size,
    )
    if errors:
        raise errors[0]
    if config.step_batch_size_schedule is not None and not (
        isinstance(cfg, GAContainer) and cfg.train.train_samples
    ):
        raise ScheduleError(
            f"train.step_batch_size_schedule {config.step_batch_size_schedule!r} needs "
            f"{'train.train_samples' if isinstance(cfg, GAContainer) else 'a GAContainer (ga_bridge.with_ga(cfg))'}: "
            "Bridge passes no schedule to the calculator and turns train_iters and lr_*_iters "
            "into samples at one GBS; the extension runs the schedule, and "
            "GAContainer.validate() gives train.train_iters the schedule's steps to "
            "train.train_samples (with sample-based LR fields, the LR decay ends on the "
            "last step)."
        )
    if config.loss_reduction == "token" and not cfg.model.calculate_per_token_loss:
        cfg.model.calculate_per_token_loss = True
        logger.info(
            "megatron-ga-ext: ga.loss_reduction token: model.calculate_per_token_loss set to "
            "True (ga.loss_reduction microbatch keeps Bridge's mean of means)"
        )
    values, origin = megatron_settings(cfg)
    with _bridge_names(origin):
        check_args(config, values)
    moe_or_mtp = [
        f"model.{name}"
        for name in ("num_moe_experts", "mtp_num_layers")
        if getattr(cfg.model, name, None)
    ]
    if config.loss_reduction == "token" and moe_or_mtp:
        logger.info(
            "megatron-ga-ext: %s in token mode: Bridge's gpt_step.forward_step does not pass "
            "loss_mask to the model (Bridge #6103); the extension gives the model the "
            "loss mask gpt_step.get_batch returned, so the router and the MTP loss count "
            "loss tokens only (docs/bridge.md). A forward step of your own must pass "
            "loss_mask to the model, or call gpt_step.get_batch.",
            " and ".join(moe_or_mtp),
        )
    return install_extension(config)


def _convert_rampup(cfg: ConfigContainer) -> None:
    """``train.rampup_batch_size`` under ``ga.convert_rampup``: written as
    ``train.step_batch_size_schedule``, its exact equivalent (thresholds in tokens at
    ``model.seq_length``, as that field is read), and cleared, since megatron-core 0.18 and later
    drop it and Bridge's validation refuses it with ``train.train_samples``. A run given in
    ``train.train_iters`` is refused with the samples those steps take: Bridge sizes the run and the
    LR horizons at one GBS."""
    rampup, train = list(cfg.train.rampup_batch_size), cfg.train
    with _bridge_names(megatron_settings(cfg)[1]):
        schedule = resolve_schedule(
            ScheduleInputs(
                step_batch_size_schedule=getattr(train, "step_batch_size_schedule", None),
                rampup_batch_size=rampup,
                global_batch_size=train.global_batch_size,
                convert_rampup=True,
            )
        )
        if schedule is None:  # never: a rampup with convert_rampup resolves to its schedule
            raise ScheduleError(
                f"train.rampup_batch_size {rampup} did not convert to a step schedule"
            )
        if not train.train_samples:
            samples = 0
            for _ in range(train.train_iters or 0):
                samples += schedule.global_batch_size_at(samples)
            raise ScheduleError(
                f"train.rampup_batch_size {rampup} with ga.convert_rampup needs "
                "train.train_samples: Bridge sizes train.train_iters and the lr_*_iters fields "
                "at one GBS "
                f"({train.global_batch_size}), and the ramp changes it. The {train.train_iters} "
                f"steps of train.train_iters take {samples} "
                "samples under the "
                f"ramp: set train.train_iters=null train.train_samples={samples}, and give the "
                "LR warmup and decay in samples (scheduler.lr_warmup_samples, "
                "scheduler.lr_decay_samples)."
            )
        text = schedule.to_string(cfg.model.seq_length)
    train.step_batch_size_schedule, train.rampup_batch_size = text, None
    logger.info(
        "megatron-ga-ext: ga.convert_rampup: train.rampup_batch_size %s runs as its exact step "
        "schedule, train.step_batch_size_schedule %r (thresholds in tokens at seq_length "
        "%s); the rampup field is cleared",
        rampup,
        text,
        cfg.model.seq_length,
    )


@contextlib.contextmanager
def _bridge_names(origin: dict[str, str]) -> Iterator[None]:
    """Re-raise a GAError with Bridge's field names where it names flags
    (config/bridge_rules.bridge_names)."""
    try:
        yield
    except GAError as error:
        fields = {"--" + name.replace("_", "-"): path for name, path in origin.items()}
        raise type(error)(bridge_names(str(error), fields)) from error
