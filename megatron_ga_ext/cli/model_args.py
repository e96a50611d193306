"""ledger's model flags and --gpu-memory: declared on its parser without loading the memory ledger
(ledger answers fast), which is imported only where a model is given (cli/costs_output.py)."""

from __future__ import annotations

from typing import Any

from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.model_flag_table import MODEL_FLAGS, NEEDS

__all__ = ["add_model_arguments", "ledger_costs"]

#: ledger's destinations of the model's flags (apart from its own, which decide the batch).
_DEST = "costs:"


def add_model_arguments(parser: Any, taken: set[str]) -> None:
    """The model's flags and --gpu-memory on ledger's parser (those it does not take already)."""
    for flag, (_, kind) in MODEL_FLAGS.items():
        if flag in taken:
            continue
        if kind in ("on", "off"):
            parser.add_argument(flag, dest=_DEST + flag, action="store_true", default=None)
        else:
            parser.add_argument(flag, dest=_DEST + flag, metavar="N" if kind == "int" else "TEXT")
    parser.add_argument("--gpu-memory", metavar="SIZE|GPU", help="80GiB, 80GB or H100: does it fit")


def ledger_costs(args: Any, launch: Launch) -> None:
    """ledger with a model's flags: the costs section after the ledger, then its problems."""
    words: list[str] = []
    for name, value in vars(args).items():
        if name.startswith(_DEST) and value is not None:
            flag = name[len(_DEST) :]
            words += [flag] if value is True else [flag, str(value)]
    if not words:
        if args.gpu_memory is not None:
            raise UsageError(f"--gpu-memory needs the model: {NEEDS}.")
        return
    for flag, values in launch.values.items():
        words += [flag, *values]
    from megatron_ga_ext.cli.costs_output import ledger_section  # the formulas, only with a model

    ledger_section(words, launch, args.gpu_memory)
