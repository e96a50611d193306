"""Read the batch arithmetic out of a real launch line (torchrun ... pretrain_gpt.py ...). Pure Python.

Only the flags that decide the batch arithmetic are read; every other flag is passed over with its
values. ``--flag=value`` and ``--flag value`` both work, and ``_`` in a flag counts as ``-``
(torchrun accepts both spellings).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from megatron_ga_ext.errors import GAError
from megatron_ga_ext.layout import FLAGS, virtual_pipeline_size

__all__ = ["Launch", "UsageError", "parse_launch", "parse_int", "layout_kwargs"]

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
