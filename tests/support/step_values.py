"""A feature a test adds with one entry in ``FEATURES``: the values each optimizer step is handed
(finalize's verdict: N, the skip), for tests that read N after a step
(integration/features/__init__.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from megatron_ga_ext.integration import installation
from megatron_ga_ext.integration.features import Entry, Feature, Handle, OptimizerStep


class StepValues(Feature):
    """Every optimizer step it saw, as handed to the features (after the step: with what --ga-checks
    async read)."""

    def __init__(self, handle: Handle) -> None:
        super().__init__(handle)
        self.steps: list[OptimizerStep] = []

    def before_optimizer_step(self, step: OptimizerStep) -> None:
        self.steps.append(step)


def add_step_values() -> None:
    """Every install() in this process from now on builds a StepValues feature, last in FEATURES
    (once)."""
    if all(entry.source is not StepValues for entry in installation.FEATURES):
        installation.FEATURES = (*installation.FEATURES, Entry(StepValues))


@contextmanager
def recording_step_values() -> Iterator[None]:
    """install() within it builds a StepValues feature, last in FEATURES."""
    saved = installation.FEATURES
    installation.FEATURES = (*saved, Entry(StepValues))
    try:
        yield
    finally:
        installation.FEATURES = saved


def last_num_tokens(state: installation.Installation) -> int | None:
    """N of the last optimizer step ``state`` ran (None where there was none, or none was read)."""
    feature = state.feature(StepValues)
    verdict = feature.steps[-1].verdict if feature is not None and feature.steps else None
    return None if verdict is None else verdict.num_tokens
