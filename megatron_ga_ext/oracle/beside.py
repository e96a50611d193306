"""``megatron-ga check --megatron PATH``: upstream's own verdict on the launch line beside check's,
from the Megatron-LM checkout at PATH (runner.py: parse_args, validate_args, the calculator,
parallel_state's sizes and TransformerConfig, with CPU stand-ins). Pure Python here; the worker
process imports torch and the checkout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.report import Report
from megatron_ga_ext.oracle.agreement import deliberate_rules, disagreements, verdict_of_report
from megatron_ga_ext.oracle.runner import UpstreamVerdict, megatron_argv, run_upstream, source_tree

__all__ = ["megatron_verdict", "print_beside", "verdict_json"]


def megatron_verdict(
    path: str, tokens: Sequence[str], report: Report, world_size: int | None
) -> UpstreamVerdict:
    """Upstream's verdict on the line, at the world size check read (``world_size`` where the ledger
    has none). UsageError (rc 2) where PATH is no Megatron-LM tree, or torch or the tree does not
    import."""
    tree = source_tree(path)
    if "Megatron-Bridge" in report.kind:
        raise UsageError(
            f"--megatron runs Megatron-LM's parse_args; {report.kind} is configured otherwise"
        )
    world = report.ledger.get("world_size") or world_size
    if not isinstance(world, int):
        world = 1
    return run_upstream(tree, [(megatron_argv(tokens), world)])[0]


def _agreement(report: Report, upstream: UpstreamVerdict) -> list[str]:
    return disagreements(verdict_of_report(report), upstream, None, deliberate_rules())


def print_beside(path: str, report: Report, upstream: UpstreamVerdict) -> None:
    """Upstream's verdict and message under check's report, and whether the two agree."""
    print(f"\nMegatron-LM at {path} (its parse_args, validate_args, calculator; CPU stand-ins):")
    print(f"  {upstream.summary()}")
    differs = _agreement(report, upstream)
    print("  check agrees." if not differs else "  check differs: " + "; ".join(differs))


def verdict_json(report: Report, upstream: UpstreamVerdict) -> dict[str, Any]:
    """``--json``'s ``megatron`` object."""
    return {
        "accepted": upstream.accepted,
        "step": upstream.step,
        "error_type": upstream.error_type,
        "message": upstream.message,
        "data_parallel_size": upstream.data_parallel_size,
        "global_batch_size": upstream.global_batch_size,
        "num_microbatches": upstream.num_microbatches,
        "stages": upstream.stages,
        "differs": _agreement(report, upstream),
    }
