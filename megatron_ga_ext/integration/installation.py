"""What one ``install()`` holds, and the phases of a run in order: one method per phase.

An Installation keeps its configuration, what it replaced (so ``uninstall()`` can put it back) and the objects its
hooks share (the loss contract, the finalize wrapper, the forward-step counter, the start-up checks). The hook table
(hooks.py) calls its phase methods; one training step reads, in this file:

    configure_calculator       Megatron builds (or rebuilds) its num-microbatches calculator
    begin_step                 a forward/backward call starts: start-up checks once, counters reset
      micro_batch  x M         each forward step: counted, its loss wrapped (the contract, or the mean report)
      (finalize)               FinalizeModelGrads (finalize.py): N, the checks, the division
    end_step                   the call returns: finalize ran, each chunk ran M micro-batches
    before_optimizer_step      liveness, the scaled rates after a skip, a deferred verdict, the zero-token skip
    after_optimizer_step       the async verdict, liveness, the noise scale and the batch-size warmup
    rerun_decided / after_log  what Megatron's rerun machine decided; the held noise-scale line
    after_save / after_load    the noise-scale sidecar beside Megatron's checkpoint
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.install_check import check_args  # the rule pass install() runs on Megatron's args
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.errors import CompatError, GuardError
from megatron_ga_ext.integration.agreement import StartupChecks
from megatron_ga_ext.integration.aux_report import (
    aux_summary,
    routes_unmasked,
    unmasked_moe_note,
    unmasked_moe_stages,
)
from megatron_ga_ext.integration.batch_warmup import BatchSizeWarmup
from megatron_ga_ext.integration.calculator import StepScheduleCalculator, live_step_calculator
from megatron_ga_ext.integration.calculator_adoption import (
    BUILT_UNSEEN,
    guard_live_calculator,
    schedule_live_calculator,
)
from megatron_ga_ext.integration.compat import live_calculator, set_live_calculator
from megatron_ga_ext.integration.finalize import FinalizeModelGrads, describe_decision
from megatron_ga_ext.integration.finalize_adoption import AdoptedFinalize, adopt_finalize
from megatron_ga_ext.integration.fsdp import prepare_units
from megatron_ga_ext.integration.guards import MicrobatchCounter, current_pipeline_size
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.integration.liveness import StepLiveness, unfinalized_message
from megatron_ga_ext.integration.loss_contract import LossContract, mean_of_means_reports
from megatron_ga_ext.integration.lr_scaling import ScaledRates
from megatron_ga_ext.integration.noise_scale import NoiseScaleMeter, check_core_layout
from megatron_ga_ext.integration.noise_scale_sidecar import load_sidecar, save_sidecar
from megatron_ga_ext.integration.patching import Patches
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["Installation"]

logger = get_logger(__name__)

#: A loss function as Megatron's schedule calls it, and what wraps one (the contract's check or the mean report).
LossFunction = Callable[..., Any]
LossWrapper = Callable[[LossFunction], LossFunction]


@dataclass(frozen=True)
class _ChunkConfig:
    """A model chunk (weakly held) and its TransformerConfig."""

    chunk: weakref.ref[torch.nn.Module]
    config: TransformerConfig


@dataclass
class Installation:
    """Everything install() changed, so uninstall() can put it back, and what its hooks share."""

    config: GAConfig
    version: str
    vendored: bool = False
    """Wired by a patched megatron/core (patches/) instead of install()."""
    waiting_for_args: bool = False
    """install() came before Megatron parsed its args: the config is read from them at the first hook."""
    compat_problems: list[str] = field(default_factory=list)
    active: bool = True
    """False once uninstalled: a wrapper still referenced somewhere then calls straight through."""
    patches: Patches = field(default_factory=Patches)
    """The module globals and class attributes install() replaced (patching.py)."""
    settled_hooks: set[str] = field(default_factory=set)
    """The hook table's rows wired (or absent from this source), by qualified name (hooks.wire)."""
    checked_modules: set[str] = field(default_factory=set)
    """Host-loop modules whose fingerprinted targets were checked when they were wired."""
    configs: list[AdoptedFinalize] = field(default_factory=list)
    """Model configs whose finalize_model_grads_func install() set."""
    successor: Installation | None = None
    """The installation that replaced this one (install() with another config): see :meth:`current`."""
    counter: MicrobatchCounter = field(default_factory=MicrobatchCounter)
    contract: LossContract | None = None
    """Token mode's loss contract; None in microbatch mode."""
    wrap_loss: LossWrapper = mean_of_means_reports
    """What each micro-batch's loss function is wrapped in: the contract's check (token) or the mean report."""
    finalize: FinalizeModelGrads | None = None
    noise_scale: NoiseScaleMeter | None = None
    """--ga-noise-scale K > 0: the in-run measurement (noise_scale.py)."""
    batch_warmup: BatchSizeWarmup | None = None
    """--ga-batch-size-warmup auto: the doubling decisions taken in the run (batch_warmup.py)."""
    scaled_rates: ScaledRates = field(default_factory=ScaledRates)
    """--ga-lr-scaling: what each scheduler's rates were written for (lr_scaling.py)."""
    agreement: StartupChecks = field(default_factory=StartupChecks)
    """Ranks agree on the batch configuration, and a resume says what changed: once, at the first schedule call."""
    reported_first_step: bool = False
    training_schedules: int = 0
    """Training calls (not forward_only) through the guarded schedule; liveness.py compares it per optimizer step."""
    open_step: tuple[int, int] = (0, 0)
    """The micro-batches of this step's training calls that returned without finalize (token mode, where an
    optimizer install() hooked marks the steps), and finalize's call count then: a step split over several
    forward_backward_func calls, finalize on the last (or called once after it). See :meth:`open_microbatches`."""
    set_aside: Any = None
    """An open step's losses, out of the loss contract while an evaluation call (forward_only) runs."""
    in_call: bool = False
    """A forward/backward call began and has not returned; still so at the next call: it raised, its step is
    abandoned."""
    replays_expected: bool = False
    """The launch replays graphs by design (a coverage row with ``replays``): liveness does not count its iterations."""
    host_loss_mask: Any = None
    """The loss mask Megatron-Bridge's ``gpt_step.get_batch`` returned for the model call that follows, which
    Bridge's GPT step does not pass to the model (Bridge #6103; bridge_loop.keeping_loss_mask); token mode only."""
    last_model_config: _ChunkConfig | None = None
    """The last schedule call's first chunk and its config, see model_config()."""
    calculator_in_force: Any = None
    """The live num-microbatches calculator as this installation last put it in force (built through its hook, or
    adopted); another one live is adopted (:meth:`adopt_live_calculator`)."""
    unmasked_moe_models: list[torch.nn.Module] = field(default_factory=list)
    """Token mode, until the first step's report: the model chunks with MoE whose call routed without a padding mask
    (aux_losses.padding_mask_forward records them; aux_report.py)."""

    def configure(self, config: GAConfig) -> None:
        """Apply ``config``: the reduction mode, the loss contract and the finalize wrapper's policy."""
        self.config = config
        self.contract = LossContract() if config.loss_reduction == "token" else None
        self.wrap_loss = self.contract.wrap if self.contract is not None else mean_of_means_reports
        self.noise_scale = NoiseScaleMeter(config) if config.noise_scale else None
        self.batch_warmup = BatchSizeWarmup(config) if config.batch_size_warmup == "auto" else None
        if self.finalize is not None:
            self.finalize.config, self.finalize.contract = config, self.contract
            self.finalize.noise_scale = self.noise_scale

    def configure_from_megatron_args(self) -> None:
        """Where install() came before Megatron parsed its args, configure from them at the first hook that runs
        (Megatron parses them before it builds the calculator), or from the defaults where there are none; at
        every later call, nothing."""
        if not self.waiting_for_args:
            return
        self.waiting_for_args = False
        args = current_host().parsed_args()
        config = self.config if args is None else GAConfig.from_args(args)
        if self.compat_problems and config.strict:
            raise CompatError(" ".join(self.compat_problems))
        if args is not None:
            check_args(config, args)
        self.configure(config)
        source = "from Megatron's args" if args is not None else "no Megatron-LM args: the config install() was given"
        logger.info("megatron-ga-ext on megatron-core %s, %s: %s", self.version, source, config)

    # -- the phases of a run, in order (hooks.py's wrappers call them) ---------------------------------------------

    def configure_calculator(self, configure: Callable, bound: inspect.BoundArguments) -> None:
        """Megatron builds its calculator: upstream's ``configure``, or the step-schedule calculator where a
        schedule (or a converted rampup) is given; then the consumed-samples guard around whichever is live."""
        inputs = ScheduleInputs.from_calculator_call(self.config, bound.arguments)
        schedule = resolve_schedule(inputs)
        if schedule is None:
            configure(*bound.args, **bound.kwargs)
        else:
            set_live_calculator(StepScheduleCalculator.for_launch(schedule, inputs, rank=bound.arguments["rank"]))
        self.guard_live_calculator()

    def guard_live_calculator(self) -> None:
        """The live calculator behind the consumed-samples guard (guards.py), once; it is then the one in force."""
        self.calculator_in_force = guard_live_calculator(self.config)

    def adopt_live_calculator(self, where: str | None = None) -> bool:
        """A live calculator this installation did not put in force (built before install(), or wherever no hook saw
        it built: calculator_adoption.py) becomes the extension's: the step schedule the config asks for, then the
        guard. ``where``: the hook that found it after install(), said in a warning. True where one was adopted."""
        live = live_calculator()
        if live is None or live is self.calculator_in_force:
            return False
        if not self.waiting_for_args:
            schedule_live_calculator(self.config)
        self.guard_live_calculator()
        if where is not None:
            logger.warning(BUILT_UNSEEN.format(kind=type(getattr(live, "inner", live)).__name__, where=where))
        return True

    def routed_without_padding_mask(self, model: torch.nn.Module) -> None:
        """A model call with MoE routed without a padding mask (token mode): kept for the first step's report."""
        if not self.reported_first_step and all(known is not model for known in self.unmasked_moe_models):
            self.unmasked_moe_models.append(model)

    def scheduled(self, count: int, requested: object) -> None:
        """The sequence-packing scheduler repacked a step into ``count`` micro-batches: the next call must run them."""
        if self.config.guards:
            self.counter.schedule(count, requested)

    def begin_step(self, call: dict[str, Any]) -> int:
        """A forward/backward call starts (``call``: its keyword arguments): a calculator no hook saw built adopted,
        the start-up checks once (with a megatron-core loop's --ga-noise-scale layout), the last step's async verdict,
        the counters reset, the model config's finalize adopted. Returns finalize's call count, for :meth:`end_step`."""
        self.configure_from_current_host().parsed_args()
        self.adopt_live_calculator("this forward/backward call")
        args = current_host().parsed_args()
        verdict = self.agreement.run_once(self.config, args)
        if verdict is not None:
            self.replays_expected = any(row.replays for row in verdict.limited)
            if self.noise_scale is not None and args is None:  # with args, install() checked them
                check_core_layout(self.config.noise_scale, call.get("model"))
        self.finalize.poll(wait=True)  # --ga-checks async: the last step's verdict, if not read after its step
        self.counter.reset()
        if self.in_call:
            self.open_step, self.set_aside = (0, 0), None
        self.in_call = True
        if self.contract is not None:
            self._prepare_contract(training=not call.get("forward_only"))
        if self.config.guards:  # the sequence-packing scheduler's count, before its iterator is read
            self.counter.check_scheduled(call["num_microbatches"])
        if not call.get("forward_only"):
            self.training_schedules += 1
            prepare_units(call.get("model"), self.config.loss_reduction)  # torch FSDP2 sums, before its reduce-scatter
        self.adopt_finalize(self.model_config(call.get("model")))
        return self.finalize.calls

    def open_microbatches(self, finalized: int | None = None) -> int:
        """The micro-batches of the open step's calls, whose losses stay in the loss contract for the step's one
        finalize, and whose sum with the last call's is the calculator's count; 0 where no step is open, or finalize
        has run since (called by hand after the last call): its call count is not ``finalized`` (default: now)."""
        microbatches, calls = self.open_step
        if self.finalize is None:
            return 0
        return microbatches if calls == (self.finalize.calls if finalized is None else finalized) else 0

    def _prepare_contract(self, *, training: bool) -> None:
        """The loss contract before a call: an open step's losses kept for the training call that continues the step,
        set aside during an evaluation call (forward_only, which never reaches finalize); else forgotten (an
        evaluation's, or an aborted step's)."""
        if not self.open_microbatches():
            self.contract.reset()
        elif not training:
            self.set_aside = self.contract.set_aside()

    def micro_batch(self, model_chunk: torch.nn.Module, loss_func: LossFunction | None) -> LossFunction | None:
        """A forward step: counted for its chunk; its loss function wrapped (token mode: the contract's check;
        microbatch mode: the micro-batch's mean reported to Megatron's logged loss)."""
        self.configure_from_current_host().parsed_args()
        self.counter.count(model_chunk)
        return None if loss_func is None else self.wrap_loss(loss_func)

    def end_step(self, call: dict[str, Any], finalized: int) -> None:
        """The forward/backward call returned: a training call reached finalize (token mode), or left its step open
        for a later call's finalize where an optimizer install() hooked ends the step; every chunk ran
        num_microbatches micro-batches (the step's calls, the calculator's count in all); after the first finalized
        call, the auxiliary losses' report."""
        self.in_call = False
        training = not call.get("forward_only")
        left_open = training and self.contract is not None and self.finalize.calls == finalized
        if training and not left_open and not self.reported_first_step:
            self._report_first_step(call)
        if left_open and self.finalize.calls_at_step is None:
            raise GuardError(
                unfinalized_message("this training step's forward_backward_func")
                + (
                    " (A step split over several forward_backward_func calls, finalize on the last only, needs an "
                    "optimizer built by megatron.core.optimizer.get_megatron_optimizer after install(): its step marks "
                    "where the step ends.)"
                )
            )
        earlier = self.open_microbatches(finalized) if training else 0
        if self.config.guards:
            calculator = live_calculator() if training and not left_open else None
            self.counter.check(call["num_microbatches"], calculator, earlier)
        if training:
            self.open_step = (earlier + call["num_microbatches"], self.finalize.calls) if left_open else (0, 0)
        elif self.set_aside is not None:
            self.contract.take_back(self.set_aside)
            self.set_aside = None

    def before_optimizer_step(self, liveness: StepLiveness, optimizer: Any = None) -> bool:
        """Before the optimizer's step: the iteration ran the hooks (liveness.py), the rates of this step's batch
        (--ga-lr-scaling, after a skipped step), the noise scale's loss scale kept, a non-finite loss left to
        Megatron's rerun machine (sync checks), and the zero-token policy. True: skip."""
        if liveness.state is not self:
            liveness.follow(self)
        open_microbatches, self.open_step = self.open_microbatches(), (0, 0)
        if self.finalize is not None:
            self.finalize.optimizer_stepped()
        if open_microbatches:  # a host fact: before the step under either --ga-checks
            raise GuardError(unfinalized_message("this training step's forward_backward_func calls"))
        liveness.check(after_step=False)
        if self.config.lr_scaling != "none":
            self.scaled_rates.before_step(optimizer)
        if self.noise_scale is not None:
            self.noise_scale.before_optimizer_step(optimizer)
        finalize = self.finalize
        if finalize is None:
            return False
        if self.config.checks != "async":
            finalize.check_deferred()
        skip, finalize.skip_step = finalize.skip_step, False
        return skip

    def after_optimizer_step(self, optimizer: Any, liveness: StepLiveness) -> None:
        """After the optimizer's step: the step's async verdict once its copy is done, liveness, then a
        --ga-noise-scale measurement and the batch-size warmup's decision on it."""
        if self.finalize is not None:
            self.finalize.poll()  # the step's own reads synced
            if self.config.checks == "async":
                self.finalize.check_deferred()
        liveness.check(after_step=True)
        if self.noise_scale is not None:
            measurement = self.noise_scale.after_optimizer_step(optimizer)
            if measurement is not None and self.batch_warmup is not None:
                self.batch_warmup.decide(self.noise_scale.last_row, live_step_calculator())

    def rerun_decided(self, decision: tuple[bool, bool, int]) -> None:
        """Megatron's rerun state machine decided: where a non-finite loss was left to it (finalize.py), say what."""
        deferred = None if self.finalize is None else self.finalize.last_deferred
        if deferred is not None:
            self.finalize.last_deferred = None
            logger.warning(
                "megatron-ga-ext: Megatron's rerun state machine decided on the non-finite loss of iteration %s: %s",
                deferred.iteration,
                describe_decision(*decision),
            )

    def after_log(self) -> None:
        """Megatron-LM's training_log returned: the noise-scale line held for it follows Megatron's line."""
        if self.noise_scale is not None:
            self.noise_scale.say_held()

    def planned_samples(self, train_samples: int | None) -> int | None:
        """The samples a run of ``train_samples`` consumes under the live step schedule, which the training dataset
        must hold: the planned steps' (the last may pass ``train_samples``), and under --ga-batch-size-warmup auto up
        to its cap more (a schedule decided later); None without a live schedule or a run length in samples."""
        calculator = live_step_calculator()
        if not self.active or calculator is None or not train_samples:
            return None
        margin = self.batch_warmup.cap if self.batch_warmup is not None else 0
        return calculator.plan(train_samples)[1] + margin

    def after_save(self, directory: str | None, iteration: int) -> None:
        """The loop saved the checkpoint of ``iteration`` under ``directory`` (its ``iter_NNNNNNN`` parent; None for
        one that has none, a local non-persistent checkpoint): the noise-scale EMAs (and warmup stages) beside it."""
        if self.noise_scale is None or not directory:
            return
        warmup = self.batch_warmup
        save_sidecar(
            self.noise_scale, directory, iteration, None if warmup is None else warmup.stages(live_step_calculator())
        )

    def after_load(self, directory: str | None, iteration: int, scheduler: Any, consumed_samples: int) -> None:
        """The loop loaded the checkpoint of ``iteration`` from ``directory`` (where the loop picked it: a
        non-persistent one, if it was that), at ``consumed_samples``: its sidecar read (iteration 0: nothing
        loaded, none), and restored warmup stages made live before the loop reads the loaded run's batch and rates.
        The load has already updated the calculator at the loaded consumed samples, and the scheduler's
        ``load_state_dict`` written the rates (--ga-lr-scaling's factor), both with the first stage only: left so,
        the loop's first update would see the batch change and save the loaded iteration again, in place, and the
        first step would train at the first stage's rate."""
        if self.noise_scale is None or not directory or iteration <= 0:
            return
        saved = load_sidecar(self.noise_scale, directory, iteration)
        stages = saved.get("stages") if saved is not None else None
        if self.batch_warmup is None:
            return
        if not stages:
            logger.warning(
                "megatron-ga-ext: the checkpoint of iteration %d keeps no batch-size warmup stages: "
                "--ga-batch-size-warmup auto starts again from --global-batch-size",
                iteration,
            )
            return
        self.batch_warmup.restore(stages, live_step_calculator())
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        # through the guard: its baseline too
        update_num_microbatches(consumed_samples, consistency_check=True, verbose=True)
        if scheduler is not None:
            scheduler.step(0)  # each group's rate and weight decay written again at its count, as its constructor does

    def _report_first_step(self, call: dict[str, Any]) -> None:
        """Once, after the first training step: the auxiliary losses and their scaling, and where the run did not
        meet the token-mode target (MoE layers that routed without a padding mask), by how much (aux_report.py)."""
        from megatron.core import parallel_state

        self.reported_first_step = True
        config = self.model_config(call.get("model"))
        mode = self.config.loss_reduction
        summary = aux_summary(config, mode)
        if summary is None:
            return
        logger.info(summary)
        self.finalize.poll(wait=True)  # the first step's N (under --ga-checks async, once)
        positions = (
            call["num_microbatches"]
            * call.get("micro_batch_size", 1)
            * call.get("seq_length", 0)
            * parallel_state.get_data_parallel_world_size()
        )
        if mode != "token" or not routes_unmasked(config, {}):  # no MoE statistics a padding mask corrects
            return
        stages = unmasked_moe_stages(self.unmasked_moe_models)  # every rank: one all-gather over its PP group
        self.unmasked_moe_models.clear()
        note = unmasked_moe_note(
            config, mode, stages, current_pipeline_size(), positions, self.finalize.last_num_tokens or 0
        )
        if note is not None:
            logger.warning(note)

    def restore(self) -> None:
        """Every original back where install()'s replacement is still what is bound: in the modules patched, in
        modules imported since that bound it (``from x import y`` after install()), on classes, and in model configs
        that hold the finalize (or a partial of it). A wrapper other code put on top of ours stays where it is; ours
        beneath it is inert from here on (``active`` False: it calls the original straight through)."""
        self.active = False
        if self.finalize is not None:
            self.finalize.active = False
        self.patches.restore()
        for adopted in self.configs:
            adopted.restore()
        self.configs.clear()

    def current(self) -> Installation | None:
        """The live installation this one led to: itself while active, else its successor's (install() with another
        config), else None (uninstalled). A wrapper that outlives its installation (the optimizer's step) follows it."""
        state: Installation | None = self
        while state is not None and not state.active:
            state = state.successor
        return state

    def model_config(self, model: torch.nn.Module | list[torch.nn.Module] | None) -> TransformerConfig | None:
        """The TransformerConfig of a schedule's ``model`` argument: looked up again only for another first chunk
        (a chunk keeps its config)."""
        chunk = model[0] if isinstance(model, (list, tuple)) else model
        if chunk is None:
            return None
        last = self.last_model_config
        if last is None or last.chunk() is not chunk:
            from megatron.core.utils import get_model_config

            last = self.last_model_config = _ChunkConfig(weakref.ref(chunk), get_model_config(chunk))
        return last.config

    def adopt_finalize(self, config: TransformerConfig | None) -> None:
        """Give ``config`` the extension's finalize where it holds upstream's or an earlier installation's, directly
        or in a ``functools.partial`` (finalize_adoption.py)."""
        adopted = None if self.finalize is None or config is None else adopt_finalize(self.finalize, config)
        if adopted is not None:
            self.configs.append(adopted)
