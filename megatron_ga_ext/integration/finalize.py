"""A ``finalize_model_grads`` wrapper that divides by the global token count, checked, in int64.

In mode ``token`` the wrapper replaces upstream's last step (broadcast the count from the last PP stage,
all-reduce it over DP x CP, divide the gradients by it) with the same two collectives on a small int64
vector that also carries the loss contract's violation flags:

    v = [n, negative, nonfinite, unchecked]          on every last PP stage (LossContract.collect)
    v = broadcast(v, src = last PP stage)            so every stage divides by the same count
    v = all_reduce_sum(v, DP x CP)                   N = sum_{m,r,c} n(m,r,c), summed, never averaged
    grad = grad * (1 / max(N, 1))                    after upstream's finalize ran with num_tokens=None; a
                                                     device scalar, as upstream scales

``v`` is read back once per step, never per micro-batch (``--ga-checks sync``, the default: a broken step
raises before its optimizer step). With ``--ga-checks async`` finalize reads nothing: ``v`` is copied to
pinned host memory without blocking and read after the optimizer step (whose own grad-norm read has synced
the stream by then) or at the start of the next step, whichever finds the copy done first; a broken step
raises there, naming the step. Mode ``microbatch`` calls upstream unchanged after checking that the
per-token flag is off.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.launch_rules import check_loss_mode
from megatron_ga_ext.errors import LossContractError
from megatron_ga_ext.integration.fsdp import check_units, scale_gradients
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.integration.liveness import check_one_finalize
from megatron_ga_ext.integration.loss_contract import SLOT_TOKENS, LossContract, StepChecks
from megatron_ga_ext.integration.noise_scale import NoiseScaleMeter
from megatron_ga_ext.integration.step_verdict import (
    Deferred,
    Verdict,
    megatron_judges_nonfinite,
    prefixed,
    raise_on_violations,
)
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.distributed import ProcessGroup

#: Upstream's ``finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False)``.
FinalizeFunction = Callable[..., None]

__all__ = [
    "FinalizeModelGrads",
    "check_ddp_chunks",
    "check_per_token_flag",
    "make_finalize_model_grads",
]

logger = get_logger(__name__)


def check_per_token_flag(config: TransformerConfig, mode: str) -> None:
    """options.check_loss_mode on a model config (its calculate_per_token_loss, as the step reads it)."""
    check_loss_mode(mode, bool(getattr(config, "calculate_per_token_loss", False)))


def check_ddp_chunks(model: Sequence[torch.nn.Module], config: TransformerConfig | None = None) -> None:
    """Every data-parallel wrapper must sum gradients over DP x CP, not average them.

    Megatron's DDP and Megatron-FSDP fix their pre-reduction gradient factor in ``__init__``: 1 (or none)
    with per-token loss, 1/(DP x CP) without. A chunk built before ``calculate_per_token_loss`` was set
    keeps 1/(DP x CP) and the finalize divides by the token count as well: gradients DP x CP times too
    small, silently. torch FSDP2 (``--use-torch-fsdp2``) has no such factor: its units are set to sum each
    step (fsdp.py). Plain modules (no wrapper) have no factor and pass. With ``config`` (the model's
    TransformerConfig) the per-token flag is checked as well.
    """
    if config is not None:
        check_per_token_flag(config, "token")
    for index, chunk in enumerate(model):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None:  # not a Megatron data-parallel wrapper
            continue
        if getattr(ddp_config, "average_in_collective", False):
            raise LossContractError(
                f"model chunk {index} was wrapped with DistributedDataParallelConfig("
                f"average_in_collective=True); per-token loss needs a summing collective. Build DDP "
                f"with average_in_collective=False (--no-average-in-collective is the default)."
            )
        for factor in _gradient_scaling_factors(chunk):
            if factor is not None and factor != 1.0:
                raise LossContractError(
                    f"model chunk {index} was wrapped in {type(chunk).__name__} with gradient_scaling_factor "
                    f"{factor:g} (= 1/{round(1 / factor)}), i.e. before calculate_per_token_loss was set; its "
                    f"gradients would end up {round(1 / factor)} times too small. Set "
                    f"config.calculate_per_token_loss=True before wrapping the model."
                )


def _gradient_scaling_factors(chunk: torch.nn.Module) -> list[float | None]:
    """The pre-reduction factors of a wrapper's gradient buffers: Megatron DDP keeps lists of buffers
    (``buffers``, ``expert_parallel_buffers``; ``nn.Module.buffers`` is a method, not such a list),
    Megatron-FSDP one ``param_and_grad_buffer`` with a dense and an expert factor."""
    buffers = [
        b
        for attr in ("buffers", "expert_parallel_buffers")
        if isinstance(getattr(chunk, attr, None), (list, tuple))
        for b in getattr(chunk, attr)
    ]
    factors = [getattr(b, "gradient_scaling_factor", None) for b in buffers]
    fsdp_buffer = getattr(chunk, "param_and_grad_buffer", None)
    if fsdp_buffer is not None and not buffers:
        factors += [
            getattr(fsdp_buffer, "gradient_scaling_factor", None),
            getattr(fsdp_buffer, "expert_gradient_scaling_factor", None),
        ]
    return factors


class _Topology(NamedTuple):
    """Where the step's count comes from and goes: the groups upstream's finalize reduces it over, and the last
    pipeline stage (the only one that sees the loss)."""

    pp_group: ProcessGroup
    dp_cp_group: ProcessGroup
    last_stage_rank: int
    """The last pipeline stage's global rank, the broadcast's source."""
    is_last_stage: bool


@dataclass(frozen=True)
class _CheckedChunks:
    """Model chunks that passed :func:`check_ddp_chunks` in ``mode``, their model config and their device."""

    chunks: list[weakref.ref[torch.nn.Module]]
    mode: str
    model_config: TransformerConfig
    device: torch.device | None
    """The chunks' device in token mode (where the step's vector is made); None in microbatch mode."""

    def are(self, model: list[torch.nn.Module], mode: str) -> bool:
        """The same chunks, checked in the same mode (``list ==`` compares identity first)."""
        return self.mode == mode and [ref() for ref in self.chunks] == model


class FinalizeModelGrads:
    """Drop-in ``config.finalize_model_grads_func``; see the module docstring for the arithmetic.

    Attributes:
        last_num_tokens: the global token count N of the last step (mode ``token``), else None.
        calls: how many times it ran (install() checks that every training step reached it).
        calls_at_step: ``calls`` at the last step of an optimizer install() hooked (or its building); None before
            there is one: without its steps the loop's steps are not seen, and calls per step are not counted.
        active: False after uninstall(): a config that still holds it gets upstream's finalize unchanged.
        skip_step: True after a step with 0 tokens under ``--ga-zero-token-policy skip``: the optimizer
            wrapper install() puts on Megatron's optimizer skips that step (and clears it).
        pending: under ``--ga-checks async``, the last step's verdict until :meth:`poll` reads it.
        deferred: a non-finite loss left to Megatron's rerun state machine (:meth:`_judged`), until a finite step
            or the optimizer step (:meth:`check_deferred`).
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
        """Where the config, the loss contract and the noise-scale meter are read, by reference: the installation
        (whose features change with its config), or those given."""
        if reads is None and self.config.loss_reduction == "token" and contract is None:
            raise LossContractError("reduction mode 'token' needs a LossContract to read counts from.")
        # upstream's __module__, __name__ and __qualname__: Bridge writes its config (holding a partial of this) as
        # YAML beside each checkpoint, and names a function's target by them
        functools.update_wrapper(self, original, updated=())
        self.original = original
        self.last_num_tokens: int | None = None
        self.calls = 0
        self.calls_at_step: int | None = None
        self.active = True
        self.skip_step = False
        self.pending: Verdict | None = None
        self.deferred: Deferred | None = None
        self.last_deferred: Deferred | None = None
        """The last deferral, until Megatron's decision on it is reported (:meth:`take_deferral`)."""
        self._checked: _CheckedChunks | None = None
        self._topology: _Topology | None = None

    def __call__(
        self,
        model: list[torch.nn.Module],
        num_tokens: torch.Tensor | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        force_all_reduce: bool | None = False,
    ) -> None:
        if not self.active:
            self.original(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
            return
        self.calls += 1
        checked = self._checked_chunks(model)
        mode = self.config.loss_reduction
        check_per_token_flag(checked.model_config, mode)
        check_units(model, mode)  # torch FSDP2: each unit sums (token) or averages (microbatch), fsdp.py
        if mode == "microbatch":
            self.original(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
            return
        if self.calls_at_step is not None:  # one finalize per optimizer step (liveness.py), before any collective
            check_one_finalize(self.calls - self.calls_at_step, current_host().iteration())
        self.poll(wait=True)  # an earlier step's verdict not yet read (no schedule call in between)
        topology = self._topology_of(pg_collection)
        contract = self.contract
        if contract is None:  # token mode has one: the constructor and the installation's configure keep it so
            raise LossContractError("reduction mode 'token' needs a LossContract to read counts from.")
        # before the grads' sync: no collective
        vector = contract.collect(checked.device, is_last_stage=topology.is_last_stage)
        self.original(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        # where upstream reduces its count: after the grads, on every stage
        torch.distributed.broadcast(vector, src=topology.last_stage_rank, group=topology.pp_group)
        if self.noise_scale is not None:  # --ga-noise-scale: the reduced norm, before the division by N
            self.noise_scale.after_reduction(model, vector[SLOT_TOKENS], topology.is_last_stage)
        torch.distributed.all_reduce(vector, group=topology.dp_cp_group)
        # a device scalar, upstream's 1.0 / clamp(N, min=1) to the bit (torch computes x / t as t.reciprocal() * x)
        scaling = torch.clamp(vector[SLOT_TOKENS], min=1).reciprocal()
        if self.config.checks == "async":
            self.pending = Verdict.of(vector, self.calls, current_host().iteration())
        else:
            # the step's one device-to-host read
            checks = self._judged(StepChecks(*vector.tolist()), current_host().iteration())
            raise_on_violations(checks)
            self.last_num_tokens = checks.tokens
            if not checks.tokens:  # --ga-zero-token-policy skip: a zero gradient for the skipped step
                self._zero_tokens()
                scaling = 0.0
        for chunk in model:
            scale_gradients(chunk, scaling)  # torch FSDP2: the local shards, while upstream's is a no-op

    @property
    def config(self) -> GAConfig:
        return self.reads.config

    @property
    def contract(self) -> LossContract | None:
        return self.reads.contract

    @property
    def noise_scale(self) -> NoiseScaleMeter | None:
        """--ga-noise-scale: the meter that reads the reduced gradient here (integration/noise_scale.py)."""
        return self.reads.noise_scale

    def take_skip(self) -> bool:
        """The step's skip verdict (--ga-zero-token-policy skip), handed once to the optimizer step it skips."""
        skip, self.skip_step = self.skip_step, False
        return skip

    def take_deferral(self) -> Deferred | None:
        """The last non-finite loss left to Megatron's rerun machine, handed once to the report of its decision."""
        deferred, self.last_deferred = self.last_deferred, None
        return deferred

    def optimizer_stepped(self) -> None:
        """An optimizer install() hooked steps, or is built: the calls from here on are the next step's."""
        self.calls_at_step = self.calls

    def poll(self, *, wait: bool = False) -> None:
        """``--ga-checks async``: read the pending verdict if its copy is done (or ``wait``) and raise if the
        step it belongs to broke the contract."""
        pending = self.pending
        if pending is None or not (wait or pending.ready()):
            return
        self.pending = None
        checks = self._judged(pending.checks(), pending.iteration)
        if checks.negative or checks.nonfinite or checks.unchecked or not checks.tokens:
            where = f"--ga-checks async, verdict of training step {pending.step}" + (
                f" (iteration {pending.iteration})" if pending.iteration is not None else ""
            )
            raise_on_violations(checks, where=where)
            self.last_num_tokens = 0
            self._zero_tokens(where)
            return
        self.last_num_tokens = checks.tokens

    def _judged(self, checks: StepChecks, iteration: int | None) -> StepChecks:
        """A non-finite loss is Megatron's to judge where its rerun state machine checks the loss
        (:func:`megatron_judges_nonfinite`): the flag is recorded (:attr:`deferred`) and left out of the checks, once
        the contract's own violations (unchecked ranks, negative counts) are clear. A step that is finite clears it:
        Megatron re-ran the iteration and its loss came out finite this time."""
        if self.deferred is not None and self.deferred.iteration != iteration:
            self.check_deferred()  # an earlier iteration's, read late (--ga-checks async): it reached the optimizer
        if not checks.nonfinite or checks.unchecked or checks.negative or not megatron_judges_nonfinite():
            self.deferred = None
            return checks
        if self.deferred is None:
            logger.warning(
                "megatron-ga-ext: %d micro-batch(es) of iteration %s returned a non-finite loss; Megatron's rerun "
                "state machine checks the loss (--rerun-mode %s, --check-for-nan-in-loss-and-grad), so the extension "
                "defers to it (it re-runs the iteration to tell a transient fault from a reproducible one) and reports "
                "what it decides. A non-finite step that reaches the optimizer step anyway stops there.",
                checks.nonfinite,
                iteration,
                current_host().settings().rerun_mode,
            )
        self.deferred = self.last_deferred = Deferred(iteration, checks.nonfinite)
        return checks._replace(nonfinite=0)

    def check_deferred(self) -> None:
        """At the optimizer step: a non-finite loss deferred to Megatron that reached the step (Megatron does not
        validate the first iteration, nor a loss function that does not call its validate_result) stops here.

        Under ``--ga-checks async`` the verdict of Megatron's re-run of that iteration may still be on its way to the
        host: it is read first (waiting for its copy), so a re-run that came out finite clears the deferral instead
        of the first run's verdict stopping a step Megatron judged sound."""
        if self.deferred is not None and self.pending is not None:
            self.poll(wait=True)
        deferred, self.deferred = self.deferred, None
        if deferred is None:
            return
        raise LossContractError(
            f"iteration {deferred.iteration}: {deferred.nonfinite} micro-batch(es) returned a non-finite loss (inf or "
            f"nan) and Megatron's rerun state machine let the step reach the optimizer (it does not validate the first "
            f"iteration, nor a loss function that does not call its validate_result); the token-weighted gradient "
            f"would be non-finite. Check the data, the loss function and the learning rate."
        )

    def _topology_of(self, pg_collection: ProcessGroupCollection | None) -> _Topology:
        """The step's :class:`_Topology`: the ranks looked up again only when the groups are not the last step's
        (upstream's schedule builds a new pg_collection per step from the same groups; a group's ranks never
        change)."""
        pp_group, dp_cp_group = _groups(pg_collection)
        topology = self._topology
        if topology is None or topology.pp_group is not pp_group or topology.dp_cp_group is not dp_cp_group:
            last_stage_rank = torch.distributed.get_process_group_ranks(pp_group)[-1]
            topology = self._topology = _Topology(
                pp_group, dp_cp_group, last_stage_rank, torch.distributed.get_rank() == last_stage_rank
            )
        return topology

    def _checked_chunks(self, model: list[torch.nn.Module]) -> _CheckedChunks:
        """The step's model chunks, their config and device, and in token mode :func:`check_ddp_chunks` on them:
        once per list of chunks and mode (a wrapper fixes its gradient factor when it is built; ``parameters()``
        walks every submodule). The per-token flag is read from that config every step."""
        mode = self.config.loss_reduction
        if self._checked is None or not self._checked.are(model, mode):
            from megatron.core.utils import get_model_config

            config = get_model_config(model[0])
            check_per_token_flag(config, mode)  # the rule a launch breaks, before what follows from it
            device = None
            if mode == "token":
                check_ddp_chunks(model)
                device = next(model[0].parameters()).device
            self._checked = _CheckedChunks([weakref.ref(chunk) for chunk in model], mode, config, device)
        return self._checked

    def _zero_tokens(self, where: str = "") -> None:
        message = (
            prefixed(where) + "the global batch has 0 non-padding tokens (the sum of num_tokens over "
            "micro-batches and DP x CP ranks); there is nothing to average."
        )
        if self.config.zero_token_policy == "error":
            raise LossContractError(
                message + " Check the loss mask and the data, or choose --ga-zero-token-policy skip to skip "
                "the optimizer step and go on."
            )
        self.skip_step = True
        warnings.warn(
            message + " Skipping this optimizer step (--ga-zero-token-policy skip): the gradient is "
            "zeroed and Megatron's optimizer does not step, so Adam's moments and weight decay do not "
            "move either; Megatron counts a skipped iteration.",
            RuntimeWarning,
            stacklevel=3,
        )


class Reads(Protocol):
    """What finalize reads, by reference (installation.Installation)."""

    @property
    def config(self) -> GAConfig: ...

    @property
    def contract(self) -> LossContract | None: ...

    @property
    def noise_scale(self) -> NoiseScaleMeter | None: ...


@dataclass(frozen=True)
class _Given:
    """A config and a contract given outright (verify's harness, the tests): no meter."""

    config: GAConfig
    contract: LossContract | None
    noise_scale: None = None


def make_finalize_model_grads(
    original: FinalizeFunction, contract: LossContract | None = None, *, config: GAConfig | None = None
) -> FinalizeModelGrads:
    """Wrap upstream's ``finalize_model_grads`` (``original``) for the given reduction mode."""
    return FinalizeModelGrads(original, contract, config or GAConfig())


def _groups(pg_collection: ProcessGroupCollection | None) -> tuple[ProcessGroup, ProcessGroup]:
    """(pipeline group, DP x CP group), as upstream's finalize picks them."""
    if pg_collection is not None:
        # the groups set on it: upstream's getattr of an unset field goes through a __getattr__ that lists every field
        dp_cp = getattr(pg_collection, "__dict__", {}).get("dp_cp_gtp_remat") or pg_collection.dp_cp
        return pg_collection.pp, dp_cp
    from megatron.core import parallel_state

    return (
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
