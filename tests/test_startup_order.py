"""install() whatever the point at which Megatron builds its num-microbatches calculator
(calculator_adoption.py).

Every source we test builds it while parsing the args (``parse_and_validate_args`` ->
``set_global_variables``); after Megatron-LM #7418 it is built later, in
``global_vars.initialize_runtime_services(args)``, which pretrain_gpt.py calls after building its
configs from the parsed args. Here, on real megatron-core, with stand-ins for Megatron-LM's
registered args: parsing registers them, and the runtime services build the calculator as #7418's do
(megatron-core's ``init_num_microbatches_calculator`` with the args' keywords). install() runs
before parsing (the drop-in), between parsing and the runtime services (only possible after #7418),
or after both; in every order the calculator in force is the extension's (the step schedule, its
backport on 0.16/0.17, a converted rampup) behind the consumed-samples guard. And a calculator put
in Megatron's global where no hook sees it is adopted at ``update_train_iters`` or the next
forward/backward call, with a warning.
"""

import argparse
import inspect
import logging
import sys
import types

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")
from megatron.core import num_microbatches_calculator as calculators

from megatron_ga_ext import GAConfig, GuardError, add_args
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.integration.guards import GuardedCalculator
from megatron_ga_ext.integration.lifecycle import install
from megatron_ga_ext.integration.megatron_lm import planned_train_iters

STEP_SCHEDULES = (
    "step_batch_size_schedule"
    in inspect.signature(calculators.init_num_microbatches_calculator).parameters
)

pytestmark = pytest.mark.usefixtures("clean_install")

#: Each case: Megatron's flags, and the global batch size at 0, 48, 64 and 96 consumed samples.
CASES = {
    "step schedule": (
        ["--step-batch-size-schedule", "0:16 256:32", "--seq-length", "4"],
        [16, 16, 32, 32],
    ),
    "converted rampup": (
        [
            "--rampup-batch-size",
            "16",
            "16",
            "64",
            "--global-batch-size",
            "32",
            "--ga-convert-rampup",
        ],
        [16, 16, 32, 32],
    ),
    "constant": (["--global-batch-size", "16"], [16, 16, 16, 16]),
}

#: When install() runs: before parsing (the drop-in), between parsing and the runtime services
#: (#7418 only), after.
ORDERS = {
    "install, parse, runtime services": ("install", "parse", "services"),
    "parse, install, runtime services": ("parse", "install", "services"),
    "parse, runtime services, install": ("parse", "services", "install"),
}


@pytest.fixture
def global_vars(monkeypatch):
    """A stand-in for Megatron-LM's megatron.training.global_vars: the registered args, none before
    parsing."""
    training = types.ModuleType("megatron.training")
    module = types.ModuleType("megatron.training.global_vars")
    module._GLOBAL_ARGS = None
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", module)
    return module


def parse_and_validate_args(global_vars, flags: list[str]) -> argparse.Namespace:
    """#7418's parse_and_validate_args: parse, validate (the default GBS = MBS x DP) and register;
    no calculator."""
    parser = argparse.ArgumentParser()
    for flag in (
        "--global-batch-size",
        "--micro-batch-size",
        "--data-parallel-size",
        "--seq-length",
        "--pipeline-model-parallel-size",
        "--consumed-train-samples",
        "--train-samples",
        "--train-iters",
    ):
        parser.add_argument(flag, type=int)
    parser.add_argument("--rampup-batch-size", nargs=3)
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    args = add_args(parser).parse_args(
        [
            "--calculate-per-token-loss",
            "--micro-batch-size",
            "2",
            "--data-parallel-size",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            *flags,
        ]
    )
    if args.global_batch_size is None and (
        args.step_batch_size_schedule is None or not STEP_SCHEDULES
    ):
        args.global_batch_size = (
            args.micro_batch_size * args.data_parallel_size
        )  # 0.16/0.17 know no schedule
    args.rank = 0
    global_vars._GLOBAL_ARGS = args
    return args


def initialize_runtime_services(args: argparse.Namespace) -> None:
    """#7418's initialize_runtime_services, as far as the calculator goes (its first service):
    megatron-core's init_num_microbatches_calculator with the args' keywords; 0.16/0.17 take no
    schedule and pass the rampup."""
    common = {
        "rank": args.rank,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size,
        "data_parallel_size": args.data_parallel_size,
        "decrease_batch_size_if_needed": False,
    }
    if STEP_SCHEDULES:
        calculators.init_num_microbatches_calculator(
            **common,
            step_batch_size_schedule=args.step_batch_size_schedule,
            seq_length=args.seq_length,
        )
    else:
        calculators.init_num_microbatches_calculator(
            **common, rampup_batch_size=args.rampup_batch_size
        )


def global_batch_sizes(*consumed: int) -> list[int]:
    sizes = []
    for samples in consumed:
        calculators.update_num_microbatches(samples, consistency_check=True)
        sizes.append(calculators.get_current_global_batch_size())
    return sizes


def assert_in_force(case: str, expected: list[int]) -> None:
    """The extension's calculator behind the guard, giving ``expected``; the guard stops a
    PP-multiplied advance."""
    live = calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    assert isinstance(live, GuardedCalculator), type(live).__name__
    assert isinstance(live.inner, StepScheduleCalculator) == (case != "constant"), type(
        live.inner
    ).__name__
    assert global_batch_sizes(0, 48, 64, 96) == expected
    calculators.update_num_microbatches(
        96, consistency_check=False
    )  # the loop's unchecked call: the baseline
    with pytest.raises(
        GuardError, match=r"pipeline parallelism never multiplies the global batch size"
    ):
        calculators.update_num_microbatches(
            96 + 2 * expected[-1], consistency_check=False
        )  # GBS x PP 2


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("order", ORDERS)
def test_the_calculator_in_force_is_the_extensions_in_every_order(global_vars, order, case):
    flags, expected = CASES[case]
    args = None
    for event in ORDERS[order]:
        if event == "install":
            install()
        elif event == "parse":
            args = parse_and_validate_args(global_vars, flags)
        else:
            initialize_runtime_services(args)
    assert_in_force(case, expected)


def test_the_args_install_reads_between_parsing_and_the_runtime_services_are_the_ones_registered(
    global_vars,
):
    """After #7418 a script may call install() right after parse_and_validate_args: it reads the
    registered args (the schedule, PP 2) and no calculator exists yet; the runtime services then
    build the extension's."""
    args = parse_and_validate_args(global_vars, CASES["step schedule"][0])
    state = install()
    assert (
        not state.waiting_for_args
        and state.config.step_batch_size_schedule == args.step_batch_size_schedule
    )
    assert state.config.pipeline_model_parallel_size == 2
    assert (
        calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
        and state.calculator_in_force is None
    )
    initialize_runtime_services(args)
    assert state.calculator_in_force is calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR


def unseen_constant_calculator() -> None:
    """Megatron's global set where no hook of the installation sees it: upstream's constant GBS 16,
    MBS 2, DP 4."""
    calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculators.ConstantNumMicroBatchesCalculator(
        16, 2, 4, False, 0
    )


def test_a_calculator_built_where_no_hook_saw_it_is_adopted_at_the_next_forward_backward_call(
    global_vars, caplog
):
    parse_and_validate_args(global_vars, CASES["step schedule"][0])
    state = install()
    unseen_constant_calculator()
    with caplog.at_level(logging.WARNING):
        state.begin_step({"num_microbatches": 2})
    assert "was built where install() did not see it" in caplog.text
    assert (
        "ConstantNumMicroBatchesCalculator" in caplog.text
        and "this forward/backward call" in caplog.text
    )
    assert_in_force("step schedule", CASES["step schedule"][1])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        state.begin_step({"num_microbatches": 2})  # in force: nothing to adopt, nothing said
    assert "did not see it" not in caplog.text


def test_update_train_iters_plans_the_run_from_the_adopted_calculator(global_vars, caplog):
    """Megatron-LM's update_train_iters is the first to read the calculator in pretrain(): the run
    length is planned from the schedule's calculator, not from the constant one found live."""
    args = parse_and_validate_args(
        global_vars, [*CASES["step schedule"][0], "--train-samples", "160"]
    )
    state = install()
    unseen_constant_calculator()
    with caplog.at_level(logging.WARNING):
        planned_train_iters(lambda args: pytest.fail("upstream's constant-batch plan ran"), state)(
            args
        )
    assert "Megatron-LM's update_train_iters" in caplog.text
    assert (
        args.train_iters == 7
    )  # 16 x 4 steps (64 samples = 256 tokens / seq 4), then 32 x 3 steps: 160 samples
    assert isinstance(calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR.inner, StepScheduleCalculator)


def test_install_given_its_config_guards_a_calculator_built_after_it(global_vars):
    """A megatron-core loop (no Megatron-LM args): install(GAConfig) before
    init_num_microbatches_calculator."""
    install(GAConfig(step_batch_size_schedule="0:16 64:32", pipeline_model_parallel_size=2))
    calculators.init_num_microbatches_calculator(0, None, 16 if not STEP_SCHEDULES else None, 2, 4)
    assert_in_force("step schedule", [16, 16, 32, 32])
