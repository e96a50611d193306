"""Megatron-LM's own training loop (pretrain_gpt.py's ``pretrain()``), unmodified, run through the
drop-in entry ``python -m megatron_ga_ext pretrain_gpt.py``, on every tested release and main-branch
commit, DP 2 and PP 2 x DP 2, on the CPU over gloo.

Per (source, layout), five launches with the extension and one of upstream alone:

* token mode, constant GBS 16, --train-samples 128, and the same launch of upstream's own
  ``--calculate-per-token-loss`` without the extension: every iteration's loss and grad norm are
  equal, and the extension's N is the batch's loss tokens (--eod-mask-loss on short documents);
* DP 2: the one-line drop-in (a copy of pretrain_gpt.py with only ``import megatron_ga_ext;
  megatron_ga_ext.install()`` added) and the entry, each launched with ``--ga-loss-reduction token``
  and without ``--calculate-per-token-loss``: equal to upstream's own per-token run, and N the
  batch's loss tokens;
* token mode, ``--rampup-batch-size 8 8 64 --global-batch-size 24 --ga-convert-rampup``;
* microbatch mode, ``--step-batch-size-schedule "0:16 3072:24 6144:32"`` (tokens; the backport on
  0.16/0.17), saving at iteration 4, and a launch resuming from that checkpoint;
* PP 2 only: the training loop made to pass num_microbatches x PP: the guard stops it at the first
  step;
* on the newest release and the newest main commit of the leg, DP 2: the converted rampup with the
  calculator built after parsing, in Megatron-LM #7418's start-up order (the fault
  runtime-services-order);
* on the newest release and the newest main commit of the leg, DP 2: a global batch without a single
  loss token at iteration 3, under ``--ga-zero-token-policy error`` (the run stops there, and no
  checkpoint of that step is written) and ``skip`` (Megatron skips that optimizer step: a skipped
  iteration, the learning rate held, and the run goes on).

Every run: exit status 0, iterations / consumed samples / GBS / num_microbatches step for step as
``megatron-ga schedule`` plans them, the learning rate at its minimum exactly at the last planned
step (linear decay over --train-samples), and the guard's count of forward steps per chunk equal to
num_microbatches every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ga_ext.integration.guards import PP_RULE
from tests.support.plans import planned_steps, ran_steps, seq_length_schedule
from tests.support.pretrain_runs import DROP_INS, Run
from tools.compatibility import source_name

pytestmark = pytest.mark.e2e

MIN_LR = 1e-4
TOKEN = ["--calculate-per-token-loss"]
MICROBATCH = ["--ga-loss-reduction", "microbatch"]
CONSTANT = ["--global-batch-size", "16", "--train-samples", "128"]
RAMPUP = [
    "--rampup-batch-size",
    "8",
    "8",
    "64",
    "--global-batch-size",
    "24",
    "--ga-convert-rampup",
    "--train-samples",
    "160",
]
SCHEDULE_TEXT = "0:16 3072:24 6144:32"
SCHEDULE = ["--step-batch-size-schedule", SCHEDULE_TEXT, "--train-samples", "160"]
SAVE_AT = 4

#: The `megatron-ga schedule` arguments and --train-samples that plan each case (both layouts have
#: DP 2).
PLANS = {
    "constant": (seq_length_schedule("0:16"), 128),
    "rampup": (["--from-rampup", "8", "8", "64", "--global-batch-size", "24"], 160),
    "schedule": (seq_length_schedule(SCHEDULE_TEXT), 160),
}


def check_run(run: Run, case: str) -> dict:
    """The checks every run gets; returns its row of the results table."""
    assert run.rc == 0 and run.error is None, run.describe()
    plan, ran = planned_steps(*PLANS[case]), ran_steps(run)
    assert ran == plan, f"{run.name}: ran {ran}, planned {plan}\n{run.describe()}"
    rates = [r["learning_rate"] for r in run.iterations]
    assert rates[-1] == pytest.approx(MIN_LR, rel=1e-9) and rates[-2] > MIN_LR * (1 + 1e-6), (
        run.name,
        rates,
    )
    for row in (
        run.iterations
    ):  # the guard counted every chunk's forward steps, and they were num_microbatches
        assert row["forward_steps"] == [row["num_microbatches"]], (run.name, row)
    return {
        "iterations": f"{len(ran)} = plan",
        "samples": f"{ran[-1][1]} = plan",
        "lr_end": "min at last step",
    }


def check_num_tokens(run: Run) -> str:
    """Token mode: the extension's N is the global batch's loss tokens, every iteration."""
    mask_tokens = run.mask_tokens()
    num_tokens = [r["num_tokens"] for r in run.iterations]
    assert num_tokens == mask_tokens, (run.name, num_tokens, mask_tokens)
    return f"= loss tokens ({min(num_tokens)}-{max(num_tokens)})"


def record(record_property, name: str, layout: str, rows: list[dict]) -> None:
    """This test's rows of the results table (conftest prints them, and records each source's
    compatibility row)."""
    record_property("rows", [{"source": name, "layout": layout} | row for row in rows])


def constant_runs(launches, source: Path, layout: str) -> tuple[Run, Run]:
    upstream = launches.get(source, layout, "upstream", [*TOKEN, *CONSTANT], extension=False)
    token = launches.get(source, layout, "token", [*TOKEN, *CONSTANT])
    return upstream, token


@pytest.mark.parametrize("layout", ["dp2", "pp2dp2"])
def test_token_mode_equals_upstream_per_token_loss(launches, source, layout, record_property):
    upstream, token = constant_runs(launches, source, layout)
    assert upstream.rc == 0, upstream.describe()
    row = check_run(token, "constant")
    assert ran_steps(upstream) == ran_steps(token)
    for ours, theirs in zip(token.iterations, upstream.iterations):
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"]), (
            ours,
            theirs,
        )
    row |= {
        "mode": "token",
        "case": "constant",
        "loss_vs_upstream": "equal (loss, grad norm)",
        "N": check_num_tokens(token),
    }
    record(record_property, source_name(source), layout, [row])


@pytest.mark.parametrize("drop_in", DROP_INS)
def test_drop_in_alone_runs_the_token_mode(launches, source, drop_in, record_property):
    """No --calculate-per-token-loss on the line: install() turns it on, and the run equals
    upstream's own."""
    upstream, _ = constant_runs(launches, source, "dp2")
    run = launches.get(
        source,
        "dp2",
        f"drop-in-{drop_in}",
        ["--ga-loss-reduction", "token", *CONSTANT],
        drop_in=drop_in,
    )
    row = check_run(run, "constant")
    assert ran_steps(upstream) == ran_steps(run)
    for ours, theirs in zip(run.iterations, upstream.iterations):
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"]), (
            ours,
            theirs,
        )
    assert "turns on --calculate-per-token-loss" in run.output, run.describe()
    row |= {
        "mode": "token",
        "case": f"{drop_in}, no --calculate-per-token-loss",
        "loss_vs_upstream": "equal (loss, grad norm)",
        "N": check_num_tokens(run),
    }
    record(record_property, source_name(source), "dp2", [row])


@pytest.mark.parametrize("layout", ["dp2", "pp2dp2"])
def test_converted_rampup_runs_its_plan(launches, source, layout, record_property):
    run = launches.get(source, layout, "rampup", [*TOKEN, *RAMPUP])
    row = check_run(run, "rampup") | {"mode": "token", "case": "rampup", "N": check_num_tokens(run)}
    record(record_property, source_name(source), layout, [row])


def test_a_late_install_still_runs_the_converted_rampup(launches, source, record_property):
    """install() after initialize_megatron (the fault late-install): Megatron built its own
    calculator (0.18+: a constant 24, the rampup dropped; 0.16/0.17: its rampup calculator);
    install() replaces it by the converted rampup's, and the run follows the same plan as an early
    install."""
    run = launches.get(
        source,
        "dp2",
        "rampup-late-install",
        [*TOKEN, *RAMPUP],
        env={"MEGATRON_GA_FAULT": "late-install"},
    )
    assert "megatron-ga-ext installed after Megatron built its calculator" in run.output, (
        run.describe()
    )
    row = check_run(run, "rampup") | {
        "mode": "token",
        "case": "rampup, install() late",
        "N": check_num_tokens(run),
    }
    record(record_property, source_name(source), "dp2", [row])


def test_the_calculator_built_after_parsing_runs_the_converted_rampup(
    launches, newest_source, record_property
):
    """Megatron-LM #7418's start-up order (the fault runtime-services-order): set_global_variables
    no longer builds the calculator; it is built after parsing, as initialize_runtime_services does.
    The drop-in, installed before both, gets it through its hook, and the run follows the same plan
    as in the order of every tested source."""
    run = launches.get(
        newest_source,
        "dp2",
        "rampup-runtime-services",
        [*TOKEN, *RAMPUP],
        env={"MEGATRON_GA_FAULT": "runtime-services-order"},
    )
    assert "the num-microbatches calculator built after parsing" in run.output, run.describe()
    row = check_run(run, "rampup") | {
        "mode": "token",
        "case": "rampup, calculator built after parsing (#7418)",
        "N": check_num_tokens(run),
    }
    record(record_property, source_name(newest_source), "dp2", [row])


def test_a_reinstall_with_another_config_trains_on(launches, source, record_property):
    """install() with another config after iteration 2 (the fault reinstall-at:2): the model config
    still holds the first installation's finalize and the optimizer its step wrapper; the next step
    adopts the new finalize, the optimizer follows the new installation, and the run trains to its
    plan with N checked every iteration."""
    run = launches.get(
        source, "dp2", "reinstall", [*TOKEN, *CONSTANT], env={"MEGATRON_GA_FAULT": "reinstall-at:2"}
    )
    assert "checks='async'" in run.output, (
        run.describe()
    )  # the second installation's config, logged
    row = check_run(run, "constant") | {
        "mode": "token",
        "case": "install() again after iteration 2",
        "N": check_num_tokens(run),
    }
    record(record_property, source_name(source), "dp2", [row])


def schedule_run(launches, source: Path, layout: str) -> tuple[Run, Path]:
    """The microbatch-mode launch of SCHEDULE, saving at SAVE_AT, and its checkpoint directory
    (test_lr_scaling.py compares its learning rates with a scaled launch's)."""
    checkpoints = launches.workdir / source.name / layout / "checkpoints"
    run = launches.get(
        source,
        layout,
        "schedule",
        [
            *MICROBATCH,
            *SCHEDULE,
            "--save",
            str(checkpoints),
            "--save-interval",
            str(SAVE_AT),
            "--ckpt-format",
            "torch",
        ],
    )
    return run, checkpoints


@pytest.mark.parametrize("layout", ["dp2", "pp2dp2"])
def test_step_schedule_and_resume_mid_schedule(launches, source, layout, record_property):
    run, checkpoints = schedule_run(launches, source, layout)
    row = check_run(run, "schedule") | {"mode": "microbatch", "case": "schedule"}
    assert all(
        r["num_tokens"] is None for r in run.iterations
    )  # microbatch mode takes no global count
    _, token = constant_runs(launches, source, layout)
    # Same first batch (GBS 16) and weights: the two modes optimise different means, so the
    # gradients differ, and the logged loss is each mode's own mean (the mean of micro-batch means
    # here, the token mean there).
    first_token, first_micro = token.iterations[0]["grad_norm"], run.iterations[0]["grad_norm"]
    assert abs(first_micro - first_token) > 1e-5 * first_token, (first_micro, first_token)
    loss_token, loss_micro = (
        token.iterations[0]["loss"]["lm loss"],
        run.iterations[0]["loss"]["lm loss"],
    )
    assert abs(loss_micro - loss_token) > 1e-6 * loss_token, (loss_micro, loss_token)
    row["loss_vs_upstream"] = (
        f"step 1: loss {loss_micro:.5f} vs token {loss_token:.5f}, grad norm {first_micro:.5f} "
        f"vs {first_token:.5f}"
    )

    resumed = launches.get(
        source,
        layout,
        "resume",
        [
            *MICROBATCH,
            *SCHEDULE,
            "--load",
            str(checkpoints),
            "--ckpt-step",
            str(SAVE_AT),
            "--ckpt-format",
            "torch",
        ],
    )
    assert resumed.rc == 0 and resumed.error is None, resumed.describe()
    assert ran_steps(resumed) == ran_steps(run)[SAVE_AT:], (ran_steps(resumed), ran_steps(run))
    resume_row = {
        "mode": "microbatch",
        "case": f"resume at {SAVE_AT}",
        "iterations": f"{SAVE_AT + 1}-{len(run.iterations)} = uninterrupted",
        "samples": f"{ran_steps(resumed)[-1][1]} = uninterrupted",
    }
    record(record_property, source_name(source), layout, [row, resume_row])


def test_pp_guard_stops_a_pp_multiplied_step(launches, source, record_property):
    run = launches.get(
        source,
        "pp2dp2",
        "pp-fault",
        [*TOKEN, *CONSTANT],
        env={"MEGATRON_GA_FAULT": "pp-multiplied-microbatches"},
    )
    assert run.rc != 0 and run.iterations == [], run.describe()
    assert run.error is not None and run.error.startswith("GuardError") and PP_RULE in run.error, (
        run.describe()
    )
    assert "8 = 4 x PP 2" in run.error, run.error
    row = {
        "mode": "token",
        "case": "num_microbatches x PP",
        "iterations": "0 (stopped at step 1)",
        "N": "GuardError: " + PP_RULE,
    }
    record(record_property, source_name(source), "pp2dp2", [row])


ZERO_AT = 3


def test_zero_token_batch_stops_the_run_without_saving_it(launches, newest_source, record_property):
    source = newest_source
    checkpoints = launches.workdir / source.name / "dp2" / "zero-error-checkpoints"
    run = launches.get(
        source,
        "dp2",
        "zero-error",
        [
            *TOKEN,
            *CONSTANT,
            "--save",
            str(checkpoints),
            "--save-interval",
            "1",
            "--ckpt-format",
            "torch",
        ],
        env={"MEGATRON_GA_FAULT": f"zero-tokens-at:{ZERO_AT}"},
    )
    assert run.rc != 0 and run.error is not None, run.describe()
    assert run.error.startswith("LossContractError") and "0 non-padding tokens" in run.error, (
        run.error
    )
    assert [r["iteration"] for r in run.iterations] == list(range(1, ZERO_AT))
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(
        ZERO_AT - 1
    )
    assert not (checkpoints / f"iter_{ZERO_AT:07d}").exists()
    record(
        record_property,
        source_name(source),
        "dp2",
        [
            {
                "mode": "token",
                "case": f"0 tokens at step {ZERO_AT}, policy error",
                "iterations": f"{ZERO_AT - 1}, then LossContractError",
                "samples": "last checkpoint: step 2",
            }
        ],
    )


def test_zero_token_batch_skips_the_optimizer_step(launches, newest_source, record_property):
    source = newest_source
    run = launches.get(
        source,
        "dp2",
        "zero-skip",
        [*TOKEN, *CONSTANT, "--ga-zero-token-policy", "skip"],
        env={"MEGATRON_GA_FAULT": f"zero-tokens-at:{ZERO_AT}"},
    )
    assert run.rc == 0 and run.error is None, run.describe()
    assert ran_steps(run) == planned_steps(
        *PLANS["constant"]
    )  # the data is consumed: consumed samples still advance
    rows = {r["iteration"]: r for r in run.iterations}
    skipped = rows[ZERO_AT]
    assert (
        skipped["num_tokens"] == 0 and skipped["skipped"] == 1 and skipped["grad_norm"] is None
    ), skipped
    assert (
        skipped["learning_rate"] == rows[ZERO_AT - 1]["learning_rate"]
    )  # the scheduler did not advance
    assert all(r["skipped"] == 0 for i, r in rows.items() if i != ZERO_AT)
    assert run.iterations[-1]["learning_rate"] > MIN_LR  # one step of decay fewer than the plan
    record(
        record_property,
        source_name(source),
        "dp2",
        [
            {
                "mode": "token",
                "case": f"0 tokens at step {ZERO_AT}, policy skip",
                "iterations": f"8, step {ZERO_AT} skipped",
                "samples": "128 = plan",
                "lr_end": "held at the skipped step",
                "N": "0 at the skipped step",
            }
        ],
    )
