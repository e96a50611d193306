"""Token-level loss reduction: the loss helper, and the per-micro-batch loss contract.

Mode ``token`` (``--calculate-per-token-loss``) optimises

    L_token = sum_{m,r,c} L(m,r,c) / sum_{m,r,c} n(m,r,c)

over micro-batches m, data-parallel ranks r and context-parallel shards c, where L is a micro-batch's
*summed* token loss and n its non-padding token count. Mode ``microbatch`` is upstream's default mean of
means, ``(1/(M*D*C)) sum_{m,r,c} L(m,r,c) / max(n(m,r,c), 1)``. ``docs/reduction.md`` has the math.

:func:`masked_loss` is the loss helper for pretrain_gpt-style loss functions. :class:`LossContract`
checks what a loss function returns, one micro-batch at a time, without reading anything back from the
device: tuple shape and dtypes are host facts and fail at once; sign and finiteness are accumulated as
device flags that :mod:`megatron_ga_ext.finalize` reads once per step, inside the token-count
collectives the step already does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_ga_ext.errors import LossContractError
from megatron_ga_ext.options import MODES

__all__ = ["MODES", "LossContract", "masked_loss", "mean_of_means_reports", "reduce_reports"]

#: Slots of the per-step int64 vector (see :meth:`LossContract.collect`).
SLOT_TOKENS, SLOT_NEGATIVE, SLOT_NONFINITE, SLOT_UNCHECKED = range(4)
NUM_SLOTS = 4


def masked_loss(losses: torch.Tensor, loss_mask: torch.Tensor, *, mode: str = "token",
                key: str = "lm loss") -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(per-token losses, loss_mask) -> (summed loss, num_tokens, report), the 3-tuple Megatron wants.

        loss       = sum_i losses_i * mask_i          (a sum: the schedule or finalize divides)
        num_tokens = sum_i mask_i                     (int64, so a global batch cannot overflow it)
        report     = {key: [loss, num_tokens]}        in mode ``token``
                     {key: [loss / max(num_tokens, 1), 1]}   in mode ``microbatch``

    Megatron's training loop logs ``sum(report[0]) / sum(report[1])`` over micro-batches and DP x CP
    ranks (:func:`reduce_reports` does the same), so in either mode the logged loss is the loss that is
    optimised: the token mean, or the mean of the micro-batch means.
    """
    if losses.shape != loss_mask.shape and losses.numel() != loss_mask.numel():
        raise LossContractError(
            f"masked_loss: losses has shape {tuple(losses.shape)} but loss_mask has shape "
            f"{tuple(loss_mask.shape)}; pass one loss per token and one mask value per token.")
    mask = loss_mask.reshape(-1)
    loss = torch.sum(losses.reshape(-1).float() * mask.float())
    num_tokens = (mask != 0).sum().to(torch.int64)
    if mode == "token":
        row = torch.stack([loss.detach(), num_tokens.to(loss.dtype)])
    elif mode == "microbatch":
        mean = loss.detach() / torch.clamp(num_tokens, min=1)
        row = torch.stack([mean, torch.ones_like(mean)])
    else:
        raise LossContractError(f"masked_loss: mode {mode!r} is not known; choose one of {MODES}.")
    return loss, num_tokens, {key: row}


def reduce_reports(reports: list[dict[str, torch.Tensor]],
                   group: Any = None) -> dict[str, torch.Tensor]:
    """The logged loss: sum over micro-batches (and ranks of ``group``) of report[0] / of report[1].

    With :func:`masked_loss` reports this is the token-weighted mean in mode ``token`` and the mean of
    micro-batch means in mode ``microbatch``: the loss the step optimises.
    """
    if not reports:
        return {}
    reduced = {}
    for key in reports[0]:
        total = torch.stack([r[key].reshape(-1) for r in reports]).sum(dim=0)
        if group is not None:
            torch.distributed.all_reduce(total, group=group)
        reduced[key] = total[0] / total[1]
    return reduced


def mean_of_means_reports(loss_func: Callable) -> Callable:
    """Mode ``microbatch`` with a loss function whose report is ``[summed loss, n]`` (upstream's pretrain_gpt):
    report ``[summed loss / max(n, 1), 1]`` instead, so that Megatron's logged loss, sum(report[0]) /
    sum(report[1]) over micro-batches and DP x CP ranks, is the mean of the micro-batch means that this mode
    optimises, not the token mean. Reports of another shape pass unchanged."""

    def reported(*args: Any, **kwargs: Any):
        outputs = loss_func(*args, **kwargs)
        if kwargs.get("non_loss_data") or not isinstance(outputs, tuple) or not isinstance(outputs[-1], dict):
            return outputs
        report = {key: _mean_row(value) for key, value in outputs[-1].items()}
        return (*outputs[:-1], report)

    return reported


def _mean_row(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.numel() != 2:
        return value
    row = value.reshape(-1)
    mean = row[0] / torch.clamp(row[1], min=1)
    return torch.stack([mean, torch.ones_like(mean)]).reshape(value.shape)


class LossContract:
    """Checks each micro-batch's loss-function outputs; accumulates the int64 token count on device.

    Host facts fail at once (no synchronization): the outputs are not a 3-tuple; num_tokens is not an
    integer scalar. Device facts (num_tokens < 0, a non-finite loss) are summed into flags that
    :meth:`collect` hands to the finalize wrapper once per step.

    Use ``contract.wrap(loss_func)`` where a loss function is built, or call ``contract.check(outputs)``
    on what a loss function returned.
    """

    def __init__(self) -> None:
        self._flags: torch.Tensor | None = None
        self.microbatches = 0
        """Micro-batches checked since the last :meth:`collect` (a host counter)."""

    def wrap(self, loss_func: Callable) -> Callable:
        """``loss_func`` with its outputs checked; ``non_loss_data=True`` calls pass through."""

        def checked(*args: Any, **kwargs: Any):
            outputs = loss_func(*args, **kwargs)
            if kwargs.get("non_loss_data"):
                return outputs
            return self.check(outputs)

        return checked

    def check(self, outputs: Any) -> tuple:
        """Validate one micro-batch's ``(loss, num_tokens, report)``; return it unchanged.

        A count on the host (an int, or a CPU tensor beside a device loss) is checked on the host and
        added as a scalar, so no host-to-device copy (which would synchronize) happens per micro-batch.
        """
        _require_three_tuple(outputs, self.microbatches)
        loss, num_tokens, report = outputs
        _require_integer_scalar(num_tokens)
        if not isinstance(loss, torch.Tensor):
            raise LossContractError(
                f"the loss function returned a loss of type {type(loss).__name__}; it must be a "
                f"tensor (the summed token loss of the micro-batch).")
        flags = self._flags_on(loss.device)
        nonfinite = (~torch.isfinite(loss.detach())).any().to(torch.int64)
        if isinstance(num_tokens, torch.Tensor) and num_tokens.device == loss.device:
            count = num_tokens.reshape(()).to(torch.int64)
            flags[:SLOT_UNCHECKED].add_(torch.stack([count, (count < 0).to(torch.int64), nonfinite]))
        else:
            count = int(num_tokens)  # a host value: reading it costs no device synchronization
            if count < 0:
                raise LossContractError(
                    f"the loss function returned num_tokens = {count} at micro-batch {self.microbatches}; a "
                    f"token count is >= 0. Count non-padding tokens as loss_mask.sum().to(torch.int64).")
            flags[SLOT_TOKENS].add_(count)
            flags[SLOT_NONFINITE].add_(nonfinite)
        self.microbatches += 1
        return outputs

    def _flags_on(self, device: torch.device) -> torch.Tensor:
        """This step's flag vector, on the loss's device; every micro-batch of a step must use one device."""
        if self._flags is None:
            self._flags = torch.zeros(NUM_SLOTS, dtype=torch.int64, device=device)
        elif self._flags.device != device:
            raise LossContractError(
                f"micro-batch {self.microbatches} returned its loss on {device}, earlier ones on "
                f"{self._flags.device}; keep every micro-batch's loss on the model's device.")
        return self._flags

    def reset(self) -> None:
        """Forget everything accumulated (call at the start of a step that follows an aborted one)."""
        self._flags = None
        self.microbatches = 0

    def collect(self, device: torch.device, *, is_last_stage: bool) -> torch.Tensor:
        """This step's int64 vector [tokens, negative, nonfinite, unchecked], then reset.

        ``unchecked`` is 1 on a last pipeline stage that ran no micro-batch through the contract
        (the loss function was not wrapped): a host fact, so it costs no synchronization.
        """
        flags = self._flags if self._flags is not None else torch.zeros(
            NUM_SLOTS, dtype=torch.int64, device=device)
        flags = flags.to(device)
        if is_last_stage and self.microbatches == 0:
            flags[SLOT_UNCHECKED] = 1
        self.reset()
        return flags


def _require_three_tuple(outputs: Any, index: int) -> None:
    if isinstance(outputs, (tuple, list)) and len(outputs) == 3:
        return
    got = f"a {len(outputs)}-tuple" if isinstance(outputs, (tuple, list)) else type(outputs).__name__
    raise LossContractError(
        f"the loss function returned {got} at micro-batch {index}; token mode needs "
        f"(summed loss, num_tokens, report). With a 2-tuple (loss, report) Megatron multiplies the "
        f"loss by the CP size and never divides by a token count, so gradients come out summed over "
        f"DP x CP instead of averaged. Return megatron_ga_ext.reduction.masked_loss(losses, loss_mask).")


def _require_integer_scalar(num_tokens: Any) -> None:
    if isinstance(num_tokens, bool):
        pass
    elif isinstance(num_tokens, int):
        return
    elif isinstance(num_tokens, torch.Tensor):
        integer = not (num_tokens.is_floating_point() or num_tokens.is_complex()
                       or num_tokens.dtype == torch.bool)
        if integer and num_tokens.numel() == 1:
            return
        what = f"a tensor of dtype {num_tokens.dtype} and shape {tuple(num_tokens.shape)}"
        raise LossContractError(
            f"the loss function returned num_tokens as {what}; it must be an integer scalar (one "
            f"count of non-padding tokens per micro-batch; a float count is inexact above "
            f"2^24 in float32). Use loss_mask.sum().to(torch.int64).")
    raise LossContractError(
        f"the loss function returned num_tokens of type {type(num_tokens).__name__}; it must be an "
        f"integer scalar tensor. Use loss_mask.sum().to(torch.int64).")
