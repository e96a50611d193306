"""Whether install() patches each upstream function it hooks: by its normalised source, then by its
behaviour.

For each target (compat.TARGETS) that this source defines, in this order:

==================  ===========================================================================================
refused (changed)   its start-up probe (probes.py) measured other arithmetic than the tested sources': refused,
                    naming the function and the difference, whatever ``MEGATRON_GA_ACCEPT_SOURCE``
                    says
tested              its normalised source (compat.fingerprint) is one a tested source has
same behaviour      its source is none of them (a fork's edit), and its probe measured the tested arithmetic
not wired           its hook row is not wired on this source (the defect it corrects is absent): nothing to check
first call          the correction it serves measures upstream's arithmetic at its first call and steps aside
                    where upstream is fixed (upstream_factors.py)
accepted            ``MEGATRON_GA_ACCEPT_SOURCE`` names it: patched with a warning (a fork that knows what it changed)
refused (unknown)   none of the above: refused (strict, the default), warned about with ``--no-ga-strict``
==================  ===========================================================================================

``megatron-ga compat`` prints the same verdicts without a process group (cli/compat.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from megatron_ga_ext.errors import CompatError, OptionError
from megatron_ga_ext.integration.compat import (
    TARGETS,
    UPSTREAM,
    Target,
    fingerprint,
    known_fingerprints,
    live_targets,
)
from megatron_ga_ext.integration.probes import FIRST_CALL, Measured, probe
from megatron_ga_ext.logs import get_logger

#: The correction a target's hook row serves where that row is wired on this source (None: not wired
#: here); given by wiring.py, which reads the hook table (this module is below it).
Correction = Callable[[Target], "str | None"]

logger = get_logger(__name__)

__all__ = [
    "ACCEPTED",
    "ACCEPT_SOURCE",
    "CHANGED",
    "FIRST_CALL_CHECK",
    "NOT_WIRED",
    "SAME_BEHAVIOUR",
    "TESTED",
    "UNKNOWN",
    "Correction",
    "Decision",
    "SourceProblem",
    "accepted_names",
    "check_targets",
    "decide",
    "unwaived",
]

TESTED = "tested"
SAME_BEHAVIOUR = "same behaviour"
NOT_WIRED = "not wired"
FIRST_CALL_CHECK = "first call"
ACCEPTED = "accepted"
CHANGED = "refused: behaviour changed"
UNKNOWN = "refused: unknown source"


@dataclass(frozen=True)
class Decision:
    """One target's verdict, and why."""

    function: str
    """The qualified name (``megatron.core....finalize_model_grads``)."""
    name: str
    """As ``MEGATRON_GA_ACCEPT_SOURCE`` names it: ``finalize_model_grads``, ``GPTModel.forward``."""
    fingerprint: str
    sources: tuple[str, ...]
    """The tested sources whose normalised source this is (empty: none)."""
    measured: Measured | None
    """Its start-up probe's measurement (None: it has none)."""
    verdict: str
    reason: str

    @property
    def refused(self) -> bool:
        return self.verdict in (CHANGED, UNKNOWN)

    @property
    def waivable(self) -> bool:
        """``MEGATRON_GA_ACCEPT_SOURCE`` waives an unknown source, never a measured change."""
        return self.verdict == UNKNOWN


class SourceProblem(str):
    """A refusal's message, with the function it names and whether ``MEGATRON_GA_ACCEPT_SOURCE``
    waives it (an unknown source, never a measured change)."""

    function: str
    name: str
    waivable: bool

    def __new__(
        cls, message: str, function: str = "", name: str = "", waivable: bool = False
    ) -> SourceProblem:
        problem = super().__new__(cls, message)
        problem.function, problem.name, problem.waivable = function, name, waivable
        return problem


def unwaived(problems: list[str], accept: Any) -> list[str]:
    """The problems ``MEGATRON_GA_ACCEPT_SOURCE`` (``accept``: its setting) does not waive."""
    names = accepted_names(accept)

    def waived(problem: str) -> bool:
        if not isinstance(problem, SourceProblem) or not problem.waivable:
            return False
        return bool(names & {problem.function, problem.name, problem.name.rsplit(".", 1)[-1]})

    return [problem for problem in problems if not waived(problem)]


#: The setting that names a fork's functions install() patches unchecked: comma-separated, read at
#: each check (install() reads it before Megatron parses its args; ``megatron-ga compat`` reads it
#: too).
ACCEPT_SOURCE = "MEGATRON_GA_ACCEPT_SOURCE"


def accepted_names(setting: str | Iterable[str] | None = None) -> frozenset[str]:
    """The names ``setting`` (comma-separated, or a list) and :data:`ACCEPT_SOURCE` give,
    stripped."""
    given = os.environ.get(ACCEPT_SOURCE, "").split(",")
    if setting is not None:
        given += setting.split(",") if isinstance(setting, str) else list(setting)
    return frozenset(name.strip() for name in given if name.strip())


def _check_named(names: frozenset[str]) -> None:
    """Every name given must be a hooked function's: a misspelt one would waive nothing, silently."""
    unknown = sorted(
        name for name in names if not any(_named(t, frozenset([name])) for t in TARGETS)
    )
    if unknown:
        raise OptionError(
            f"--ga-accept-source (with {ACCEPT_SOURCE}) names {', '.join(unknown)}, which no hook "
            "row wraps: name a hooked function as `megatron-ga compat` lists it (e.g. "
            "finalize_model_grads or GPTModel.forward)."
        )


def _named(target: Target, accept: frozenset[str]) -> bool:
    return any(
        name in (target.qualified, target.name, target.name.rsplit(".", 1)[-1]) for name in accept
    )


def decide(
    target: Target,
    function: Callable,
    accept: frozenset[str] = frozenset(),
    correction: Correction | None = None,
) -> Decision:
    """The verdict for ``target``, live as ``function`` (module docstring)."""
    found = fingerprint(function)
    sources = tuple(known_fingerprints().get(target.qualified, {}).get(found, []))
    measured = probe(target.qualified, function)

    def decision(verdict: str, reason: str) -> Decision:
        return Decision(target.qualified, target.name, found, sources, measured, verdict, reason)

    if measured is not None and not measured.same:
        having = f", as in {', '.join(sources)}" if sources else ", which no tested source has"
        return decision(
            CHANGED,
            f"has fingerprint {found}{having}, and its behaviour changed: {measured.detail}",
        )
    if sources:
        probed = f"; its probe: {measured.detail}" if measured is not None else ""
        return decision(TESTED, f"as in {', '.join(sources)}{probed}")
    if measured is not None:
        return decision(
            SAME_BEHAVIOUR,
            f"its source is no tested one, its probe measured the same: {measured.detail}",
        )
    serves = correction(target) if correction is not None else target.assumed_by or ""
    if serves is None:
        return decision(
            NOT_WIRED, "its hook is not wired on this source (the defect it corrects is absent)"
        )
    if serves in FIRST_CALL:
        return decision(
            FIRST_CALL_CHECK,
            f"its source is no tested one; {FIRST_CALL[serves]} measures upstream's arithmetic "
            "at the correction's first call and steps aside where upstream is fixed",
        )
    if _named(target, accept):
        return decision(
            ACCEPTED,
            "its source is no tested one and no probe measures it; MEGATRON_GA_ACCEPT_SOURCE "
            "names it",
        )
    return decision(
        UNKNOWN,
        f"has fingerprint {found}, which no tested source has, and no probe measures its "
        f"behaviour (--ga-accept-source {target.name}, or MEGATRON_GA_ACCEPT_SOURCE="
        f"{target.name}, patches it anyway, for a fork that knows what it changed)",
    )


def check_targets(
    version: str,
    strict: bool,
    targets: tuple[Target, ...] = TARGETS,
    accept: Any = None,
    correction: Correction | None = None,
) -> list[str]:
    """Decide each live target (:func:`decide`); raise (strict) or warn on a refusal. ``accept``:
    names to accept beside :data:`ACCEPT_SOURCE`'s; ``correction``: the correction a target's wired
    row serves (wiring.py).

    Returns the refusals' messages, each a :class:`SourceProblem` (empty when every hooked function
    is patched)."""
    names = accepted_names(accept)
    _check_named(names)
    decisions = [decide(t, t.resolve(), names, correction) for t in live_targets(targets)]
    for decision in decisions:
        if decision.verdict != TESTED and not decision.refused:
            logger.info(
                "megatron-ga-ext: %s: %s (%s)", decision.function, decision.verdict, decision.reason
            )
    refused = [d for d in decisions if d.refused]
    if not refused:
        return []
    known = known_fingerprints()
    seen = {d.function: d.fingerprint for d in decisions}
    nearest, matched = _nearest_source(seen, known)
    tested = ", ".join(u.name for u in UPSTREAM)
    problems: list[str] = [
        SourceProblem(
            f"unknown upstream source in megatron-core {version}: {d.function} {d.reason}. The "
            "nearest tested "
            f"source is {nearest} ({matched} of {len(seen)} hooked functions identical). The "
            "extension is tested "
            f"on {tested}: use one of them, or pass strict=False (--no-ga-strict) to patch "
            "anyway with a warning.",
            d.function,
            d.name,
            d.waivable,
        )
        for d in refused
    ]
    if strict:
        raise CompatError(" ".join(problems))
    for problem in problems:
        logger.warning(problem)
    return problems


def _nearest_source(
    seen: dict[str, str], known: dict[str, dict[str, list[str]]]
) -> tuple[str, int]:
    """The tested source that shares the most hooked functions with the live ones, and how many."""
    counts = {u.name: 0 for u in UPSTREAM}
    for name, fp in seen.items():
        for source in known.get(name, {}).get(fp, []):
            counts[source] = counts.get(source, 0) + 1
    best = max(
        counts, key=lambda source: counts[source]
    )  # ties: the oldest, as UPSTREAM is ordered
    return best, counts[best]
