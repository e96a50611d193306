"""The ``schedule`` command's numbers, parsed and checked once for the table and for ``--suggest``.

Every count is a whole number (suffixes K, M, B, T), >= 1 for a size and >= 0 for a count of
samples; ``--lr`` is a positive finite number and goes with ``--lr-base-batch-size``. A bad one
raises a typed error (exit 2).
"""

from __future__ import annotations

import argparse
import math

from megatron_ga_ext.core.rules import require_positive_int
from megatron_ga_ext.core.schedule.step_schedule import parse_count
from megatron_ga_ext.errors import SizeError, UsageError

__all__ = ["count", "lr_hints", "run_length"]


def count(flag: str, text: str, minimum: int = 1) -> int:
    """A whole number >= ``minimum`` (1 for sizes, 0 for counts), suffixes allowed."""
    value = parse_count(str(text), flag, signed=True)
    if value.denominator != 1:
        raise SizeError(f"{flag} {text!r} is not a whole number; give an integer >= {minimum}.")
    if minimum == 1:
        return require_positive_int(flag, int(value))
    if value < minimum:
        raise SizeError(
            f"{flag} {int(value)} must be at least {minimum}; give an integer >= {minimum}."
        )
    return int(value)


def run_length(args: argparse.Namespace, seq: int | None) -> int | None:
    """``--train-samples``, or ``--train-tokens`` / ``--seq-length`` rounded up; None without
    either."""
    if args.train_samples is not None:
        return count("--train-samples", args.train_samples)
    if args.train_tokens is None:
        return None
    if seq is None:
        raise UsageError(
            "--train-tokens needs --seq-length to count samples; or give --train-samples."
        )
    tokens = count("--train-tokens", args.train_tokens)
    return -(-tokens // seq)  # the run ends at the first step reaching the token count


def lr_hints(args: argparse.Namespace) -> tuple[float | None, int | None]:
    """(``--lr``, ``--lr-base-batch-size``) for the table's hints: both or neither, ``--lr``
    positive and finite."""
    base = (
        count("--lr-base-batch-size", args.lr_base_batch_size) if args.lr_base_batch_size else None
    )
    if (args.lr is None) != (base is None):
        raise UsageError(
            "--lr and --lr-base-batch-size go together: the hints scale --lr from the base batch "
            "size."
        )
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr {args.lr} must be a positive finite number.")
    return args.lr, base
