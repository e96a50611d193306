"""The hook table: every Megatron target install() wraps, how, and the step phase it serves, in one place.

A row names an upstream function (a module global, rebound in every module that bound it by ``from x import y``)
or a ``Class.method`` (replaced on the class, so instances built before install() see it too), the factory
``wrap(original, state)`` that makes its replacement, and where the code is:

* ``import``: a megatron-core module, imported and wired at install();
* ``loaded``: a module of a host loop (Megatron-LM's ``megatron.training``, Megatron-Bridge's
  ``megatron.bridge.training``), wired once the script has loaded it:
  install() tries, and the calculator hook tries again (Megatron-LM's training modules are loaded by then);
* a row whose function this source does not define (``present`` false) is settled, never wired.

The wrappers of the step's phases are thin: each calls the Installation's method for its phase (installation.py),
where the order of one training step reads in one file as loops over the features. The others serve one feature or
the finalize wrapper directly: the auxiliary-loss corrections (aux_losses.py) read the loss contract and the kept
loss mask, the noise scale's bucket-group read its meter, the scaled ``get_lr`` the batch schedule's rates, finalize's
row makes the wrapper. The table's rows for a host loop are its adapter: Megatron-LM's (megatron_lm.py) and
Megatron-Bridge's (bridge_loop.py).
``fingerprinted`` rows replace behaviour and are compared with the tested sources (compat.TARGETS) before patching;
the others only wrap around a call and are not.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from megatron_ga_ext.integration import aux_losses, bridge_loop, megatron_lm
from megatron_ga_ext.integration.compat import (
    CALCULATOR,
    FINALIZE,
    GPT_MODEL,
    MOE_UTILS,
    MTP,
    ROUTER,
    SCHEDULES,
    TARGETS,
    TRAINING,
    check_targets,
)
from megatron_ga_ext.integration.finalize import FinalizeModelGrads
from megatron_ga_ext.integration.installation import Installation
from megatron_ga_ext.integration.liveness import StepLiveness
from megatron_ga_ext.integration.lr_scaling import scaled_get_lr
from megatron_ga_ext.integration.noise_scale import counting_bucket_group
from megatron_ga_ext.integration.step_guards import Guards

__all__ = ["HOOKS", "PHASES", "Hook", "hook_table", "optimizer_step", "stream_capturing", "wire"]

#: The phases of a run, in order; each row serves one (the Installation method of the same name runs it).
PHASES = ("configure", "step", "micro_batch", "finalize", "optimizer_step", "log", "save", "load")

Wrap = Callable[[Callable, Installation], Callable]


@dataclass(frozen=True)
class Hook:
    """One upstream target and how install() wraps it."""

    phase: str
    module: str
    name: str
    """A module global, or ``Class.method``."""
    wrap: Wrap
    load: str = "import"
    """``import``: imported at install(); ``loaded``: wired once the host loop has loaded the module."""
    host: str = "megatron-core"
    """The code the row belongs to: megatron-core, or a host loop (megatron-lm, megatron-bridge)."""
    present: Callable[[ModuleType], bool] | None = None
    """Whether this source has the target (None: where the name resolves)."""
    fingerprinted: bool = False
    does: str = ""
    """What the replacement does, in a few words (the table in docs/design.md)."""

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"

    def found_in(self, module: ModuleType) -> bool:
        if self.present is not None:
            return self.present(module)
        owner, _, attribute = self.name.rpartition(".")
        holder = getattr(module, owner, None) if owner else module
        return holder is not None and attribute in vars(holder)


def _schedule(original: Callable, installed_as: Installation) -> Callable:
    """A forward/backward schedule (step phase). Megatron's loop takes its forward_backward_func once, before
    training: after install() with another config that function is this wrapper still, so it runs the installation
    that replaced its own."""

    @functools.wraps(original)
    def schedule(*args: Any, **kwargs: Any) -> Any:
        state = installed_as.current()
        if state is None:
            return original(*args, **kwargs)
        step = state.begin_step(kwargs)
        result = original(*args, **kwargs)
        state.end_step(step)
        return result

    return schedule


def _forward_step_calc_loss(original: Callable, state: Installation) -> Callable:
    """Each micro-batch's forward step: the Installation counts it and wraps its loss function."""
    # Megatron passes every argument by position: find model and loss_func by index, not by Signature.bind per call.
    names = list(inspect.signature(original).parameters)
    model_at, loss_at = names.index("model"), names.index("loss_func")

    @functools.wraps(original)
    def forward_step_calc_loss(*args: Any, **kwargs: Any) -> Any:
        if not state.active:
            return original(*args, **kwargs)
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
    """Upstream's finalize, wrapped: it reads the installation's config, contract and meter by reference."""
    state.finalize = FinalizeModelGrads(original, reads=state)
    return state.finalize


def _configure_calculator(original: Callable, state: Installation) -> Callable:
    """Megatron's calculator configure (init and reconfigure, whoever calls them: calculator_adoption.py): the hooks
    of modules loaded since install() are wired first (a vendored tree's first chance, and Megatron-LM's training
    modules are loaded by then, at parsing or in initialize_runtime_services)."""
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
    """The optimizers Megatron builds: only the returned object's ``step`` is wrapped (the builder's code is
    untouched, and not fingerprinted)."""

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any) -> Any:
        optimizer = original(*args, **kwargs)
        optimizer.step = optimizer_step(optimizer.step, state, optimizer)
        return optimizer

    return build


def optimizer_step(step: Callable, state: Installation, optimizer: Any = None) -> Callable:
    """The optimizer's step between the Installation's before and after phases. The optimizer outlives an install()
    with another config: the step follows to the installation that replaced the one it was built under."""
    liveness = StepLiveness(state)

    @functools.wraps(step)
    def checked_step(*args: Any, **kwargs: Any) -> Any:
        live = state.current()
        if live is None:
            return step(*args, **kwargs)
        if live.before_optimizer_step(liveness, optimizer):
            return False, None, None  # a skipped step, as after an fp16 overflow
        result = step(*args, **kwargs)
        if not stream_capturing():  # Megatron's optimizer CUDA graph captures this step: no host read in the graph
            live.after_optimizer_step(optimizer, liveness)
        return result

    return checked_step


def stream_capturing() -> bool:
    """The current CUDA stream is capturing a graph (``--optimizer-cuda-graph`` captures the optimizer's step)."""
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


def _scheduled_count(original: Callable, state: Installation) -> Callable:
    """``wrap_data_iterator(data_iterator, config, num_microbatches, ...)`` -> (iterator, the packed count, tokens,
    squared lengths): the packed count, validated, is the one the next forward/backward call must run."""

    @functools.wraps(original)
    def wrap_data_iterator(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        live = state.current()
        if live is not None:
            guards = live.feature(Guards)
            if guards is not None:
                guards.scheduled(result[1], args[2] if len(args) > 2 else kwargs.get("num_microbatches"))
        return result

    return wrap_data_iterator


def _record_checkpoint_args(original: Callable, state: Installation) -> Callable:
    return state.agreement.recording(original)


_OPTIMIZER = "megatron.core.optimizer"
_DATA_SCHEDULE = "megatron.core.datasets.data_schedule"
_CHECKPOINTING = "megatron.training.checkpointing"
_LM: dict[str, Any] = {"load": "loaded", "host": "megatron-lm"}
_BRIDGE: dict[str, Any] = {"load": "loaded", "host": "megatron-bridge"}

#: Every target, by phase. A vendored tree (patches/) wires the rows of SCHEDULES, FINALIZE and CALCULATOR at each
#: module's import; install() wires all the rows it can.
# fmt: off
HOOKS: tuple[Hook, ...] = (
    # configure: the flags, the calculator, the run length
    Hook("configure", megatron_lm.ARGUMENTS, "parse_args", megatron_lm.with_ga_flags, load="parser", host="megatron-lm",
         does="adds the --ga-* flags; token mode turns on --calculate-per-token-loss before anything is built"),
    Hook("configure", CALCULATOR, "_configure_global_num_microbatches_calculator", _configure_calculator,
         fingerprinted=True, does="the step-schedule calculator where a schedule (or a converted rampup) is given, "
         "behind the consumed-samples guard, whoever builds it (set_global_variables; initialize_runtime_services "
         "after #7418); first, the rows of modules loaded since install()"),
    Hook("configure", TRAINING, "update_train_iters", megatron_lm.planned_train_iters, fingerprinted=True, **_LM,
         does="--train-samples under a step schedule: the steps the schedule plans"),
    Hook("configure", TRAINING, "get_train_valid_test_num_samples", megatron_lm.planned_num_samples,
         fingerprinted=True, **_LM, does="a training dataset that holds every sample the planned steps consume"),
    Hook("configure", bridge_loop.LOADERS, "get_train_valid_test_num_samples", bridge_loop.planned_num_samples,
         **_BRIDGE, does="Bridge's training dataset: every sample the planned steps consume"),
    # step: one forward/backward call, and the sequence-packing scheduler's count for it
    *(Hook("step", SCHEDULES, name, _schedule, fingerprinted=True,
           does="the start-up checks once; after the call, every chunk ran num_microbatches and finalize was reached")
      for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_with_interleaving",
                   "forward_backward_pipelining_without_interleaving")),
    Hook("step", bridge_loop.TRAIN, "train_step", bridge_loop.stepping, **_BRIDGE,
         does="Bridge's GlobalState as the step's run state: its iteration, consumed samples and writers"),
    Hook("step", _DATA_SCHEDULE, "wrap_data_iterator", _scheduled_count,
         does="the sequence-packing scheduler's count, the one the next forward/backward call must run"),
    # micro_batch: the loss contract, and the MoE/MTP terms with the loss mask's padding (aux_losses.py)
    Hook("micro_batch", SCHEDULES, "forward_step_calc_loss", _forward_step_calc_loss, fingerprinted=True,
         does="counts forward steps per chunk; token mode checks each loss function's return (the loss contract)"),
    Hook("micro_batch", bridge_loop.GPT_STEP, "get_batch", bridge_loop.keeping_loss_mask, **_BRIDGE,
         does="token mode: the loss mask kept for the model call Bridge's GPT step makes without it (#6103)"),
    Hook("micro_batch", GPT_MODEL, "GPTModel.forward", aux_losses.padding_mask_forward, fingerprinted=True,
         does="token mode, MoE: routes with padding_mask = (loss_mask == 0); a call without a loss mask gets "
         "Bridge's kept one"),
    # the router first: it binds moe_utils' functions by name, and is patched there too once it is loaded
    Hook("micro_batch", ROUTER, "TopKRouter._apply_expert_bias", aux_losses.per_token_padding_expert_bias,
         fingerprinted=True, present=lambda module: not aux_losses.broadcasts_padding_per_token(module.TopKRouter),
         does="before main@d98e8a64: the expert-bias counts given the padding mask per token"),
    Hook("micro_batch", MOE_UTILS, "get_tokens_per_expert_and_token_count", aux_losses.exact_token_counts,
         fingerprinted=True, does="the router's count n_u over this micro-batch's TP x CP group (#7452 finding 10)"),
    Hook("micro_batch", MOE_UTILS, "z_loss_func", aux_losses.tp_cp_scaled_z_loss, fingerprinted=True,
         present=lambda module: not aux_losses.router_scales_by_tp_cp(),
         does="before 0.19: the z-loss gradient times the TP x CP size (value unchanged)"),
    Hook("micro_batch", MTP, "process_mtp_loss", aux_losses.global_count_mtp_loss, fingerprinted=True,
         does="0.17+: every MTP token weighs alpha / N (#7452 finding 3)"),
    # finalize: the noise scale's read of each bucket group, then the token count N and the division
    Hook("finalize", "megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.start_grad_sync",
         counting_bucket_group, does="--ga-noise-scale, measured steps: the replica's squared norm before the "
         "reduction"),
    Hook("finalize", FINALIZE, "finalize_model_grads", _finalize, fingerprinted=True,
         does="token mode: N as int64 with the step's checks in one vector, the gradients divided by N"),
    # optimizer_step: liveness, the skip policy, the async verdict, the noise scale; the scaled learning rate
    *(Hook("optimizer_step", _OPTIMIZER, name, _optimizer_builder,
           does="the built optimizer's step: liveness, --ga-zero-token-policy skip, the async verdict, a noise-scale "
           "measurement")
      for name in ("get_megatron_optimizer", "get_megatron_muon_optimizer")),
    Hook("optimizer_step", "megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.get_lr",
         scaled_get_lr, does="--ga-lr-scaling: the rate times (GBS / first GBS) ** 1/2 or ** 1"),
    # log, save, load: what Megatron decided, the noise-scale line, the sidecar, the checkpoint's batch settings
    Hook("log", "megatron.core.rerun_state_machine", "RerunStateMachine.should_checkpoint_and_exit", _rerun_decision,
         does="what Megatron decided on a non-finite loss left to its rerun machine, logged"),
    Hook("log", TRAINING, "training_log", megatron_lm.printing_after_training_log, **_LM,
         does="--ga-noise-scale: its line after Megatron's"),
    Hook("log", bridge_loop.TRAIN, "training_log", megatron_lm.printing_after_training_log, **_BRIDGE,
         does="--ga-noise-scale: its line after Bridge's"),
    Hook("save", TRAINING, "save_checkpoint", megatron_lm.saving_sidecar, **_LM,
         does="--ga-noise-scale: its EMAs (and warmup stages) in a sidecar beside each checkpoint "
         "(non-persistent global too)"),
    Hook("load", TRAINING, "load_checkpoint", megatron_lm.loading_sidecar, **_LM,
         does="the sidecar read on resume; restored warmup stages live before the loop reads them"),
    Hook("save", bridge_loop.CHECKPOINTING, "save_checkpoint", bridge_loop.saving_sidecar, **_BRIDGE,
         does="--ga-noise-scale: its EMAs in a sidecar beside each checkpoint Bridge saves"),
    Hook("load", bridge_loop.CHECKPOINTING, "load_checkpoint", bridge_loop.loading_sidecar, **_BRIDGE,
         does="the sidecar read from the checkpoint Bridge loaded"),
    Hook("load", _CHECKPOINTING, "check_checkpoint_args", _record_checkpoint_args, **_LM,
         does="the checkpoint's batch settings, so a resume with others is said at start-up"),
)
# fmt: on

#: The modules a vendored tree patches, each wiring its rows at its import (patches/, lifecycle.wire_vendored).
CORE_MODULES = (SCHEDULES, FINALIZE, CALCULATOR)


def wire(state: Installation, module_name: str | None = None) -> None:
    """Wire every row not yet settled (only ``module_name``'s where given). A row is settled once wired, or where
    its module cannot be imported or this source lacks its target; a host loop's row whose module is not loaded
    yet waits for the next call."""
    for hook in HOOKS:
        if hook.qualified in state.settled_hooks or module_name not in (None, hook.module):
            continue
        module = _module_of(hook, state)
        if module is None or hook.qualified in state.settled_hooks:  # importing it may have wired it (vendored)
            continue
        state.settled_hooks.add(hook.qualified)
        if not isinstance(module, ModuleType) or not hook.found_in(module):
            continue
        _check_host_targets(state, hook)
        owner, _, attribute = hook.name.rpartition(".")
        wrap: Callable[[Callable], Callable] = functools.partial(_wrapped, hook, state)
        if owner:
            state.patches.patch_attribute(getattr(module, owner), attribute, wrap)
        else:
            state.patches.patch(hook.module, attribute, wrap)


def _wrapped(hook: Hook, state: Installation, original: Callable) -> Callable:
    return hook.wrap(original, state)


def _module_of(hook: Hook, state: Installation) -> ModuleType | bool | None:
    """The row's module; False where it is settled without one (not importable); None while it is not loaded."""
    if hook.load == "loaded":
        return sys.modules.get(hook.module)
    if hook.load == "parser":
        return megatron_lm.parser_module(state)
    try:
        return importlib.import_module(hook.module)
    except ImportError:  # e.g. megatron-core 0.16-0.18 have no data_schedule module
        return False


def _check_host_targets(state: Installation, hook: Hook) -> None:
    """A host loop's module is loaded after install() checked megatron-core's: its fingerprinted targets are checked
    when its first row is wired."""
    if hook.host == "megatron-core" or hook.module in state.checked_modules:
        return
    state.checked_modules.add(hook.module)
    targets = tuple(t for t in TARGETS if t.module == hook.module)
    state.compat_problems += check_targets(state.version, state.config.strict and not state.waiting_for_args, targets)


def hook_table() -> str:
    """The table as markdown, in phase order (docs/design.md)."""
    lines = ["| phase | target | wrapped as | wired | fingerprinted | what it does |", "|---|---|---|---|---|---|"]
    wired = {"import": "at install()", "loaded": "once loaded", "parser": "at install(), with Megatron-LM"}
    for hook in sorted(HOOKS, key=lambda hook: PHASES.index(hook.phase)):
        how = "class attribute" if "." in hook.name else "module global"
        lines.append(
            f"| {hook.phase} | `{hook.qualified}` | {how} | {hook.host}, {wired[hook.load]} | "
            f"{'yes' if hook.fingerprinted else 'no'} | {hook.does} |"
        )
    return "\n".join(lines)
