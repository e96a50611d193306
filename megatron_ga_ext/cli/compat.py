"""``megatron-ga compat``: whether install() would accept the megatron-core that is importable, for
the image build.

Without a GPU or a process group: imports megatron-core's modules that install() hooks (and
Megatron-LM's ``megatron.training.training``, Megatron-Bridge's training loop, where importable),
and for each hooked function prints the tested source it matches, what its start-up probe measured
(probes.py), and the verdict install() would reach (acceptance.py): tested, same behaviour, measured
at the first call, not wired here, accepted (``MEGATRON_GA_ACCEPT_SOURCE``), or refused and why.
Exit status: 0 where install() would accept every function, 1 where it would refuse one (under
``--ga-strict``, the default), 2 where megatron-core cannot be imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import warnings
from typing import Any

from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.errors import CompatError

__all__ = ["configure_parser", "run"]

#: The host loops whose hooked functions are checked where they import: (name, the module that holds
#: them).
HOSTS = (
    ("Megatron-LM", "megatron.training.training"),
    ("Megatron-Bridge", "megatron.bridge.training.train"),
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add compat's options to ``parser``."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (megatron_core, hosts, functions: [{function, verdict, "
        "sources, probe, "
        "reason}], refused) instead of a table",
    )
    parser.add_argument(
        "--accept-source",
        metavar="NAMES",
        help="comma-separated hooked functions to accept unchecked, as MEGATRON_GA_ACCEPT_SOURCE "
        "would at install() "
        "(a fork that knows what it changed; probes still run)",
    )


def run(args: argparse.Namespace) -> int:
    """Report each hooked function; 0 where install() would accept them all, 1 where it would refuse
    one."""
    start = time.perf_counter()
    try:
        hosts = _import_targets()
    except ImportError as error:
        raise CompatError(
            f"megatron-core cannot be imported here ({error}): install() needs it."
        ) from error
    from megatron_ga_ext.integration.acceptance import accepted_names, decide
    from megatron_ga_ext.integration.compat import TARGETS, live_targets, megatron_core_version
    from megatron_ga_ext.integration.wiring import correction_of

    accept = accepted_names(args.accept_source)
    decisions = [decide(t, t.resolve(), accept, correction_of) for t in live_targets(TARGETS)]
    refused = [d for d in decisions if d.refused]
    version = megatron_core_version()
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(_as_json(version, hosts, decisions, seconds), indent=1))
    else:
        _print(version, hosts, decisions, seconds)
    return 1 if refused else 0


def _import_targets() -> dict[str, bool]:
    """Import the modules install() hooks; {host loop: importable}. megatron-core's must import."""
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # megatron-core warns about Apex and Transformer Engine on a CPU image
        from megatron_ga_ext.integration.compat import TARGETS

        for module in dict.fromkeys(t.module for t in TARGETS if not t.optional):
            importlib.import_module(module)
        hosts = {}
        for name, module in HOSTS:
            try:
                importlib.import_module(module)
                hosts[name] = True
            except (
                Exception
            ):  # a host loop's import may fail in any way where its own dependencies are missing
                hosts[name] = False
    return hosts


def _as_json(
    version: str, hosts: dict[str, bool], decisions: list, seconds: float
) -> dict[str, Any]:
    return {
        "megatron_core": version,
        "hosts": hosts,
        "functions": [
            {
                "function": d.function,
                "verdict": d.verdict,
                "sources": list(d.sources),
                "probe": None
                if d.measured is None
                else {"outcome": d.measured.outcome, "detail": d.measured.detail},
                "reason": d.reason,
            }
            for d in decisions
        ],
        "refused": [d.function for d in decisions if d.refused],
        "seconds": round(seconds, 2),
    }


def _sources(sources: tuple[str, ...]) -> str:
    """The tested sources, the newest two named: ``0.19.2, main@9f3fe8c925fb (+3)``."""
    if not sources:
        return "-"
    more = f" (+{len(sources) - 2})" if len(sources) > 2 else ""
    return ", ".join(sources[:2]) + more


def _print(version: str, hosts: dict[str, bool], decisions: list, seconds: float) -> None:
    loaded = ", ".join(
        f"{name} {'importable' if ok else 'not importable'}" for name, ok in hosts.items()
    )
    rows = [
        (
            d.function.removeprefix("megatron."),
            d.verdict,
            _sources(d.sources),
            "-" if d.measured is None else d.measured.outcome,
        )
        for d in decisions
    ]
    print_table(
        f"megatron-ga compat: megatron-core {version}; {loaded}",
        ("function", "verdict", "as in", "probe"),
        rows,
    )
    refused = [d for d in decisions if d.refused]
    for decision in refused:
        print(f"refused: {decision.function} {decision.reason}", file=sys.stderr)
    if refused:
        print(
            f"install() would refuse {len(refused)} function(s) of this megatron-core under "
            "--ga-strict "
            f"({seconds:.1f} s).",
            file=sys.stderr,
        )
    else:
        print(
            f"install() would accept this megatron-core ({len(decisions)} functions, "
            f"{seconds:.1f} s)."
        )
