"""Whether upstream still does what each auxiliary-loss correction corrects: a factor measured once,
at the first step.

install() corrects three upstream defects in token mode (aux_losses.py): the router's token count
(#7452 finding 10), the per-token z-loss factor before 0.19, and MTP's local count ratio (#7452
finding 3). Open upstream pull requests would fix them (Megatron-LM #7481 the router's count; #7498,
#7570 MTP's counts; #7213 / #7214 global_aux_loss's), and a correction laid over a fixed upstream
corrects twice. The fingerprints (compat.TARGETS, with the router and MTP functions whose arithmetic
the corrections assume) refuse a changed source in strict mode; these checks hold with
``--no-ga-strict`` too. Each measures, at its correction's first call, the factor upstream applies
and compares it with the defect's, as the finalize reads the factor DDP baked into its buffers:

* the router's count (:class:`RouterCountCheck`): upstream's count function on a probe routing map;
* the z-loss before 0.19 (:class:`ZLossFactorCheck`): the attachment the router makes right after
  ``z_loss_func``;
* MTP (:class:`~megatron_ga_ext.integration.mtp_ratio_check.MTPRatioCheck`, its own module):
  upstream's ``process_mtp_loss`` on a probe batch.

A correction applies where the measurement shows the defect it corrects, where nothing it could show
would change what the correction returns, and where upstream changed to something else but the
correction replaces upstream's value instead of scaling it (the router's count, MTP's attachment),
so that it cannot correct twice (said once, in an info line). Where upstream already gives what the
correction would, or does arithmetic none of them expects, the correction steps aside (upstream's
own result stands) and says so once, on rank 0, in a warning. A check costs one host read (and at
most two small collectives the ranks of its group make together) at its first call, nothing per
micro-batch after.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from megatron_ga_ext.integration.compat import ROUTER
from megatron_ga_ext.logs import get_logger

__all__ = [
    "APPLIES",
    "RouterCountCheck",
    "ZLossFactorCheck",
    "host_values",
    "nonzero_total",
]

logger = get_logger(__name__)

DEFECT = "defect"
"""Upstream still does what the correction corrects."""
NO_EVIDENCE = "no evidence"
"""The defect cannot show here (nothing is reduced); the correction then returns upstream's value
anyway."""
CHANGED = "changed"
"""Upstream changed (the router's count is this rank's own, #7481; MTP's ratio is not), not to what
the correction gives; the correction replaces upstream's value (never scales it), so it applies
without correcting twice."""
FIXED = "fixed"
"""Upstream already gives what the correction would."""
UNKNOWN = "unknown"
"""Neither the defect nor the fix: arithmetic no correction was written for."""

#: The verdicts under which a correction applies; under any other it steps aside.
APPLIES = (DEFECT, NO_EVIDENCE, CHANGED)


def host_values(*values: Any) -> list[float]:
    """The values as floats, in one device-to-host read."""
    tensors = [torch.as_tensor(v, dtype=torch.float64) for v in values]
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    floats: list[float] = torch.stack([t.to(device) for t in tensors]).tolist()
    return floats


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-9)


class RouterCountCheck:
    """Whether ``moe_utils.get_tokens_per_expert_and_token_count`` still reads its local count back
    after the in-place all-reduce of the per-expert counts (#7452 finding 10), measured once per
    reduce group: at the first call with a padding mask, every rank of the group runs a probe
    routing map through upstream's function (its count l, its total) and through the correction (its
    count c), one all-reduce each and one host read. Group rank 0 routes 1 token, every other rank
    2, so this rank's own count t is 1 or 2 and the group's T = 2g - 1 for a group of g:

        l = T                the defect: the correction applies
        l = c                upstream gives the router the count the correction would: it steps aside
        l = t                a local count (#7481's fix): the router's TP x CP times it is exact only where the shards
                             hold equal counts; the correction, which replaces the count and never
                             scales it, applies
        g = 1                no evidence: the correction applies (it returns upstream's count there)
        else, or total != T  unknown: it steps aside
    """

    def __init__(self) -> None:
        self.verdicts: dict[int, str] = {}
        self.probing = False

    def steps_aside(
        self,
        corrected_counts: Callable,
        original: Callable,
        routing_map: torch.Tensor,
        reduce_group: Any,
        topk: int | None,
    ) -> bool:
        """True where upstream's own counts stand for ``reduce_group``. ``corrected_counts`` is the
        correction (run again on the probe, where this returns False), ``original`` upstream's
        function."""
        if self.probing:
            return False
        key = id(
            reduce_group
        )  # a reduce group lives as long as the model-parallel state, beyond one installation
        if key not in self.verdicts:
            self.verdicts[key] = self._measure(
                corrected_counts, original, routing_map, reduce_group, topk
            )
        return self.verdicts[key] not in APPLIES

    def _measure(
        self,
        corrected_counts: Callable,
        original: Callable,
        routing_map: torch.Tensor,
        reduce_group: Any,
        topk: int | None,
    ) -> str:
        size = reduce_group.size()
        if size == 1:
            return NO_EVIDENCE
        own = 1 if torch.distributed.get_rank(reduce_group) == 0 else 2
        probe = torch.zeros(
            own, routing_map.shape[1], dtype=routing_map.dtype, device=routing_map.device
        )
        probe[:, :topk] = 1
        _, upstream, total = original(probe, reduce_group, topk, True)
        self.probing = True
        try:
            _, corrected, _ = corrected_counts(probe, reduce_group, topk, True)
        finally:
            self.probing = False
        upstream, total, corrected = host_values(upstream, total, corrected)
        group_total = 2 * size - 1
        verdict = _count_verdict(upstream, total, corrected, own, group_total)
        _say_count(verdict, upstream, corrected, own, group_total, size)
        return verdict


def _count_verdict(
    upstream: float, total: float, corrected: float, own: int, group_total: int
) -> str:
    if not _close(total, group_total):
        return UNKNOWN
    if _close(upstream, group_total):
        return DEFECT
    if _close(upstream, corrected):
        return FIXED
    return CHANGED if _close(upstream, own) else UNKNOWN


def nonzero_total(counts: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """Upstream's (tokens per expert, local count, total) where the router-count correction steps
    aside, its total of 0 made 1 (a separate defect: upstream divides the load-balancing loss by its
    square, NaN without loss tokens)."""
    tokens_per_expert, local, total = counts
    return tokens_per_expert, local, total.masked_fill(total == 0, 1)


def _say_count(
    verdict: str, upstream: float, corrected: float, own: int, group_total: int, size: int
) -> None:
    probe = (
        f"on a probe where this rank routes {own} token(s) and its reduce group of {size} ranks "
        f"{group_total}, upstream's get_tokens_per_expert_and_token_count returns the "
        f"local count {upstream:g}"
    )
    if verdict == DEFECT:
        logger.debug(
            "megatron-ga-ext: %s, the group's (#7452 finding 10): the router's count is corrected",
            probe,
        )
    elif verdict == CHANGED:
        logger.info(
            "megatron-ga-ext: %s, this rank's own (Megatron-LM #7481): the router scales it by "
            "TP x CP, exact only where the TP and CP shards hold equal numbers of loss "
            "tokens, so install() still gives the router the unit's count (%g here), in "
            "place of upstream's, never on top of it",
            probe,
            corrected,
        )
    elif verdict == FIXED:
        logger.warning(
            "megatron-ga-ext: %s, the count install() would give the router: upstream is fixed "
            "here, and the router-count correction steps aside (upstream's counts stand)",
            probe,
        )
    else:
        logger.warning(
            "megatron-ga-ext: %s, neither the group's (the defect install() corrects, %d), this "
            "rank's (%d) nor the corrected count (%g): the router-count correction steps "
            "aside so as not to correct twice; upstream's counts stand. Check the MoE "
            "auxiliary gradients (megatron-ga verify)",
            probe,
            group_total,
            own,
            corrected,
        )


class ZLossFactorCheck:
    """Whether the router still attaches the per-token z-loss without the |TP x CP| factor (releases
    before 0.19; #5047 added it), measured at the first call of the z-loss correction from the
    attachment the router makes right after ``z_loss_func`` returns (the router module's
    ``MoEAuxLossAutoScaler.apply``, stood in for once):

        phi = attached / (z x valid tokens)     1: the defect, the correction applies
                                                |TP x CP|: the router scales it already; the correction steps aside,
                                                from this attachment on
                                                else: unknown, it steps aside

    One host read. Without a valid token (z = 0) phi tells nothing: it is measured again at the next
    call."""

    def __init__(self) -> None:
        self.verdict: str | None = None
        self.pending: _ZAttachment | None = None

    def z_loss(
        self,
        z_loss: torch.Tensor,
        corrected: torch.Tensor,
        factor: int,
        args: tuple,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """What the correction returns to the router: ``corrected`` (|TP x CP| times the gradient of
        ``z_loss``, the same value) while the defect is measured or being measured, upstream's
        ``z_loss`` once it is gone."""
        if self.verdict is not None:
            return corrected if self.verdict in APPLIES else z_loss
        if (
            self.pending is not None
        ):  # the last call's attachment never reached MoEAuxLossAutoScaler.apply
            self.pending.restore()
            self.decide(float("nan"), factor, measured=False)
            return z_loss
        self.pending = _ZAttachment(
            self, sys.modules[ROUTER], z_loss, corrected, _valid_tokens(args, kwargs), factor
        )
        return corrected

    def decide(self, phi: float, factor: int, *, measured: bool = True) -> str | None:
        """The verdict for the measured ``phi`` (None: nothing measurable, ask again)."""
        self.pending = None
        if measured and not math.isfinite(phi):
            return None
        self.verdict = DEFECT if _close(phi, 1.0) else FIXED if _close(phi, factor) else UNKNOWN
        _say_z(self.verdict, phi, factor, measured)
        return self.verdict


def _valid_tokens(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The tokens ``z_loss_func(logits, coeff, padding_mask=None)`` averages over (the router
    multiplies by them): the positions its padding mask (True: padding) leaves, or every row of the
    logits."""
    logits = args[0] if args else kwargs["logits"]
    padding_mask = (
        kwargs["padding_mask"] if "padding_mask" in kwargs else args[2] if len(args) > 2 else None
    )
    return logits.shape[0] if padding_mask is None else (~padding_mask).sum()


def _say_z(verdict: str, phi: float, factor: int, measured: bool) -> None:
    found = (
        f"the router attached its z-loss at {phi:.4g} x z x its valid tokens, where TP x CP = "
        f"{factor}"
        if measured
        else "the router attached its z-loss without MoEAuxLossAutoScaler.apply"
    )
    if verdict == DEFECT:
        logger.debug(
            "megatron-ga-ext: %s (before 0.19, no TP x CP factor): the z-loss gradient is scaled",
            found,
        )
    elif verdict == FIXED:
        logger.warning(
            "megatron-ga-ext: %s: the router applies the TP x CP factor itself (as 0.19 does), "
            "and the z-loss correction steps aside (upstream's z-loss stands)",
            found,
        )
    else:
        logger.warning(
            "megatron-ga-ext: %s, neither 1 (the defect install() corrects) nor TP x CP: the "
            "z-loss correction steps aside so as not to correct twice; upstream's z-loss "
            "stands. Check the MoE auxiliary gradients (megatron-ga verify)",
            found,
        )


class _ZAttachment:
    """Stands once in the router module for ``MoEAuxLossAutoScaler``: the z-loss attachment that
    follows the first ``z_loss_func`` call is measured, then passed on (uncorrected where the
    correction steps aside)."""

    def __init__(
        self,
        check: ZLossFactorCheck,
        module: Any,
        z_loss: torch.Tensor,
        corrected: torch.Tensor,
        tokens: Any,
        factor: int,
    ) -> None:
        self.module, self.autoscaler = module, module.MoEAuxLossAutoScaler
        self.check, self.z_loss, self.corrected, self.tokens, self.factor = (
            check,
            z_loss,
            corrected,
            tokens,
            factor,
        )
        module.MoEAuxLossAutoScaler = self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["autoscaler"], name)

    def restore(self) -> None:
        if self.module.MoEAuxLossAutoScaler is self:
            self.module.MoEAuxLossAutoScaler = self.autoscaler

    def apply(self, activation: torch.Tensor, attached: torch.Tensor) -> Any:
        self.restore()
        (phi,) = host_values((attached / (self.corrected * self.tokens)).detach())
        if self.check.decide(phi, self.factor) in (None, *APPLIES):
            return self.autoscaler.apply(activation, attached)
        # attached = corrected x c, c = tokens x phi: the same c on upstream's z-loss
        return self.autoscaler.apply(activation, self.z_loss * (attached / self.corrected).detach())
