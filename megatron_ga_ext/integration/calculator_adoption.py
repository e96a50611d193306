"""The live num-microbatches calculator made the extension's, wherever and whenever Megatron builds
it: the one module that replaces it (:func:`build_calculator`, :func:`schedule_live_calculator`,
:func:`guard_live_calculator`, and :func:`unguard_live_calculator` at uninstall()).

Where Megatron-LM builds it:

* every source we test (0.16.1 to main@d98e8a64): ``megatron/training/arguments.py``'s
  ``parse_and_validate_args`` ends in ``megatron/training/global_vars.py``'s
  ``set_global_variables(args)``, which calls megatron-core's ``init_num_microbatches_calculator``
  and then builds the tokenizer (``_build_tokenizer``) and the loggers (``_set_tensorboard_writer``,
  ``_set_wandb_writer``, ``_set_one_logger``, ``_set_adlr_autoresume``, ``_set_timers``,
  ``_set_energy_monitor``, ``_set_telemetry``): the calculator exists once the args are parsed;
* Megatron-LM #7418 (merged after main@d98e8a64): ``parse_and_validate_args`` only parses, validates
  and registers the args (``set_args``); the calculator, the tokenizer and the loggers move, in that
  order, into a new ``global_vars.initialize_runtime_services(args)``, which ``pretrain_gpt.py``'s
  ``__main__`` calls after it has built the model config and the config container from the args,
  before ``pretrain()``. ``set_global_variables`` still registers the args and calls it. Between
  parsing and that call there is no calculator.

Nothing here depends on that point. ``init_num_microbatches_calculator`` and
``reconfigure_num_microbatches_calculator`` build through the module global
``_configure_global_num_microbatches_calculator`` on every release, whoever calls them
(``set_global_variables``, ``initialize_runtime_services``, a megatron-core loop); install() wraps
it (hooks.py), so a calculator built after install() is built as the config asks, whichever function
builds it. A calculator built before install() is adopted at install()
(:func:`schedule_live_calculator`, then the guard). And one that reached the global where neither
saw it is adopted at Megatron-LM's ``update_train_iters`` (which plans the run length from it) or at
the next forward/backward call, with a warning (``Installation.adopt_live_calculator``). The drop-in
(install() at the top of the script, or ``python -m megatron_ga_ext``) runs before both points, so
Megatron-LM's calculator goes through the hook in either order; a script's own install() may come
before parsing, between parsing and ``initialize_runtime_services`` (it reads the registered args),
or after.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.errors import ScheduleError
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.integration.compat import Calculator, live_calculator, set_live_calculator
from megatron_ga_ext.integration.guards import GuardedCalculator
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.logs import get_logger

__all__ = ["BUILT_UNSEEN", "guard_live_calculator", "schedule_live_calculator"]

logger = get_logger(__name__)

#: Said where a calculator is adopted that no hook of the installation saw built.
BUILT_UNSEEN = (
    "megatron-ga-ext: the num-microbatches calculator in force ({kind}) was built where "
    "install() did not see it (not through megatron-core's "
    "init_num_microbatches_calculator or reconfigure_num_microbatches_calculator after "
    "install(), nor before install()); adopted at {where}, as install() adopts one built "
    "before it"
)


def schedule_live_calculator(config: GAConfig) -> None:
    """Where ``config`` asks for a step schedule (given, backported, a converted rampup,
    --ga-batch-size-warmup auto) and the live calculator is not the extension's: the live calculator
    becomes the extension's, with the live one's MBS and DP and the GBS a rampup ends at (Megatron's
    ``--global-batch-size`` where its args exist), advanced to the consumed samples Megatron's args
    hold (0 before training). Raises a ScheduleError naming the fix where the live calculator does
    not say its MBS and DP."""
    live = live_calculator()
    inner = getattr(live, "inner", live)
    if live is None or isinstance(inner, StepScheduleCalculator):
        return
    args = current_host().settings()
    micro_batch_size = getattr(inner, "micro_batch_size", None)
    global_batch_size = (
        args.global_batch_size
        or getattr(inner, "global_batch_size", None)
        or getattr(inner, "current_global_batch_size", None)
    )
    arguments = {
        "micro_batch_size": micro_batch_size,
        "global_batch_size": global_batch_size,
        "rampup_batch_size": None,
        "data_parallel_size": _data_parallel_size(inner),
    }
    inputs = ScheduleInputs.from_calculator_call(config, arguments)
    schedule = resolve_schedule(inputs)
    if schedule is None:
        return
    if arguments["data_parallel_size"] is None:
        raise ScheduleError(
            "install() came after Megatron built its num-microbatches calculator "
            f"({type(inner).__name__}), which "
            "does not say its --micro-batch-size and data-parallel size, so the step schedule "
            f"{schedule} cannot "
            "replace it. Call megatron_ga_ext.install() before Megatron builds its calculator: "
            "at the top of the training script (Megatron-LM builds it in "
            "parse_and_validate_args, or in initialize_runtime_services "
            f"after #7418), or before init_num_microbatches_calculator() in a megatron-core loop."
        )
    from torch import distributed

    rank = (
        distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0
    )
    calculator = StepScheduleCalculator.for_launch(schedule, inputs, rank=rank)
    consumed = args.consumed_train_samples
    if consumed:
        calculator.update(consumed, consistency_check=False)
    set_live_calculator(calculator)
    logger.info(
        "megatron-ga-ext installed after Megatron built its calculator (%s): replaced by the "
        "step schedule %s at %d consumed samples (MBS %d, DP %d)",
        type(inner).__name__,
        schedule,
        consumed,
        micro_batch_size,
        arguments["data_parallel_size"],
    )


def build_calculator(config: GAConfig, configure: Callable, bound: inspect.BoundArguments) -> None:
    """Megatron builds its calculator (``configure``, called as ``bound``): upstream's, or the
    step-schedule calculator where ``config`` gives a schedule (or a converted rampup)."""
    inputs = ScheduleInputs.from_calculator_call(config, bound.arguments)
    schedule = resolve_schedule(inputs)
    if schedule is None:
        configure(*bound.args, **bound.kwargs)
    else:
        set_live_calculator(
            StepScheduleCalculator.for_launch(schedule, inputs, rank=bound.arguments["rank"])
        )


def unguard_live_calculator() -> None:
    """uninstall(): the live calculator out from behind the guard."""
    live = live_calculator()
    if isinstance(live, GuardedCalculator):
        set_live_calculator(live.inner)


def guard_live_calculator(config: GAConfig) -> Calculator | None:
    """The live calculator behind the consumed-samples guard (guards.py), once, where ``config``
    keeps the guards; returns the live calculator."""
    live = live_calculator()
    if live is not None and not isinstance(live, GuardedCalculator) and config.guards:
        live = GuardedCalculator(live, config.pipeline_model_parallel_size)
        set_live_calculator(live)
    return live


def _data_parallel_size(calculator: object) -> int | None:
    """DP of a built calculator: MBS x DP / MBS where it keeps that product (the schedule
    calculators), else the running GBS / (MBS x num_microbatches) (upstream's constant one keeps
    only those); None where it says neither."""
    micro_batch_size: int | None = getattr(calculator, "micro_batch_size", None)
    if not micro_batch_size:
        return None
    product: int | None = getattr(calculator, "micro_batch_times_data_parallel_size", None)
    if product:
        return product // micro_batch_size
    running: int | None = getattr(calculator, "current_running_global_batch_size", None)
    microbatches: int | None = getattr(calculator, "num_micro_batches", None)
    if running and microbatches and running % (micro_batch_size * microbatches) == 0:
        return running // (micro_batch_size * microbatches)
    return None
