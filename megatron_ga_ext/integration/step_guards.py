"""The guards as a feature (features.py): every model chunk runs the step's micro-batches (guards.py), and every
training iteration ran the extension's hooks (liveness.py). Host integers only, nothing per micro-batch beyond a
count."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ga_ext.integration.compat import live_calculator
from megatron_ga_ext.integration.features import Feature, OptimizerStep, Step
from megatron_ga_ext.integration.guards import MicrobatchCounter

__all__ = ["Guards"]


class Guards(Feature):
    """--ga-guards: the micro-batch counts per call; always: liveness at each optimizer step."""

    flags = ("--ga-guards",)

    def __init__(self, state: Any) -> None:
        super().__init__(state)
        self.counter = MicrobatchCounter()
        self.replays_expected = False
        """The launch replays graphs by design (a coverage row with ``replays``): liveness does not count its
        iterations."""

    def scheduled(self, count: int, requested: object) -> None:
        """The sequence-packing scheduler repacked a step into ``count`` micro-batches: the next call must run them."""
        if self.state.config.guards:
            self.counter.schedule(count, requested)

    def begin_step(self, step: Step) -> None:
        """The counts reset; the packing scheduler's count checked; replays by design noted (first call)."""
        if step.startup is not None:
            self.replays_expected = any(row.replays for row in step.startup.limited)
        self.counter.reset()
        if self.state.config.guards:  # the sequence-packing scheduler's count, before its iterator is read
            self.counter.check_scheduled(step.call["num_microbatches"])

    def micro_batch(self, model_chunk: torch.nn.Module, loss_func: Any) -> Any:
        """The chunk's forward step counted."""
        self.counter.count(model_chunk)
        return loss_func

    def end_step(self, step: Step) -> None:
        """Every chunk ran num_microbatches (--ga-guards): the step's calls, the calculator's count in all."""
        if self.state.config.guards:
            calculator = live_calculator() if step.training and not step.left_open else None
            self.counter.check(step.call["num_microbatches"], calculator, step.earlier)

    def before_optimizer_step(self, step: OptimizerStep) -> None:
        """Liveness: the iteration ran the guarded schedule and finalize (liveness.py)."""
        step.liveness.check(after_step=False)

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """Liveness under --ga-checks async, after the step."""
        step.liveness.check(after_step=True)
