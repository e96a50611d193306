"""Token-level loss reduction: the loss helper, and the per-micro-batch loss contract.

Mode ``token`` (``--calculate-per-token-loss``) optimises

    L_token = sum_{m,r,c} L(m,r,c) / sum_{m,r,c} n(m,r,c)

over micro-batches m, data-parallel ranks r and context-parallel shards c, where L is a
micro-batch's *summed* token loss and n its non-padding token count. Mode ``microbatch`` is
upstream's default mean of means, ``(1/(M*D*C)) sum_{m,r,c} L(m,r,c) / max(n(m,r,c), 1)``.
``docs/reduction.md`` has the math.

:func:`masked_loss` is the loss helper for pretrain_gpt-style loss functions. :class:`LossContract`
checks what a loss function returns, one micro-batch at a time, with host bookkeeping only: the
tuple's length and the count's type and dtype are host facts and fail at once; the loss and the
count are kept by reference, and their devices, sign and finiteness are checked for the whole step
at once (:meth:`LossContract.collect`), in the vector :mod:`megatron_ga_ext.integration.finalize`
broadcasts and all-reduces with the token count anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from megatron_ga_ext.config.flags import MODES
from megatron_ga_ext.errors import LossContractError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["LossContract", "StepChecks", "masked_loss", "mean_of_means_reports", "reduce_reports"]


class StepChecks(NamedTuple):
    """The step's int64 check vector (:meth:`LossContract.collect`), read on the host after the
    finalize's collectives: each field summed over the DP x CP ranks."""

    tokens: int
    """N, the non-padding tokens of the global batch."""
    negative: int
    """Micro-batches that returned num_tokens < 0."""
    nonfinite: int
    """Micro-batches whose loss holds an inf or nan."""
    unchecked: int
    """Last pipeline stages that ran no micro-batch through the contract."""


#: Where each field of :class:`StepChecks` stands in the device vector.
SLOT_TOKENS, SLOT_NEGATIVE, SLOT_NONFINITE, SLOT_UNCHECKED = range(len(StepChecks._fields))
NUM_SLOTS = len(StepChecks._fields)


def masked_loss(
    losses: torch.Tensor, loss_mask: torch.Tensor, *, mode: str = "token", key: str = "lm loss"
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(per-token losses, loss_mask) -> (summed loss, num_tokens, report), the 3-tuple Megatron
    wants.

        loss       = sum_i losses_i * mask_i          (a sum: the schedule or finalize divides)
        num_tokens = sum_i mask_i                     (int64, so a global batch cannot overflow it)
        report     = {key: [loss, num_tokens]}        in mode ``token``
                     {key: [loss / max(num_tokens, 1), 1]}   in mode ``microbatch``

    Megatron's training loop logs ``sum(report[0]) / sum(report[1])`` over micro-batches and DP x CP
    ranks (:func:`reduce_reports` does the same), so in either mode the logged loss is the loss that
    is optimised: the token mean, or the mean of the micro-batch means.
    """
    if losses.shape != loss_mask.shape and losses.numel() != loss_mask.numel():
        raise LossContractError(
            f"masked_loss: losses has shape {tuple(losses.shape)} but loss_mask has shape "
            f"{tuple(loss_mask.shape)}; pass one loss per token and one mask value per "
            "token."
        )
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


def reduce_reports(
    reports: list[dict[str, torch.Tensor]], group: ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """The logged loss: sum over micro-batches (and ranks of ``group``) of report[0] / of report[1].

    With :func:`masked_loss` reports this is the token-weighted mean in mode ``token`` and the mean
    of micro-batch means in mode ``microbatch``: the loss the step optimises.
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
    """Mode ``microbatch`` with a loss function whose report is ``[summed loss, n]`` (upstream's
    pretrain_gpt): report ``[summed loss / max(n, 1), 1]`` instead, so that Megatron's logged loss,
    sum(report[0]) / sum(report[1]) over micro-batches and DP x CP ranks, is the mean of the
    micro-batch means that this mode optimises, not the token mean. Reports of another shape pass
    unchanged."""

    def reported(*args: Any, **kwargs: Any) -> Any:
        outputs = loss_func(*args, **kwargs)
        if (
            kwargs.get("non_loss_data")
            or not isinstance(outputs, tuple)
            or not isinstance(outputs[-1], dict)
        ):
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
    """Checks each micro-batch's loss-function outputs with host bookkeeping only; the device checks
    of a whole step run in :meth:`collect`, once per step.

    Host facts fail at once (no synchronization): the outputs are not a 3-tuple; num_tokens is not
    an integer scalar; the loss is not a tensor. Per micro-batch it keeps references only (an alias
    of the loss's data, the count): no kernel runs. :meth:`collect` turns them into the step's int64
    vector [tokens, negative, nonfinite, unchecked] for the finalize wrapper, which reads it once
    per step (or, with ``--ga-checks async``, not at all); a loss on another device than the step's
    first is named there.

    Use ``contract.wrap(loss_func)`` where a loss function is built, or call
    ``contract.check(outputs)`` on what a loss function returned.
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._counts: list[torch.Tensor] = []
        self._host_tokens = 0

    @property
    def microbatches(self) -> int:
        """Micro-batches checked since the last :meth:`collect` (a host count)."""
        return len(self._losses)

    def wrap(self, loss_func: Callable) -> Callable:
        """``loss_func`` with its outputs checked; ``non_loss_data=True`` calls pass through."""
        return functools.partial(self.checked_call, loss_func)

    def checked_call(self, loss_func: Callable, *args: Any, **kwargs: Any) -> Any:
        """``loss_func(*args, **kwargs)``, its outputs checked (what :meth:`wrap` returns calls)."""
        outputs = loss_func(*args, **kwargs)
        return outputs if kwargs.get("non_loss_data") else self.check(outputs)

    def check(self, outputs: Any) -> Any:
        """Validate one micro-batch's ``(loss, num_tokens, report)`` (a tuple, or a list of three);
        return it unchanged.

        The loss is kept as ``loss.data``, an alias of its values without autograd: Megatron's 1F1B
        schedule may free a last stage's output storage (``deallocate_pipeline_outputs``) before
        finalize, and the alias keeps the values. A count given as a Python int is checked and
        summed on the host, so no host-to-device copy (which would synchronize) happens per
        micro-batch.
        """
        if type(outputs) is not tuple or len(outputs) != 3:
            _require_three_tuple(outputs, len(self._losses))
        loss, num_tokens, _ = outputs
        if not isinstance(loss, torch.Tensor):
            raise LossContractError(
                f"the loss function returned a loss of type {type(loss).__name__}; it must be a "
                "tensor (the summed token loss of the micro-batch)."
            )
        _require_integer_scalar(num_tokens)
        if isinstance(num_tokens, torch.Tensor):
            self._counts.append(num_tokens)
        elif num_tokens < 0:
            raise LossContractError(
                f"the loss function returned num_tokens = {num_tokens} at micro-batch "
                f"{len(self._losses)}; a token count is >= 0. Count non-padding tokens "
                "as loss_mask.sum().to(torch.int64)."
            )
        else:
            self._host_tokens += num_tokens
        self._losses.append(loss.data)
        return outputs

    def reset(self) -> None:
        """Forget everything kept (an evaluation call, or a step that follows an aborted one)."""
        self._losses, self._counts, self._host_tokens = [], [], 0

    def set_aside(self) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Everything kept, taken out for :meth:`take_back` (an open step's losses while an
        evaluation call runs)."""
        kept = self._losses, self._counts, self._host_tokens
        self.reset()
        return kept

    def take_back(self, kept: tuple[list[torch.Tensor], list[torch.Tensor], int]) -> None:
        """Keep what :meth:`set_aside` took out again, in place of what was checked since."""
        self._losses, self._counts, self._host_tokens = kept

    def collect(self, device: torch.device, *, is_last_stage: bool) -> torch.Tensor:
        """This step's int64 vector on ``device``, then reset:

            tokens    = sum_m n_m                    (int64: a global batch cannot overflow it)
            negative  = #{m : n_m < 0}
            nonfinite = #{m : loss_m has an inf or nan}
            unchecked = 1 on a last pipeline stage that ran no micro-batch through the contract

        Device ops only, no read: ``unchecked`` is a host fact (the loss function was not wrapped),
        and a count on the host is added as a scalar operand.
        """
        losses, counts, host_tokens = self._losses, self._counts, self._host_tokens
        self.reset()
        if not losses:  # no micro-batch went through the contract this step
            vector = torch.zeros(NUM_SLOTS, dtype=torch.int64, device=device)
            if is_last_stage:
                vector[SLOT_UNCHECKED] = 1
            return vector
        return _step_vector(losses, counts, host_tokens).to(device)


def _step_vector(
    losses: list[torch.Tensor], counts: list[torch.Tensor], host_tokens: int
) -> torch.Tensor:
    """[tokens, negative, nonfinite, 0] on the losses' device, for any mix the contract accepts:
    losses of several shapes or dtypes, counts of several shapes or dtypes (uint16-64 widened), host
    counts (a CPU tensor beside device losses is read on the host, which synchronizes nothing); a
    loss on another device than the first is refused."""
    device = losses[0].device
    for index, loss in enumerate(losses):
        if loss.device != device:
            raise LossContractError(
                f"micro-batch {index} returned its loss on {loss.device}, earlier ones on "
                f"{device}; keep every micro-batch's loss on the model's device."
            )
    device_counts, host_negative = [], 0
    for count in counts:
        if count.device == device:
            device_counts.append(count)
        else:
            value = int(count)
            host_tokens += value
            host_negative += value < 0
    zero = torch.zeros((), dtype=torch.int64, device=device)
    tokens, negative = zero, zero
    if device_counts:  # summed in int64 (torch sums every integer dtype in int64)
        stacked = _stacked_counts(device_counts)
        tokens, negative = stacked.sum(), torch.count_nonzero(stacked < 0)
    vector = torch.stack([tokens, negative, _nonfinite_microbatches(losses), zero])
    if host_tokens or host_negative:  # scalar operands: no host-to-device copy
        vector[SLOT_TOKENS] += host_tokens
        vector[SLOT_NEGATIVE] += host_negative
    return vector


def _stacked_counts(counts: list[torch.Tensor]) -> torch.Tensor:
    """The step's one-element counts in one op (counts of several shapes, () beside (1,), one by
    one; uint16-64, which few torch ops take, widened to int64)."""
    try:
        stacked = torch.stack(counts)
    except RuntimeError:  # counts of several shapes, or dtypes that do not promote to one
        return torch.stack([count.reshape(()).to(torch.int64) for count in counts])
    return stacked if stacked.dtype in _NATIVE_INTEGER_DTYPES else stacked.to(torch.int64)


def _nonfinite_microbatches(losses: list[torch.Tensor]) -> torch.Tensor:
    """How many micro-batches' losses hold an inf or nan: ``x - x`` is nan exactly there and 0
    elsewhere, so it is ``count_nonzero(x - x)`` (losses of several elements or shapes, which
    Megatron does not make, take a few more ops)."""
    try:
        stacked = torch.stack(losses)
    except RuntimeError:
        return torch.stack([(loss - loss).isnan().any() for loss in losses]).sum()
    difference = stacked - stacked
    if difference.numel() == len(losses):
        return torch.count_nonzero(difference)
    return difference.isnan().reshape(len(losses), -1).any(dim=1).sum()


def _require_three_tuple(outputs: Any, index: int) -> None:
    if isinstance(outputs, (tuple, list)) and len(outputs) == 3:
        return
    got = (
        f"a {len(outputs)}-tuple" if isinstance(outputs, (tuple, list)) else type(outputs).__name__
    )
    raise LossContractError(
        f"the loss function returned {got} at micro-batch {index}; token mode needs (summed "
        "loss, num_tokens, report). With a 2-tuple (loss, report) Megatron multiplies the loss "
        "by the CP size and never divides by a token count, so gradients come out summed "
        "over DP x CP instead of averaged. Return "
        "megatron_ga_ext.integration.loss_contract.masked_loss(losses, loss_mask)."
    )


#: Integer dtypes every torch op takes (sums of them are int64).
_NATIVE_INTEGER_DTYPES = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
#: Integer dtypes a token count may have (bool and floating or complex counts are refused).
_INTEGER_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
)


def _require_integer_scalar(num_tokens: Any) -> None:
    """One count per micro-batch, an integer: a Python int, or a one-element tensor of an integer
    dtype (its dtype and size are host metadata)."""
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.dtype in _INTEGER_DTYPES and num_tokens.numel() == 1:
            return
        raise LossContractError(
            f"the loss function returned num_tokens as a tensor of dtype {num_tokens.dtype} and "
            "shape "
            f"{tuple(num_tokens.shape)}; it must be an integer scalar (one count of non-padding "
            "tokens per micro-batch; a float count is inexact above 2^24 in float32). Use "
            "loss_mask.sum().to(torch.int64)."
        )
    if isinstance(num_tokens, int) and not isinstance(num_tokens, bool):
        return
    raise LossContractError(
        f"the loss function returned num_tokens of type {type(num_tokens).__name__}; it must be "
        "an integer scalar tensor. Use loss_mask.sum().to(torch.int64)."
    )
