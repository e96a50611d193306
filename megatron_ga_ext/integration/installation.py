"""What one ``install()`` holds, and the phases of a run in order: each a loop over the features.

An Installation keeps its configuration, what it replaced (so ``uninstall()`` can put it back), the
finalize wrapper and the features its configuration asks for (features/), in the order of
``FEATURES``. The hook table (hooks.py) calls its phase methods; one training step reads, in this
file:

    configure_calculator       Megatron builds (or rebuilds) its num-microbatches calculator
    begin_step                 a forward/backward call starts: the start-up checks once, then each feature's part
      micro_batch  x M         each forward step: each feature's part (counted; the loss function wrapped)
      finalized                FinalizeModelGrads (finalize.py) reduced N and the gradients: each feature's finalize
                               on the Finalizing value; its Finalized verdict kept for the optimizer
                               step
    end_step                   the call returns: each feature's part (the open step, the counts, the first report)
    before_optimizer_step      liveness follows; each feature's part with the verdict; a deferred loss, the skip
    after_optimizer_step       finalize's async verdict; each feature's part (liveness, the noise scale, the warmup)
    rerun_decided / after_log  what Megatron's rerun machine decided; the held noise-scale line
    after_save / after_load    each feature's state in the sidecar beside the loop's checkpoint (sidecar.py)
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.install_check import (
    check_args,
)  # the rule pass install() runs on Megatron's args
from megatron_ga_ext.errors import CompatError
from megatron_ga_ext.integration.acceptance import unwaived
from megatron_ga_ext.integration.agreement import StartupChecks
from megatron_ga_ext.integration.calculator import live_step_calculator
from megatron_ga_ext.integration.calculator_adoption import (
    BUILT_UNSEEN,
    build_calculator,
    guard_live_calculator,
    schedule_live_calculator,
)
from megatron_ga_ext.integration.compat import live_calculator
from megatron_ga_ext.integration.features import (
    Entry,
    Feature,
    Finalized,
    Finalizing,
    Loaded,
    OptimizerStep,
    Step,
)
from megatron_ga_ext.integration.finalize import FinalizeModelGrads
from megatron_ga_ext.integration.finalize_adoption import AdoptedFinalize, adopt_finalize
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.integration.liveness import Counts, StepLiveness
from megatron_ga_ext.integration.loss_contract import LossContract
from megatron_ga_ext.integration.patching import Patches
from megatron_ga_ext.integration.sidecar import read_sidecar, sidecar_path, write_sidecar
from megatron_ga_ext.integration.step_verdict import describe_decision
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["FEATURES", "Installation", "Wiring"]

logger = get_logger(__name__)

_INTEGRATION = "megatron_ga_ext.integration"
_FEATURES = f"{_INTEGRATION}.features"
_SCIENCE = "megatron_ga_ext.science.integration"  # the batch-size science's features
#: The features, in the order each phase runs them (features/); each module is imported only where
#: its entry wants it. torch FSDP2's units set before anything of the step, the loss reduction
#: before the guards (it tells them the micro-batches an open step holds), the noise scale before
#: the batch schedule (whose warmup decides on its row).
FEATURES: tuple[Entry, ...] = (
    Entry(f"{_FEATURES}.torch_fsdp2:TorchFSDP2"),
    Entry(f"{_FEATURES}.loss_reduction:LossReduction"),
    Entry(f"{_FEATURES}.guards:Guards"),
    Entry(f"{_SCIENCE}.noise_scale_feature:NoiseScale", lambda config: bool(config.noise_scale)),
    Entry(
        f"{_SCIENCE}.batch_schedule:BatchSchedule",
        lambda config: config.batch_size_warmup == "auto" or config.lr_scaling != "none",
    ),
    Entry(f"{_FEATURES}.aux_losses:AuxLosses"),
)

F = TypeVar("F", bound=Feature)


@dataclass(frozen=True)
class _ChunkConfig:
    """A model chunk (weakly held) and its TransformerConfig."""

    chunk: weakref.ref[torch.nn.Module]
    config: TransformerConfig


@dataclass
class Wiring:
    """What install() replaced and checked, so uninstall() can put it back."""

    patches: Patches = field(default_factory=Patches)
    """The module globals and class attributes install() replaced (patching.py)."""
    settled_hooks: set[str] = field(default_factory=set)
    """The hook table's rows wired (or absent from this source), by qualified name (hooks.wire)."""
    checked_modules: set[str] = field(default_factory=set)
    """Host-loop modules whose fingerprinted targets were checked when they were wired."""
    configs: list[AdoptedFinalize] = field(default_factory=list)
    """Model configs whose finalize_model_grads_func install() set."""
    compat_problems: list[str] = field(default_factory=list)
    """Fingerprints that did not match a tested source (refused under --ga-strict)."""


@dataclass
class Installation:
    """Everything install() changed, so uninstall() can put it back, and the features its hooks run.
    To the features it is their :class:`features.Handle`."""

    config: GAConfig
    version: str
    vendored: bool = False
    """Wired by a patched megatron/core (patches/) instead of install()."""
    waiting_for_args: bool = False
    """install() came before Megatron parsed its args: the config is read from them at the first
    hook."""
    active: bool = True
    """False once uninstalled: a wrapper still referenced somewhere then calls straight through."""
    wiring: Wiring = field(default_factory=Wiring)
    successor: Installation | None = None
    """The installation that replaced this one (install() with another config): see
    :meth:`current`."""
    features: list[Feature] = field(default_factory=list)
    """The features of the config, in the order of FEATURES (:meth:`configure`)."""
    contract: LossContract | None = None
    """Token mode's loss contract (loss_contract.py), which the loss functions fill and finalize
    collects."""
    finalize: FinalizeModelGrads | None = None
    """The finalize wrapper, made by its hook (hooks.py); it reads the config and the contract
    here."""
    agreement: StartupChecks = field(default_factory=StartupChecks)
    """Ranks agree on the batch configuration, and a resume says what changed: once, at the first
    schedule call."""
    counts: Counts = field(default_factory=Counts)
    """The training calls and the finalize calls, as liveness compares them (liveness.py)."""
    verdict: Finalized | None = None
    """Finalize's verdict, until the optimizer step takes it (its deferral: until the rerun decision
    is said)."""
    last_model_config: _ChunkConfig | None = None
    """The last schedule call's first chunk and its config, see model_config()."""
    calculator_in_force: Any = None
    """The live num-microbatches calculator as this installation last put it in force (built through
    its hook, or adopted); another one live is adopted (:meth:`adopt_live_calculator`)."""

    def configure(self, config: GAConfig) -> None:
        """Apply ``config``: token mode's contract, and the features it asks for, in order."""
        self.config = config
        self.contract = LossContract() if config.loss_reduction == "token" else None
        self.features = [entry.load()(self) for entry in FEATURES if entry.wanted(config)]

    def feature(self, kind: type[F]) -> F | None:
        """The feature of that class, where the config asks for it."""
        return next((feature for feature in self.features if isinstance(feature, kind)), None)

    @property
    def steps_bounded(self) -> bool:
        """An optimizer install() hooked marks where each step ends (features.Handle)."""
        return self.counts.finalizes_at_step is not None

    def configure_from_megatron_args(self) -> None:
        """Where install() came before Megatron parsed its args, configure from them at the first
        hook that runs (Megatron parses them before it builds the calculator), or from the defaults
        where there are none; at every later call, nothing."""
        if not self.waiting_for_args:
            return
        self.waiting_for_args = False
        args = current_host().parsed_args()
        config = self.config if args is None else GAConfig.from_args(args)
        problems = unwaived(self.wiring.compat_problems, config.accept_source)
        if problems and config.strict:
            raise CompatError(" ".join(problems))
        if args is not None:
            check_args(config, args)
        self.configure(config)
        source = (
            "from Megatron's args"
            if args is not None
            else "no Megatron-LM args: the config install() was given"
        )
        logger.info("megatron-ga-ext on megatron-core %s, %s: %s", self.version, source, config)

    # -- the phases of a run, in order (hooks.py's wrappers call them)
    # ---------------------------------------------

    def configure_calculator(self, configure: Callable, bound: inspect.BoundArguments) -> None:
        """Megatron builds its calculator: upstream's ``configure``, or the step-schedule calculator
        where a schedule (or a converted rampup) is given; then the consumed-samples guard around
        whichever is live."""
        build_calculator(self.config, configure, bound)
        self.guard_live_calculator()

    def guard_live_calculator(self) -> None:
        """The live calculator behind the consumed-samples guard (guards.py), once; it is then the
        one in force."""
        self.calculator_in_force = guard_live_calculator(self.config)

    def adopt_live_calculator(self, where: str | None = None) -> bool:
        """A live calculator this installation did not put in force (built before install(), or
        wherever no hook saw it built: calculator_adoption.py) becomes the extension's: the step
        schedule the config asks for, then the guard. ``where``: the hook that found it after
        install(), said in a warning. True where one was adopted."""
        live = live_calculator()
        if live is None or live is self.calculator_in_force:
            return False
        if not self.waiting_for_args:
            schedule_live_calculator(self.config)
        self.guard_live_calculator()
        if where is not None:
            logger.warning(
                BUILT_UNSEEN.format(kind=type(getattr(live, "inner", live)).__name__, where=where)
            )
        return True

    def begin_step(self, call: dict[str, Any]) -> Step:
        """A forward/backward call starts (``call``: its keyword arguments): a calculator no hook
        saw built adopted, the start-up checks once, the last step's async verdict, each feature's
        part, the model config's finalize adopted. Returns the step, for :meth:`end_step`."""
        self.configure_from_megatron_args()
        self.adopt_live_calculator("this forward/backward call")
        step = Step(
            call, startup=self.agreement.run_once(self.config, current_host().parsed_args())
        )
        if (
            self.finalize is None
        ):  # its hook is wired at install(): a vendored tree without finalize's patch
            raise CompatError(
                "megatron-ga-ext: finalize_model_grads is not wired; patch it (patches/) or "
                "install()"
            )
        self.keep(
            self.finalize.poll(wait=True)
        )  # --ga-checks async: the last step's, if not read after its step
        step.abandoned, self.counts.in_call = self.counts.in_call, True
        if step.training:
            self.counts.training_schedules += 1
        for feature in self.features:
            feature.begin_step(step)
        self.adopt_finalize(self.model_config(call.get("model")))
        return step

    def micro_batch(self, model_chunk: torch.nn.Module, loss_func: Any) -> Any:
        """A forward step of ``model_chunk``: each feature's part; returns the loss function it
        runs."""
        self.configure_from_megatron_args()
        for feature in self.features:
            loss_func = feature.micro_batch(model_chunk, loss_func)
        return loss_func

    def end_step(self, step: Step) -> None:
        """The forward/backward call returned: each feature's part."""
        self.counts.in_call = False
        for feature in self.features:
            feature.end_step(step)

    def finalized(self, step: Finalizing, verdict: Finalized) -> None:
        """Finalize (finalize.py) reduced the gradients and N: each feature's finalize on ``step``,
        in order (before the division by N); ``verdict`` kept for the optimizer step
        (:meth:`before_optimizer_step`)."""
        counts = self.counts
        counts.finalizes += 1
        if (
            counts.finalizes_at_step is not None
        ):  # the calls since the optimizer's last step, this one included
            step = dataclasses.replace(step, repeated=counts.finalizes - counts.finalizes_at_step)
        for feature in self.features:
            feature.finalize(step)
        self.keep(verdict)

    def take_verdict(self) -> Finalized | None:
        """Finalize's verdict on the last step (N, the skip), handed over once: for a loop that
        steps an optimizer install() did not hook (the hooked ones are handed it in their
        OptimizerStep)."""
        verdict, self.verdict = self.verdict, None
        return verdict

    def wants_replica_tokens(self) -> bool:
        """A feature reads b_r in finalize (finalize.Reads)."""
        return any(feature.reads_replica_tokens for feature in self.features)

    def keep(self, verdict: Finalized | None) -> None:
        """Finalize's verdict (or a later read of it, ``--ga-checks async``), added to the one not
        yet handed on."""
        if verdict is not None:
            self.verdict = verdict if self.verdict is None else self.verdict.then(verdict)

    def before_optimizer_step(self, liveness: StepLiveness, optimizer: Any = None) -> OptimizerStep:
        """Before the optimizer's step: finalize's verdict handed to the step; each feature's part
        (the open step, liveness, the rates of this step's batch, the noise scale's loss scale);
        then a non-finite loss left to Megatron's rerun machine that reached the step stops it.
        Returns the step, for
        :meth:`after_optimizer_step`; its ``skip``: the zero-token policy skips it."""
        if liveness.state is not self:
            liveness.follow(self)
        verdict, self.verdict = self.verdict, None
        if (
            verdict is not None and verdict.deferred is not None
        ):  # said once Megatron decides (rerun_decided)
            self.verdict = Finalized(deferred=verdict.deferred)
        step = OptimizerStep(optimizer, liveness, verdict)
        self.counts.finalizes_at_step = self.counts.finalizes
        for feature in self.features:
            feature.before_optimizer_step(step)
        if self.finalize is not None and self.config.checks != "async":
            self.keep(self.finalize.check_deferred())
        return step

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """After the optimizer's step: the step's async verdict once its copy is done (added to the
        step's), then each feature's part."""
        if self.finalize is not None:
            late = self.finalize.poll()  # the step's own reads synced
            if self.config.checks == "async":
                deferred = self.finalize.check_deferred()
                late = deferred if late is None else late.then(deferred)
            if late is not None:
                step.verdict = late if step.verdict is None else step.verdict.then(late)
                self.keep(
                    late if late.skip or late.deferred else None
                )  # what the next optimizer step must see
        for feature in self.features:
            feature.after_optimizer_step(step)

    def rerun_decided(self, decision: tuple[bool, bool, int]) -> None:
        """Megatron's rerun state machine decided: where a non-finite loss was left to it
        (finalize.py), say what."""
        verdict = self.verdict
        deferred = None if verdict is None else verdict.deferred
        if verdict is not None and deferred is not None:
            self.verdict = dataclasses.replace(verdict, deferred=None)
            logger.warning(
                "megatron-ga-ext: Megatron's rerun state machine decided on the non-finite loss "
                "of iteration %s: %s",
                deferred.iteration,
                describe_decision(*decision),
            )

    def after_log(self) -> None:
        """The loop's training_log returned: each feature's part (the noise-scale line held for
        it)."""
        for feature in self.features:
            feature.after_log()

    def planned_samples(self, train_samples: int | None) -> int | None:
        """The samples a run of ``train_samples`` consumes under the live step schedule, which the
        training dataset must hold: the planned steps' (the last may pass ``train_samples``), and
        what the features add (under --ga-batch-size-warmup auto up to its cap); None without a live
        schedule or a run length in samples."""
        calculator = live_step_calculator()
        if not self.active or calculator is None or not train_samples:
            return None
        return calculator.plan(train_samples)[1] + sum(
            feature.extra_samples() for feature in self.features
        )

    def after_save(self, directory: str | None, iteration: int) -> None:
        """The loop saved the checkpoint of ``iteration`` under ``directory`` (its ``iter_NNNNNNN``
        parent; None for one that has none, a local non-persistent checkpoint): each feature's state
        beside it (sidecar.py)."""
        states = {
            f.name: (f.version, state)
            for f in self.features
            if (state := f.state_dict()) is not None
        }
        if states and directory:
            write_sidecar(directory, iteration, states)

    def after_load(
        self, directory: str | None, iteration: int, scheduler: Any, consumed_samples: int
    ) -> None:
        """The loop loaded the checkpoint of ``iteration`` from ``directory`` (where the loop picked
        it: a non-persistent one, if it was that), at ``consumed_samples``: each feature with state
        continues from its part of the sidecar (iteration 0: nothing loaded, none)."""
        stateful = [feature for feature in self.features if feature.name]
        if not stateful or not directory or iteration <= 0:
            return
        path = sidecar_path(directory, iteration)
        parts = read_sidecar(path) or {}
        loaded = Loaded(iteration, scheduler, consumed_samples)
        for feature in stateful:
            version, saved = parts.get(feature.name, (feature.version, None))
            feature.load_state_dict(saved, version, loaded, str(path))

    def restore(self) -> None:
        """Every original back where install()'s replacement is still what is bound: in the modules
        patched, in modules imported since that bound it (``from x import y`` after install()), on
        classes, and in model configs that hold the finalize (or a partial of it). A wrapper other
        code put on top of ours stays where it is; ours beneath it is inert from here on (``active``
        False: it calls the original straight through)."""
        self.active = False
        if self.finalize is not None:
            self.finalize.active = False
        self.wiring.patches.restore()
        for adopted in self.wiring.configs:
            adopted.restore()
        self.wiring.configs.clear()

    def current(self) -> Installation | None:
        """The live installation this one led to: itself while active, else its successor's
        (install() with another config), else None (uninstalled). A wrapper that outlives its
        installation (the optimizer's step) follows it."""
        state: Installation | None = self
        while state is not None and not state.active:
            state = state.successor
        return state

    def model_config(
        self, model: torch.nn.Module | list[torch.nn.Module] | None
    ) -> TransformerConfig | None:
        """The TransformerConfig of a schedule's ``model`` argument: looked up again only for
        another first chunk (a chunk keeps its config)."""
        chunk = model[0] if isinstance(model, (list, tuple)) else model
        if chunk is None:
            return None
        last = self.last_model_config
        if last is None or last.chunk() is not chunk:
            from megatron.core.utils import get_model_config

            last = self.last_model_config = _ChunkConfig(
                weakref.ref(chunk), get_model_config(chunk)
            )
        return last.config

    def adopt_finalize(self, config: TransformerConfig | None) -> None:
        """Give ``config`` the extension's finalize where it holds upstream's or an earlier
        installation's, directly or in a ``functools.partial`` (finalize_adoption.py)."""
        adopted = (
            None
            if self.finalize is None or config is None
            else adopt_finalize(self.finalize, config)
        )
        if adopted is not None:
            self.wiring.configs.append(adopted)
