"""Megatron-LM's ``--yaml-cfg FILE`` read like the flags it stands for. Pure Python (PyYAML, a
dependency).

Megatron's parse_args replaces the whole parsed command line by the YAML file (``load_yaml``:
"argparse arguments will be ignored"): its top-level keys and the keys of its sections
(``model_parallel:``, ``language_model:``) are Megatron's args by name (``micro_batch_size``,
``tensor_model_parallel_size``, ``rampup_batch_size: [32, 32, N]``).
:func:`with_yaml` gives the launch those values in place of the line's Megatron flags; the launcher's stay (the world
size is the launcher's, which Megatron reads from WORLD_SIZE). A Megatron flag on the line beside
``--yaml-cfg`` is ignored by Megatron, which is a problem of its own.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron_ga_ext.core.megatron_flags import BY_DEST, LAUNCHER_OPTIONS
from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.report import Note, Problem

__all__ = ["FLAG", "read_yaml_mapping", "with_yaml"]

FLAG = "--yaml-cfg"
_LAUNCHER = {option.flag for option in LAUNCHER_OPTIONS}
#: A YAML key Megatron-LM's parser has no flag for, read as the flag that gives the same value.
_ALIASES = {"virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank"}


def with_yaml(launch: Launch) -> tuple[Launch, list[Problem], list[Note]]:
    """``launch`` with its ``--yaml-cfg`` file's settings in place of its Megatron flags (the
    launcher's and the ``--ga-*`` ones kept), the problems of the pair, and a note saying what was
    read. Unchanged without the flag."""
    path = launch.get(FLAG)
    if path is None:
        return launch, [], []
    try:
        settings = _settings(path)
    except UsageError as error:
        return (
            launch,
            [
                Problem(
                    message=f"{error} Megatron runs with the file's settings, not the line's: "
                    "the ledger below is the line's.",
                    rule="yaml-cfg-unread",
                    flag=FLAG,
                    value=path,
                    fix="Run check where the file is.",
                )
            ],
            [],
        )
    line = copy.deepcopy(launch)
    ignored = [
        launch.name(f)
        for f in (*launch.values, *launch.switches)
        if f not in _LAUNCHER and f != FLAG and not f.startswith("--ga-")
    ]
    for held in (line.values, line.switches, line.repeated, line.stray):
        for flag in [
            f for f in held if f not in _LAUNCHER and f != FLAG and not f.startswith("--ga-")
        ]:
            del held[flag]
    for key, (where, value) in settings.items():
        option = BY_DEST.get(_ALIASES.get(key, key))
        if option is None or value is None or option.flag in _LAUNCHER:
            continue
        line.spelled[option.flag] = f"{path}: {where}"
        if option.nargs == 0:
            line.switches[option.flag] = bool(value)
        elif isinstance(value, list):
            line.values[option.flag] = [str(v) for v in value]
        else:
            line.values[option.flag] = [_text(value)]
    problems = []
    if ignored:
        problems.append(
            Problem(
                message=f"{FLAG} {path} replaces Megatron's whole command line (load_yaml: "
                '"argparse arguments will '
                f"be ignored\"), so {', '.join(ignored)} on the line do(es) nothing; the YAML's "
                "values are used. Set "
                f"them in the YAML, or drop them from the line.",
                rule="yaml-cfg-ignores-line",
                flag=ignored[0],
                fix="Set them in the YAML, or drop them from the line.",
            )
        )
    read = sum(1 for key in settings if BY_DEST.get(_ALIASES.get(key, key)) is not None)
    note = Note(
        severity="info",
        text=f"read {FLAG} {path}: {read} setting(s) check knows, in place of the line's "
        "Megatron flags (Megatron's YAML arguments are experimental).",
    )
    return line, problems, [note]


def read_yaml_mapping(flag: str, path: str, holds: str) -> dict:
    """The mapping the YAML file at ``path`` (given by ``flag``) holds; a UsageError naming the flag
    where it cannot be read, is not YAML, or holds something else than ``holds``. PyYAML is imported
    here only: a line without a YAML file is checked without it."""
    try:
        import yaml
    except ImportError:
        raise UsageError(
            f"{flag} {path}: reading a YAML file needs PyYAML (pip install pyyaml)."
        ) from None
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot read it ({error.strerror or error}).") from None
    except yaml.YAMLError as error:
        raise UsageError(f"{flag} {path}: not YAML ({error}).") from None
    if not isinstance(data, dict):
        raise UsageError(f"{flag} {path}: the file holds {type(data).__name__}, not {holds}.")
    return data


def _settings(path: str) -> dict[str, tuple[str, Any]]:
    """Each arg the file sets: its name -> (where in the file, the value); a section's keys under
    the section."""
    data = read_yaml_mapping(FLAG, path, "Megatron's settings by name")
    settings: dict[str, tuple[str, Any]] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            for inner, inner_value in value.items():
                settings.setdefault(str(inner), (f"{key}.{inner}", inner_value))
        else:
            settings[str(key)] = (str(key), value)
    return settings


def _text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
