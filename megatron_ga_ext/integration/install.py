"""``install()`` / ``uninstall()``: wire the extension into megatron-core, and ``add_args()`` for its flags.

What install() patches, after checking each target's source fingerprint against the tested sources
(compat.py):

* ``schedules.forward_step_calc_loss`` (a module global every schedule looks up, combined_1f1b too):
  count forward steps per model chunk, and in ``token`` mode check the loss contract;
* the three ``forward_backward_*`` schedules (``get_forward_backward_func`` returns module globals):
  after each call, every chunk ran exactly num_microbatches = GBS / (MBS x DP) micro-batches (under the
  sequence-packing scheduler, the count its ``wrap_data_iterator`` returned for the call: training_hooks.py);
* ``finalize_model_grads``: the token-mode finalize (int64 count, checks read once per step);
* ``_configure_global_num_microbatches_calculator`` (called by init and reconfigure): the global
  calculator becomes the step-schedule calculator where a schedule (or a converted rampup) is given,
  and is wrapped by the consumed-samples guard;
* Megatron-LM's ``update_train_iters`` and ``get_train_valid_test_num_samples`` (megatron.training,
  wired once it is loaded): with a step schedule or a converted rampup in force, ``--train-samples``
  gives the planned number of steps (and a dataset that holds the samples they consume), not
  train_samples // global_batch_size of a constant batch; and Megatron-LM's parser, the optimizers Megatron
  builds and ``GPTModel.forward`` (training_hooks.py, arguments.py and aux_losses.py have these hooks).

A name bound elsewhere by ``from x import y`` before install() (megatron.training.training binds
``finalize_model_grads``) is rebound too: every loaded module whose global holds the original is patched.
A model config that already holds upstream's ``finalize_model_grads`` (a loop that set it before
install()) gets the extension's at the next forward/backward call, and a training step that never
reached the extension's finalize in token mode is an error. uninstall() puts back every original: in the
modules patched, in modules imported since that bound a replacement, and in model configs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import sys
from typing import Any, Callable

from megatron_ga_ext.config.args import add_args, args_provider
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.errors import GuardError, ScheduleError
from megatron_ga_ext.integration.arguments import wire_arguments
from megatron_ga_ext.integration.noise_scale import wire_bucket_groups
from megatron_ga_ext.integration.aux_losses import aux_summary, pipeline_inexact_note
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.integration.compat import (
    CALCULATOR,
    FINALIZE,
    SCHEDULES,
    TARGETS,
    check_targets,
    live_calculator,
    matching_sources,
    megatron_args,
    megatron_core_version,
    set_live_calculator,
)
from megatron_ga_ext.integration.finalize import make_finalize_model_grads
from megatron_ga_ext.integration.guards import GuardedCalculator, current_pipeline_size
from megatron_ga_ext.integration.installation import Installation, check_args
from megatron_ga_ext.integration.lr_scaling import wire_lr_scaling
from megatron_ga_ext.integration.training_hooks import (
    wire_gpt_model,
    wire_optimizer,
    wire_packing_scheduler,
    wire_rerun_machine,
    wire_training,
)
from megatron_ga_ext.logs import get_logger

__all__ = ["GAConfig", "Installation", "add_args", "args_provider", "install", "installed", "uninstall", "wire_vendored"]

logger = get_logger(__name__)

SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
)


#: The live installation. install(), uninstall() and installed() take no handle (a training script calls install()
#: once at its top, and a vendored tree's patched modules call wire_vendored() with their name only), so the one
#: installation of the process is kept here, set by install() and wire_vendored(), cleared by uninstall().
_live: Installation | None = None


def installed() -> Installation | None:
    """The live installation, if any."""
    return _live


def install(config: GAConfig | argparse.Namespace | None = None) -> Installation:
    """Turn the extension on. ``config``: a :class:`GAConfig`, Megatron's parsed args, or None: Megatron's
    parsed args once they exist (read at the first hook that runs), else the defaults (token mode,
    strict). Twice is harmless; a different config replaces the installation."""
    global _live
    resolved, waiting = _resolve_config(config)
    current = _live
    if current is not None:
        if config is None or current.config == resolved:
            return current
        if current.vendored:  # the tree is wired already (patches/): only the config changes
            current.waiting_for_args = False
            current.configure(resolved)
            return current
        uninstall()
    import megatron.core.distributed.finalize_model_grads  # noqa: F401  (load every target module)
    import megatron.core.num_microbatches_calculator  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401

    version = megatron_core_version()
    # Waiting for Megatron's args, strictness is theirs to decide (--no-ga-strict): refused at the first hook.
    problems = check_targets(version, resolved.strict and not waiting, TARGETS)
    args = config if config is not None and not isinstance(config, GAConfig) else None
    if config is None and not waiting:
        args = megatron_args()
    if args is not None:
        check_args(resolved, args)
    sources = ", ".join(matching_sources()) or "no single tested source"
    state = Installation(config=resolved, version=version, waiting_for_args=waiting, compat_problems=problems)
    state.configure(resolved)
    try:
        for wire in WIRE_CORE_MODULE.values():
            wire(state)
        _wire_training_hooks(state)
        _reconfigure_live_calculator(state)
        _guard_live_calculator(state)
    except BaseException:
        state.restore()
        raise
    if current is not None:
        current.successor = state  # wrappers that outlive the old installation (an optimizer's step) follow it
    _live = state
    if waiting:
        logger.info("megatron-ga-ext installed on megatron-core %s (hooked functions as in %s); its "
                    "configuration is read from Megatron's args once they are parsed", version, sources)
    else:
        logger.info("megatron-ga-ext installed on megatron-core %s (hooked functions as in %s): %s",
                    version, sources, resolved)
    return state


def wire_vendored(module_name: str) -> None:
    """Called at the end of each patched upstream module of a vendored tree (patches/): wire that module
    into the one installation, which reads Megatron's args at its first hook like install()."""
    global _live
    if _live is None:
        _live = Installation(config=GAConfig(), version=megatron_core_version(), vendored=True, waiting_for_args=True)
        _live.configure(_live.config)
    WIRE_CORE_MODULE[module_name](_live)


def uninstall() -> None:
    """Restore every original install() replaced; harmless when nothing is installed."""
    global _live
    state, _live = _live, None
    if state is None:
        return
    state.restore()
    live = live_calculator()
    if isinstance(live, GuardedCalculator):
        set_live_calculator(live.inner)
    if state.finalize is not None:
        state.finalize.poll(wait=True)  # --ga-checks async: the last step's verdict, everything restored first


def _resolve_config(config: GAConfig | argparse.Namespace | None) -> tuple[GAConfig, bool]:
    """(config, waiting): waiting when Megatron's training code exists but has not parsed its args yet."""
    if isinstance(config, GAConfig):
        return config, False
    if config is not None:
        return GAConfig.from_args(config), False
    args = megatron_args()
    if args is not None:
        return GAConfig.from_args(args), False
    return GAConfig(), _has_megatron_training()


def _has_megatron_training() -> bool:
    """Megatron-LM's training package is there (it is not in the megatron-core wheel)."""
    if "megatron.training" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def _wire_schedules(state: Installation) -> None:
    state.patch(SCHEDULES, "forward_step_calc_loss", lambda original: _forward_step_calc_loss(original, state))
    for name in SCHEDULE_FUNCTIONS:
        state.patch(SCHEDULES, name, lambda original: _checked_schedule(original, state))


def _wire_finalize(state: Installation) -> None:
    state.finalize = state.patch(
        FINALIZE, "finalize_model_grads",
        lambda original: make_finalize_model_grads(original, state.contract, config=state.config),
    )
    state.finalize.noise_scale = state.noise_scale


def _wire_calculator(state: Installation) -> None:
    state.patch(CALCULATOR, "_configure_global_num_microbatches_calculator", lambda o: _configure_calculator(o, state))


def _wire_training_hooks(state: Installation) -> None:
    """The hooks outside the three modules a vendored tree patches (patches/): Megatron-LM's parser and training
    loop, the optimizer builders, GPTModel and the checkpoint's args. Each is wired once, as soon as its module is
    loaded: install() tries them all, and the calculator hook tries again (a vendored tree's first chance, and
    Megatron-LM's training modules are loaded by then)."""
    for name, wire in (("arguments", wire_arguments), ("optimizer", wire_optimizer), ("gpt_model", wire_gpt_model),
                       ("rerun_machine", wire_rerun_machine), ("training", wire_training),
                       ("packing_scheduler", wire_packing_scheduler),
                       ("bucket_groups", wire_bucket_groups), ("lr_scaling", wire_lr_scaling),
                       ("checkpoint_args", state.startup.wire)):
        if name not in state.training_hooks_wired and wire(state) is not False:
            state.training_hooks_wired.add(name)


#: How each of the three core modules is wired: install() runs all of them, a vendored tree each at its module's
#: import.
WIRE_CORE_MODULE: dict[str, Callable[[Installation], None]] = {
    SCHEDULES: _wire_schedules, FINALIZE: _wire_finalize, CALCULATOR: _wire_calculator}


def _forward_step_calc_loss(original: Callable, state: Installation) -> Callable:
    """Counts forward steps per chunk; checks each micro-batch's loss in token mode, and in microbatch mode
    reports the micro-batch's mean (what that mode optimises) to Megatron's logged loss."""
    # Megatron passes every argument by position: find model and loss_func by index, not by Signature.bind per call.
    names = list(inspect.signature(original).parameters)
    model_at, loss_at = names.index("model"), names.index("loss_func")

    @functools.wraps(original)
    def forward_step_calc_loss(*args: Any, **kwargs: Any):
        if not state.active:
            return original(*args, **kwargs)
        state.configure_from_megatron_args()
        state.counter.count(args[model_at] if len(args) > model_at else kwargs["model"])
        if len(args) > loss_at:
            args = list(args)
            if args[loss_at] is not None:
                args[loss_at] = state.wrap_loss(args[loss_at])
        elif kwargs.get("loss_func") is not None:
            kwargs["loss_func"] = state.wrap_loss(kwargs["loss_func"])
        return original(*args, **kwargs)

    return forward_step_calc_loss


def _checked_schedule(original: Callable, installed_as: Installation) -> Callable:
    """The schedule, guarded. Megatron's loop takes its forward_backward_func once, before training: after install()
    with another config that function is this wrapper still, so it runs the installation that replaced its own."""

    @functools.wraps(original)
    def schedule(*args: Any, **kwargs: Any):
        state = installed_as.current()
        if state is None:
            return original(*args, **kwargs)
        state.configure_from_megatron_args()
        verdict = state.startup.run_once(state.config, megatron_args())
        if verdict is not None:
            state.replays_expected = any(row.replays for row in verdict.limited)
        finalize, contract = state.finalize, state.contract
        finalize.poll(wait=True)  # --ga-checks async: the last step's verdict, if not read after its optimizer step
        state.counter.reset()
        if contract is not None:  # an evaluation call (forward_only) never reaches finalize
            contract.reset()
        if state.config.guards:  # the sequence-packing scheduler's count, before its iterator is read
            state.counter.check_scheduled(kwargs["num_microbatches"])
        forward_only = kwargs.get("forward_only")
        if not forward_only:
            state.training_schedules += 1
        state.adopt_finalize(state.model_config(kwargs.get("model")))
        finalized = finalize.calls
        result = original(*args, **kwargs)
        if not forward_only and not state.reported_first_step:
            _report_first_step(state, kwargs)
        if not forward_only and contract is not None and finalize.calls == finalized:
            raise GuardError(
                "this training step's forward_backward_func never called megatron-ga-ext's finalize_model_grads, "
                "so the global token count N was not taken and the gradients were not divided by it (nor checked). "
                "Set config.finalize_model_grads_func to megatron.core.distributed.finalize_model_grads after "
                "megatron_ga_ext.install(), or leave it to Megatron's training loop.")
        if state.config.guards:
            state.counter.check(kwargs["num_microbatches"], None if forward_only else live_calculator())
        return result

    return schedule


def _report_first_step(state: Installation, kwargs: dict) -> None:
    """Once, after the first training step: the auxiliary losses and their scaling, and where this release or
    layout cannot meet the token-mode target, by how much (aux_losses.py)."""
    from megatron.core import parallel_state

    state.reported_first_step = True
    config = state.model_config(kwargs.get("model"))
    mode = state.config.loss_reduction
    summary = aux_summary(config, mode)
    if summary is None:
        return
    logger.info(summary)
    state.finalize.poll(wait=True)  # the first step's N (under --ga-checks async, once)
    positions = (kwargs["num_microbatches"] * kwargs.get("micro_batch_size", 1) * kwargs.get("seq_length", 0)
                 * parallel_state.get_data_parallel_world_size())
    note = pipeline_inexact_note(config, mode, current_pipeline_size(), positions, state.finalize.last_num_tokens or 0)
    if note is not None:
        logger.warning(note)


def _configure_calculator(original: Callable, state: Installation) -> Callable:
    """Upstream's configure, or the step-schedule calculator where a schedule (or a converted rampup)
    is given; then the consumed-samples guard around whichever is live."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def configure(*args: Any, **kwargs: Any) -> None:
        if not state.active:
            return original(*args, **kwargs)
        state.configure_from_megatron_args()
        _wire_training_hooks(state)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        inputs = ScheduleInputs.from_calculator_call(state.config, bound.arguments)
        schedule = resolve_schedule(inputs)
        if schedule is None:
            original(*bound.args, **bound.kwargs)
        else:
            set_live_calculator(StepScheduleCalculator.for_launch(schedule, inputs, rank=bound.arguments["rank"]))
        _guard_live_calculator(state)

    return configure


def _reconfigure_live_calculator(state: Installation) -> None:
    """install() after Megatron built its calculator (after ``initialize_megatron``, or after
    ``init_num_microbatches_calculator`` in a megatron-core loop): where the config asks for a step schedule (given,
    backported, or a converted rampup), the live calculator becomes the extension's, with the live one's MBS and
    DP and the GBS a rampup ends at (Megatron's ``--global-batch-size`` where its args exist), advanced to the
    consumed samples Megatron's args hold (0 before training). Raises a ScheduleError naming the fix where the live
    calculator does not say its MBS and DP."""
    live = live_calculator()
    inner = getattr(live, "inner", live)
    if live is None or isinstance(inner, StepScheduleCalculator) or state.waiting_for_args:
        return
    args = megatron_args()
    micro_batch_size = getattr(inner, "micro_batch_size", None)
    global_batch_size = getattr(args, "global_batch_size", None) or getattr(inner, "global_batch_size", None) \
        or getattr(inner, "current_global_batch_size", None)
    arguments = {"micro_batch_size": micro_batch_size, "global_batch_size": global_batch_size, "rampup_batch_size": None,
                 "data_parallel_size": _data_parallel_size(inner)}
    inputs = ScheduleInputs.from_calculator_call(state.config, arguments)
    schedule = resolve_schedule(inputs)
    if schedule is None:
        return
    if arguments["data_parallel_size"] is None:
        raise ScheduleError(
            f"install() came after Megatron built its num-microbatches calculator ({type(inner).__name__}), which "
            f"does not say its --micro-batch-size and data-parallel size, so the step schedule {schedule} cannot "
            f"replace it. Call megatron_ga_ext.install() before initialize_megatron() (or before "
            f"init_num_microbatches_calculator() in a megatron-core loop).")
    from torch import distributed

    rank = distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0
    calculator = StepScheduleCalculator.for_launch(schedule, inputs, rank=rank)
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0)
    if consumed:
        calculator.update(consumed, consistency_check=False)
    set_live_calculator(calculator)
    logger.info("megatron-ga-ext installed after Megatron built its calculator (%s): replaced by the step schedule "
                "%s at %d consumed samples (MBS %d, DP %d)", type(inner).__name__, schedule, consumed,
                micro_batch_size, arguments["data_parallel_size"])


def _data_parallel_size(calculator: object) -> int | None:
    """DP of a built calculator: MBS x DP / MBS where it keeps that product (the schedule calculators), else the
    running GBS / (MBS x num_microbatches) (upstream's constant one keeps only those); None where it says neither."""
    micro_batch_size = getattr(calculator, "micro_batch_size", None)
    if not micro_batch_size:
        return None
    product = getattr(calculator, "micro_batch_times_data_parallel_size", None)
    if product:
        return product // micro_batch_size
    running = getattr(calculator, "current_running_global_batch_size", None)
    microbatches = getattr(calculator, "num_micro_batches", None)
    if running and microbatches and running % (micro_batch_size * microbatches) == 0:
        return running // (micro_batch_size * microbatches)
    return None


def _guard_live_calculator(state: Installation) -> None:
    live = live_calculator()
    if live is None or isinstance(live, GuardedCalculator) or not state.config.guards:
        return
    set_live_calculator(GuardedCalculator(live, state.config.pipeline_model_parallel_size))
