"""A ``finalize_model_grads`` wrapper that divides by the global token count, checked, in int64.

In mode ``token`` the wrapper replaces upstream's last step (broadcast the count from the last PP
stage, all-reduce it over DP x CP, divide the gradients by it) with the same two collectives on a
small int64 vector that also carries the loss contract's violation flags:

    v = [n, negative, nonfinite, unchecked]          on every last PP stage (LossContract.collect)
    v = broadcast(v, src = last PP stage)            so every stage divides by the same count
    v = all_reduce_sum(v, DP x CP)                   N = sum_{m,r,c} n(m,r,c), summed, never averaged
    features' finalize(Finalizing(model, N, ...))    the reduced gradient, N on the device (features/)
    grad = grad * (1 / max(N, 1))                    after upstream's finalize ran with num_tokens=None; a
                                                     device scalar, as upstream scales (division.py)

``v`` is read back once per step, never per micro-batch (``--ga-checks sync``, the default: a broken
step raises before its optimizer step). With ``--ga-checks async`` finalize reads nothing: ``v`` is
copied to pinned host memory without blocking and read after the optimizer step (whose own grad-norm
read has synced the stream by then) or at the start of the next step, whichever finds the copy done
first; a broken step raises there, naming the step. Either way the step's verdict (N, skip, a
deferred non-finite loss) is a :class:`Finalized` value handed to the installation with the
features' :class:`Finalizing`, which carries it to the optimizer step. Mode ``microbatch`` calls
upstream unchanged after checking that the per-token flag is off, then the features' finalize.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.errors import LossContractError
from megatron_ga_ext.integration.chunk_checks import (
    CheckedChunks,
    check_ddp_chunks,
    check_per_token_flag,
)
from megatron_ga_ext.integration.division import scale_gradients
from megatron_ga_ext.integration.features import Deferred, Finalized, Finalizing
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.integration.loss_contract import SLOT_TOKENS, LossContract, StepChecks
from megatron_ga_ext.integration.step_verdict import (
    PendingChecks,
    megatron_judges_nonfinite,
    prefixed,
    raise_on_violations,
)
from megatron_ga_ext.integration.violations import observed
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed import ProcessGroup

#: Upstream's ``finalize_model_grads(model, num_tokens=None, pg_collection=None,
#: force_all_reduce=False)``.
FinalizeFunction = Callable[..., None]

__all__ = [
    "FinalizeModelGrads",
    "make_finalize_model_grads",
]

logger = get_logger(__name__)


class _Topology(NamedTuple):
    """Where the step's count comes from and goes: the groups upstream's finalize reduces it over,
    and the last pipeline stage (the only one that sees the loss)."""

    pp_group: ProcessGroup
    dp_cp_group: ProcessGroup
    last_stage_rank: int
    """The last pipeline stage's global rank, the broadcast's source."""
    is_last_stage: bool


class FinalizeModelGrads:
    """Drop-in ``config.finalize_model_grads_func``; see the module docstring for the arithmetic.

    Each call hands the features a :class:`Finalizing` value (the model, N on the device, where the
    rank stands) and its verdict on the step as a :class:`Finalized` value, through
    :meth:`Reads.finalized`; nothing of the step is left here for another object to read. What
    crosses calls by nature stays private: under ``--ga-checks async`` the copy on its way to the
    host, and a non-finite loss left to Megatron's rerun state machine until a finite re-run clears
    it or the optimizer step stops it (:meth:`check_deferred`).

    Attributes: active: False after uninstall(): a config that still holds it gets upstream's
        finalize unchanged.
    """

    def __init__(
        self,
        original: FinalizeFunction,
        contract: LossContract | None = None,
        config: GAConfig | None = None,
        *,
        reads: Reads | None = None,
    ) -> None:
        self.reads: Reads = reads if reads is not None else _Given(config or GAConfig(), contract)
        """Where the config and the loss contract are read, and the step's values go: the
        installation (whose features change with its config), or those given."""
        if reads is None and self.config.loss_reduction == "token" and contract is None:
            raise LossContractError(
                "reduction mode 'token' needs a LossContract to read counts from."
            )
        # upstream's __module__, __name__ and __qualname__: Bridge writes its config (holding a
        # partial of this) as YAML beside each checkpoint, and names a function's target by them
        functools.update_wrapper(self, original, updated=())
        self.original = original
        self.active = True
        self._calls = 0
        """Calls so far: the step an async verdict names."""
        self._pending: PendingChecks | None = None
        self._deferred: Deferred | None = None
        self._checked: CheckedChunks | None = None
        self._topology: _Topology | None = None

    def __call__(
        self,
        model: list[torch.nn.Module],
        num_tokens: torch.Tensor | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        force_all_reduce: bool | None = False,
    ) -> None:
        if not self.active:
            self.original(
                model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce
            )
            return
        self._calls += 1
        checked = self._checked_chunks(model)
        mode = self.config.loss_reduction
        check_per_token_flag(checked.model_config, mode)
        if mode == "microbatch":
            self.original(
                model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce
            )
            self.reads.finalized(Finalizing(model, mode), Finalized())
            return
        earlier = self.poll(
            wait=True
        )  # an earlier step's verdict not yet read (no schedule call in between)
        topology = self._topology_of(pg_collection)
        contract = self.contract
        if (
            contract is None
        ):  # token mode has one: the constructor and the installation's configure keep it so
            raise LossContractError(
                "reduction mode 'token' needs a LossContract to read counts from."
            )
        # before the grads' sync: no collective
        vector = contract.collect(checked.device, is_last_stage=topology.is_last_stage)
        self.original(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        # where upstream reduces its count: after the grads, on every stage
        torch.distributed.broadcast(vector, src=topology.last_stage_rank, group=topology.pp_group)
        # b_r, copied before the sum only where a feature reads this replica's gradient (noise scale)
        replica_tokens = vector[SLOT_TOKENS].clone() if self.reads.wants_replica_tokens() else None
        torch.distributed.all_reduce(vector, group=topology.dp_cp_group)
        tokens = vector[SLOT_TOKENS]
        iteration = current_host().iteration()
        verdict = self._verdict(vector, iteration)
        step = Finalizing(
            model, mode, tokens, replica_tokens, topology.is_last_stage, iteration=iteration
        )
        self.reads.finalized(step, verdict if earlier is None else earlier.then(verdict))
        # a device scalar, upstream's 1.0 / clamp(N, min=1) to the bit (torch computes x / t as
        # t.reciprocal() * x)
        scaling = 0.0 if verdict.skip else torch.clamp(tokens, min=1).reciprocal()
        for chunk in model:  # torch FSDP2: the local shards, while upstream's is a no-op
            scale_gradients(chunk, scaling)

    def _verdict(self, vector: torch.Tensor, iteration: int | None) -> Finalized:
        """The step's verdict: under ``--ga-checks sync`` its one device-to-host read, checked (a
        broken step raises here); under async a copy on its way (:meth:`poll`), nothing known
        yet."""
        if self.config.checks == "async":
            self._pending = PendingChecks.of(vector, self._calls, iteration)
            return Finalized()
        checks = self._judged(StepChecks(*vector.tolist()), iteration)
        with observed(
            self.config, "step token checks"
        ):  # --ga-on-violation log: logged, counted, trained on
            raise_on_violations(checks)
        skip = (
            not checks.tokens and self._zero_tokens()
        )  # --ga-zero-token-policy skip: a zero gradient
        return Finalized(checks.tokens, skip, self._deferred)

    @property
    def config(self) -> GAConfig:
        return self.reads.config

    @property
    def contract(self) -> LossContract | None:
        return self.reads.contract

    def poll(self, *, wait: bool = False) -> Finalized | None:
        """``--ga-checks async``: read the pending checks if their copy is done (or ``wait``), raise
        if the step they belong to broke the contract, and return its verdict; None where there is
        none to read yet."""
        pending = self._pending
        if pending is None or not (wait or pending.ready()):
            return None
        self._pending = None
        checks = self._judged(pending.checks(), pending.iteration)
        if checks.negative or checks.nonfinite or checks.unchecked or not checks.tokens:
            where = f"--ga-checks async, verdict of training step {pending.step}" + (
                f" (iteration {pending.iteration})" if pending.iteration is not None else ""
            )
            with observed(self.config, "step token checks"):
                raise_on_violations(checks, where=where)
            if checks.tokens:  # --ga-on-violation log: a violation logged, the step trained on
                return Finalized(checks.tokens, False, self._deferred)
            return Finalized(0, self._zero_tokens(where), self._deferred)
        return Finalized(checks.tokens, False, self._deferred)

    def _judged(self, checks: StepChecks, iteration: int | None) -> StepChecks:
        """A non-finite loss is Megatron's to judge where its rerun state machine checks the loss
        (:func:`megatron_judges_nonfinite`): it is kept (deferred) and left out of the checks, once
        the contract's own violations (unchecked ranks, negative counts) are clear. A step that is
        finite clears it: Megatron re-ran the iteration and its loss came out finite this time."""
        if self._deferred is not None and self._deferred.iteration != iteration:
            # an earlier iteration's, read late (--ga-checks async): it reached the optimizer
            self.check_deferred()
        if (
            not checks.nonfinite
            or checks.unchecked
            or checks.negative
            or not megatron_judges_nonfinite()
        ):
            self._deferred = None
            return checks
        if self._deferred is None:
            logger.warning(
                "megatron-ga-ext: %d micro-batch(es) of iteration %s returned a non-finite loss; "
                "Megatron's rerun state machine checks the loss (--rerun-mode %s, "
                "--check-for-nan-in-loss-and-grad), so the extension defers to it (it "
                "re-runs the iteration to tell a transient fault from a reproducible "
                "one) and reports what it decides. A non-finite step that reaches the "
                "optimizer step anyway stops there.",
                checks.nonfinite,
                iteration,
                current_host().settings().rerun_mode,
            )
        self._deferred = Deferred(iteration, checks.nonfinite)
        return checks._replace(nonfinite=0)

    def check_deferred(self) -> Finalized | None:
        """At the optimizer step: a non-finite loss deferred to Megatron that reached the step
        (Megatron does not validate the first iteration, nor a loss function that does not call its
        validate_result) stops here.

        Under ``--ga-checks async`` the verdict of Megatron's re-run of that iteration may still be
        on its way to the host: it is read first (waiting for its copy, and returned), so a re-run
        that came out finite clears the deferral instead of the first run's verdict stopping a step
        Megatron judged sound."""
        late = (
            self.poll(wait=True)
            if self._deferred is not None and self._pending is not None
            else None
        )
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return late
        raise LossContractError(
            f"iteration {deferred.iteration}: {deferred.nonfinite} micro-batch(es) returned a "
            "non-finite loss (inf or nan) and Megatron's rerun state machine let the step reach "
            "the optimizer (it does not validate the first iteration, nor a loss "
            "function that does not call its validate_result); the token-weighted "
            "gradient "
            f"would be non-finite. Check the data, the loss function and the learning rate."
        )

    def _topology_of(self, pg_collection: ProcessGroupCollection | None) -> _Topology:
        """The step's :class:`_Topology`: the ranks looked up again only when the groups are not the
        last step's (upstream's schedule builds a new pg_collection per step from the same groups; a
        group's ranks never change)."""
        pp_group, dp_cp_group = _groups(pg_collection)
        topology = self._topology
        if (
            topology is None
            or topology.pp_group is not pp_group
            or topology.dp_cp_group is not dp_cp_group
        ):
            last_stage_rank = torch.distributed.get_process_group_ranks(pp_group)[-1]
            topology = self._topology = _Topology(
                pp_group,
                dp_cp_group,
                last_stage_rank,
                torch.distributed.get_rank() == last_stage_rank,
            )
        return topology

    def _checked_chunks(self, model: list[torch.nn.Module]) -> CheckedChunks:
        """The step's model chunks, their config and device, and in token mode
        :func:`check_ddp_chunks` on them: once per list of chunks and mode (a wrapper fixes its
        gradient factor when it is built; ``parameters()`` walks every submodule). The per-token
        flag is read from that config every step."""
        mode = self.config.loss_reduction
        if self._checked is None or not self._checked.are(model, mode):
            from megatron.core.utils import get_model_config

            config = get_model_config(model[0])
            check_per_token_flag(
                config, mode
            )  # the rule a launch breaks, before what follows from it
            device = None
            if mode == "token":
                check_ddp_chunks(model)
                device = next(model[0].parameters()).device
            self._checked = CheckedChunks(
                [weakref.ref(chunk) for chunk in model], mode, config, device
            )
        return self._checked

    def _zero_tokens(self, where: str = "") -> bool:
        """A step of 0 loss tokens: raises under ``--ga-zero-token-policy error``; True (skip) under
        ``skip``."""
        message = (
            prefixed(where)
            + "the global batch has 0 non-padding tokens (the sum of num_tokens over "
            "micro-batches and DP x CP ranks); there is nothing to average."
        )
        if self.config.zero_token_policy == "error":
            raise LossContractError(
                message
                + " Check the loss mask and the data, or choose --ga-zero-token-policy skip to "
                "skip "
                "the optimizer step and go on."
            )
        warnings.warn(
            message
            + " Skipping this optimizer step (--ga-zero-token-policy skip): the gradient is "
            "zeroed and Megatron's optimizer does not step, so Adam's moments and weight decay "
            "do not "
            "move either; Megatron counts a skipped iteration.",
            RuntimeWarning,
            stacklevel=3,
        )
        return True


class Reads(Protocol):
    """What finalize reads, by reference, and where its values go (installation.Installation)."""

    @property
    def config(self) -> GAConfig: ...

    @property
    def contract(self) -> LossContract | None: ...

    def finalized(self, step: Finalizing, verdict: Finalized) -> None:
        """The features' finalize phase on ``step``; ``verdict`` kept for the optimizer step."""
        ...

    def wants_replica_tokens(self) -> bool:
        """A feature reads b_r, this replica's count before the DP x CP sum
        (Feature.reads_replica_tokens)."""
        ...


@dataclass
class _Given:
    """A config and a contract given outright (verify's harness, the tests): no features; the last
    verdict kept for whoever called finalize by hand."""

    config: GAConfig
    contract: LossContract | None
    verdict: Finalized | None = None

    def finalized(self, step: Finalizing, verdict: Finalized) -> None:
        self.verdict = verdict

    def wants_replica_tokens(self) -> bool:
        return False


def make_finalize_model_grads(
    original: FinalizeFunction,
    contract: LossContract | None = None,
    *,
    config: GAConfig | None = None,
) -> FinalizeModelGrads:
    """Wrap upstream's ``finalize_model_grads`` (``original``) for the given reduction mode."""
    return FinalizeModelGrads(original, contract, config or GAConfig())


def _groups(pg_collection: ProcessGroupCollection | None) -> tuple[ProcessGroup, ProcessGroup]:
    """(pipeline group, DP x CP group), as upstream's finalize picks them."""
    if pg_collection is not None:
        # the groups set on it: upstream's getattr of an unset field goes through a __getattr__ that
        # lists every field
        dp_cp = getattr(pg_collection, "__dict__", {}).get("dp_cp_gtp_remat") or pg_collection.dp_cp
        return pg_collection.pp, dp_cp
    from megatron.core import parallel_state

    return (
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
