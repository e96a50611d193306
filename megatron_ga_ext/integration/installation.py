"""What one ``install()`` holds: its configuration, what it replaced (so ``uninstall()`` can put it back), and the
objects its hooks share (the loss contract, the finalize wrapper, the forward-step counter, the start-up checks).

install.py makes an Installation and runs the hooks; the hook modules (training_hooks.py, aux_losses.py) read it.
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.install_check import check_args  # the rule pass install() runs on Megatron's args
from megatron_ga_ext.errors import CompatError
from megatron_ga_ext.integration.batch_warmup import BatchSizeWarmup
from megatron_ga_ext.integration.compat import megatron_args
from megatron_ga_ext.integration.finalize import FinalizeModelGrads
from megatron_ga_ext.integration.guards import MicrobatchCounter
from megatron_ga_ext.integration.loss_contract import LossContract, mean_of_means_reports
from megatron_ga_ext.integration.noise_scale import NoiseScaleMeter
from megatron_ga_ext.integration.startup import StartupChecks
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["Installation", "check_args"]

logger = get_logger(__name__)

#: A loss function as Megatron's schedule calls it, and what wraps one (the contract's check or the mean report).
LossFunction = Callable[..., Any]
LossWrapper = Callable[[LossFunction], LossFunction]


@dataclass
class _GlobalPatch:
    """A module global install() replaced, in one module's namespace."""

    namespace: dict[str, Any]
    name: str
    original: Callable
    replacement: Callable


@dataclass
class _AttributePatch:
    """A class attribute install() replaced (a method: every instance looks it up on the class)."""

    owner: type
    name: str
    original: Callable
    replacement: Callable


@dataclass(frozen=True)
class _AdoptedFinalize:
    """A model config whose finalize_model_grads_func install() replaced: what it held, and what it holds since."""

    config: weakref.ref[TransformerConfig]
    original: Callable
    replacement: Callable


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
    patches: list[_GlobalPatch] = field(default_factory=list)
    attribute_patches: list[_AttributePatch] = field(default_factory=list)
    training_hooks_wired: set[str] = field(default_factory=set)
    """The hooks outside the three core modules (install.py's _wire_training_hooks) in place, by name."""
    configs: list[_AdoptedFinalize] = field(default_factory=list)
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
    startup: StartupChecks = field(default_factory=StartupChecks)
    """Ranks agree on the batch configuration, and a resume says what changed: once, at the first schedule call."""
    reported_first_step: bool = False
    training_schedules: int = 0
    """Training calls (not forward_only) through the guarded schedule; liveness.py compares it per optimizer step."""
    replays_expected: bool = False
    """The launch replays graphs by design (a coverage row with ``replays``): liveness does not count its iterations."""
    last_model_config: _ChunkConfig | None = None
    """The last schedule call's first chunk and its config, see model_config()."""

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
        args = megatron_args()
        config = self.config if args is None else GAConfig.from_args(args)
        if self.compat_problems and config.strict:
            raise CompatError(" ".join(self.compat_problems))
        if args is not None:
            check_args(config, args)
        self.configure(config)
        logger.info("megatron-ga-ext on megatron-core %s, from Megatron's args: %s", self.version, config)

    def patch(self, module_name: str, name: str, make: Callable[[Callable], Callable]) -> Callable:
        """Replace ``module.name`` by ``make(original)`` there and in every module that bound it."""
        module = sys.modules[module_name]
        original = module.__dict__[name]
        replacement = make(original)
        for namespace in _namespaces_holding(original, name):
            self.patches.append(_GlobalPatch(namespace, name, original, replacement))
            namespace[name] = replacement
        return replacement

    def patch_attribute(self, owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
        """Replace the class attribute ``owner.name`` by ``make(original)``."""
        original = owner.__dict__[name]
        replacement = make(original)
        self.attribute_patches.append(_AttributePatch(owner, name, original, replacement))
        setattr(owner, name, replacement)

    def restore(self) -> None:
        """Every original back where install()'s replacement is still what is bound: in the modules patched, in
        modules imported since that bound it (``from x import y`` after install()), on classes, and in model configs
        that hold the finalize (or a partial of it). A wrapper other code put on top of ours stays where it is; ours
        beneath it is inert from here on (``active`` False: it calls the original straight through)."""
        self.active = False
        if self.finalize is not None:
            self.finalize.active = False
        for a in reversed(self.attribute_patches):
            if a.owner.__dict__.get(a.name) is a.replacement:
                setattr(a.owner, a.name, a.original)
        self.attribute_patches.clear()
        for p in reversed(self.patches):
            for namespace in [p.namespace, *_namespaces_holding(p.replacement, p.name)]:
                if namespace.get(p.name) is p.replacement:
                    namespace[p.name] = p.original
        for adopted in self.configs:
            config = adopted.config()
            if config is not None and config.finalize_model_grads_func is adopted.replacement:
                config.finalize_model_grads_func = adopted.original
        self.patches.clear()
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
        """Give ``config`` the extension's finalize where it holds upstream's (set before install()) or an earlier
        installation's (set before install() with another config), directly or in a ``functools.partial``."""
        if self.finalize is None or config is None:
            return
        current = getattr(config, "finalize_model_grads_func", None)
        partial = isinstance(current, functools.partial)
        function = current.func if partial else current
        if function is self.finalize or not self._is_upstream_finalize(function):
            return
        replacement = functools.partial(self.finalize, *current.args, **current.keywords) if partial else self.finalize
        config.finalize_model_grads_func = replacement
        self.configs.append(_AdoptedFinalize(weakref.ref(config), current, replacement))

    def _is_upstream_finalize(self, function: object) -> bool:
        """Upstream's finalize (the one this installation wraps), or an uninstalled installation's wrapper of it."""
        return function is self.finalize.original or (
            isinstance(function, FinalizeModelGrads) and not function.active
            and function.original is self.finalize.original)


def _namespaces_holding(original: Callable, name: str) -> list[dict[str, Any]]:
    """Globals of every loaded module that hold ``original`` under ``name`` (``from x import name``)."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is original:
            found.append(namespace)
    return found
