"""Exception and warning types of megatron-ga-ext.

Every user-facing error derives from :class:`GAError`, a ``ValueError``. Where upstream Megatron
raised ``AssertionError`` for the same condition, the error derives from ``AssertionError`` too, so
code and tests written against upstream keep catching it.
"""

from __future__ import annotations

__all__ = [
    "GAError",
    "SizeError",
    "LayoutError",
    "LayerSplitError",
    "BatchSizeError",
    "InterleaveError",
    "ScheduleParseError",
    "ScheduleError",
    "ScheduleStateError",
    "OptionError",
    "CoverageError",
    "UsageError",
    "LossContractError",
    "GuardError",
    "CompatError",
    "VerifyError",
    "NoiseScaleError",
    "CriticalBatchError",
    "ScheduleWarning",
]


class GAError(ValueError):
    """Base of every error megatron-ga-ext raises for bad input or a broken contract."""


class SizeError(GAError):
    """A size is not a positive integer (zero, negative, fractional, not a number, too many
    digits)."""


class LayoutError(GAError):
    """The parallel layout does not divide as Megatron requires (world, TP, PP, CP, EP)."""


class LayerSplitError(LayoutError, AssertionError):
    """The layers do not split over the (virtual) pipeline stages as Megatron asserts they must."""


class BatchSizeError(GAError, AssertionError):
    """The global batch size does not split into micro-batches (upstream asserted this)."""


class InterleaveError(GAError):
    """The interleaved pipeline schedule cannot run this number of micro-batches."""


class ScheduleParseError(GAError):
    """A step batch-size schedule string is malformed."""


class ScheduleError(GAError, AssertionError):
    """A step batch-size schedule breaks a rule upstream asserted (order, zero, growth,
    divisibility)."""


class ScheduleStateError(ScheduleError):
    """A batch schedule a run kept cannot be restored: the ``--ga-batch-size-warmup auto`` stages of
    a checkpoint in a layout this release does not read."""


class OptionError(GAError):
    """A ``--ga-*`` setting is not one of its choices, or does not go with the Megatron flags beside
    it."""


class CoverageError(OptionError):
    """A Megatron feature under which the extension cannot keep its guarantee, refused at start-up
    (the coverage table, ``config/coverage/``)."""


class UsageError(GAError):
    """A command line cannot be read: a value is not a number, or the world size is unknown."""


class LossContractError(GAError, RuntimeError):
    """The token-level loss contract is broken at run time."""


class GuardError(GAError, RuntimeError):
    """A run-time invariant of the batch arithmetic is broken."""


class CompatError(GAError, RuntimeError):
    """Upstream code is not what the extension knows how to patch."""


class VerifyError(GAError, RuntimeError):
    """``megatron-ga verify`` could not run its launches (no device, a rank failed)."""


class NoiseScaleError(GAError):
    """A gradient-noise measurement or a measured trace cannot be used: too few replicas, a count or
    norm that is not a finite number, a malformed trace or EMA state."""


class CriticalBatchError(GAError):
    """``megatron-ga critical-batch`` cannot read its runs or targets: a file that is neither a
    Megatron log nor a TensorBoard directory, two runs at one global batch size, a run whose batch
    size changes, a target no run reached."""


class ScheduleWarning(UserWarning):
    """A stage not yet reached breaks a rule, and the caller opted to be warned instead of
    stopped."""
