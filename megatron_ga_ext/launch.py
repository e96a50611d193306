"""Read the batch arithmetic out of a real launch line (torchrun ... pretrain_gpt.py ...), and every
problem in it (``megatron-ga check``). Pure Python.

Only the flags that decide the batch arithmetic are read; every other flag is passed over with its
values. ``--flag=value`` and ``--flag value`` both work, and ``_`` in a flag counts as ``-``
(torchrun accepts both spellings).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from megatron_ga_ext.errors import GAError
from megatron_ga_ext.layout import FLAGS, BatchLayout, virtual_pipeline_size
from megatron_ga_ext.schedule import StepSchedule

__all__ = ["Launch", "UsageError", "launch_problems", "layout_kwargs", "parse_int", "parse_launch"]

#: Flags that take values, with how many; the rest of a known launch line is passed over.
VALUE_FLAGS = {
    **{flag: 1 for flag in FLAGS.values()},
    "--nnodes": 1,
    "--nproc-per-node": 1,
    "--num-layers": 1,
    "--num-layers-per-virtual-pipeline-stage": 1,
    "--num-virtual-stages-per-pipeline-rank": 1,
    "--rampup-batch-size": 3,
    "--step-batch-size-schedule": 1,
    "--train-iters": 1,
    "--train-samples": 1,
    "--ga-loss-reduction": 1,
}
_INT_FLAGS = set(VALUE_FLAGS) - {
    "--rampup-batch-size", "--step-batch-size-schedule", "--nnodes", "--nproc-per-node", "--ga-loss-reduction"
}
BOOL_FLAGS = {"--decrease-batch-size-if-needed", "--calculate-per-token-loss"}

_INT = re.compile(r"[+-]?\d+")


class UsageError(GAError):
    """The launch line cannot be read: a value is not a number, or the world size is unknown."""


@dataclass
class Launch:
    """The known flags of a launch line: the last value of each, and those given more than once."""

    values: dict[str, list[str]] = field(default_factory=dict)
    switches: set[str] = field(default_factory=set)
    repeated: dict[str, list[list[str]]] = field(default_factory=dict)

    def get(self, flag: str) -> str | None:
        return self.values[flag][0] if flag in self.values else None


def _normalize(flag: str) -> str:
    return "--" + flag[2:].replace("_", "-")


def parse_launch(tokens: list[str]) -> Launch:
    """Collect the known flags of ``tokens``; a single token holding a whole line is split like a shell."""
    if len(tokens) == 1 and " " in tokens[0].strip():
        tokens = shlex.split(tokens[0])
    launch = Launch()
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            continue
        name, eq, inline = token.partition("=")
        flag = _normalize(name)
        if flag in BOOL_FLAGS:
            launch.switches.add(flag)
            continue
        nargs = VALUE_FLAGS.get(flag)
        if nargs is None:
            continue
        if eq:
            args = [inline]
        else:
            args = tokens[i : i + nargs]
            i += len(args)
        if len(args) < nargs or any(a.startswith("--") for a in args):
            raise UsageError(f"{flag} needs {nargs} value(s), got {args or 'none'}.")
        if flag in launch.values:
            launch.repeated.setdefault(flag, [launch.values[flag]]).append(args)
        launch.values[flag] = args
    return launch


def parse_int(flag: str, text: str) -> int:
    """An integer flag value; a shell variable left unexpanded or a float is unusable input."""
    if not _INT.fullmatch(text.strip()):
        raise UsageError(f"{flag} {text!r} is not an integer; give a whole number such as 4.")
    return int(text)


def layout_kwargs(launch: Launch, world_size: int | None = None) -> dict[str, int | None]:
    """BatchLayout arguments from a launch line; ``world_size`` overrides --nnodes x --nproc-per-node."""
    ints = {flag: parse_int(flag, vals[0]) for flag, vals in launch.values.items() if flag in _INT_FLAGS}
    kwargs: dict[str, int | None] = {name: ints.get(flag) for name, flag in FLAGS.items()}
    kwargs["world_size"] = world_size if world_size is not None else _world_size(launch, ints)
    if kwargs["micro_batch_size"] is None:
        raise UsageError("--micro-batch-size is missing; Megatron needs it to split the global batch.")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size"):
        if kwargs[name] is None:
            kwargs[name] = 1
    vpp = kwargs["virtual_pipeline_model_parallel_size"] or ints.get("--num-virtual-stages-per-pipeline-rank")
    if "--num-layers-per-virtual-pipeline-stage" in ints:
        if "--num-layers" not in ints:
            raise UsageError("--num-layers-per-virtual-pipeline-stage needs --num-layers to derive the virtual pipeline size.")
        vpp = virtual_pipeline_size(
            ints["--num-layers"], kwargs["pipeline_model_parallel_size"] or 1, ints["--num-layers-per-virtual-pipeline-stage"]
        )
    kwargs["virtual_pipeline_model_parallel_size"] = vpp
    return kwargs


def _world_size(launch: Launch, ints: dict[str, int]) -> int:
    if "--world-size" in ints:
        return ints["--world-size"]
    nnodes, nproc = launch.get("--nnodes"), launch.get("--nproc-per-node")
    if nproc is None:
        raise UsageError(
            "the world size is unknown: give torchrun's --nproc-per-node (and --nnodes), or "
            "megatron-ga check --world-size N -- <launch line>."
        )
    if not _INT.fullmatch(nproc):
        raise UsageError(
            f"--nproc-per-node {nproc} leaves the world size to the machine; pass it with "
            f"megatron-ga check --world-size N -- <launch line>."
        )
    return _nnodes(nnodes) * int(nproc)


def _nnodes(text: str | None) -> int:
    """torchrun's --nnodes: N, or an elastic range MIN:MAX that leaves the world size open."""
    if text is None:
        return 1
    if ":" in text:
        raise UsageError(
            f"--nnodes {text} is an elastic range, so the world size is not fixed; pass the size to check "
            f"with megatron-ga check --world-size N -- <launch line>."
        )
    return parse_int("--nnodes", text)


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


def _launch_schedule(launch: Launch, kwargs: dict) -> tuple[StepSchedule | None, list[str]]:
    """The step schedule of a launch (given, or converted from --rampup-batch-size) and its flag problems."""
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
