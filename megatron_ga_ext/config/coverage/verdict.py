"""Applying the coverage table to a launch: the rows that refuse it and those whose limits apply
(:func:`verdict`), raised and logged at start-up (:func:`enforce`), and the flags no row or off-path
reason names (:func:`unclassified`). Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from megatron_ga_ext.config.coverage.row import Row, Setting
from megatron_ga_ext.config.coverage.rows import ROWS
from megatron_ga_ext.config.flags import OPTIONS
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.off_path import OFF_PATH
from megatron_ga_ext.errors import CoverageError
from megatron_ga_ext.logs import get_logger

__all__ = ["Verdict", "enforce", "named_by_rows", "unclassified", "verdict"]

logger = get_logger(__name__)


@dataclass(frozen=True)
class Verdict:
    """The rows one launch falls under that refuse it, and those whose limits apply to it."""

    refused: tuple[Row, ...]
    limited: tuple[Row, ...]

    def error(self) -> CoverageError | None:
        """One CoverageError naming every refusal, or None."""
        if not self.refused:
            return None
        if len(self.refused) == 1:
            return CoverageError(self.refused[0].message())
        listed = " ".join(f"({i}) {row.message()}" for i, row in enumerate(self.refused, 1))
        return CoverageError(f"{len(self.refused)} settings of this launch are refused: {listed}")

    def notes(self) -> list[str]:
        return [row.message() for row in self.limited]


def verdict(setting: Setting) -> Verdict:
    """The rows of :data:`ROWS` that refuse ``setting``, and the limited ones that apply to it."""
    applied = [row for row in ROWS if row.applies(setting)]
    return Verdict(
        tuple(r for r in applied if r.support == "refused"),
        tuple(r for r in applied if r.support == "limited"),
    )


def enforce(args: Any, config: GAConfig) -> Verdict:
    """At start-up: raise the CoverageError of every refused row that applies to Megatron's ``args``
    and the installed ``config``; log the limits that apply, once. Returns the verdict."""
    result = verdict(Setting.of(args, config))
    error = result.error()
    if error is not None:
        raise error
    for note in result.notes():
        logger.info("megatron-ga-ext coverage, limited: %s", note)
    return result


def named_by_rows() -> set[str]:
    """Every spelling of every flag a row names (a negatable switch's ``--no-<name>`` too)."""
    return {spelling for row in ROWS for flag in row.flags for spelling in OPTIONS[flag].spellings}


def unclassified(flags: Iterable[str]) -> list[str]:
    """The flags of a Megatron parser (``flags``: its option strings) that neither a row nor the
    off-path list (config/off_path.py) names, whether or not a tested source's parser has them: each
    is to be read and given a row or a reason before the table speaks for that parser. Sorted."""
    return sorted(set(flags) - named_by_rows() - set(OFF_PATH))
