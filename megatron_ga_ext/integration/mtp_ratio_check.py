"""MTP's local count ratio (#7452 finding 3): whether upstream's ``process_mtp_loss`` still weighs
depth k's MTP loss by this rank's own n_u / m_u, measured once on a probe batch at the first call of
the correction (aux_losses.global_count_mtp_loss).

One of the first-step factor checks (upstream_factors.py holds the verdicts and the router's and
z-loss's checks); it speaks through their logger, so one logger says what every check found.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from megatron_ga_ext.integration.mtp_interception import MTPInterception
from megatron_ga_ext.integration.upstream_factors import (
    APPLIES,
    CHANGED,
    DEFECT,
    FIXED,
    NO_EVIDENCE,
    UNKNOWN,
    host_values,
    logger,
)

__all__ = ["MTPRatioCheck"]


class MTPRatioCheck:
    """Whether ``process_mtp_loss`` (0.17+) still weighs depth k's MTP loss by this rank's own n_u /
    m_u (#7452 finding 3), measured once: at the first call, upstream's function runs on a probe
    batch (one sequence of 2 (D + 4) positions, D the MTP depth, whose loss mask holds its first n =
    D + 2 positions on rank 0 of the DP x CP group and D + 3 on every other rank; a per-token loss
    of 1; the call's CP group; ``is_training`` False, so nothing is logged), and each depth's
    attachment is compared with the count its ``roll_tensor`` returned, m_k:

        attached_k = alpha x m_k x n / m_k      the defect: the correction applies
        attached_k = alpha x m_k                the sum, every MTP token at alpha / N already: it steps aside
        another ratio                           of counts reduced over more ranks (#7498, #7570 would), or other:
                                                the correction applies, since it attaches the sum it
                                                builds from the per-token losses in place of
                                                upstream's product, never on top of it
        not one attachment per depth            unknown arithmetic: it steps aside

    alpha = mtp_loss_scaling_factor / D. The ranks agree: one all-reduce (a sum over DP x CP) of the
    ranks whose probe attached otherwise than once per depth, whose attachments are not the sum, not
    the defect, and where some m_k != n (the sum and the defect differ only there); one host read.
    Upstream sums only where every rank sees the sum and one at least could tell it from the
    defect."""

    def __init__(self) -> None:
        self.verdict: str | None = None

    def steps_aside(self, original: Callable, given: dict[str, Any]) -> bool:
        """True where upstream's MTP weighting stands (``given``: the call's bound arguments)."""
        if self.verdict is None:
            self.verdict = self._measure(original, given)
        return self.verdict not in APPLIES

    def _measure(self, original: Callable, given: dict[str, Any]) -> str:
        config = given["config"]
        depth = config.mtp_num_layers
        alpha = config.mtp_loss_scaling_factor / depth
        if alpha == 0:
            return NO_EVIDENCE
        group = _data_context_parallel_group()
        first = group is None or torch.distributed.get_rank(group) == 0
        tokens = depth + (2 if first else 3)
        attached = _probe_mtp(original, given, tokens, 2 * (depth + 4))
        flags, ratio, local = _mtp_flags(attached, alpha, tokens, depth, given["labels"].device)
        if group is not None and group.size() > 1:
            torch.distributed.all_reduce(flags, group=group)
        unattached, not_sum, not_defect, telling, ratio, local = host_values(*flags, ratio, local)
        verdict = (
            UNKNOWN
            if unattached
            else FIXED
            if not not_sum and telling
            else DEFECT
            if not not_defect
            else CHANGED
        )
        _say_mtp(verdict, ratio, local)
        return verdict


def _data_context_parallel_group() -> Any:
    """megatron's DP x CP group, or None where it is not initialized (a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from megatron.core import parallel_state

    try:
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    except (AssertionError, RuntimeError):
        return None


def _probe_mtp(
    original: Callable, given: dict[str, Any], tokens: int, positions: int
) -> list[tuple[Any, Any]]:
    """Upstream's ``process_mtp_loss`` on the probe batch: (attached loss summed, the rolled count)
    per depth."""
    config = given["config"]
    depth = config.mtp_num_layers
    device = given["labels"].device
    loss_mask = torch.zeros(1, positions, device=device)
    loss_mask[:, :tokens] = 1
    arguments = {
        "hidden_states": torch.zeros(1 + depth, 1, 1, device=device),
        "labels": torch.zeros(1, positions, dtype=torch.long, device=device),
        "loss_mask": loss_mask,
        "output_layer": _probe_output_layer,
        "output_weight": torch.zeros(1, device=device),
        "runtime_gather_output": None,
        "is_training": False,
        "compute_language_model_loss": _unit_token_loss,
        "config": config,
        "cp_group": given.get("cp_group"),
        "tp_group": given.get("tp_group"),
    }
    parameters = inspect.signature(original).parameters
    capture = _MTPCapture(sys.modules[original.__module__])
    with capture.in_module():
        original(**{name: value for name, value in arguments.items() if name in parameters})
    return capture.attached


def _mtp_flags(
    attached: list[tuple[Any, Any]], alpha: float, tokens: int, depth: int, device: torch.device
) -> tuple[torch.Tensor, Any, Any]:
    """This rank's [attached otherwise than once per depth, not the sum at every depth, not the
    defect at every depth, some m_k != n] (int64, on the device), its first depth's ratio attached /
    (alpha m_1) and its own n / m_1."""
    if len(attached) != depth:  # upstream attached its MTP loss some other way
        return torch.tensor([1, 1, 1, 0], device=device), float("nan"), float("nan")
    totals = torch.stack([torch.as_tensor(total, dtype=torch.float64) for total, _ in attached])
    rolled = torch.stack([torch.as_tensor(count, dtype=torch.float64) for _, count in attached]).to(
        totals.device
    )
    as_sum = alpha * rolled
    as_defect = (rolled > 0).to(totals.dtype) * (alpha * tokens)  # alpha m_k n / max(m_k, 1)
    flags = torch.stack(
        [
            torch.zeros((), dtype=torch.bool, device=totals.device),
            ~torch.isclose(totals, as_sum, rtol=1e-5, atol=1e-9).all(),
            ~torch.isclose(totals, as_defect, rtol=1e-5, atol=1e-9).all(),
            (rolled != tokens).any(),
        ]
    )
    return flags.to(torch.int64), totals[0] / as_sum[0], tokens / rolled[0].clamp(min=1)


def _say_mtp(verdict: str, ratio: float, local: float) -> None:
    found = (
        f"on a probe, upstream's process_mtp_loss attached {ratio:.4g} x the summed MTP loss "
        "where this rank's "
        f"own ratio n_u / m_u is {local:.4g}"
    )
    if verdict == DEFECT:
        logger.debug(
            "megatron-ga-ext: %s (#7452 finding 3): every MTP token is weighed alpha / N instead",
            found,
        )
    elif verdict == CHANGED:
        logger.info(
            "megatron-ga-ext: %s: upstream no longer weighs by this rank's own counts (a ratio "
            "of counts over more ranks, as Megatron-LM #7498 / #7570 would, or other), "
            "and install() still attaches alpha x the summed MTP loss in place of "
            "upstream's product (every MTP token alpha / N), never on top of it",
            found,
        )
    elif verdict == FIXED:
        logger.warning(
            "megatron-ga-ext: %s: upstream attaches the sum already (every MTP token alpha / N), "
            "and the MTP correction steps aside (upstream's MTP loss stands)",
            found,
        )
    else:
        logger.warning(
            "megatron-ga-ext: on a probe, upstream's process_mtp_loss did not attach one MTP "
            "loss per depth through MTPLossAutoScaler: the MTP correction steps aside so "
            "as not to correct twice; upstream's MTP weighting stands. Check the MTP "
            "gradients (megatron-ga verify)"
        )


def _probe_output_layer(hidden_states: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
    return hidden_states, None


def _unit_token_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return torch.ones(labels.shape, device=labels.device)


class _MTPCapture(MTPInterception):
    """Stands, during the probe, for the MTP module's ``roll_tensor`` (the count each roll returns)
    and ``MTPLossAutoScaler`` (each attachment, with the count of the roll before it: the loss
    mask's)."""

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        self.attached: list[tuple[Any, Any]] = []

    def apply(self, hidden_states: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        self.attached.append((mtp_loss.detach().sum(), self.rolled_num_tokens))
        return hidden_states
