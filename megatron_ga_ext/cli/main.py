"""The ``megatron-ga`` command: ledger | check | schedule | verify | critical-batch.

``ledger``, ``check``, ``schedule`` and ``critical-batch`` are pure Python and answer in well under
a second; ``verify`` imports torch and megatron-core only when it runs. Every command's errors take
one path (:func:`main`): one line on stderr without a traceback (and, with ``--json``, a JSON error
object on stdout), exit 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import itertools
import json
import sys
from collections.abc import Callable, Sequence

from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.cli.stage_table import print_stages
from megatron_ga_ext.config.flags import BY_DEST
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.megatron_flags import (
    LAUNCHER_OPTIONS,
    MEGATRON_OPTIONS,
    VIRTUAL_PIPELINE,
    Option,
)
from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.errors import GAError, UsageError
from megatron_ga_ext.launch.bridge_line import bridge_check, is_bridge_line
from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.ledger import LEDGER_RULES
from megatron_ga_ext.launch.line import Launch, parse_launch
from megatron_ga_ext.launch.line_layout import layout_kwargs
from megatron_ga_ext.launch.report import SEVERITIES, Report

__all__ = ["main"]

#: Commands whose parser and handler live in their own module: (module, help).
_DELEGATED = {
    "schedule": (
        "megatron_ga_ext.cli.schedule",
        "table of a step batch-size schedule (or a converted rampup)",
    ),
    "verify": (
        "megatron_ga_ext.cli.verify",
        "prove the loss reduction on real megatron-core against a reference",
    ),
    "compat": (
        "megatron_ga_ext.cli.compat",
        "whether install() accepts the importable megatron-core (image build)",
    ),
    "critical-batch": (
        "megatron_ga_ext.science.cli.critical_batch",
        "B_crit = E_min / S_min from runs at several global batch sizes (McCandlish et al. 2018)",
    ),
}

#: Megatron flags the ledger does not take: they decide a schedule or the loss, not one layout.
_NOT_LEDGER = {
    "rampup_batch_size",
    "step_batch_size_schedule",
    "decrease_batch_size_if_needed",
    "decoder_seq_length",
    "train_iters",
    "train_samples",
    "calculate_per_token_loss",
    "hybrid_context_parallel",
    "perform_rl_step",
    "rl_use_sequence_packing",
}


def print_ledger(layout: BatchLayout, title: str = "megatron-ga ledger") -> None:
    rows = [
        (LEDGER_RULES[k][0], v, LEDGER_RULES[k][1] or _GIVEN.get(k, ""))
        for k, v in layout.ledger().items()
    ]
    print_table(title, ("quantity", "value", "rule"), rows)


#: The ledger command's source of a size it reads from the line.
_GIVEN = {"world_size": "--nnodes x --nproc-per-node"}


# -- ledger ------------------------------------------------------------------------------------


def _ledger_options() -> list[Option]:
    """The ledger's flags: the launcher's and Megatron's that decide one layout (declared in
    core/megatron_flags.py)."""
    megatron = [o for o in MEGATRON_OPTIONS if o.dest not in _NOT_LEDGER]
    return [*LAUNCHER_OPTIONS, *megatron]


def _configure_ledger(parser: argparse.ArgumentParser) -> None:
    for option in _ledger_options():
        if option.type is bool:
            parser.add_argument(option.flag, dest=option.dest, action="store_true", default=None)
        else:
            parser.add_argument(
                option.flag,
                dest=option.dest,
                metavar="N" if option.type is int else "TEXT",
                help=option.help or None,
            )
    parser.add_argument(
        VIRTUAL_PIPELINE.flag, dest=VIRTUAL_PIPELINE.dest, metavar="N", help=VIRTUAL_PIPELINE.help
    )
    parser.add_argument(
        "--grad-sync",
        choices=("step", "microbatch"),
        default="step",
        help="DP gradient sync once per step (Megatron, no_sync) or after every micro-batch",
    )
    parser.add_argument("--json", action="store_true", help="print the ledger as JSON")
    from megatron_ga_ext.cli.model_args import add_model_arguments

    add_model_arguments(parser, {o.flag for o in _ledger_options()})


def _run_ledger(args: argparse.Namespace) -> int:
    launch, given = Launch(), MegatronArgs.of(args)
    for option in _ledger_options():
        value = given.get(option.dest, None)
        if value is None:
            continue
        if option.type is bool:
            launch.switches[option.flag] = True
        else:
            launch.values[option.flag] = [value]
    kwargs = layout_kwargs(launch)
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp is not None:
        if kwargs["virtual_pipeline_model_parallel_size"] is not None:
            raise UsageError(
                f"{VIRTUAL_PIPELINE.flag} {vpp} is given with another flag that sets the virtual "
                "pipeline size "
                f"({kwargs['given']['virtual_pipeline_model_parallel_size']}); "
                "keep one."
            )
        kwargs["virtual_pipeline_model_parallel_size"] = read_int(VIRTUAL_PIPELINE.flag, vpp)
    layout = BatchLayout(**kwargs, grad_sync=args.grad_sync)
    if args.json:
        print(json.dumps(layout.ledger(), indent=2))
    else:
        from megatron_ga_ext.cli.model_args import ledger_costs

        print_ledger(layout)
        ledger_costs(args, launch)
    return 0


# -- check -------------------------------------------------------------------------------------


def _configure_check(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size", metavar="N", help="the world size, where the launch line leaves it open"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the ledger and the problems as JSON"
    )
    parser.add_argument(
        "--bridge",
        action="store_true",
        help="a Megatron-Bridge launch: read its section.field=value overrides (docs/bridge.md); "
        "a run_recipe.py line is read so without it, another script that calls "
        "ga_bridge.install needs it",
    )
    parser.add_argument(
        "--gpu-memory", metavar="SIZE|GPU", help="80GiB, 80GB or H100: does the launch fit"
    )
    parser.add_argument(
        "--megatron",
        metavar="PATH",
        help="also run Megatron-LM's own parse_args and validate_args on the line, from the "
        "checkout at PATH "
        "(needs torch; CPU stand-ins, no GPU; docs/oracle.md), and print its verdict beside "
        "check's",
    )
    parser.add_argument("launch", nargs=argparse.REMAINDER, help="-- then the whole launch line")


def _run_check(args: argparse.Namespace) -> int:
    tokens = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    if not tokens:
        raise UsageError(
            "give the launch line after --: megatron-ga check -- torchrun ... pretrain_gpt.py ..."
        )
    from megatron_ga_ext.cli.costs_output import (
        with_costs,
    )  # check's alone: ledger and --version skip it

    world_size = (
        None if args.world_size is None else read_int(BY_DEST["world_size"].flag, args.world_size)
    )
    launch = None
    if args.bridge or is_bridge_line(tokens):
        report = bridge_check(tokens, world_size)
    else:
        launch = parse_launch(tokens)
        report = check_launch(launch, world_size)
    report, costs, section = with_costs(tokens, launch, report, world_size, args.gpu_memory)
    upstream = None
    if (
        args.megatron is not None
    ):  # imports nothing heavy here: the oracle's worker process imports torch
        from megatron_ga_ext.oracle import beside

        upstream = beside.megatron_verdict(args.megatron, tokens, report, world_size)
    if args.json:
        megatron = {} if upstream is None else {"megatron": beside.verdict_json(report, upstream)}
        print(json.dumps({**report.json(), "costs": costs, **megatron}, indent=2))
    else:
        print_report(report, section)
        if upstream is not None:
            beside.print_beside(args.megatron, report, upstream)
    return 1 if report.problems else 0


#: A rampup's equivalent schedule is printed up to this many stages (--json always gives it).
_LISTED_EQUIVALENT = 12


def print_report(report: Report, section: Callable[[], None] | None = None) -> None:
    """The ledger (with where each number came from), the stage table, ``section`` (the costs), the
    notes (worst first), the problems."""
    if report.kind != "a launch line":
        print(f"read as {report.kind}")
    title = "megatron-ga check: ledger of the launch"
    if report.ledger_stage:
        title += f", at {report.ledger_stage}"
    rows = [(LEDGER_RULES[k][0], v, report.sources.get(k, "")) for k, v in report.ledger.items()]
    print_table(title, ("quantity", "value", "from"), rows)
    table = report.stages
    if table is not None:
        print()
        runs = "" if table.runs else " (not run: see the problems)"
        if table.warmup:
            warmup = [
                (
                    gbs,
                    gbs // (table.micro_batch_size * table.data_parallel_size),
                    table.warmup_bubble(gbs),
                    None if table.seq_length is None else gbs * table.seq_length,
                )
                for gbs in table.warmup
            ]
            print_table(
                f"stages of {table.source}: {table.summary}",
                ("GBS", "micro-batches", "bubble", "tokens per step"),
                warmup,
            )
        elif table.rows is None:
            print(f"stages of {table.source}{runs}: {table.summary}")
        else:
            print_stages(
                table.rows,
                title=f"stages of {table.source}{runs}, MBS {table.micro_batch_size} x DP "
                f"{table.data_parallel_size}",
                seq=table.seq_length,
                train_samples=table.train_samples,
                run_length=table.run_length,
                bubble=table.bubble if table.pipeline_model_parallel_size > 1 else None,
            )
        if (
            table.equivalent is not None
            and table.rows is not None
            and len(table.rows) <= _LISTED_EQUIVALENT
        ):
            unit = "tokens" if table.seq_length else "samples"
            print(
                f"as a step schedule (thresholds in {unit}): --step-batch-size-schedule "
                f'"{table.equivalent}"'
            )
        elif table.equivalent is not None:
            print(
                "as a step schedule: check --json gives it (stages.equivalent_schedule), as does "
                "megatron-ga schedule --from-rampup"
            )
    if section is not None:
        section()
    notes = sorted(report.notes, key=lambda n: SEVERITIES.index(n.severity))
    if notes:
        print(f"\n{len(notes)} note(s):")
        for note in notes:
            print(f"  {note}")
    if report.problems:
        print(f"\n{len(report.problems)} problem(s):")
        for i, problem in enumerate(report.problems, 1):
            print(f"  {i}. {problem.message}")
    else:
        print("\nno problems found.")


# -- entry point -------------------------------------------------------------------------------

_LOCAL = {
    "ledger": (
        _configure_ledger,
        _run_ledger,
        "the batch ledger of one layout, from Megatron's flags",
    ),
    "check": (
        _configure_check,
        _run_check,
        "read a whole launch line, print its ledger and every problem",
    ),
}


@functools.cache
def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; a delegated command's module is imported only when ``command`` selects it. Built
    once per command: parsing does not change it, and main() called in-process (tests, fuzzing) need
    not rebuild it."""
    parser = argparse.ArgumentParser(prog="megatron-ga", description=__doc__.splitlines()[0])
    version = importlib.metadata.version("megatron-ga-ext")
    parser.add_argument("--version", action="version", version=f"megatron-ga {version}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (configure, run, help_text) in _LOCAL.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.set_defaults(handler=run)
    for name, (module_name, help_text) in _DELEGATED.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.configure_parser(p)
            p.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a GAError is reported by :func:`report_error` (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        _require_inline_values(argv)
        status: int = args.handler(args)
        return status
    except GAError as error:
        return report_error(args.command, error, as_json=vars(args).get("json", False))


def _require_inline_values(argv: Sequence[str]) -> None:
    """argparse reads ``--flag=--`` as an empty list (it drops '--', its end-of-options marker), not
    as a value: refuse it before a command reads a list where it expects text. A launch line after
    ``check --`` is not ours."""
    for token in itertools.takewhile(lambda word: word != "--", argv):
        name, eq, value = token.partition("=")
        if name.startswith("--") and eq and value == "--":
            raise UsageError(
                f"{token}: '--' is not a value for {name}; give {name} a value, or leave it out."
            )


def report_error(command: str, error: GAError, as_json: bool = False) -> int:
    """The one error path of every command: ``megatron-ga COMMAND: error: ...`` on stderr, no
    traceback; with ``--json`` also ``{"error": ..., "error_type": ...}`` on stdout. Returns the
    exit status, 2."""
    if as_json:
        print(
            json.dumps(
                {
                    "error": str(error),
                    "error_type": type(error).__name__,
                    "ledger": None,
                    "problems": [],
                    "notes": [],
                },
                indent=2,
            )
        )
    print(f"megatron-ga {command}: error: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
