"""A Megatron-Bridge launch line, ``torchrun ... SCRIPT --recipe NAME section.field=value ...``,
read as the Megatron-LM line it configures, for ``megatron-ga check --bridge``. Pure Python (PyYAML
for a YAML file).

The script is Bridge's ``scripts/training/run_recipe.py``, or a copy that calls
``ga_bridge.install(cfg)`` before ``pretrain()``. Its overrides are Hydra's:
``section.field=value``, with ``+`` or ``++`` before a new key. A field of Bridge's sections
(config/bridge_rules.SECTIONS) has the name of Megatron-LM's arg, and ``ga.<field>`` is
``--ga-<field>``: each override of a flag that ``check`` reads becomes that flag (a switch: given
where the value is true, ``--no-...`` where false and negatable; a list such as ``[2,2,64]``: its
values). The other overrides are Bridge's alone and left out; every other word of the line is kept.
The recipe's own values are not on the line, so what no override sets reads as Megatron-LM's
default: ``check`` says so.

What the scripts read besides, in their order (a later one wins, as the scripts merge them):

* ``--seq_length N``, run_recipe.py's: the recipe's ``model.seq_length``;
* ``--config-file PATH`` (or ``--config_file``), the YAML of overrides Bridge's example scripts
  merge before the command line's (``section: {field: value}``, as ``cfg.to_yaml()`` writes it);
* the ``section.field=value`` overrides.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from typing import Any

from megatron_ga_ext.config.bridge_rules import SECTIONS, bridge_errors, bridge_names
from megatron_ga_ext.config.flags import BY_DEST, GA_FLAGS
from megatron_ga_ext.core.megatron_flags import Option
from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.line import ga_values, parse_int, parse_launch
from megatron_ga_ext.launch.report import Note, Problem, Report, problem_of
from megatron_ga_ext.launch.yaml_cfg import read_yaml_mapping

__all__ = ["RECIPE_SCRIPT", "bridge_check", "bridge_tokens", "is_bridge_line"]

#: Megatron-Bridge's launch script, recognised without ``--bridge``.
RECIPE_SCRIPT = "run_recipe.py"

#: Where Bridge holds what check's messages name without an override of it.
_FIELDS = {
    "--calculate-per-token-loss": "model.calculate_per_token_loss",
    # a converted rampup's, as install writes it
    "--step-batch-size-schedule": "train.step_batch_size_schedule",
    "--rampup-batch-size": "train.rampup_batch_size",
}


def is_bridge_line(tokens: list[str]) -> bool:
    """The line runs Megatron-Bridge's run_recipe.py (in one word or a pasted line)."""
    words = tokens[0].split() if len(tokens) == 1 else tokens
    return any(word.rstrip("\\;").endswith(RECIPE_SCRIPT) for word in words)


def bridge_check(tokens: list[str], world_size: int | None) -> Report:
    """The report of a Bridge launch line: Megatron-LM's line it configures, checked as one with the
    extension on, with Bridge's refusals (config/bridge_rules.py), every flag named as Bridge's
    field."""
    if len(tokens) == 1 and " " in tokens[0].strip():
        try:
            tokens = shlex.split(tokens[0].replace("\\\n", " "), comments=True)
        except ValueError as error:
            raise UsageError(
                f"the launch line cannot be split like a shell line: {error}."
            ) from None
    line, fields, files = bridge_tokens(tokens)
    launch = parse_launch(line)
    launch.entry = True  # the script calls ga_bridge.install(cfg)
    ramp_flag, gbs_flag = BY_DEST["rampup_batch_size"].flag, BY_DEST["global_batch_size"].flag
    converted = bool(ga_values(launch).get("convert_rampup"))
    # unconverted: Bridge's own refusal below, not Megatron-LM's advice; converted: checked as
    # Megatron-LM's
    ramp = launch.values.get(ramp_flag) if converted else launch.values.pop(ramp_flag, None)
    report = check_launch(launch, world_size)
    rampup = None if ramp is None else [parse_int(ramp_flag, value) for value in ramp]
    gbs = launch.get(gbs_flag)
    global_batch_size = None if gbs is None else parse_int(gbs_flag, gbs)
    bridge = [
        problem_of(error, "bridge")
        for error in bridge_errors(ga_values(launch), rampup, global_batch_size)
    ]
    names = {**_FIELDS, **fields}
    read = "".join(f" and {path}" for path in files)
    first = Note(
        severity="info",
        text=f"a Megatron-Bridge launch: {len(fields)} field(s) set by its overrides{read}; "
        "the recipe's own values are not on the line, so a field no override sets reads as "
        "Megatron-LM's default.",
        link="docs/bridge.md",
    )
    notes = [first, *(replace(n, text=bridge_names(n.text, names)) for n in report.notes)]
    return replace(
        report,
        problems=tuple(_renamed(p, names) for p in (*report.problems, *bridge)),
        notes=tuple(notes),
        kind="a Megatron-Bridge launch",
    )


def _renamed(problem: Problem, names: dict[str, str]) -> Problem:
    """``problem`` with each flag it names as Bridge's field."""
    return replace(
        problem,
        message=bridge_names(problem.message, names),
        fix=None if problem.fix is None else bridge_names(problem.fix, names),
        flag=None if problem.flag is None else bridge_names(problem.flag, names),
    )


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def bridge_tokens(tokens: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """(the line with each setting of a declared flag as that flag, flag -> Bridge's field that set
    it, the YAML files read)."""
    line: list[str] = []
    files: list[str] = []
    recipe: dict[str, str] = {}  # section.field -> value, in the scripts' order of merging
    yaml: dict[str, str] = {}
    overrides: dict[str, str] = {}
    words = iter(tokens)
    for token in words:
        flag, eq, inline = token.partition("=")
        if flag in ("--seq_length", "--config-file", "--config_file"):
            value = inline if eq else next(words, None)
            if value is None:
                raise UsageError(f"{flag} is given without a value on the Bridge launch line.")
            if flag == "--seq_length":
                recipe["model.seq_length"] = value
            else:
                files.append(value)
                yaml.update(_yaml_overrides(flag, value))
            continue
        key, eq, value = token.lstrip("+").partition("=")
        if not eq or token.startswith("-"):  # the launcher, the script, --recipe NAME
            line.append(token)
            continue
        overrides[key] = value
    fields: dict[str, str] = {}
    for key, value in {**recipe, **yaml, **overrides}.items():
        section, _, name = key.partition(".")
        option = (
            GA_FLAGS.get(name)
            if section == "ga"
            else BY_DEST.get(name)
            if section in SECTIONS
            else None
        )
        if option is None:  # a field check does not read: Bridge's, not Megatron-LM's parser's
            continue
        fields[option.flag] = key
        line += _flag(option, value.strip().strip("'\""))
    return line, fields, files


def _yaml_overrides(flag: str, path: str) -> dict[str, str]:
    """``section.field`` -> the value as an override writes it, for each field of the sections in
    the YAML file at ``path`` (a null: left as the recipe has it)."""
    data = read_yaml_mapping(flag, path, "the sections of a config (section: {field: value})")
    return {
        f"{section}.{name}": _override_text(value)
        for section, holder in data.items()
        if section in (*SECTIONS, "ga") and isinstance(holder, dict)
        for name, value in holder.items()
        if value is not None and not isinstance(value, dict)
    }


def _override_text(value: Any) -> str:
    """A YAML value as the override ``section.field=...`` writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def _flag(option: Option, value: str) -> list[str]:
    if option.nargs == 0:
        if value.lower() in _TRUE:
            return [option.flag]
        if value.lower() in _FALSE:
            return ["--no-" + option.flag[2:]] if option.negatable else []
        return [option.flag, value]  # not a truth value: the flag's own reading refuses it
    if value.startswith("[") and value.endswith("]"):
        return [option.flag, *value[1:-1].replace(",", " ").split()]
    return [option.flag, value]
