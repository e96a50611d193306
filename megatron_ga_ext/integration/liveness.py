"""Liveness: every training iteration ran the extension's hooks, or the run says which path went
around them.

The optimizer step that Megatron's builders return runs once per training iteration, after the
forward/backward and finalize. Its wrapper (hooks.optimizer_step) compares two host counters with
their values at that optimizer's previous step:

* the training calls (not ``forward_only``) through the guarded schedule
  (:attr:`Counts.training_schedules`): the micro-batch guards, the start-up checks, and the loss
  contract's reset;
* the calls of the extension's finalize (:attr:`Counts.finalizes`): the token count N, its checks,
  the division.

An iteration that reached the optimizer without them ran a path the extension does not see: a
replayed full-iteration CUDA graph (finalize and the schedule are inside the graph), or a
forward/backward function that is not the one ``get_forward_backward_func()`` returns after
install() (bound before it, or unwrapped). ``--ga-checks sync`` raises a GuardError before that
optimizer step; ``--ga-checks async`` raises it after the step, where the step's other verdicts are
read. Launches whose iterations replay a graph by design (a coverage row with ``replays``) are
exempt. Two integer comparisons per step; nothing per micro-batch.

The same optimizer steps bound the step for finalize (token mode): once such an optimizer exists, a
second call of the extension's finalize before the next optimizer step is stopped at that call
(:func:`check_one_finalize`, the guards' finalize phase). A loop that splits its step over several
forward_backward_func calls and runs finalize on each reduces and divides partial gradients; split
with finalize on the last call only (or called once after the last), the step trains as one: the
earlier calls leave it open, their losses stay in the loss contract, and the one finalize counts
every call's tokens (installation.py). A step still open at its optimizer step never reached
finalize, and stops there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.integration.host import current_host

if TYPE_CHECKING:
    from megatron_ga_ext.config.ga_config import GAConfig

__all__ = [
    "Counts",
    "StepLiveness",
    "bypass_message",
    "check_one_finalize",
    "megatron_reruns_in_place",
    "unfinalized_message",
]

#: What a step split over several forward_backward_func calls does right (the messages say it).
SPLIT_STEP_FIX = (
    "Run one forward_backward_func call per optimizer step with all of its micro-batches "
    "(num_microbatches=get_num_microbatches()); or, where a step must be split, set "
    "config.finalize_model_grads_func on its last call only (None on the others), or "
    "leave it None and call megatron.core.distributed.finalize_model_grads once after "
    "the last call: megatron-ga-ext keeps every call's loss tokens for that one finalize."
)


def unfinalized_message(step: str) -> str:
    """``step`` (what ran: "this training step's forward_backward_func") never reached the
    extension's finalize."""
    return (
        f"{step} never called megatron-ga-ext's finalize_model_grads, so the global token count "
        "N was not taken and the gradients were not divided by it (nor checked). Set "
        "config.finalize_model_grads_func to "
        "megatron.core.distributed.finalize_model_grads after megatron_ga_ext.install() "
        "(on the last forward_backward_func call of a step split over several), or leave "
        "it to Megatron's training loop."
    )


def megatron_reruns_in_place() -> bool:
    """Megatron's rerun state machine is re-running the iteration in place (``--rerun-mode
    validate_results`` after a non-finite loss): train_step zeroes the gradients and runs the step's
    forward/backward again, finalize included, before the one optimizer step. Read without creating
    the machine; False where megatron has none."""
    module = sys.modules.get("megatron.core.rerun_state_machine")
    machine = getattr(module, "_GLOBAL_RERUN_STATE_MACHINE", None)
    return getattr(getattr(machine, "state", None), "name", None) == "RERUNNING_IN_PLACE"


def check_one_finalize(calls: int, iteration: int | None) -> None:
    """Raise :class:`GuardError` where finalize ran ``calls`` > 1 times since the last optimizer
    step, unless Megatron's rerun state machine re-runs the iteration
    (:func:`megatron_reruns_in_place`)."""
    if calls <= 1 or megatron_reruns_in_place():
        return
    step = f"training iteration {iteration}" if iteration is not None else "this training step"
    raise GuardError(
        f"megatron-ga-ext's finalize_model_grads ran {calls} times in {step} before its "
        "optimizer step: the step is "
        f"split over several forward_backward_func calls, each running finalize_model_grads "
        "(config.finalize_model_grads_func set on every call, as an RL framework does when it "
        "calls forward_backward_func once per subset of a step's micro-batches). Each "
        "finalize all-reduces the partial gradients accumulated so far and divides them "
        "by a partial token count (that call's tokens only), so the step's gradient is "
        "not sum_m grad L_m / N over all its micro-batches: the earlier calls' part is "
        "reduced "
        f"and divided again. {SPLIT_STEP_FIX}"
    )


def bypass_message(
    *, scheduled: bool, finalized: bool, token: bool, iteration: int | None
) -> str | None:
    """What an iteration that ran (``scheduled``) or did not run the guarded schedule, and its
    finalize (``finalized``), most likely went through; None when the hooks it needs ran (finalize
    is needed in token mode)."""
    if scheduled and (finalized or not token):
        return None
    step = f"training iteration {iteration}" if iteration is not None else "a training iteration"
    if not scheduled and finalized:
        return (
            f"{step} reached the optimizer step through megatron-ga-ext's finalize_model_grads "
            "but not through its guarded forward/backward schedule: the training loop called a "
            "forward_backward_func not taken from "
            "megatron.core.pipeline_parallel.get_forward_backward_func() after install() "
            "(a schedule function bound before install(), or the unwrapped original), so "
            "the micro-batch guards and the loss contract's per-step reset did not run. "
            "Call the function get_forward_backward_func() returns."
        )
    if not scheduled:
        return (
            f"{step} reached the optimizer step without running megatron-ga-ext's hooks: neither "
            "its guarded forward/backward schedule nor its finalize_model_grads was called, so "
            "the loss contract, the token count N and its checks and the micro-batch "
            "guards did not run for this step. Most likely a replayed full-iteration "
            "CUDA graph (--cuda-graph-impl full_iteration; FullCudaGraphWrapper) ran the "
            "forward/backward, or a forward_backward_func that is not a megatron-core "
            "schedule. Leave "
            f"full-iteration graphs off, or call the schedule get_forward_backward_func() returns."
        )
    return (
        f"{step} ran megatron-ga-ext's guarded schedule but not its finalize_model_grads: "
        + unfinalized_message("its forward_backward_func")
    )


@dataclass
class Counts:
    """What the installation's phases count, on the host: liveness compares them at each optimizer
    step."""

    training_schedules: int = 0
    """Training calls (not forward_only) through the guarded schedule."""
    finalizes: int = 0
    """Calls of the extension's finalize (its features' finalize phase)."""
    finalizes_at_step: int | None = None
    """``finalizes`` at the last step of an optimizer install() hooked (or its building); None
    before there is one: without its steps the loop's steps are not seen, and finalize calls per
    step are not counted."""
    in_call: bool = False
    """A forward/backward call began and has not returned; still so at the next call: it raised, its
    step is abandoned."""


class Hooked(Protocol):
    """What liveness reads of an installation (installation.Installation)."""

    @property
    def config(self) -> GAConfig: ...

    @property
    def counts(self) -> Counts: ...

    @property
    def finalize(self) -> object | None: ...


class StepLiveness:
    """One optimizer's view: the schedule and finalize counts at its last step (an optimizer steps
    once per iteration; two optimizers each keep their own)."""

    def __init__(self, state: Hooked) -> None:
        self.state = state
        self.schedules, self.finalized = self._counts()
        if (
            state.finalize is not None
        ):  # from here the optimizer's steps bound finalize's count per step
            state.counts.finalizes_at_step = state.counts.finalizes

    def follow(self, state: Hooked) -> None:
        """Count against ``state`` (the installation that replaced this one's) from now on: its
        counts start at install(), so the iteration in progress is counted from 0."""
        self.state, self.schedules, self.finalized = state, 0, 0

    def _counts(self) -> tuple[int, int]:
        counts = self.state.counts
        return counts.training_schedules, counts.finalizes

    def problem(self, *, exempt: bool = False) -> str | None:
        """This iteration's bypass message (see :func:`bypass_message`), or None; the counts move on
        either way. ``exempt``: the launch replays graphs by design (the guards' start-up
        finding)."""
        schedules, finalized = self._counts()
        scheduled, reached = schedules > self.schedules, finalized > self.finalized
        self.schedules, self.finalized = schedules, finalized
        if exempt or self.state.finalize is None:
            return None
        return bypass_message(
            scheduled=scheduled,
            finalized=reached,
            token=self.state.config.loss_reduction == "token",
            iteration=current_host().iteration(),
        )

    def check(self, *, after_step: bool, exempt: bool = False) -> None:
        """Raise the iteration's GuardError: before the step under ``--ga-checks sync``
        (``after_step`` False), after it under ``--ga-checks async``."""
        is_async = self.state.config.checks == "async"
        if is_async != after_step:
            return
        message = self.problem(exempt=exempt)
        if message is not None:
            raise GuardError(
                ("--ga-checks async, after the optimizer step: " if is_async else "") + message
            )
