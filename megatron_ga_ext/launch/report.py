"""What ``megatron-ga check`` answers, as values: problems, notes, fixes and the whole report. Pure
Python.

A :class:`Problem` is one thing the run would refuse or get wrong: the flag and value it is about
(as the line spells them), a stable rule id (docs/check.schema.json lists them), the message, the
nearest valid values where a rule has them, and the fix. A fix that is an edit of the line
(:class:`Edit`) is checked against every rule before it is printed (launch/problems.py): an edit the
next run would refuse is never advised. A :class:`Note` is one line a person reads in one breath,
its severity first.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.schedule.tables import StageRow
from megatron_ga_ext.errors import GAError

__all__ = [
    "SEVERITIES",
    "Edit",
    "Note",
    "Problem",
    "Report",
    "Severity",
    "StageTable",
    "problem_of",
]

Severity = Literal["wrong", "careful", "info"]
#: A note's severities, worst first: ``wrong`` changes what the run trains, ``careful`` may,
#: ``info`` does not.
SEVERITIES: tuple[Severity, ...] = ("wrong", "careful", "info")


@dataclass(frozen=True, kw_only=True)
class Edit:
    """A change to a launch line: flags given (with their values; a switch with none), flags
    dropped, and the drop-in entry added (``-m megatron_ga_ext``)."""

    give: tuple[tuple[str, tuple[str, ...]], ...] = ()
    drop: tuple[str, ...] = ()
    entry: bool = False

    def __add__(self, other: Edit) -> Edit:
        given = dict(self.give)
        given.update(other.give)
        dropped = tuple(f for f in (*self.drop, *other.drop) if f not in given)
        return Edit(
            give=tuple(given.items()),
            drop=tuple(dict.fromkeys(dropped)),
            entry=self.entry or other.entry,
        )

    def words(self) -> str:
        """The edit in words: ``add --ga-convert-rampup; drop --train-iters``."""
        parts = []
        if self.entry:
            parts.append("run the script through -m megatron_ga_ext")
        for flag, values in self.give:
            parts.append(f"add {' '.join((flag, *values))}")
        for flag in self.drop:
            parts.append(f"drop {flag}")
        return "; ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One problem of a launch line."""

    message: str
    rule: str
    """A stable id of the rule broken (``schedule-stage``, ``coverage:<row>``, ``upstream:<row>``
    ...)."""
    flag: str | None = None
    value: str | None = None
    nearest: tuple[int, ...] = ()
    """The nearest valid values of ``flag``, where the rule has them."""
    fix: str | None = None
    """What to do, in words (checked against every rule where it is an :attr:`edit`)."""
    edit: Edit | None = None

    def json(self) -> dict[str, Any]:
        return {
            "flag": self.flag,
            "value": self.value,
            "rule": self.rule,
            "message": self.message,
            "nearest": list(self.nearest),
            "fix": self.fix,
        }


@dataclass(frozen=True, kw_only=True)
class Note:
    """One line a person reads in one breath: the severity first, the detail one link away."""

    severity: Severity
    text: str
    link: str | None = None
    """Where the detail is: ``docs/coverage.md#<row>``."""

    def __str__(self) -> str:
        return f"{self.severity}: {self.text}" + (f" ({self.link})" if self.link else "")

    def json(self) -> dict[str, Any]:
        return {"severity": self.severity, "text": self.text, "link": self.link}


@dataclass
class Found:
    """Problems as they are gathered, in order, without repeats."""

    problems: list[Problem] = field(default_factory=list)

    def add(self, *problems: Problem) -> None:
        for problem in problems:
            if all(p.message != problem.message for p in self.problems):
                self.problems.append(problem)


#: The flag and the value a message in the house style starts with: ``--global-batch-size 96 is
#: ...``.
_LEADING = re.compile(r"^(?P<flag>--[a-z0-9][a-z0-9_-]*)(?: (?P<value>'[^']*'|[^\s:;,]+))?")
_NEAREST = re.compile(r"Nearest valid [^:]*: (?P<values>\d+(?:, \d+)*)")
#: The verbs a fix sentence of the house style starts with.
_FIX_VERBS = (
    "Use",
    "Give",
    "Drop",
    "Add",
    "Pass",
    "Keep",
    "Quote",
    "Change",
    "Train",
    "Write",
    "Move",
    "Begin",
    "Set",
    "Make",
    "Choose",
    "Run",
    "Replace",
    "Remove",
    "Create",
    "Reduce",
    "Raise",
    "Or",
)


def problem_of(
    source: GAError | str,
    rule: str,
    *,
    flag: str | None = None,
    value: str | None = None,
    fix: str | None = None,
    edit: Edit | None = None,
) -> Problem:
    """A :class:`Problem` from an error (or a message) in the house style: the flag and value it
    starts with, its nearest valid values and its fix sentences, where not given."""
    message = str(source)
    leading = _LEADING.match(message)
    if leading is not None and flag is None:
        flag, value = leading.group("flag"), leading.group("value")
        value = (
            value.strip("'")
            if value is not None and value not in ("is", "and", "with", "needs")
            else None
        )
    nearest = _NEAREST.search(message)
    return Problem(
        message=message,
        rule=rule,
        flag=flag,
        value=value,
        fix=fix if fix is not None else fix_sentences(message),
        nearest=tuple(int(v) for v in nearest.group("values").split(", ")) if nearest else (),
        edit=edit,
    )


def fix_sentences(message: str) -> str | None:
    """The fix a house-style message ends with: from its first sentence that starts with a fix verb
    (or ``Nearest valid``) to the end; None where it has none."""
    sentences = re.split(r"(?<=[.!?]) (?=[A-Z])", message)
    for i, sentence in enumerate(sentences[1:], 1):
        if sentence.startswith(_FIX_VERBS) or sentence.startswith("Nearest valid"):
            return " ".join(sentences[i:])
    return None


@dataclass(frozen=True, kw_only=True)
class StageTable:
    """The stages of a launch's batch schedule as its run steps through them (``schedule``'s
    table)."""

    source: str
    """What the stages come from, in words."""
    runs: bool
    """The run trains these stages (False: a rampup megatron-core >= 0.18 ignores; the stages are
    what --ga-convert-rampup would run)."""
    rows: tuple[StageRow, ...] | None
    """One per stage; None where there are too many to list (a long ramp) or a stage breaks a
    rule."""
    summary: str
    micro_batch_size: int
    data_parallel_size: int
    seq_length: int | None
    pipeline_model_parallel_size: int
    virtual_pipeline_size: int
    train_samples: int | None
    """The run's length in samples (from --train-samples, or what --train-iters steps consume);
    None: open."""
    run_length: str | None
    """The flag that gives it, as a person reads it."""
    equivalent: str | None = None
    """A rampup's stages as the --step-batch-size-schedule that runs them (thresholds in tokens with
    a seq length); None for a given schedule, or a ramp too long to write."""
    warmup: tuple[int, ...] | None = None
    """--ga-batch-size-warmup auto: the global batch sizes it may double through, up to its cap
    (when is decided in the run); None otherwise."""

    def warmup_bubble(self, batch: int) -> float:
        """The pipeline bubble at global batch ``batch``."""
        pp, micro = (
            self.pipeline_model_parallel_size,
            batch // (self.micro_batch_size * self.data_parallel_size),
        )
        return (pp - 1) / (self.virtual_pipeline_size * micro + pp - 1)

    def bubble(self, row: StageRow) -> float:
        """(PP - 1) / (VPP x GA + PP - 1) at this stage."""
        pp = self.pipeline_model_parallel_size
        return (pp - 1) / (self.virtual_pipeline_size * row.num_microbatches + pp - 1)

    def json(self) -> dict[str, Any]:
        rows = (
            None
            if self.rows is None
            else [
                {
                    **{k: v for k, v in asdict(r).items() if not k.startswith("lr_")},
                    "pipeline_bubble_fraction": self.bubble(r),
                }
                for r in self.rows
            ]
        )
        return {
            "source": self.source,
            "runs": self.runs,
            "summary": self.summary,
            "micro_batch_size": self.micro_batch_size,
            "data_parallel_size": self.data_parallel_size,
            "seq_length": self.seq_length,
            "train_samples": self.train_samples,
            "run_length": self.run_length,
            "equivalent_schedule": self.equivalent,
            "warmup_batch_sizes": list(self.warmup or []) or None,
            "stages": rows,
        }


@dataclass(frozen=True, kw_only=True)
class Report:
    """Everything ``megatron-ga check`` says of a launch line."""

    ledger: dict[str, int | float | None]
    """Every quantity of the ledger; None where a broken rule decides it."""
    sources: dict[str, str]
    """Where each quantity came from: the flags as the line spelled them, Megatron's default, or its
    formula."""
    ledger_stage: str | None
    """Which stage of a batch schedule the ledger's numbers are (None: the batch is constant)."""
    layout: BatchLayout | None
    """The layout of the ledger where every rule of it holds, else None."""
    stages: StageTable | None
    problems: tuple[Problem, ...]
    notes: tuple[Note, ...]
    kind: str = "a launch line"
    """What the words were read as: a launch line, a pasted script, a Megatron-Bridge launch, a
    --yaml-cfg file."""

    def json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ledger": self.ledger,
            "sources": self.sources,
            "ledger_stage": self.ledger_stage,
            "stages": None if self.stages is None else self.stages.json(),
            "problems": [p.json() for p in self.problems],
            "notes": [n.json() for n in self.notes],
        }
