"""Exception types of megatron-ga-ext.

Every user-facing error derives from :class:`GAError`, a ``ValueError``. Where upstream Megatron
raised ``AssertionError`` for the same condition, the error derives from ``AssertionError`` too, so
code and tests written against upstream keep catching it.
"""

from __future__ import annotations

__all__ = [
    "GAError",
    "SizeError",
    "LayoutError",
    "BatchSizeError",
    "InterleaveError",
    "ScheduleParseError",
    "ScheduleError",
    "LossContractError",
    "GuardError",
    "CompatError",
]


class GAError(ValueError):
    """Base of every error megatron-ga-ext raises for bad input or a broken contract."""


class SizeError(GAError):
    """A size is not a positive integer (zero, negative, fractional, not a number)."""


class LayoutError(GAError):
    """The parallel layout does not divide as Megatron requires (world, TP, PP, CP, EP)."""


class BatchSizeError(GAError, AssertionError):
    """The global batch size does not split into micro-batches (upstream asserted this)."""


class InterleaveError(GAError):
    """The interleaved pipeline schedule cannot run this number of micro-batches."""


class ScheduleParseError(GAError):
    """A step batch-size schedule string is malformed."""


class ScheduleError(GAError, AssertionError):
    """A step batch-size schedule breaks a rule upstream asserted (order, zero, growth, divisibility)."""


class LossContractError(GAError, RuntimeError):
    """The token-level loss contract is broken at run time."""


class GuardError(GAError, RuntimeError):
    """A run-time invariant of the batch arithmetic is broken."""


class CompatError(GAError, RuntimeError):
    """Upstream code is not what the extension knows how to patch."""
