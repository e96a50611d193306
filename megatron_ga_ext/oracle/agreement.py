"""``megatron-ga check``'s verdict on a launch line beside upstream's (runner.py): where they
disagree, and how to say it. Pure Python.

They agree on a line where both accept it or both refuse it, and, where both accept it, on its
numbers: the world size, DP, GBS and GA, and for a step schedule each stage's (threshold in samples,
GBS, GA). A refusal of check's that upstream does not make agrees only where every problem check
reports is one of its deliberate additions (a rule upstream lacks, on purpose: ``deliberate``, rule
name -> reason).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_ga_ext.errors import GAError
from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.line import parse_launch
from megatron_ga_ext.launch.registry import ADDITIONS, RULES
from megatron_ga_ext.launch.report import Report
from megatron_ga_ext.oracle.runner import UpstreamVerdict

__all__ = [
    "CheckVerdict",
    "check_verdict",
    "deliberate_rules",
    "disagreements",
    "report_block",
    "verdict_of_report",
]


@dataclass(frozen=True)
class CheckVerdict:
    """check's answer: its exit status (0 clean, 1 problems, 2 unreadable), its problems (rule,
    message) and the ledger's numbers."""

    rc: int
    problems: tuple[tuple[str, str], ...]
    world_size: int | None = None
    data_parallel_size: int | None = None
    global_batch_size: int | None = None
    num_microbatches: int | None = None
    stages: tuple[tuple[int, int, int], ...] | None = None

    @property
    def accepted(self) -> bool:
        return self.rc == 0

    def summary(self) -> str:
        numbers = (
            f"world {self.world_size}, DP {self.data_parallel_size}, GBS "
            f"{self.global_batch_size}, GA {self.num_microbatches}"
        )
        if self.stages:
            numbers += ", stages " + " ".join(f"{t}:{g}/GA {a}" for t, g, a in self.stages)
        verdict = "accepted" if self.accepted else f"refused (rc {self.rc})"
        problems = "".join(f"\n    [{rule}] {message}" for rule, message in self.problems)
        return f"{verdict}: {numbers}{problems}"


def check_verdict(tokens: list[str], world_size: int | None = None) -> CheckVerdict:
    """check's verdict on a launch line, as ``megatron-ga check -- TOKENS`` gives it."""
    try:
        report = check_launch(parse_launch(tokens), world_size)
    except GAError as error:
        return CheckVerdict(rc=2, problems=(("unreadable", str(error)),))
    return verdict_of_report(report)


def verdict_of_report(report: Report) -> CheckVerdict:
    """The verdict and numbers of check's report."""
    ledger, table = report.ledger, report.stages
    rows = None if table is None or table.rows is None else table.rows
    return CheckVerdict(
        rc=1 if report.problems else 0,
        problems=tuple((p.rule, p.message) for p in report.problems),
        world_size=_int(ledger.get("world_size")),
        data_parallel_size=_int(ledger.get("data_parallel_size")),
        global_batch_size=_int(ledger.get("global_batch_size")),
        num_microbatches=_int(ledger.get("num_microbatches")),
        stages=None
        if rows is None
        else tuple((r.threshold_samples, r.global_batch_size, r.num_microbatches) for r in rows),
    )


def _int(value: object) -> int | None:
    return value if isinstance(value, int) else None


def deliberate_rules() -> dict[str, str]:
    """check's deliberate additions, from its rule registry: each rule marked ``ours`` and each of
    ``ADDITIONS`` (rule id -> why; an id ending in ``<row>`` stands for every id with that
    prefix)."""
    ours = {rule.id: rule.ours for rule in RULES if rule.ours}
    return {**ours, **{rule: why for rule, why, _ in ADDITIONS}}


def _is_deliberate(rule: str, deliberate: Mapping[str, str]) -> bool:
    prefixes = [key.removesuffix("<row>") for key in deliberate if key.endswith("<row>")]
    return rule in deliberate or any(rule.startswith(prefix) for prefix in prefixes)


def deliberate_only(check: CheckVerdict, deliberate: Mapping[str, str]) -> bool:
    """check refuses only by its deliberate additions."""
    return bool(check.problems) and all(
        _is_deliberate(rule, deliberate) for rule, _ in check.problems
    )


def disagreements(
    check: CheckVerdict, upstream: UpstreamVerdict, world: int | None, deliberate: Mapping[str, str]
) -> list[str]:
    """What check says otherwise than upstream on one line ([] where they agree: the module
    docstring)."""
    found = []
    if world is not None and check.world_size is not None and check.world_size != world:
        found.append(f"world: check reads {check.world_size}, the launcher starts {world}")
    if check.accepted != upstream.accepted:
        if not (upstream.accepted and deliberate_only(check, deliberate)):
            said = "accepts" if check.accepted else "refuses"
            found.append(
                f"verdict: check {said}, upstream {'accepts' if upstream.accepted else 'refuses'}"
            )
        return found
    if not upstream.accepted:
        return found
    if check.data_parallel_size != upstream.data_parallel_size:
        found.append(
            f"DP: check {check.data_parallel_size}, upstream {upstream.data_parallel_size}"
        )
    if upstream.stages is not None or check.stages is not None:
        if check.stages != upstream.stages:
            found.append(f"stages: check {check.stages}, upstream {upstream.stages}")
    else:
        for name in ("global_batch_size", "num_microbatches"):
            ours, theirs = getattr(check, name), getattr(upstream, name)
            if ours != theirs:
                found.append(f"{name}: check {ours}, upstream {theirs}")
    return found


def report_block(
    line: str, check: CheckVerdict, upstream: Mapping[str, UpstreamVerdict], found: list[str]
) -> str:
    """One disagreement, for a person to fix: the line, check's verdict, each source's verdict, what
    differs."""
    text = [f"line: {line}", f"check: {check.summary()}"]
    text += [f"upstream {source}: {verdict.summary()}" for source, verdict in upstream.items()]
    text += [f"differs: {reason}" for reason in found]
    return "\n".join(text)
