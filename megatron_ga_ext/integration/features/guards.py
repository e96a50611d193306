"""The guards as a feature (features/): every model chunk runs the step's micro-batches (guards.py),
every training iteration ran the extension's hooks, and finalize ran once per optimizer step
(liveness.py). Host integers only, nothing per micro-batch beyond a count."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from megatron_ga_ext.integration.compat import live_calculator
from megatron_ga_ext.integration.features import Feature, Finalizing, Handle, OptimizerStep, Step
from megatron_ga_ext.integration.guards import MicrobatchCounter
from megatron_ga_ext.integration.hook_rows import Hook
from megatron_ga_ext.integration.liveness import check_one_finalize
from megatron_ga_ext.integration.violations import observed

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = ["Guards"]


def scheduled_count(original: Callable, state: Installation) -> Callable:
    """``wrap_data_iterator(data_iterator, config, num_microbatches, ...)`` -> (iterator, the packed
    count, tokens, squared lengths): the packed count, validated, is the one the next
    forward/backward call must run."""

    @functools.wraps(original)
    def wrap_data_iterator(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        live = state.current()
        guards = None if live is None else live.feature(Guards)
        if guards is not None:
            guards.scheduled(
                result[1], args[2] if len(args) > 2 else kwargs.get("num_microbatches")
            )
        return result

    return wrap_data_iterator


class Guards(Feature):
    """--ga-guards: the micro-batch counts per call; always: liveness at each optimizer step, one
    finalize a step."""

    flags = ("--ga-guards",)
    hooks = (
        Hook(
            "step",
            "megatron.core.datasets.data_schedule",
            "wrap_data_iterator",
            scheduled_count,
            when=lambda state: state.config.guards,
            does="the sequence-packing scheduler's count, the one the next forward/backward call "
            "must run",
        ),
    )

    def __init__(self, handle: Handle) -> None:
        super().__init__(handle)
        self.counter = MicrobatchCounter()
        self.replays_expected = False
        """The launch replays graphs by design (a coverage row with ``replays``): liveness does not
        count its iterations."""

    def scheduled(self, count: int, requested: object) -> None:
        """The sequence-packing scheduler repacked a step into ``count`` micro-batches: the next
        call must run them."""
        if self.handle.config.guards:
            self.counter.schedule(count, requested)

    def begin_step(self, step: Step) -> None:
        """The counts reset; the packing scheduler's count checked; replays by design noted (first
        call)."""
        if step.startup is not None:
            self.replays_expected = any(row.replays for row in step.startup.limited)
        self.counter.reset()
        if (
            self.handle.config.guards
        ):  # the sequence-packing scheduler's count, before its iterator is read
            with observed(self.handle.config, "scheduled micro-batches"):
                self.counter.check_scheduled(step.call["num_microbatches"])

    def micro_batch(self, model_chunk: torch.nn.Module, loss_func: Any) -> Any:
        """The chunk's forward step counted."""
        self.counter.count(model_chunk)
        return loss_func

    def end_step(self, step: Step) -> None:
        """Every chunk ran num_microbatches (--ga-guards): the step's calls, the calculator's count
        in all."""
        if self.handle.config.guards:
            calculator = live_calculator() if step.training and not step.left_open else None
            with observed(self.handle.config, "micro-batches per chunk"):
                self.counter.check(step.call["num_microbatches"], calculator, step.earlier)

    def finalize(self, step: Finalizing) -> None:
        """Token mode: one finalize per optimizer step (liveness.py), where an optimizer bounds the
        steps."""
        if step.mode == "token":
            with observed(self.handle.config, "one finalize per step"):
                check_one_finalize(step.repeated, step.iteration)

    def before_optimizer_step(self, step: OptimizerStep) -> None:
        """Liveness: the iteration ran the guarded schedule and finalize (liveness.py)."""
        with observed(self.handle.config, "liveness"):
            step.liveness.check(after_step=False, exempt=self.replays_expected)

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """Liveness under --ga-checks async, after the step."""
        with observed(self.handle.config, "liveness"):
            step.liveness.check(after_step=True, exempt=self.replays_expected)
