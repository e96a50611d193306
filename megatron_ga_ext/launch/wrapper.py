"""The command a container or shell wrapper runs: ``bash -c "..."`` / ``sh -c`` after srun (pyxis's
``--container-image``), ``enroot start``, ``docker run ... IMAGE``, ``apptainer exec``. Pure Python.

The wrapper's quoted command is split as the shell splits it and read in its place; of a command
list (``cd /workspace && torchrun ...``) the part that runs the training script is read. What cannot
be read (the command in a variable) is a UsageError (check exits 2): check never shows a ledger of
defaults for words it did not read.
"""

from __future__ import annotations

import os
import shlex

from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.report import Note

__all__ = ["unwrap"]

_SHELLS = ("bash", "sh", "zsh", "dash")
_SEPARATORS = ("&&", "||", ";", "|")


def unwrap(tokens: list[str], start: int) -> tuple[list[str], int, list[Note]]:
    """``tokens`` with a shell wrapper's ``-c`` command at or after ``start`` split in place, the
    index the launch's own words start at, and a note naming what was read; unchanged where there is
    no wrapper."""
    at = _shell_command(tokens, start)
    if at is None:
        return tokens, start, []
    shell, command = at
    text = tokens[command]
    if text.strip().startswith("$") and len(shlex.split(text)) == 1:
        raise UsageError(
            f"the launch runs {os.path.basename(tokens[shell])} -c {text}: the command is in a "
            "shell variable check cannot read. Paste the command itself: megatron-ga check -- "
            "'<the launch line>'."
        )
    try:
        inner = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as error:
        raise UsageError(
            f"the command of {tokens[shell]} -c cannot be split like a shell line: {error}."
        ) from None
    words = _training_part(inner)
    before = " ".join(tokens[:shell])
    note = Note(
        severity="info",
        text=f"read the command {os.path.basename(tokens[shell])} -c runs"
        + (f" (started by {before[:80]})" if before else "")
        + "; the words before it start the container or shell, not the training.",
    )
    return [*tokens[:shell], *words], shell, [note]


def _shell_command(tokens: list[str], start: int) -> tuple[int, int] | None:
    """(the shell's index, its command's index) of the first ``bash -c CMD`` at or after
    ``start``."""
    for i in range(start, len(tokens)):
        if os.path.basename(tokens[i]) not in _SHELLS:
            continue
        j = i + 1
        while j < len(tokens) and tokens[j].startswith("-"):
            if "c" in tokens[j][1:] and not tokens[j].startswith("--"):
                return (i, j + 1) if j + 1 < len(tokens) else None
            j += 1
    return None


def _training_part(words: list[str]) -> list[str]:
    """Of a command list, the part that runs Python or torchrun (the last such part); the whole
    where none does."""
    parts: list[list[str]] = [[]]
    for word in words:
        if word in _SEPARATORS:
            parts.append([])
        else:
            parts[-1].append(word)
    training = [p for p in parts if any(_runs_training(w) for w in p)]
    return training[-1] if training else words


def _runs_training(word: str) -> bool:
    name = os.path.basename(word)
    return name.startswith("python") or name == "torchrun" or word.endswith(".py")
