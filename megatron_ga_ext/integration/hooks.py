"""The hook table: every Megatron target install() wraps, how, and the step phase it serves, in one
place.

A row names an upstream function (a module global, rebound in every module that bound it by ``from x
import y``) or a ``Class.method`` (replaced on the class, so instances built before install() see it
too), the factory ``wrap(original, state)`` that makes its replacement, and where the code is:

* ``import``: a megatron-core module, imported and wired at install();
* ``loaded``: a module of a host loop (Megatron-LM's ``megatron.training``, Megatron-Bridge's
  ``megatron.bridge.training``), wired once the script has loaded it: install() tries, and the
  calculator hook tries again (Megatron-LM's training modules are loaded by then);
* a row whose function this source does not define (``present`` false) is settled, never wired.

The rows here are the phases' (their wrappers are thin: each calls the Installation's method for its
phase, installation.py, where one training step reads in one file as loops over the features), each
wired where the installation needs it (``when``: the optimizer's step where a feature has a part in
it, the log where one prints, the checkpoint where one keeps state). A feature's own rows are beside
it (``Feature.hooks``: the auxiliary-loss corrections, the noise scale's read of each bucket group,
the scaled ``get_lr``, the packing scheduler's count), and install() wires the union (:func:`rows`).
The table's rows for a host loop are its adapter: Megatron-LM's (megatron_lm.py) and
Megatron-Bridge's (bridge_loop.py). ``fingerprinted`` rows replace behaviour and are compared with
the tested sources (compat.TARGETS) before patching; the others only wrap around a call and are not.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from megatron_ga_ext.integration import bridge_loop, megatron_lm
from megatron_ga_ext.integration.acceptance import check_targets
from megatron_ga_ext.integration.compat import (
    CALCULATOR,
    FINALIZE,
    SCHEDULES,
    TARGETS,
    TRAINING,
)
from megatron_ga_ext.integration.features import Feature
from megatron_ga_ext.integration.finalize import FinalizeModelGrads
from megatron_ga_ext.integration.hook_rows import PHASES, Hook
from megatron_ga_ext.integration.installation import FEATURES, Installation
from megatron_ga_ext.integration.liveness import StepLiveness
from megatron_ga_ext.logs import get_logger

__all__ = [
    "HOOKS",
    "PHASES",
    "Hook",
    "all_rows",
    "optimizer_step",
    "rows",
    "stream_capturing",
    "wire",
    "wired_line",
]

logger = get_logger(__name__)


def _configured(state: Installation) -> None:
    """Where install() came before Megatron parsed its args: the config read now, and the rows it
    needs wired."""
    if state.waiting_for_args:
        state.configure_from_megatron_args()
        wire(state)
        logger.info("megatron-ga-ext: %s", wired_line(state))


def wired_line(state: Installation) -> str:
    """What install() wrapped so far, for the start-up log: how many upstream functions, and
    which."""
    names = state.wiring.patches.wrapped()
    return f"{len(names)} upstream functions wrapped: " + ", ".join(
        name.rsplit(".", 1)[-1] for name in names
    )


def _schedule(original: Callable, installed_as: Installation) -> Callable:
    """A forward/backward schedule (step phase). Megatron's loop takes its forward_backward_func
    once, before training: after install() with another config that function is this wrapper still,
    so it runs the installation that replaced its own."""

    @functools.wraps(original)
    def schedule(*args: Any, **kwargs: Any) -> Any:
        state = installed_as.current()
        if state is None:
            return original(*args, **kwargs)
        _configured(state)
        step = state.begin_step(kwargs)
        result = original(*args, **kwargs)
        state.end_step(step)
        return result

    return schedule


def _forward_step_calc_loss(original: Callable, state: Installation) -> Callable:
    """Each micro-batch's forward step: the Installation counts it and wraps its loss function."""
    # Megatron passes every argument by position: find model and loss_func by index, not by
    # Signature.bind per call.
    names = list(inspect.signature(original).parameters)
    model_at, loss_at = names.index("model"), names.index("loss_func")

    @functools.wraps(original)
    def forward_step_calc_loss(*args: Any, **kwargs: Any) -> Any:
        if not state.active:
            return original(*args, **kwargs)
        _configured(state)
        if len(args) > loss_at:
            args_list = list(args)
            args_list[loss_at] = state.micro_batch(args[model_at], args[loss_at])
            return original(*args_list, **kwargs)
        model = args[model_at] if len(args) > model_at else kwargs["model"]
        loss_func = state.micro_batch(model, kwargs.get("loss_func"))
        if loss_func is not None:
            kwargs["loss_func"] = loss_func
        return original(*args, **kwargs)

    return forward_step_calc_loss


def _finalize(original: Callable, state: Installation) -> Callable:
    """Upstream's finalize, wrapped: it reads the installation's config and contract by reference,
    and hands it the step's values (finalize.py)."""
    state.finalize = FinalizeModelGrads(original, reads=state)
    return state.finalize


def _configure_calculator(original: Callable, state: Installation) -> Callable:
    """Megatron's calculator configure (init and reconfigure, whoever calls them:
    calculator_adoption.py): the hooks of modules loaded since install() are wired first (a vendored
    tree's first chance, and Megatron-LM's training modules are loaded by then, at parsing or in
    initialize_runtime_services)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def configure(*args: Any, **kwargs: Any) -> None:
        if not state.active:
            original(*args, **kwargs)
            return
        state.configure_from_megatron_args()
        wire(state)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        state.configure_calculator(original, bound)

    return configure


def _optimizer_builder(original: Callable, state: Installation) -> Callable:
    """The optimizers Megatron builds: only the returned object's ``step`` is wrapped (the builder's
    code is untouched, and not fingerprinted)."""

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any) -> Any:
        optimizer = original(*args, **kwargs)
        optimizer.step = optimizer_step(optimizer.step, state, optimizer)
        return optimizer

    return build


def optimizer_step(step: Callable, state: Installation, optimizer: Any = None) -> Callable:
    """The optimizer's step between the Installation's before and after phases. The optimizer
    outlives an install() with another config: the step follows to the installation that replaced
    the one it was built under."""
    liveness = StepLiveness(state)

    @functools.wraps(step)
    def checked_step(*args: Any, **kwargs: Any) -> Any:
        live = state.current()
        if live is None:
            return step(*args, **kwargs)
        stepping = live.before_optimizer_step(liveness, optimizer)
        if stepping.skip:
            return False, None, None  # a skipped step, as after an fp16 overflow
        result = step(*args, **kwargs)
        if (
            not stream_capturing()
        ):  # Megatron's optimizer CUDA graph captures this step: no host read in the graph
            live.after_optimizer_step(stepping)
        return result

    return checked_step


def stream_capturing() -> bool:
    """The current CUDA stream is capturing a graph (``--optimizer-cuda-graph`` captures the
    optimizer's step)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _rerun_decision(original: Callable, state: Installation) -> Callable:
    @functools.wraps(original)
    def should_checkpoint_and_exit(machine: Any, *args: Any, **kwargs: Any) -> Any:
        decision = original(machine, *args, **kwargs)
        if state.active:
            state.rerun_decided(decision)
        return decision

    return should_checkpoint_and_exit


def _record_checkpoint_args(original: Callable, state: Installation) -> Callable:
    return state.agreement.recording(original)


def _runs(phase: str) -> Callable[[Installation], bool]:
    """The installation has a feature with a part in ``phase`` (a method of its own by that
    name)."""
    return lambda state: any(_overrides(type(feature), phase) for feature in state.features)


def _overrides(kind: type[Feature], phase: str) -> bool:
    return getattr(kind, phase) is not getattr(Feature, phase)


def _stateful(state: Installation) -> bool:
    """A feature keeps state across a resume (the checkpoint sidecar)."""
    return any(feature.name for feature in state.features)


def _optimizer(state: Installation) -> bool:
    """Token mode (finalize's verdict: the zero-token skip, a deferred non-finite loss, the async
    read, one finalize a step), or a feature with a part in the optimizer's step (the guards'
    liveness, always there)."""
    return state.contract is not None or any(
        _overrides(type(feature), phase)
        for feature in state.features
        for phase in ("before_optimizer_step", "after_optimizer_step")
    )


def _token(state: Installation) -> bool:
    return state.contract is not None


_OPTIMIZER = "megatron.core.optimizer"
_CHECKPOINTING = "megatron.training.checkpointing"
_LM: dict[str, Any] = {"load": "loaded", "host": "megatron-lm"}
_BRIDGE: dict[str, Any] = {"load": "loaded", "host": "megatron-bridge"}
_LOG: dict[str, Any] = {"when": _runs("after_log")}
_STATE: dict[str, Any] = {"when": _stateful}

#: The rows the phases run on, by phase; each feature's own rows are beside it (Feature.hooks). A
#: vendored tree (patches/) wires the rows of SCHEDULES, FINALIZE and CALCULATOR at each module's
#: import; install() wires the rows its installation needs (``when``), and those of its features.
# fmt: off
HOOKS: tuple[Hook[Installation], ...] = (
    # configure: the flags, the calculator, the run length
    Hook("configure", megatron_lm.ARGUMENTS, "parse_args", megatron_lm.with_ga_flags, load="parser", host="megatron-lm",
         does="adds the --ga-* flags; token mode turns on --calculate-per-token-loss before "
             "anything is built"),
    Hook("configure", CALCULATOR, "_configure_global_num_microbatches_calculator", _configure_calculator,
         fingerprinted=True, does="the step-schedule calculator where a schedule (or a converted "
             "rampup) is given, "
         "behind the consumed-samples guard, whoever builds it (set_global_variables; "
             "initialize_runtime_services "
         "after #7418); first, the rows of modules loaded since install()"),
    Hook("configure", TRAINING, "update_train_iters", megatron_lm.planned_train_iters, fingerprinted=True, **_LM,
         does="--train-samples under a step schedule: the steps the schedule plans"),
    Hook("configure", TRAINING, "get_train_valid_test_num_samples", megatron_lm.planned_num_samples,
         fingerprinted=True, **_LM, does="a training dataset that holds every sample the planned "
             "steps consume"),
    Hook("configure", bridge_loop.LOADERS, "get_train_valid_test_num_samples", bridge_loop.planned_num_samples,
         **_BRIDGE, does="Bridge's training dataset: every sample the planned steps consume"),
    # step: one forward/backward call
    *(Hook("step", SCHEDULES, name, _schedule, fingerprinted=True,
           does="the start-up checks once; after the call, every chunk ran num_microbatches and "
               "finalize was reached")
      for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_with_interleaving",
                   "forward_backward_pipelining_without_interleaving")),
    Hook("step", bridge_loop.TRAIN, "train_step", bridge_loop.stepping, **_BRIDGE,
         does="Bridge's GlobalState as the step's run state: its iteration, consumed samples and "
             "writers"),
    # micro_batch: each forward step's loss function
    Hook("micro_batch", SCHEDULES, "forward_step_calc_loss", _forward_step_calc_loss, fingerprinted=True,
         does="counts forward steps per chunk; token mode checks each loss function's return "
             "(the loss contract)"),
    # finalize: the token count N, the features' finalize, the division
    Hook("finalize", FINALIZE, "finalize_model_grads", _finalize, fingerprinted=True,
         does="token mode: N as int64 with the step's checks in one vector, the features' "
             "finalize, the gradients "
         "divided by N"),
    # optimizer_step: finalize's verdict and the features' parts around the optimizer's step
    *(Hook("optimizer_step", _OPTIMIZER, name, _optimizer_builder, when=_optimizer,
           does="the built optimizer's step: liveness, --ga-zero-token-policy skip, the async "
               "verdict, the features' "
           "parts")
      for name in ("get_megatron_optimizer", "get_megatron_muon_optimizer")),
    # log, save, load: what Megatron decided, the features' lines, the sidecar, the checkpoint's
    # batch settings
    Hook("log", "megatron.core.rerun_state_machine", "RerunStateMachine.should_checkpoint_and_exit", _rerun_decision,
         when=_token, does="token mode: what Megatron decided on a non-finite loss left to its "
             "rerun machine, logged"),
    Hook("log", TRAINING, "training_log", megatron_lm.printing_after_training_log, **_LM, **_LOG,
         does="a feature's line after Megatron's (--ga-noise-scale)"),
    Hook("log", bridge_loop.TRAIN, "training_log", megatron_lm.printing_after_training_log, **_BRIDGE, **_LOG,
         does="a feature's line after Bridge's (--ga-noise-scale)"),
    Hook("save", TRAINING, "save_checkpoint", megatron_lm.saving_sidecar, **_LM, **_STATE,
         does="the features' state (noise-scale EMAs, warmup stages) in a sidecar beside each "
             "checkpoint "
         "(non-persistent global too)"),
    Hook("load", TRAINING, "load_checkpoint", megatron_lm.loading_sidecar, **_LM, **_STATE,
         does="the sidecar read on resume; restored warmup stages live before the loop reads them"),
    Hook("save", bridge_loop.CHECKPOINTING, "save_checkpoint", bridge_loop.saving_sidecar, **_BRIDGE, **_STATE,
         does="the features' state in a sidecar beside each checkpoint Bridge saves"),
    Hook("load", bridge_loop.CHECKPOINTING, "load_checkpoint", bridge_loop.loading_sidecar, **_BRIDGE, **_STATE,
         does="the sidecar read from the checkpoint Bridge loaded"),
    Hook("load", _CHECKPOINTING, "check_checkpoint_args", _record_checkpoint_args, **_LM,
         does="the checkpoint's batch settings, so a resume with others is said at start-up"),
)
# fmt: on

#: The modules a vendored tree patches, each wiring its rows at its import (patches/,
#: lifecycle.wire_vendored).
CORE_MODULES = (SCHEDULES, FINALIZE, CALCULATOR)


def rows(state: Installation) -> list[Hook[Installation]]:
    """The rows ``state`` needs: the phases' rows its features and config call for, then its
    features' own."""
    every = HOOKS + tuple(hook for feature in state.features for hook in type(feature).hooks)
    return [hook for hook in every if hook.when is None or hook.when(state)]


def all_rows() -> tuple[Hook[Installation], ...]:
    """Every row: the phases' and every feature's own (each feature's module imported)."""
    return HOOKS + tuple(hook for entry in FEATURES for hook in entry.load().hooks)


def wire(state: Installation, module_name: str | None = None) -> None:
    """Wire every row ``state`` needs not yet settled (only ``module_name``'s where given). A row is
    settled once wired, or where its module cannot be imported or this source lacks its target; a
    host loop's row whose module is not loaded yet waits for the next call."""
    settled = state.wiring.settled_hooks
    for hook in rows(state):
        if hook.qualified in settled or module_name not in (None, hook.module):
            continue
        module = _module_of(hook, state)
        if module is None or hook.qualified in settled:  # importing it may have wired it (vendored)
            continue
        settled.add(hook.qualified)
        if not isinstance(module, ModuleType) or not hook.found_in(module):
            continue
        _check_host_targets(state, hook)
        owner, _, attribute = hook.name.rpartition(".")
        wrap: Callable[[Callable], Callable] = functools.partial(_wrapped, hook, state)
        if owner:
            state.wiring.patches.patch_attribute(getattr(module, owner), attribute, wrap)
        else:
            state.wiring.patches.patch(hook.module, attribute, wrap)


def _wrapped(hook: Hook, state: Installation, original: Callable) -> Callable:
    return hook.wrap(original, state)


def _module_of(hook: Hook, state: Installation) -> ModuleType | bool | None:
    """The row's module; False where it is settled without one (not importable); None while it is
    not loaded."""
    if hook.load == "loaded":
        return sys.modules.get(hook.module)
    if hook.load == "parser":
        return megatron_lm.parser_module(state)
    try:
        return importlib.import_module(hook.module)
    except ImportError:  # e.g. megatron-core 0.16-0.18 have no data_schedule module
        return False


def _check_host_targets(state: Installation, hook: Hook) -> None:
    """A host loop's module is loaded after install() checked megatron-core's: its fingerprinted
    targets are checked when its first row is wired."""
    wiring = state.wiring
    if hook.host == "megatron-core" or hook.module in wiring.checked_modules:
        return
    wiring.checked_modules.add(hook.module)
    targets = tuple(t for t in TARGETS if t.module == hook.module)
    wiring.compat_problems += check_targets(
        state.version,
        state.config.strict and not state.waiting_for_args,
        targets,
        accept=state.config.accept_source,
    )
