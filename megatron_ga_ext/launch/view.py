"""One resolved view of a launch line: every Megatron argument check's rules read, as Megatron holds
it once parse_args has read the line and validate_args has filled in its defaults. Pure Python.

    data_parallel_size          = world / (TP x PP x CP)             (None where it is not whole)
    expert_tensor_parallel_size = TP unless given
    global_batch_size           = MBS x DP unless given (or set by a schedule)
    eval_micro_batch_size       = MBS, eval_global_batch_size = GBS unless given

The registry (launch/registry.py) evaluates every rule over this one view; the memory and FLOPs
ledger reads it too. A flag the line leaves out holds Megatron's default; a value that is not a
number, or a size or batch below 1, is None (the line's own reading reports it), so no rule divides
by zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_ga_ext.config.flags import OPTIONS
from megatron_ga_ext.core.megatron_flags import (
    COVERED_OPTIONS,
    MEGATRON_OPTIONS,
    RULE_OPTIONS,
    Option,
)
from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.errors import GAError
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.pipeline_layout import layout_counts

__all__ = ["COUNTS", "View", "build_view"]

_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)
_BATCHES = (
    *_SIZES,
    "micro_batch_size",
    "global_batch_size",
    "eval_micro_batch_size",
    "eval_global_batch_size",
    "virtual_pipeline_model_parallel_size",
    "expert_tensor_parallel_size",
)
#: Counts Megatron divides by that no layout rule reports below 1: their values below 1 are kept in
#: ``below_one`` for rules_model.COUNTS to report.
COUNTS = ("num_attention_heads", "num_query_groups", "num_distributed_optimizer_instances")


@dataclass(frozen=True)
class View:
    """Megatron's args of one launch line, by argparse destination, and how the line gave them."""

    args: Mapping[str, Any]
    given: frozenset[str]
    """The destinations the line gives (the rest hold Megatron's defaults or what validate_args
    derives)."""
    spelled: Mapping[str, str]
    """Each destination's flag, as the line spelled it where it gave it."""
    extension: bool
    """megatron-ga-ext is on the line (the drop-in entry or a --ga-* flag)."""

    def __getitem__(self, dest: str) -> Any:
        return self.args.get(dest)

    def flag(self, dest: str) -> str:
        return self.spelled.get(dest, dest)

    def named(self, dest: str) -> str:
        """``--pipeline-model-parallel-size 2``: the flag and its value (a switch alone)."""
        value = self[dest]
        if isinstance(value, bool):
            return self.flag(dest)
        if isinstance(value, (list, tuple)):
            return f"{self.flag(dest)} {' '.join(map(str, value))}"
        return f"{self.flag(dest)} {value}"


def build_view(launch: Launch, kwargs: Mapping[str, Any]) -> View:
    """The view of ``launch``; ``kwargs`` is its batch layout as line_layout.read_layout reads
    it."""
    args: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    given: set[str] = set()
    for option in (*MEGATRON_OPTIONS, *RULE_OPTIONS, *COVERED_OPTIONS):
        args.setdefault(option.dest, option.default)
        spelled.setdefault(option.dest, option.flag)
    for flag in (*launch.values, *launch.switches):
        option = OPTIONS[flag]
        if option.dest not in args:
            continue  # the launcher's and the --ga-* flags
        args[option.dest] = _value(launch, option, flag)
        spelled[option.dest] = launch.name(option.flag)
        given.add(option.dest)
    _derive(args, kwargs)
    return View(args=args, given=frozenset(given), spelled=spelled, extension=launch.extension)


def _value(launch: Launch, option: Option, flag: str) -> Any:
    """The value Megatron's args hold for ``flag`` as the line gives it (store_false flags hold
    False)."""
    if option.nargs == 0:
        return not option.default if option.default is True else launch.switches[flag]
    values = launch.values[flag]
    typed = [_typed(launch.name(flag), option, v) for v in values]
    return typed[0] if option.nargs == 1 else typed


def _typed(name: str, option: Option, text: str) -> Any:
    try:
        if option.type is int:
            return read_int(name, text)
        if option.type is float:
            return float(text)
    except (GAError, ValueError):
        return None
    return text


def _derive(args: dict[str, Any], kwargs: Mapping[str, Any]) -> None:
    """What validate_args fills in before its rules, from the layout the line gives (``kwargs``)."""
    for name in (
        *_SIZES,
        "world_size",
        "seq_length",
        "micro_batch_size",
        "virtual_pipeline_model_parallel_size",
    ):
        args[name] = kwargs.get(name, args.get(name))
    args["below_one"] = {name: args[name] for name in COUNTS if _below_one(args.get(name))}
    for name in (*_BATCHES, *COUNTS, "world_size"):
        if _below_one(args.get(name)):
            args[name] = None  # reported by its own rule; unknown to the others
    tp, pp, cp = (args[name] or 1 for name in _SIZES[:3])
    world = args["world_size"]
    whole = isinstance(world, int) and world % (tp * pp * cp) == 0
    args["data_parallel_size"] = world // (tp * pp * cp) if whole else None
    if args.get("expert_tensor_parallel_size") is None:
        args["expert_tensor_parallel_size"] = tp
    mbs, dp = args["micro_batch_size"], args["data_parallel_size"]
    default_gbs = mbs * dp if isinstance(mbs, int) and dp is not None else None
    if args.get("global_batch_size") is None and args.get("step_batch_size_schedule") is None:
        args["global_batch_size"] = default_gbs
    if args.get("eval_micro_batch_size") is None:
        args["eval_micro_batch_size"] = mbs
    if args.get("eval_global_batch_size") is None:
        args["eval_global_batch_size"] = args["global_batch_size"]
    layout = args.get("pipeline_model_parallel_layout")
    args["layout_counts"] = _counts(layout) if isinstance(layout, str) else None


def _below_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value < 1


def _counts(text: str) -> dict[str, int] | None:
    try:
        return layout_counts(text)
    except GAError:
        return None  # the layer split reports a layout it cannot unroll
