"""A feature: one job of the extension in a training step, with a method per phase that does nothing
by default.

The installation (installation.py) keeps the features of its configuration in one ordered list,
``FEATURES``, and runs each phase as a loop over them, in that order; a feature's part in a phase is
its method of that name. What one phase finds is handed to the next as a value: a :class:`Step` for
a forward/backward call, a :class:`Finalizing` for finalize (the gradients reduced, N on the
device), an :class:`OptimizerStep` (carrying finalize's
:class:`Finalized` verdict) for the optimizer's step. A feature asks the installation that runs it only what
:class:`Handle` declares. A feature with state across a resume names it (``name``, ``version``) and gives it in
:meth:`Feature.state_dict`; the checkpoint sidecar (sidecar.py) keeps each feature's part under its name and version.
OLMo-core's trainer callbacks are the model (a method per event, defaults that do nothing, state of
their own).

Each feature names the hook rows it needs beyond the phases' own (:attr:`Feature.hooks`); install()
wires the union (hooks.py). Adding a feature is a module with its class and one :class:`Entry` in
``FEATURES``; the entry names the module by its dotted path, so a feature's module is imported only
where its configuration turns it on.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ga_ext.config.coverage.verdict import Verdict
    from megatron_ga_ext.config.ga_config import GAConfig
    from megatron_ga_ext.integration.hook_rows import Hook
    from megatron_ga_ext.integration.liveness import StepLiveness
    from megatron_ga_ext.integration.loss_contract import LossContract

__all__ = [
    "Entry",
    "Feature",
    "Finalized",
    "Finalizing",
    "Handle",
    "Loaded",
    "OptimizerStep",
    "Step",
]


class Handle(Protocol):
    """What a feature may ask of the installation that runs it (installation.Installation; a
    stand-in in tests)."""

    @property
    def config(self) -> GAConfig:
        """The --ga-* configuration (read from Megatron's args where install() came first)."""
        ...

    @property
    def contract(self) -> LossContract | None:
        """Token mode's loss contract, which finalize collects N from; None in microbatch mode."""
        ...

    @property
    def steps_bounded(self) -> bool:
        """An optimizer install() hooked marks where each step ends (its building, or its first
        step)."""
        ...

    def model_config(
        self, model: torch.nn.Module | list[torch.nn.Module] | None
    ) -> TransformerConfig | None:
        """The TransformerConfig of a schedule's ``model`` argument."""
        ...


@dataclass
class Step:
    """One forward/backward call, from its start to its return."""

    call: dict[str, Any]
    """The schedule's keyword arguments (``num_microbatches``, ``model``, ``forward_only``, ...)."""
    finalized: int = 0
    """Finalize's call count when the call started: unchanged at its return, the call did not reach
    finalize."""
    abandoned: bool = False
    """The last call raised before it returned: its step is abandoned."""
    startup: Verdict | None = None
    """The start-up checks' verdict, on the first call only."""
    left_open: bool = False
    """A training call that left its step open for a later call's finalize (token mode)."""
    earlier: int = 0
    """The micro-batches of the same step's earlier calls, whose losses wait for its one
    finalize."""

    @property
    def training(self) -> bool:
        return not self.call.get("forward_only")


@dataclass(frozen=True)
class Finalized:
    """Finalize's verdict on one step, carried to its optimizer step
    (:attr:`OptimizerStep.verdict`)."""

    num_tokens: int | None = None
    """N, read on the host (``--ga-checks sync``, token mode); None where not read yet (async) or
    not taken."""
    skip: bool = False
    """0 loss tokens under ``--ga-zero-token-policy skip``: the optimizer step is skipped."""
    deferred: Deferred | None = None
    """A non-finite loss left to Megatron's rerun state machine, for the report of what it
    decides."""

    def then(self, later: Finalized | None) -> Finalized:
        """This verdict with a later one's findings added (a skip and a deferral persist until
        handed over)."""
        if later is None:
            return self
        return Finalized(
            later.num_tokens if later.num_tokens is not None else self.num_tokens,
            self.skip or later.skip,
            later.deferred or self.deferred,
        )


@dataclass(frozen=True)
class Deferred:
    """A non-finite loss left to Megatron's rerun state machine."""

    iteration: int | None
    nonfinite: int


@dataclass(frozen=True)
class Finalizing:
    """One call of the extension's finalize (finalize.py), after upstream's reduction and before the
    division.

    Token mode: ``N = all_reduce_sum(n, DP x CP)`` on the device (never read here: no device-to-host
    sync), this replica's count ``b_r`` (broadcast from the last pipeline stage, before the DP x CP
    sum) and where this rank stands. Microbatch mode: the model only."""

    model: Sequence[torch.nn.Module]
    mode: str
    num_tokens: torch.Tensor | None = None
    """N on the device, int64, after the DP x CP all-reduce (token mode)."""
    replica_tokens: torch.Tensor | None = None
    """b_r: this replica's count, before the DP x CP all-reduce (token mode, where a feature reads
    it)."""
    is_last_stage: bool = False
    """This rank is on the last pipeline stage (the one that sees the loss; token mode)."""
    repeated: int = 1
    """Finalize calls since the optimizer's last step, this one included (1 where steps are not
    bounded)."""
    iteration: int | None = None
    """Megatron's iteration, where the host loop knows it."""


@dataclass
class OptimizerStep:
    """One step of an optimizer install() hooked."""

    optimizer: Any
    liveness: StepLiveness
    """That optimizer's view of the hooks' counts (liveness.py)."""
    verdict: Finalized | None = None
    """Finalize's verdict on the step (None where finalize did not run); after the optimizer's step,
    with what ``--ga-checks async`` read since."""
    measurement: dict[str, Any] | None = None
    """--ga-noise-scale: this step's trace row, where the step was measured."""

    @property
    def skip(self) -> bool:
        """0 loss tokens under ``--ga-zero-token-policy skip``: the optimizer's step is skipped."""
        return self.verdict is not None and self.verdict.skip


@dataclass(frozen=True)
class Loaded:
    """A checkpoint the loop loaded: its iteration, the LR scheduler, and the samples consumed
    before it."""

    iteration: int
    scheduler: Any
    consumed_samples: int


class Feature:
    """One job in the step. Built by the installation where its :class:`Entry` says its
    configuration asks for it."""

    name: ClassVar[str] = ""
    """The key of its state in the checkpoint sidecar (features without state need none)."""
    version: ClassVar[int] = 1
    """The layout of that state this release writes; :meth:`load_state_dict` reads each earlier
    one."""
    flags: ClassVar[tuple[str, ...]] = ()
    """The ``--ga-*`` flags that act here (docs/design.md's table of the step)."""
    reads_replica_tokens: ClassVar[bool] = False
    """Its finalize reads :attr:`Finalizing.replica_tokens` (finalize copies b_r before the sum only
    then)."""
    hooks: ClassVar[tuple[Hook[Any], ...]] = ()
    """The hook rows of its own (hook_rows.Hook: targets only this feature wraps, each wired where
    its ``when`` says the installation needs it). Their wrappers run the Installation, which this
    module cannot name (it imports the features): each feature module declares its rows as
    ``Hook[Installation]``."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        """The installation that runs it, as far as :class:`Handle` declares."""

    def begin_step(self, step: Step) -> None:
        """A forward/backward call starts."""

    def micro_batch(self, model_chunk: torch.nn.Module, loss_func: Any) -> Any:
        """A forward step of ``model_chunk``; returns the loss function it runs (``loss_func``, or a
        wrapper)."""
        return loss_func

    def end_step(self, step: Step) -> None:
        """The forward/backward call returned."""

    def finalize(self, step: Finalizing) -> None:
        """Finalize reduced the gradients (and N); the division by N follows."""

    def before_optimizer_step(self, step: OptimizerStep) -> None:
        """Before the optimizer's step."""

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """After the optimizer's step (not while a CUDA graph captures it)."""

    def after_log(self) -> None:
        """The loop printed its iteration's line."""

    def extra_samples(self) -> int:
        """Samples beyond the planned steps' that the training dataset must hold for this
        feature."""
        return 0

    def state_dict(self) -> dict[str, Any] | None:
        """What a resumed run continues from, as JSON; None where there is nothing."""
        return None

    def load_state_dict(
        self, saved: dict[str, Any] | None, version: int, loaded: Loaded, where: str
    ) -> None:
        """Continue from ``saved`` (written at layout ``version``; None where the checkpoint kept
        none for this feature), read from ``where`` (the sidecar's path, for messages)."""


def _always(config: GAConfig) -> bool:
    return True


@dataclass(frozen=True)
class Entry:
    """One line of ``FEATURES``: the feature's class, or ``"package.module:Class"`` (imported only
    where ``wanted``), and the configurations that turn it on."""

    source: str | type[Feature]
    wanted: Callable[[GAConfig], bool] = _always

    def load(self) -> type[Feature]:
        """The feature's class (its module imported on the first call)."""
        if not isinstance(self.source, str):
            return self.source
        module, _, name = self.source.partition(":")
        kind: type[Feature] = getattr(importlib.import_module(module), name)
        return kind
