"""Read the batch arithmetic out of a real launch line (torchrun ... pretrain_gpt.py ...). Pure
Python.

Only the flags config/flags.py and core/megatron_flags.py declare are read (Megatron's that decide
the batch arithmetic, the launcher's, the ``--ga-*`` flags, typed as declared); every other flag is
passed over with its values. ``--flag=value`` and ``--flag value`` both work, and ``_`` in a flag
counts as ``-`` (torchrun accepts both spellings); messages name a flag as the line spelled it.
Megatron's parser takes no positional arguments, so words left after a Megatron flag's values (a
schedule split by an unquoted shell array) are kept to be reported: Megatron stops with
"unrecognized arguments" there. ``line_layout.py`` reads the batch layout a
:class:`Launch` gives (``world.py`` its world size), ``problems.py`` turns it into its problems.
"""

from __future__ import annotations

import copy
import itertools
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_ga_ext.config.flags import GA_OPTIONS, OPTIONS, GAFlag
from megatron_ga_ext.core.megatron_flags import LAUNCHER_OPTIONS, NOT_MEGATRON, Option
from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.report import Edit, Note, Problem
from megatron_ga_ext.launch.script import is_script, read_script
from megatron_ga_ext.launch.slurm import Slurm, read_slurm
from megatron_ga_ext.launch.wrapper import unwrap

__all__ = [
    "Launch",
    "UsageError",
    "ga_values",
    "parse_int",
    "parse_launch",
]

_LAUNCHER = {option.flag for option in LAUNCHER_OPTIONS}
#: The module of the drop-in entry (megatron_ga_ext/__main__.py).
ENTRY = "megatron_ga_ext"


@dataclass
class Launch:
    """The declared flags of a launch line: the last value of each, and what else the line shows."""

    values: dict[str, list[str]] = field(default_factory=dict)
    """Each flag with values (by its declared spelling): the values of its last occurrence."""
    switches: dict[str, bool] = field(default_factory=dict)
    """Each switch given: on, or off for ``--no-<name>``."""
    repeated: dict[str, list[list[str]]] = field(default_factory=dict)
    spelled: dict[str, str] = field(default_factory=dict)
    """How the line spelled each flag it gave (``--nproc_per_node`` for ``--nproc-per-node``)."""
    stray: dict[str, list[str]] = field(default_factory=dict)
    """Words left after a Megatron flag's values, which Megatron's parser refuses."""
    not_megatron: dict[str, list[str]] = field(default_factory=dict)
    """Flags no Megatron parser defines (NOT_MEGATRON), with their values."""
    entry: bool = False
    """The line runs the drop-in entry: ``python -m megatron_ga_ext SCRIPT`` or ``torchrun ... -m
    megatron_ga_ext``."""
    slurm: Slurm = field(default_factory=Slurm)
    """srun's (sbatch's, salloc's) options and the allocation's, where Slurm starts the line."""
    read_as: str = "a launch line"
    """How the words were read: a launch line, a pasted script (its arrays expanded)."""
    read_notes: list[Note] = field(default_factory=list)
    """What reading the line found besides its flags: variables taken from the environment."""
    read_problems: list[Problem] = field(default_factory=list)
    """What the shell would do apart from the launch: a continuation line it runs as a command of
    its own."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables the line assigns before its command (``WORLD_SIZE=16 python ...``, ``env NAME=V
    ...``)."""

    @property
    def extension(self) -> bool:
        """The extension is on: the drop-in entry, or any ``--ga-*`` flag (a script with install()
        in it)."""
        return self.entry or any(
            flag.startswith("--ga-") for flag in (*self.values, *self.switches)
        )

    def get(self, flag: str) -> str | None:
        return self.values[flag][0] if flag in self.values else None

    def on(self, flag: str) -> bool:
        """A switch is on (given, and not as ``--no-<name>``)."""
        return bool(self.switches.get(flag, OPTIONS[flag].default))

    def name(self, flag: str) -> str:
        """``flag`` as the line spelled it."""
        return self.spelled.get(flag, flag)

    def edited(self, edit: Edit) -> Launch:
        """A copy of this line with ``edit`` applied (a flag given replaces its value; repeats and
        strays go)."""
        line = copy.deepcopy(self)
        line.entry = line.entry or edit.entry
        for spelling, values in edit.give:
            option = OPTIONS[spelling]
            line._forget(option.flag)
            if option.nargs == 0:
                line.switches[option.flag] = not spelling.startswith("--no-")
            else:
                line.values[option.flag] = list(values)
        for spelling in edit.drop:
            if spelling in OPTIONS:
                line._forget(OPTIONS[spelling].flag)
            line.not_megatron.pop(spelling, None)
        return line

    def _forget(self, flag: str) -> None:
        for held in (self.values, self.switches, self.repeated, self.spelled, self.stray):
            held.pop(flag, None)


def _normalize(flag: str) -> str:
    return "--" + flag[2:].replace("_", "-")


def parse_launch(tokens: list[str], environment: Mapping[str, str] | None = None) -> Launch:
    """Collect the declared flags of ``tokens``; a single token holding a whole line is split like a
    shell, and a pasted script is read as the shell reads it (launch/script.py; ``environment``
    stands in for os.environ)."""
    launch = Launch()
    sbatch: list[str] = []
    if len(tokens) == 1 and is_script(tokens[0]):
        script = read_script(tokens[0], environment)
        tokens, sbatch = script.words, script.sbatch
        launch.read_as = "a pasted script, its arrays and variables expanded as bash expands them"
        launch.read_notes += [
            Note(severity="info", text=f"${name} is {value}, from the environment check runs in.")
            for name, value in script.from_environment.items()
        ]
        launch.read_problems += [_orphan(words) for words in script.orphans]
    elif len(tokens) == 1 and " " in tokens[0].strip():
        try:  # as the shell reads a line: line continuations joined, comments dropped
            tokens = shlex.split(tokens[0].replace("\\\n", " "), comments=True)
        except ValueError as error:
            raise UsageError(
                f"the launch line cannot be split like a shell line: {error}."
            ) from None
    launch.slurm = read_slurm(tokens, sbatch, environment)
    tokens, i, wrapped = unwrap(tokens, launch.slurm.program_index or 0)
    launch.read_notes += wrapped
    launch.env, i = _assignments(tokens, i)
    launch.entry = any(
        a in ("-m", "--module") and b == ENTRY for a, b in itertools.pairwise(tokens)
    )
    start = i
    while i < len(tokens):
        token, i = tokens[i], i + 1
        if not token.startswith("--"):
            continue
        name, eq, inline = token.partition("=")
        flag = _normalize(name)
        if flag in NOT_MEGATRON:
            launch.not_megatron[flag], i = _values(tokens, i, name, 1, inline if eq else None)
        elif flag in OPTIONS:
            i = _read(launch, OPTIONS[flag], flag, name, tokens, i, inline if eq else None)
    unread_script(launch, tokens[start:])
    return launch


def unread_script(launch: Launch, words: list[str]) -> None:
    """A launch whose training flags live in a shell script it runs (``bash train.sh``) is not one
    check can read: UsageError (exit 2), not a ledger of Megatron's defaults."""
    given = [f for f in (*launch.values, *launch.switches) if f not in _LAUNCHER]
    scripts = [w for w in words if w.endswith(".sh")]
    if scripts and not given:
        raise UsageError(
            f"the launch runs {scripts[0]}, whose flags check cannot see from here. Pass the "
            "script itself: "
            f'megatron-ga check -- "$(cat {scripts[0]})".'
        )


_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _assignments(tokens: list[str], i: int) -> tuple[dict[str, str], int]:
    """The ``NAME=VALUE`` words before the command at ``tokens[i:]`` (after an ``env``), and the
    index after."""
    env: dict[str, str] = {}
    if i < len(tokens) and tokens[i] == "env":
        i += 1
    while i < len(tokens) and _ASSIGNMENT.match(tokens[i]):
        name, _, value = tokens[i].partition("=")
        env[name] = value
        i += 1
    return env, i


def _orphan(words: str) -> Problem:
    first = words.split()[0]
    return Problem(
        message=f"the script runs '{words[:80]}' as a command of its own: the line before it "
        "does not end with '\\', "
        f"so the launch never gets {first} and what follows it. End the line before with '\\'.",
        rule="script-continuation",
        flag=first,
        fix="End the line before with '\\'.",
    )


def _read(
    launch: Launch,
    option: Option,
    flag: str,
    name: str,
    tokens: list[str],
    i: int,
    inline: str | None,
) -> int:
    """Record ``option`` (given as ``name``) and its values from ``tokens[i:]``; the index after
    them."""
    launch.spelled[option.flag] = name
    if option.nargs == 0:
        launch.switches[option.flag] = not flag.startswith("--no-")
        return i
    values, i = _values(tokens, i, name, option.nargs, inline)
    if option.flag in launch.values:
        launch.repeated.setdefault(option.flag, [launch.values[option.flag]]).append(values)
    launch.values[option.flag] = values
    if (
        option.flag not in _LAUNCHER
    ):  # the launcher's flags are followed by the script and its words
        stray = []
        while i < len(tokens) and not tokens[i].startswith("-"):
            stray.append(tokens[i])
            i += 1
        if stray:
            launch.stray[option.flag] = stray
    return i


def _values(
    tokens: list[str], i: int, name: str, nargs: int | str, inline: str | None
) -> tuple[list[str], int]:
    """The values of a flag given as ``name`` at ``tokens[i:]`` (``nargs="+"``: every word up to the
    next flag)."""
    need = nargs if isinstance(nargs, int) else 1
    if inline is not None:
        values = [inline]
    else:
        count = need if isinstance(nargs, int) else max(_words_before_flag(tokens, i), 1)
        values = tokens[i : i + count]
    if len(values) < need or any(v.startswith("--") for v in values):
        raise UsageError(f"{name} needs {need} value(s), got {' '.join(values) or 'none'}.")
    return values, i if inline is not None else i + len(values)


def _words_before_flag(tokens: list[str], i: int) -> int:
    end = i
    while end < len(tokens) and not tokens[end].startswith("-"):
        end += 1
    return end - i


def parse_int(flag: str, text: str) -> int:
    """An integer flag value (at most 10**30); a shell variable left unexpanded or a float is
    unusable input."""
    return read_int(flag, text)


def ga_values(launch: Launch) -> dict[str, Any]:
    """The ``--ga-*`` flags the line gives, by GAConfig field, typed as config/flags.py declares
    them: an integer that is not one raises UsageError naming the flag as spelled; a float that is
    no number stays text (its rule names it). Flags the line leaves out are absent (the rule pass
    reads their defaults)."""
    values: dict[str, Any] = {}
    for option in GA_OPTIONS:
        if option.type is bool and option.flag in launch.switches:
            values[option.field] = launch.on(option.flag)
        elif option.type is not bool and option.flag in launch.values:
            values[option.field] = _typed(launch, option, launch.values[option.flag][0])
    return values


def _typed(launch: Launch, option: GAFlag, text: str) -> object:
    if option.type is int:
        return read_int(launch.name(option.flag), text)
    if option.type is float:
        try:
            return float(text)
        except ValueError:
            return text
    return text
