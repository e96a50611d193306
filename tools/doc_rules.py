"""docs/check-rules.md's tables, rendered by ``make docs`` from check's registry
(launch/registry.py): every rule with what it reads and its upstream line at each tested source,
then upstream's rules the registry does not hold and check's additions. Kept out of the installed
package; tools/docs.py writes them and tests/test_check_rules.py compares."""

from __future__ import annotations

from typing import Any

from megatron_ga_ext.core.megatron_flags import BY_DEST
from megatron_ga_ext.launch.registry import ADDITIONS, NOT_APPLIED, RULES
from megatron_ga_ext.launch.rule import REFS, Rule
from megatron_ga_ext.launch.view import View

__all__ = ["not_applied_table", "rules_table"]


def rules_table() -> str:
    """docs/check-rules.md's table: every rule, what it reads, and its upstream line at each tested
    source."""
    head = ["rule", "reads", "Megatron's words", *REFS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rule in RULES:
        says = _sample(rule)
        if rule.source is None:
            cells = [f"ours: {rule.ours}", *([""] * (len(REFS) - 1))]
        else:
            name = rule.source.file.rsplit("/", 1)[-1]
            cells = [
                f"{name}:{line}" if line is not None else "absent" for line in rule.source.lines
            ]
        reads = ", ".join(f"`{_flag(dest)}`" for dest in rule.reads)
        lines.append("| " + " | ".join([f"`{rule.id}`", reads, _cell(says), *cells]) + " |")
    return "\n".join(lines)


class _Blank(View):
    """A view whose every value prints as ``…``: a rule's words with the launch's values left
    out."""

    def __getitem__(self, dest: str) -> Any:
        return "…"


def _sample(rule: Rule) -> str:
    if isinstance(rule.says, str):
        return rule.says
    try:
        return rule.says(_Blank(args={}, given=frozenset(), spelled={}, extension=False))
    except (TypeError, KeyError, ValueError):
        return "(with the launch's values: see the message)"


def _flag(dest: str) -> str:
    """The flag of an argparse destination, or the destination validate_args derives
    (data_parallel_size)."""
    return BY_DEST[dest].flag if dest in BY_DEST else dest


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def not_applied_table() -> str:
    """The rules of upstream's validation on the batch and the layout that the registry does not
    hold, and why."""
    lines = ["| upstream's rule | where | why not in the registry |", "|---|---|---|"]
    lines += [f"| {_cell(words)} | {where} | {why} |" for words, where, why in NOT_APPLIED]
    lines += ["", "| check's addition | why | decided in |", "|---|---|---|"]
    lines += [f"| `{rule}` | {why} | {where} |" for rule, why, where in ADDITIONS]
    return "\n".join(lines)
