"""The ``megatron-ga`` command: ledger | check | schedule | verify.

``ledger``, ``check`` and ``schedule`` are pure Python and answer in well under a second; ``verify``
imports torch and megatron-core only when it runs. Errors print one line without a traceback and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import TYPE_CHECKING, Sequence

from megatron_ga_ext.errors import GAError
from megatron_ga_ext.launch import Launch, UsageError, layout_kwargs, parse_int, parse_launch
from megatron_ga_ext.layout import FLAGS, BatchLayout
from megatron_ga_ext.render import print_table

if TYPE_CHECKING:
    from megatron_ga_ext.schedule import StepSchedule

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


MAX_STAGE_PROBLEMS = 5


def launch_problems(launch: Launch, world_size: int | None) -> tuple[BatchLayout | None, list[str]]:
    """The layout of a launch line (None if broken) and every problem found in it."""
    problems = [
        f"{flag} is given {len(vals)} times ({', '.join(' '.join(v) for v in vals)}); Megatron keeps the last "
        f"({' '.join(vals[-1])}). Give it once."
        for flag, vals in launch.repeated.items()
    ]
    problems += _reduction_problems(launch)
    kwargs = layout_kwargs(launch, world_size)
    schedule, schedule_problems = _launch_schedule(launch, kwargs)
    if schedule is not None:
        kwargs["global_batch_size"] = None  # the schedule's stages are checked one by one below
    layout, errors = BatchLayout.problems(**kwargs)
    problems += [str(e) for e in errors]
    if layout is not None and schedule is not None:
        stage_problems = [str(p.error) for p in schedule.problems(
            layout.micro_batch_size, layout.data_parallel_size, layout.pipeline_model_parallel_size,
            layout.virtual_pipeline_size, microbatch_group_size_per_vp_stage=layout.microbatch_group_size_per_vp_stage,
        )]
        if len(stage_problems) > MAX_STAGE_PROBLEMS:
            hidden = len(stage_problems) - MAX_STAGE_PROBLEMS
            stage_problems[MAX_STAGE_PROBLEMS:] = [
                f"... and {hidden} more stage(s) like these; megatron-ga schedule lists every stage."
            ]
        problems += stage_problems
        # The ledger of a schedule is the ledger of its last stage (upstream's nominal GBS), once every stage is valid.
        layout = None if stage_problems else BatchLayout(**{**kwargs, "global_batch_size": schedule.final_global_batch_size})
    return layout, problems + schedule_problems


def _reduction_problems(launch: Launch) -> list[str]:
    """The loss mode asked for (--ga-loss-reduction) against Megatron's --calculate-per-token-loss."""
    mode = launch.get("--ga-loss-reduction")
    per_token = "--calculate-per-token-loss" in launch.switches
    if mode == "token" and not per_token:
        return [
            "--ga-loss-reduction token needs --calculate-per-token-loss: without it Megatron divides each "
            "micro-batch by its own token count (a mean of means) and DDP pre-divides by DP x CP. Add "
            "--calculate-per-token-loss."
        ]
    if mode == "microbatch" and per_token:
        return [
            "--ga-loss-reduction microbatch is upstream's mean of means, but --calculate-per-token-loss is "
            "given; drop one of them."
        ]
    return []


def _launch_schedule(launch: Launch, kwargs: dict) -> tuple["StepSchedule | None", list[str]]:
    """The step schedule of a launch (given, or converted from --rampup-batch-size) and its flag problems."""
    from megatron_ga_ext.schedule import StepSchedule

    text = launch.get("--step-batch-size-schedule")
    seq_length = kwargs["seq_length"]
    if text is not None:
        problems = _schedule_flag_problems(launch)
        try:
            return StepSchedule.parse(text, seq_length=seq_length), problems
        except GAError as error:
            return None, problems + [str(error)]
    if "--rampup-batch-size" not in launch.values:
        return None, []
    values = launch.values["--rampup-batch-size"]
    start, increment, samples = (parse_int("--rampup-batch-size", v) for v in values)
    gbs = kwargs["global_batch_size"]
    if gbs is None:
        return None, [f"--rampup-batch-size {' '.join(values)} needs --global-batch-size, the batch size it ramps up to."]
    ignored = (
        f"--rampup-batch-size {' '.join(values)} is ignored without a word by megatron-core >= 0.18: the run trains "
        f"at the constant --global-batch-size {gbs}."
    )
    try:
        schedule = StepSchedule.from_rampup(start, increment, samples, gbs)
    except GAError as error:
        return None, [f"{ignored} It has no equivalent step schedule either: {error}"]
    unit = "tokens" if seq_length else "samples (add --seq-length: pretrain_gpt reads thresholds as tokens)"
    return schedule, [
        f"{ignored} Replace it with the equivalent schedule ({len(schedule.stages)} "
        f"stages, thresholds in {unit}), dropping --global-batch-size and --rampup-batch-size: "
        f"--step-batch-size-schedule \"{schedule.to_string(seq_length)}\""
    ]


def _schedule_flag_problems(launch: Launch) -> list[str]:
    problems = []
    if launch.get("--global-batch-size") is not None:
        problems.append(
            "--global-batch-size is given together with --step-batch-size-schedule; Megatron refuses the pair "
            "(the schedule sets the batch size). Drop --global-batch-size."
        )
    if launch.get("--train-iters") is not None:
        problems.append(
            "--step-batch-size-schedule with --train-iters: Megatron converts LR warmup/decay iterations and the "
            "dataset size with GBS = MBS x DP, not the schedule's batch sizes, so warmup and decay end early and "
            "the dataset is undersized. Give --train-samples (and --lr-warmup-samples, --lr-decay-samples) instead."
        )
    if "--rampup-batch-size" in launch.values:
        problems.append("--rampup-batch-size and --step-batch-size-schedule are both given; keep only the schedule.")
    return problems


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
