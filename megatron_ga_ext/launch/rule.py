"""One rule of ``megatron-ga check``, declared once: what it reads, when the launch breaks it,
Megatron's own words, the fix, and the upstream file:line it mirrors at each tested source (or
``ours`` with the reason). Pure Python.

The declarations live in launch/rules_*.py; launch/registry.py gathers them and evaluates them in
one pass over one resolved view of the launch (launch/view.py). The oracle tier and
docs/check-rules.md read the same declarations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_ga_ext.launch.report import Edit, Problem
from megatron_ga_ext.launch.view import View

__all__ = ["ARGS", "CONFIG", "LAYOUT", "REFS", "Cite", "Rule", "cite", "switched"]

#: The tested sources a citation gives a line for, oldest first (release tags, then main's
#: d98e8a64).
REFS = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0", "d98e8a64")
ARGS = "megatron/training/arguments.py"
CONFIG = "megatron/core/transformer/transformer_config.py"
LAYOUT = "megatron/core/transformer/pipeline_parallel_layer_layout.py"


@dataclass(frozen=True)
class Cite:
    """Where upstream holds the rule: a file and its line at each of :data:`REFS` (None: that source
    lacks it)."""

    file: str
    lines: tuple[int | None, ...]

    def newest(self) -> str:
        """``arguments.py:1000 at core_v0.19.0``: the newest release that has it (main where no
        release does)."""
        for ref, line in reversed(tuple(zip(REFS[:-1], self.lines[:-1]))):
            if line is not None:
                return f"{self.file.rsplit('/', 1)[-1]}:{line} at {ref}"
        return f"{self.file.rsplit('/', 1)[-1]}:{self.lines[-1]} at {REFS[-1]}"

    def since(self) -> str | None:
        """The first tested source that has the rule, where an older one lacks it (None: all have
        it)."""
        if self.lines[0] is not None:
            return None
        return next(ref for ref, line in zip(REFS, self.lines) if line is not None)


def cite(file: str, *lines: int | None) -> Cite:
    if len(lines) != len(REFS):
        raise ValueError(
            f"a citation gives one line per tested source ({len(REFS)}), got {len(lines)}"
        )
    return Cite(file, lines)


Words = Callable[[View], str]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One rule: ``broken(view)`` says the launch breaks it; the problem then reads
    ``<given>: Megatron asserts "<says>" (<file:line>). <fix>``."""

    id: str
    """The problem's rule id (docs/guide.md lists them); several declarations may share one."""
    about: str
    """The destination of the flag the problem is about (named as the line spells it)."""
    reads: tuple[str, ...]
    """The argparse destinations it reads (docs/check-rules.md lists them)."""
    broken: Callable[[View], bool]
    given: Words
    """The launch's side, in its own flags: ``--use-torch-fsdp2 with --pipeline-model-parallel-size
    2``."""
    says: str | Words
    """Megatron's own message (as upstream words it), or ours."""
    fix: str | Words
    edit: Callable[[View], Edit | None] | None = None
    source: Cite | None = None
    ours: str | None = None
    """Why the rule is ours, where upstream has no such rule (the oracle tier lists it as a
    deliberate addition)."""
    verb: str = "asserts"
    """How upstream stops: ``asserts``, or ``raises ValueError`` (TransformerConfig)."""
    topic: str = "batch"
    extension_only: bool = False
    """The rule holds only with megatron-ga-ext on the line."""

    def __post_init__(self) -> None:
        if (self.source is None) == (self.ours is None):
            raise ValueError(
                f"rule {self.id}: give its upstream source or why it is ours, one of the two"
            )

    def problem(self, view: View) -> Problem:
        says = self.says(view) if callable(self.says) else self.says
        fix = self.fix(view) if callable(self.fix) else self.fix
        if self.source is None:
            message = f"{self.given(view)}: {says}. {fix}"
        else:
            since = self.source.since()
            when = f" (from {since} on)" if since else ""
            message = (
                f'{self.given(view)}: Megatron{when} {self.verb} "{says}" '
                f"({self.source.newest()}). {fix}"
            )
        value = view[self.about]
        return Problem(
            message=message,
            rule=self.id,
            flag=view.flag(self.about),
            value=None if value is None or isinstance(value, bool) else _text(value),
            fix=fix,
            edit=self.edit(view) if self.edit is not None else None,
        )


def switched(
    switch: str, flag: str, *, id: str, topic: str, about_reads: bool = False
) -> Callable[..., Rule]:
    """The builder of the arguments.py rules one switch gates (``--use-torch-fsdp2``,
    ``--hybrid-context-parallel``, ``--overlap-param-gather-with-optimizer-step``):
    ``build(reads, broken, given, says, fix, edit, lines)`` is broken only where ``switch`` is on,
    and its launch side reads ``<flag> with <given>``. The problem is about the switch, or with
    ``about_reads`` about what each rule reads."""

    def build(
        reads: str,
        broken: Callable[[View], bool],
        given: Words,
        says: str,
        fix: str,
        edit: Edit,
        lines: tuple[int, ...],
    ) -> Rule:
        return Rule(
            id=id,
            about=reads if about_reads else switch,
            reads=(switch, reads),
            broken=lambda v: bool(v[switch]) and broken(v),
            given=lambda v: f"{flag} with {given(v)}",
            says=says,
            fix=fix,
            edit=lambda v: edit,
            source=cite(ARGS, *lines),
            topic=topic,
        )

    return build


def _text(value: object) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
