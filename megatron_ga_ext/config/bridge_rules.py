"""What a Megatron-Bridge launch is refused beyond a Megatron-LM one, and Bridge's field names for
Megatron-LM's flags: shared by ``integration/bridge.py`` (install(cfg)) and ``megatron-ga check
--bridge``. Pure Python.

A field of Bridge's ConfigContainer sections has the name of Megatron-LM's arg
(``train.micro_batch_size`` is ``--micro-batch-size``); ``ga.<field>`` is ``--ga-<field>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_ga_ext.config.flags import GA_FLAGS
from megatron_ga_ext.errors import OptionError

__all__ = ["SECTIONS", "bridge_errors", "bridge_names"]

#: The container's sections read as Megatron-LM's args, in order: a name two sections hold is the
#: first's.
SECTIONS = (
    "train",
    "model",
    "optimizer",
    "ddp",
    "scheduler",
    "dataset",
    "validation",
    "checkpoint",
    "logger",
    "dist",
    "rng",
    "rerun_state_machine",
    "tokenizer",
)


def bridge_errors(
    ga: Mapping[str, Any], rampup: Sequence[int] | None, global_batch_size: int | None
) -> list[OptionError]:
    """The refusals of a Bridge launch beyond a Megatron-LM launch's: a ``train.rampup_batch_size``
    without ``ga.convert_rampup`` (megatron-core 0.18 and later drop it with a warning, and Bridge's
    validation refuses it with ``train.train_samples``)."""
    errors: list[OptionError] = []
    if rampup is not None and not ga.get("convert_rampup"):
        errors.append(
            OptionError(
                f"train.rampup_batch_size {list(rampup)}: megatron-core 0.18 and later drop it "
                "with a warning (init_num_microbatches_calculator passes no ramp on), so the run "
                "would train at global_batch_size "
                f"{global_batch_size} from the first step. Set ga.convert_rampup=true to run it "
                "as its exact step schedule (with train.train_samples), or remove it (None); "
                "megatron-ga schedule --from-rampup "
                f"{' '.join(map(str, rampup))} --global-batch-size={global_batch_size} prints "
                "that schedule (docs/bridge.md)."
            )
        )
    return errors


def bridge_names(message: str, fields: Mapping[str, str]) -> str:
    """``message`` with each flag it names as Bridge's field: ``--ga-noise-scale`` as
    ``ga.noise_scale``, and each Megatron-LM flag of ``fields`` (flag -> ``section.field``) as that
    field."""
    names = {option.flag: f"ga.{option.field}" for option in GA_FLAGS.values()}
    names.update(fields)
    return _FLAG.sub(lambda match: names.get(match.group(0), match.group(0)), message)


#: A command-line flag in a message: ``--`` and a name, not inside a longer one; ``--flag=value`` is
#: a command of this package's CLI quoted in the message, kept as it is.
_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*(?![\w=-])")
