"""The ``megatron-ga`` command: ledger | check | schedule | verify.

``ledger``, ``check`` and ``schedule`` are pure Python and answer in well under a second; ``verify``
imports torch and megatron-core only when it runs. Errors print one line without a traceback and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

from megatron_ga_ext.errors import GAError
from megatron_ga_ext.launch import Launch, UsageError, launch_problems, layout_kwargs, parse_launch
from megatron_ga_ext.layout import FLAGS, BatchLayout
from megatron_ga_ext.render import print_table

__all__ = ["main"]

#: Commands whose parser and handler live in their own module: (module, help).
_DELEGATED = {
    "schedule": ("megatron_ga_ext.schedule_command", "table of a step batch-size schedule (or a converted rampup)"),
    "verify": ("megatron_ga_ext.verify.command", "prove the loss reduction on real megatron-core against a reference"),
}

_LEDGER_LABELS = {
    "world_size": ("world size", "--nnodes x --nproc-per-node"),
    "tensor_model_parallel_size": ("TP", ""),
    "pipeline_model_parallel_size": ("PP", ""),
    "virtual_pipeline_model_parallel_size": ("VPP", "model chunks per pipeline rank"),
    "context_parallel_size": ("CP", ""),
    "expert_model_parallel_size": ("EP", ""),
    "expert_data_parallel_size": ("expert DP", "world / (ETP x EP x PP)"),
    "data_parallel_size": ("DP", "world / (TP x PP x CP)"),
    "micro_batch_size": ("MBS", "samples per forward/backward"),
    "global_batch_size": ("GBS", "MBS x DP x GA; TP, PP, CP, EP never multiply it"),
    "num_microbatches": ("GA = num_microbatches", "GBS / (MBS x DP), per rank and per model chunk"),
    "samples_per_step": ("samples per step", "= GBS"),
    "samples_per_rank_per_step": ("samples per DP rank per step", "MBS x GA"),
    "seq_length": ("seq length", ""),
    "tokens_per_step": ("tokens per step", "GBS x seq_length (padding included)"),
    "dp_syncs_per_step": ("DP gradient syncs per step", "0 if DP = 1; 1 deferred; GA if every micro-batch syncs"),
    "pipeline_bubble_fraction": ("pipeline bubble", "(PP - 1) / (VPP x GA + PP - 1)"),
}


def print_ledger(layout: BatchLayout, title: str = "megatron-ga ledger") -> None:
    rows = [(_LEDGER_LABELS[k][0], v, _LEDGER_LABELS[k][1]) for k, v in layout.ledger().items()]
    print_table(title, ("quantity", "value", "rule"), rows)


# -- ledger ------------------------------------------------------------------------------------


def _configure_ledger(parser: argparse.ArgumentParser) -> None:
    for flag in FLAGS.values():
        parser.add_argument(flag, metavar="N")
    parser.add_argument("--nnodes", metavar="N", help="torchrun nodes (with --nproc-per-node instead of --world-size)")
    parser.add_argument("--nproc-per-node", metavar="N")
    parser.add_argument("--num-layers", metavar="N")
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", metavar="N", help="with --num-layers, derives VPP")
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", metavar="N", help="newer spelling of VPP")
    parser.add_argument(
        "--grad-sync", choices=("step", "microbatch"), default="step",
        help="DP gradient sync once per step (Megatron, no_sync) or after every micro-batch",
    )
    parser.add_argument("--json", action="store_true", help="print the ledger as JSON")


def _run_ledger(args: argparse.Namespace) -> int:
    launch = Launch()
    for dest, value in vars(args).items():
        if value is not None and dest not in ("json", "grad_sync", "command", "handler"):
            launch.values["--" + dest.replace("_", "-")] = [value]
    layout = BatchLayout(**layout_kwargs(launch), grad_sync=args.grad_sync)
    if args.json:
        print(json.dumps(layout.ledger(), indent=2))
    else:
        print_ledger(layout)
    return 0


# -- check -------------------------------------------------------------------------------------


def _configure_check(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, help="the world size, where the launch line leaves it open")
    parser.add_argument("--json", action="store_true", help="print the ledger and the problems as JSON")
    parser.add_argument("launch", nargs=argparse.REMAINDER, help="-- then the whole launch line")


def _run_check(args: argparse.Namespace) -> int:
    tokens = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    if not tokens:
        raise UsageError("give the launch line after --: megatron-ga check -- torchrun ... pretrain_gpt.py ...")
    layout, problems = launch_problems(parse_launch(tokens), args.world_size)
    if args.json:
        print(json.dumps({"ledger": layout.ledger() if layout else None, "problems": problems}, indent=2))
        return 1 if problems else 0
    if layout is not None:
        print_ledger(layout, "megatron-ga check: ledger of the launch")
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for i, text in enumerate(problems, 1):
            print(f"  {i}. {text}")
        return 1
    print("\nno problems found.")
    return 0


# -- entry point -------------------------------------------------------------------------------

_LOCAL = {
    "ledger": (_configure_ledger, _run_ledger, "the batch ledger of one layout, from Megatron's flags"),
    "check": (_configure_check, _run_check, "read a whole launch line, print its ledger and every problem"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; a delegated command's module is imported only when ``command`` selects it."""
    parser = argparse.ArgumentParser(prog="megatron-ga", description=__doc__.splitlines()[0])
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
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args.handler(args)
    except GAError as error:
        print(f"megatron-ga {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
