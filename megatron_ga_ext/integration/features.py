"""A feature: one job of the extension in a training step, with a method per phase that does nothing by default.

The installation (installation.py) keeps the features of its configuration in one ordered list, ``FEATURES``, and
runs each phase as a loop over them, in that order; a feature's part in a phase is its method of that name. What one
phase finds is handed to the next as a value: a :class:`Step` for a forward/backward call, an :class:`OptimizerStep`
for the optimizer's step. A feature with state across a resume names it (``name``, ``version``) and gives it in
:meth:`Feature.state_dict`; the checkpoint sidecar (sidecar.py) keeps each feature's part under its name and version.
OLMo-core's trainer callbacks are the model (a method per event, defaults that do nothing, state of their own).

Adding a feature is a module with its class and one line in ``FEATURES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from megatron_ga_ext.config.coverage.verdict import Verdict
    from megatron_ga_ext.config.ga_config import GAConfig
    from megatron_ga_ext.integration.liveness import StepLiveness

__all__ = ["Feature", "Loaded", "OptimizerStep", "Step"]


@dataclass
class Step:
    """One forward/backward call, from its start to its return."""

    call: dict[str, Any]
    """The schedule's keyword arguments (``num_microbatches``, ``model``, ``forward_only``, ...)."""
    finalized: int = 0
    """Finalize's call count when the call started: unchanged at its return, the call did not reach finalize."""
    abandoned: bool = False
    """The last call raised before it returned: its step is abandoned."""
    startup: Verdict | None = None
    """The start-up checks' verdict, on the first call only."""
    left_open: bool = False
    """A training call that left its step open for a later call's finalize (token mode)."""
    earlier: int = 0
    """The micro-batches of the same step's earlier calls, whose losses wait for its one finalize."""

    @property
    def training(self) -> bool:
        return not self.call.get("forward_only")


@dataclass
class OptimizerStep:
    """One step of an optimizer install() hooked."""

    optimizer: Any
    liveness: StepLiveness
    """That optimizer's view of the hooks' counts (liveness.py)."""
    measurement: dict[str, Any] | None = None
    """--ga-noise-scale: this step's trace row, where the step was measured."""


@dataclass(frozen=True)
class Loaded:
    """A checkpoint the loop loaded: its iteration, the LR scheduler, and the samples consumed before it."""

    iteration: int
    scheduler: Any
    consumed_samples: int


class Feature:
    """One job in the step. Built by the installation where :meth:`wanted` says its configuration asks for it."""

    name: ClassVar[str] = ""
    """The key of its state in the checkpoint sidecar (features without state need none)."""
    version: ClassVar[int] = 1
    """The layout of that state this release writes; :meth:`load_state_dict` reads each earlier one."""
    flags: ClassVar[tuple[str, ...]] = ()
    """The ``--ga-*`` flags that act here (docs/design.md's table of the step)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        """The installation that runs it (installation.Installation: not imported here, it imports the features)."""

    @classmethod
    def wanted(cls, config: GAConfig) -> bool:
        return True

    def begin_step(self, step: Step) -> None:
        """A forward/backward call starts."""

    def micro_batch(self, model_chunk: torch.nn.Module, loss_func: Any) -> Any:
        """A forward step of ``model_chunk``; returns the loss function it runs (``loss_func``, or a wrapper)."""
        return loss_func

    def end_step(self, step: Step) -> None:
        """The forward/backward call returned."""

    def before_optimizer_step(self, step: OptimizerStep) -> None:
        """Before the optimizer's step."""

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """After the optimizer's step (not while a CUDA graph captures it)."""

    def after_log(self) -> None:
        """The loop printed its iteration's line."""

    def extra_samples(self) -> int:
        """Samples beyond the planned steps' that the training dataset must hold for this feature."""
        return 0

    def state_dict(self) -> dict[str, Any] | None:
        """What a resumed run continues from, as JSON; None where there is nothing."""
        return None

    def load_state_dict(self, saved: dict[str, Any] | None, version: int, loaded: Loaded, where: str) -> None:
        """Continue from ``saved`` (written at layout ``version``; None where the checkpoint kept none for this
        feature), read from ``where`` (the sidecar's path, for messages)."""
