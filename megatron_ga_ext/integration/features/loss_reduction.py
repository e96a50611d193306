"""--ga-loss-reduction as a feature (features/): how each micro-batch's loss function is wrapped,
and the step the loss contract keeps open across calls.

Token mode checks each loss function's return and keeps the step's counts in the installation's loss
contract, which finalize collects (loss_contract.py); microbatch mode reports each micro-batch's
mean to Megatron's logged loss. A training step split over several forward_backward_func calls with
finalize on the last only (liveness.py) leaves the step open after each earlier call: its losses
stay in the contract, and an evaluation call (forward_only, which never reaches finalize) in between
sets them aside.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.integration.features import Feature, Finalizing, Handle, OptimizerStep, Step
from megatron_ga_ext.integration.liveness import unfinalized_message
from megatron_ga_ext.integration.loss_contract import mean_of_means_reports

__all__ = ["LossReduction"]

_SPLIT_NEEDS_OPTIMIZER = (
    " (A step split over several forward_backward_func calls, finalize on the last only, needs "
    "an optimizer built by megatron.core.optimizer.get_megatron_optimizer after "
    "install(): its step marks where the step ends.)"
)


class LossReduction(Feature):
    """The loss functions wrapped (token mode: the loss contract's check; microbatch: the mean's
    report) and the open step."""

    flags = ("--ga-loss-reduction",)

    def __init__(self, handle: Handle) -> None:
        super().__init__(handle)
        self.contract = handle.contract
        self.wrap_loss = self.contract.wrap if self.contract is not None else mean_of_means_reports
        self.finalizes = 0
        """Finalize's calls this feature has seen (its finalize phase)."""
        self.open_step: tuple[int, int] = (0, 0)
        """The micro-batches of this step's training calls that returned without finalize (token
        mode, where an optimizer install() hooked marks the steps), and :attr:`finalizes` then. See
        :meth:`open_microbatches`."""
        self.set_aside: Any = None
        """An open step's losses, out of the loss contract while an evaluation call (forward_only)
        runs."""

    def open_microbatches(self, finalized: int | None = None) -> int:
        """The micro-batches of the open step's calls, whose losses stay in the loss contract for
        the step's one finalize, and whose sum with the last call's is the calculator's count; 0
        where no step is open, or finalize has run since (called by hand after the last call): its
        call count is not ``finalized`` (default: now)."""
        microbatches, calls = self.open_step
        return microbatches if calls == (self.finalizes if finalized is None else finalized) else 0

    def begin_step(self, step: Step) -> None:
        """The contract afresh, or an open step's losses kept (set aside during an evaluation call).

        Kept for the training call that continues the step; else forgotten (an evaluation's, or an
        aborted step's)."""
        step.finalized = self.finalizes
        if step.abandoned:
            self.open_step, self.set_aside = (0, 0), None
        if self.contract is None:
            return
        if not self.open_microbatches():
            self.contract.reset()
        elif not step.training:
            self.set_aside = self.contract.set_aside()

    def micro_batch(self, model_chunk: torch.nn.Module, loss_func: Any) -> Any:
        """The loss function wrapped: the contract's check (token), the mean's report
        (microbatch)."""
        return None if loss_func is None else self.wrap_loss(loss_func)

    def end_step(self, step: Step) -> None:
        """The step closed, or left open for a later call's finalize; its earlier calls'
        micro-batches.

        A training call that did not reach finalize (token mode) leaves its step open where an
        optimizer install() hooked ends the step, and stops without one."""
        step.left_open = (
            step.training and self.contract is not None and self.finalizes == step.finalized
        )
        if step.left_open and not self.handle.steps_bounded:
            raise GuardError(
                unfinalized_message("this training step's forward_backward_func")
                + _SPLIT_NEEDS_OPTIMIZER
            )
        step.earlier = self.open_microbatches(step.finalized) if step.training else 0
        if step.training:
            self.open_step = (
                (step.earlier + step.call["num_microbatches"], self.finalizes)
                if step.left_open
                else (0, 0)
            )
        elif self.set_aside is not None and self.contract is not None:
            self.contract.take_back(self.set_aside)
            self.set_aside = None

    def finalize(self, step: Finalizing) -> None:
        """Counted: a training call that reached finalize closes its step."""
        self.finalizes += 1

    def before_optimizer_step(self, step: OptimizerStep) -> None:
        """A step still open here never reached finalize: stopped (a host fact, under either
        --ga-checks)."""
        open_microbatches, self.open_step = self.open_microbatches(), (0, 0)
        if open_microbatches:
            raise GuardError(
                unfinalized_message("this training step's forward_backward_func calls")
            )
