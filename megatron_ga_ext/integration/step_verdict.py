"""A step's checks (finalize.py's, in one int64 vector): raised now, read later under ``--ga-checks
async`` (:class:`PendingChecks`, a pinned host copy), or a non-finite loss left to Megatron's rerun
state machine (features.Deferred), whose decision is then said in words
(:func:`describe_decision`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ga_ext.errors import LossContractError
from megatron_ga_ext.integration.features import Deferred
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.integration.loss_contract import StepChecks

__all__ = [
    "Deferred",
    "PendingChecks",
    "describe_decision",
    "megatron_judges_nonfinite",
    "prefixed",
    "raise_on_violations",
]


def prefixed(where: str) -> str:
    return f"{where}: " if where else ""


def raise_on_violations(checks: StepChecks, *, where: str = "") -> None:
    prefix = prefixed(where)
    if checks.unchecked:
        raise LossContractError(
            f"{prefix}{checks.unchecked} last-stage rank(s) ran no micro-batch through the "
            "LossContract this step, so their token counts are unchecked; wrap the loss function "
            "with contract.wrap(loss_func) (install() does this for you)."
        )
    if checks.nonfinite:
        raise LossContractError(
            f"{prefix}{checks.nonfinite} micro-batch(es) in this global batch returned a "
            "non-finite loss (inf or nan); the token-weighted gradient would be non-finite. "
            "Check the data, the loss function and "
            f"the learning rate (--check-for-nan-in-loss-and-grad names the rank at the source)."
        )
    if checks.negative:
        raise LossContractError(
            f"{prefix}{checks.negative} micro-batch(es) returned a negative num_tokens; a token "
            "count is "
            f">= 0. Count non-padding tokens as loss_mask.sum().to(torch.int64)."
        )


def megatron_judges_nonfinite() -> bool:
    """Megatron-LM's rerun state machine checks each loss for NaN and Inf:
    ``--check-for-nan-in-loss-and-grad`` (the default) with ``--rerun-mode validate_results`` (the
    default; ``report_stats`` stops Megatron at start-up, and the coverage table refuses it). (With
    ``--rerun-mode disabled`` its check raises in the loss function, before finalize.) Without
    Megatron's args: no."""
    args = current_host().settings()
    return args.check_for_nan_in_loss_and_grad and args.rerun_mode == "validate_results"


@dataclass
class PendingChecks:
    """A step's reduced vector on its way to the host (``--ga-checks async``)."""

    host: torch.Tensor
    """Pinned host copy (CUDA: filled without blocking, done once ``event`` is)."""
    event: torch.cuda.Event | None
    step: int
    """The finalize call it belongs to (FinalizeModelGrads.calls)."""
    iteration: int | None

    @classmethod
    def of(cls, vector: torch.Tensor, step: int, iteration: int | None) -> PendingChecks:
        if (
            vector.device.type != "cuda"
        ):  # the CPU, or a device without events: the vector itself, or a copy
            return cls(vector.to("cpu"), None, step, iteration)
        host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
        host.copy_(vector, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event, step, iteration)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def checks(self) -> StepChecks:
        if self.event is not None:
            self.event.synchronize()  # done already when ready(); else waits for this one copy
        return StepChecks(
            *self.host.numpy().tolist()
        )  # host memory: reading it cannot synchronize the device


def describe_decision(checkpoint: bool, exit: bool, exit_code: int) -> str:
    """Megatron's ``RerunStateMachine.should_checkpoint_and_exit()`` in words."""
    if exit:
        return f"{'save a checkpoint and ' if checkpoint else ''}exit with code {exit_code}"
    return "save a checkpoint and go on" if checkpoint else "go on training"
