"""Liveness: every training iteration ran the extension's hooks, or the run says which path went around them.

The optimizer step that Megatron's builders return runs once per training iteration, after the forward/backward
and finalize. Its wrapper (hooks.optimizer_step) compares two host counters with their values at that optimizer's
previous step:

* the training calls (not ``forward_only``) through the guarded schedule (``Installation.training_schedules``):
  the micro-batch guards, the start-up checks, and the loss contract's reset;
* the calls of the extension's finalize (``FinalizeModelGrads.calls``): the token count N, its checks, the division.

An iteration that reached the optimizer without them ran a path the extension does not see: a replayed full-iteration
CUDA graph (finalize and the schedule are inside the graph), or a forward/backward function that is not the one
``get_forward_backward_func()`` returns after install() (bound before it, or unwrapped). ``--ga-checks sync`` raises a
GuardError before that optimizer step; ``--ga-checks async`` raises it after the step, where the step's other
verdicts are read. Launches whose iterations replay a graph by design (a coverage row with ``replays``) are exempt.
Two integer comparisons per step; nothing per micro-batch.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.integration.compat import megatron_iteration

__all__ = ["StepLiveness", "bypass_message"]


def bypass_message(*, scheduled: bool, finalized: bool, token: bool, iteration: int | None) -> str | None:
    """What an iteration that ran (``scheduled``) or did not run the guarded schedule, and its finalize
    (``finalized``), most likely went through; None when the hooks it needs ran (finalize is needed in token mode)."""
    if scheduled and (finalized or not token):
        return None
    step = f"training iteration {iteration}" if iteration is not None else "a training iteration"
    if not scheduled and finalized:
        return (f"{step} reached the optimizer step through megatron-ga-ext's finalize_model_grads but not through its "
                f"guarded forward/backward schedule: the training loop called a forward_backward_func not taken from "
                f"megatron.core.pipeline_parallel.get_forward_backward_func() after install() (a schedule function "
                f"bound before install(), or the unwrapped original), so the micro-batch guards and the loss "
                f"contract's per-step reset did not run. Call the function get_forward_backward_func() returns.")
    if not scheduled:
        return (f"{step} reached the optimizer step without running megatron-ga-ext's hooks: neither its guarded "
                f"forward/backward schedule nor its finalize_model_grads was called, so the loss contract, the token "
                f"count N and its checks and the micro-batch guards did not run for this step. Most likely a replayed "
                f"full-iteration CUDA graph (--cuda-graph-impl full_iteration; FullCudaGraphWrapper) ran the "
                f"forward/backward, or a forward_backward_func that is not a megatron-core schedule. Leave "
                f"full-iteration graphs off, or call the schedule get_forward_backward_func() returns.")
    return (f"{step} ran megatron-ga-ext's guarded schedule but not its finalize_model_grads, so the global token "
            f"count N was not taken and the gradients were not divided by it. Set config.finalize_model_grads_func "
            f"to megatron.core.distributed.finalize_model_grads after megatron_ga_ext.install().")


class Hooked(Protocol):
    """What liveness reads of an installation (installation.Installation)."""

    config: Any
    finalize: Any
    contract: Any
    training_schedules: int
    replays_expected: bool


class StepLiveness:
    """One optimizer's view: the schedule and finalize counts at its last step (an optimizer steps once per
    iteration; two optimizers each keep their own)."""

    def __init__(self, state: Hooked) -> None:
        self.state = state
        self.schedules, self.finalized = self._counts()

    def follow(self, state: Hooked) -> None:
        """Count against ``state`` (the installation that replaced this one's) from now on: its counts start at
        install(), so the iteration in progress is counted from 0."""
        self.state, self.schedules, self.finalized = state, 0, 0

    def _counts(self) -> tuple[int, int]:
        finalize = self.state.finalize
        return self.state.training_schedules, 0 if finalize is None else finalize.calls

    def problem(self) -> str | None:
        """This iteration's bypass message (see :func:`bypass_message`), or None; the counts move on either way."""
        schedules, finalized = self._counts()
        scheduled, reached = schedules > self.schedules, finalized > self.finalized
        self.schedules, self.finalized = schedules, finalized
        if self.state.replays_expected or self.state.finalize is None:
            return None
        return bypass_message(scheduled=scheduled, finalized=reached, token=self.state.contract is not None,
                              iteration=megatron_iteration())

    def check(self, *, after_step: bool) -> None:
        """Raise the iteration's GuardError: before the step under ``--ga-checks sync`` (``after_step`` False), after
        it under ``--ga-checks async``."""
        is_async = self.state.config.checks == "async"
        if is_async != after_step:
            return
        message = self.problem()
        if message is not None:
            raise GuardError(("--ga-checks async, after the optimizer step: " if is_async else "") + message)

