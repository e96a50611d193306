"""install() after Megatron built its num-microbatches calculator: the schedule, the backport and a
converted rampup replace the live calculator (with its MBS and DP) instead of being dropped, in a
megatron-core loop and in Megatron-LM's flow (install() after initialize_megatron, reading its
parsed args)."""

import argparse
import inspect
import sys
import types

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")
from megatron.core import num_microbatches_calculator as calculators

from megatron_ga_ext import GAConfig, ScheduleError, add_args
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.integration.lifecycle import install

STEP_SCHEDULES = (
    "step_batch_size_schedule"
    in inspect.signature(calculators.init_num_microbatches_calculator).parameters
)


pytestmark = pytest.mark.usefixtures("clean_install")


@pytest.fixture
def megatron_args(monkeypatch):
    """Megatron-LM's global args (megatron.training.global_vars), set by a test once 'parsed'."""
    training = types.ModuleType("megatron.training")
    global_vars = types.ModuleType("megatron.training.global_vars")
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)

    def parsed(*flags: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        for flag in (
            "--global-batch-size",
            "--micro-batch-size",
            "--seq-length",
            "--consumed-train-samples",
        ):
            parser.add_argument(flag, type=int)
        parser.add_argument("--rampup-batch-size", nargs=3)
        parser.add_argument("--calculate-per-token-loss", action="store_true")
        global_vars._GLOBAL_ARGS = add_args(parser).parse_args(
            ["--calculate-per-token-loss", *flags]
        )
        return global_vars._GLOBAL_ARGS

    return parsed


def global_batch_sizes(*consumed: int) -> list[int]:
    """The global batch size the live calculator gives at each consumed-sample count (a checked
    update, as at a checkpoint load: the consumed-samples guard checks one step's advance only on
    the loop's unchecked calls)."""
    sizes = []
    for samples in consumed:
        calculators.update_num_microbatches(samples, consistency_check=True)
        sizes.append(calculators.get_current_global_batch_size())
    return sizes


def live_inner():
    live = calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    return getattr(live, "inner", live)


def test_a_schedule_installed_after_the_calculator_replaces_it_in_a_megatron_core_loop():
    """The issue's launch: constant GBS 4 built first, then
    install(GAConfig(step_batch_size_schedule="0:4 64:8")). Before: the global batch was still 4 at
    64 samples, without a word."""
    calculators.init_num_microbatches_calculator(0, None, 4, 1, 2)
    install(GAConfig(step_batch_size_schedule="0:4 64:8"))
    inner = live_inner()
    assert isinstance(inner, StepScheduleCalculator)
    assert (inner.micro_batch_size, inner.data_parallel_size) == (
        1,
        2,
    )  # the live calculator's MBS and DP
    assert global_batch_sizes(0, 60, 64, 72) == [4, 4, 8, 8]
    assert calculators.get_num_microbatches() == 4  # 8 / (MBS 1 x DP 2)


def test_install_without_a_schedule_leaves_the_live_calculator():
    calculators.init_num_microbatches_calculator(0, None, 4, 1, 2)
    before = live_inner()
    install(GAConfig())
    assert live_inner() is before and global_batch_sizes(0, 64) == [4, 4]


def test_a_late_install_in_megatron_lms_flow_reads_the_schedule_from_its_args(megatron_args):
    """install() after initialize_megatron: the args hold --step-batch-size-schedule (thresholds in
    tokens with --seq-length), Megatron built its calculator from them (0.18+: its own; 0.16/0.17:
    constant, no schedule)."""
    args = megatron_args(
        "--micro-batch-size", "2", "--seq-length", "4", "--step-batch-size-schedule", "0:16 256:32"
    )
    if STEP_SCHEDULES:
        calculators.init_num_microbatches_calculator(
            0,
            None,
            None,
            2,
            4,
            step_batch_size_schedule=args.step_batch_size_schedule,
            seq_length=4,
        )
    else:
        calculators.init_num_microbatches_calculator(0, None, 16, 2, 4)
    install()
    assert isinstance(live_inner(), StepScheduleCalculator)
    assert global_batch_sizes(0, 48, 64, 96) == [16, 16, 32, 32]  # 256 tokens / seq 4 = 64 samples


def test_a_late_install_converts_the_rampup_and_resumes_at_the_consumed_samples(megatron_args):
    """--rampup-batch-size with --ga-convert-rampup after initialize_megatron (0.18+ built a
    constant calculator, dropping the rampup; 0.16/0.17 their own rampup calculator), resumed at 32
    consumed samples."""
    megatron_args(
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "24",
        "--rampup-batch-size",
        "8",
        "8",
        "64",
        "--ga-convert-rampup",
        "--consumed-train-samples",
        "32",
    )
    calculators.init_num_microbatches_calculator(0, [8, 8, 64], 24, 2, 2)
    install()
    assert isinstance(live_inner(), StepScheduleCalculator)
    assert (
        calculators.get_current_global_batch_size() == 16
    )  # at 32 consumed: 4 x 8, then the 16 stage
    assert global_batch_sizes(32, 64, 88) == [16, 24, 24]


def test_a_live_calculator_that_does_not_say_its_layout_is_refused_with_the_fix():
    class Opaque:
        def get(self) -> int:
            return 2

        def get_current_global_batch_size(self) -> int:
            return 4

    calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR = Opaque()
    with pytest.raises(
        ScheduleError,
        match=r"install\(\) came after Megatron built its num-microbatches "
        r"calculator \(Opaque\).* Call megatron_ga_ext.install\(\) before "
        r"Megatron builds its calculator",
    ):
        install(GAConfig(step_batch_size_schedule="0:4 64:8"))
