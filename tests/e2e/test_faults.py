"""Faults injected into Megatron-LM's own training loop (pretrain_gpt.py through the drop-in entry,
``python -m megatron_ga_ext``), DP 2 on the CPU over gloo, on the newest release and the newest main
commit of the leg. Each fault has one documented outcome (docs/reliability.md):

* a NaN loss on rank 1 at iteration 3: LossContractError naming the non-finite loss, at iteration 3;
  the checkpoints of iterations 1 and 2 are there, none of iteration 3; the same with --ga-checks
  async, raised after the optimizer step of iteration 3 and naming it;
* resuming that checkpoint with another schedule: rank 0 warns with both schedules, from which
  iteration and consumed-sample count the new one applies and the global batch size there under
  each; the run goes on under the new schedule, step for step as `megatron-ga schedule
  --consumed-samples` plans it;
* in that resumed run, a micro-batch without a single loss token on rank 1 (iteration 4): training
  goes on, and the global token count N is the other micro-batches' tokens;
* a loss function returning a 2-tuple: LossContractError at the first micro-batch, nothing saved;
* the loop's forward/backward function bypassing the extension's schedule hook: GuardError at the
  optimizer step of iteration 1 (before it; with --ga-checks async after it) naming the bypass,
  nothing saved; under --ga-on-violation log, the liveness rule logged once and every iteration
  trained and saved;
* a model wrapped in DDP before --calculate-per-token-loss: LossContractError naming the factor 1/2,
  nothing saved;
* rank 1 launched with another --global-batch-size, or another schedule: GuardError at the first
  forward/backward call naming both ranks and their values (the batch configuration is all-gathered
  once), nothing saved.

Every launch saves after every step (--save-interval 1, --ckpt-format torch), bounds each collective
with --distributed-timeout-minutes 1, and runs under the launch's own timeout. The zero-token faults
(a whole global batch without loss tokens, under each policy) are test_pretrain_gpt.py's; their rows
are added here when they ran in the same session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.plans import (
    BOUNDED,
    planned_steps,
    ran_steps,
    save_every_step,
    saved,
    seq_length_schedule,
)
from tools.compatibility import source_name
from tools.results import record

pytestmark = pytest.mark.e2e

TOKEN = ["--calculate-per-token-loss"]
CONSTANT = ["--global-batch-size", "16", "--train-samples", "128"]
SCHEDULE_TEXT, CHANGED_TEXT = "0:16 3072:24 6144:32", "0:16 2048:32"
TRAIN_SAMPLES = 160
SCHEDULE = ["--step-batch-size-schedule", SCHEDULE_TEXT, "--train-samples", str(TRAIN_SAMPLES)]
CHANGED = ["--step-batch-size-schedule", CHANGED_TEXT, "--train-samples", str(TRAIN_SAMPLES)]
NAN_AT, EMPTY_AT = 3, 4
NO_MEGATRON_NAN_CHECK = ["--no-check-for-nan-in-loss-and-grad"]

_ROWS: dict[str, list[dict]] = {}


def faulty(launches, source: Path, name: str, flags: list[str], **env: str):
    """A DP 2 launch that saves after every step; returns (run, its checkpoint directory)."""
    checkpoints = launches.workdir / source.name / "dp2" / f"{name}-checkpoints"
    run = launches.get(
        source, "dp2", name, [*TOKEN, *flags, *BOUNDED, *save_every_step(checkpoints)], env=env
    )
    return run, checkpoints


def failed_with(run, error: str, *texts: str) -> None:
    assert run.rc != 0 and run.error is not None, run.describe()
    assert run.error.startswith(error) and all(text in run.error for text in texts), run.error


def nothing_saved(checkpoints: Path) -> None:
    assert saved(checkpoints) == (None, []), saved(checkpoints)


def row(source: Path, fault: str, injected: str, outcome: str, checkpoints: str) -> None:
    _ROWS.setdefault(source_name(source), []).append(
        {
            "Source": source_name(source),
            "Fault": fault,
            "Injected as": injected,
            "Outcome": outcome,
            "Checkpoints": checkpoints,
        }
    )


def nan_run(launches, source: Path):
    """Megatron's own NaN check off: the extension's is the one that stops the step."""
    return faulty(
        launches,
        source,
        "nan-loss",
        [*SCHEDULE, *NO_MEGATRON_NAN_CHECK],
        MEGATRON_GA_FAULT=f"nan-loss-at:{NAN_AT}@1",
    )


def test_a_nan_loss_is_left_to_megatrons_rerun_state_machine_which_decides(launches, newest_source):
    """Megatron's defaults (--rerun-mode validate_results, its NaN check on): the extension defers
    to Megatron, which re-runs iteration 3 in place; the injected NaN (first micro-batch of the
    first run only) does not come back, so Megatron judges a transient fault and exits with its code
    (0.16: after saving a checkpoint of the last iteration it completed) before the optimizer step.
    The extension says it deferred and reports that decision; the checkpoints of iterations 1-2 are
    there."""
    run, checkpoints = faulty(
        launches,
        newest_source,
        "nan-loss-rerun",
        SCHEDULE,
        MEGATRON_GA_FAULT=f"nan-loss-at:{NAN_AT}@1",
    )
    assert run.rc != 0 and run.error is not None and run.error.startswith("SystemExit: "), (
        run.describe()
    )
    code = int(run.error.split(": ")[1])
    deferred = (
        f"micro-batch(es) of iteration {NAN_AT} returned a non-finite loss; Megatron's "
        "rerun state machine"
    )
    decided = (
        f"Megatron's rerun state machine decided on the non-finite loss of iteration {NAN_AT}: "
    )
    decision = (
        run.output[run.output.index(decided) + len(decided) :].splitlines()[0]
        if decided in run.output
        else ""
    )
    assert decision.endswith(f"exit with code {code}"), run.output[
        -3000:
    ]  # 0.16 saves a checkpoint first
    assert deferred in run.output and decided in run.output, run.output[-3000:]
    assert "Possible transient error" in run.output
    assert [r["iteration"] for r in run.iterations] == list(range(1, NAN_AT))
    assert saved(checkpoints) == (NAN_AT - 1, list(range(1, NAN_AT)))
    row(
        newest_source,
        "NaN loss on rank 1, Megatron's NaN check on (its defaults)",
        f"`nan-loss-at:{NAN_AT}@1`",
        f"deferred to Megatron's rerun state machine: it re-ran iteration {NAN_AT} (finite: a "
        "transient fault) and "
        f"decided: {decision}, reported",
        f"iterations 1-{NAN_AT - 1}, none of {NAN_AT}",
    )


def test_a_nan_loss_on_one_rank_stops_that_step(launches, newest_source):
    """--no-check-for-nan-in-loss-and-grad: Megatron does not judge the loss, the extension stops
    the step."""
    run, checkpoints = nan_run(launches, newest_source)
    failed_with(
        run,
        "LossContractError",
        "1 micro-batch(es) in this global batch returned a non-finite loss",
    )
    assert [r["iteration"] for r in run.iterations] == list(range(1, NAN_AT))
    assert saved(checkpoints) == (NAN_AT - 1, list(range(1, NAN_AT)))
    row(
        newest_source,
        "NaN loss on rank 1, --no-check-for-nan-in-loss-and-grad",
        f"`nan-loss-at:{NAN_AT}@1`",
        f"LossContractError at iteration {NAN_AT}: {run.error.split(': ', 1)[1].split(';')[0]}",
        f"iterations 1-{NAN_AT - 1}, none of {NAN_AT}",
    )


def test_async_checks_stop_a_nan_step_after_its_optimizer_step_before_its_checkpoint(
    launches, newest_source
):
    """--ga-checks async: finalize reads nothing; the verdict of iteration 3 is read after its
    optimizer step (whose own grad-norm read has synchronized by then) and stops the run there,
    naming it, before Megatron saves it."""
    run, checkpoints = faulty(
        launches,
        newest_source,
        "nan-loss-async",
        [*SCHEDULE, *NO_MEGATRON_NAN_CHECK, "--ga-checks", "async"],
        MEGATRON_GA_FAULT=f"nan-loss-at:{NAN_AT}@1",
    )
    failed_with(
        run,
        "LossContractError",
        f"--ga-checks async, verdict of training step {NAN_AT} (iteration {NAN_AT}): "
        "1 micro-batch(es) in this global batch returned a non-finite loss",
    )
    assert [r["iteration"] for r in run.iterations] == list(range(1, NAN_AT))
    assert saved(checkpoints) == (NAN_AT - 1, list(range(1, NAN_AT)))
    row(
        newest_source,
        "NaN loss on rank 1, --no-check-for-nan-in-loss-and-grad, --ga-checks async",
        f"`nan-loss-at:{NAN_AT}@1`",
        f"LossContractError after the optimizer step of iteration {NAN_AT}, naming it",
        f"iterations 1-{NAN_AT - 1}, none of {NAN_AT}",
    )


def test_a_resume_with_another_schedule_says_what_changed_and_an_empty_microbatch_is_left_out(
    launches, newest_source
):
    _, checkpoints = nan_run(launches, newest_source)
    resumed = launches.get(
        newest_source,
        "dp2",
        "resume-changed",
        [*TOKEN, *CHANGED, *BOUNDED, "--load", str(checkpoints), "--ckpt-format", "torch"],
        env={"MEGATRON_GA_FAULT": f"empty-microbatch-at:{EMPTY_AT}@1"},
    )
    assert resumed.rc == 0 and resumed.error is None, resumed.describe()
    start, consumed = NAN_AT - 1, 32
    warning = (
        f"resuming from the checkpoint of iteration {start} (consumed samples {consumed}) with "
        "another batch "
        f"configuration than it was saved with: --step-batch-size-schedule '{SCHEDULE_TEXT}' "
        "when it was "
        f"saved, '{CHANGED_TEXT}' now. The new configuration applies from iteration {start + 1} "
        "(consumed "
        f"samples {consumed}) on: global batch size 32 (8 micro-batches), where the checkpoint's "
        "configuration "
        f"has 16."
    )
    assert resumed.output.count(warning) == 1, resumed.output[-3000:]  # on rank 0 only
    plan = planned_steps(seq_length_schedule(CHANGED_TEXT), TRAIN_SAMPLES, consumed, start)
    assert ran_steps(resumed) == plan
    # The empty micro-batch: rank 1's first of iteration 4 lost its tokens; N is every other token,
    # and goes on.
    rank1 = {r["iteration"]: r for r in resumed.records[1] if r.get("event") == "iteration"}
    assert [i for i, r in rank1.items() if r["zeroed_tokens"]] == [EMPTY_AT], rank1
    num_tokens = [r["num_tokens"] for r in resumed.iterations]
    assert num_tokens == resumed.mask_tokens() and all(n > 0 for n in num_tokens)
    row(
        newest_source,
        "resumed with another schedule",
        f'`--load` the NaN run\'s iteration {start}, `--step-batch-size-schedule "{CHANGED_TEXT}"`',
        f"rank 0 warns with both schedules, from iteration {start + 1} (consumed {consumed}): "
        "GBS 32, was 16; "
        f"iterations {start + 1}-{plan[-1][0]} = plan",
        "-",
    )
    row(
        newest_source,
        "micro-batch without loss tokens on rank 1",
        f"`empty-microbatch-at:{EMPTY_AT}@1` (resumed run)",
        f"training goes on; N at iteration {EMPTY_AT} = {num_tokens[EMPTY_AT - start - 1]}, the "
        "other "
        f"micro-batches' tokens ({rank1[EMPTY_AT]['zeroed_tokens']} left out)",
        "-",
    )


def test_a_two_tuple_loss_function_stops_at_the_first_microbatch(launches, newest_source):
    run, checkpoints = faulty(
        launches, newest_source, "two-tuple", CONSTANT, MEGATRON_GA_FAULT="two-tuple-loss"
    )
    failed_with(run, "LossContractError", "the loss function returned a 2-tuple at micro-batch 0")
    assert run.iterations == []
    nothing_saved(checkpoints)
    row(
        newest_source,
        "loss function returns (loss, report)",
        "`two-tuple-loss`",
        "LossContractError at micro-batch 0 of iteration 1",
        "none",
    )


def test_a_model_wrapped_before_the_per_token_flag_is_named_with_its_factor(
    launches, newest_source
):
    run, checkpoints = faulty(
        launches,
        newest_source,
        "ddp-before-flag",
        CONSTANT,
        MEGATRON_GA_FAULT="ddp-before-per-token-flag",
    )
    failed_with(
        run,
        "LossContractError",
        "model chunk 0 was wrapped in DistributedDataParallel with gradient_scaling_factor 0.5 "
        "(= 1/2), i.e. before calculate_per_token_loss was set; its gradients would end "
        "up 2 times too small",
    )
    assert run.iterations == []
    nothing_saved(checkpoints)
    row(
        newest_source,
        "DDP built before --calculate-per-token-loss",
        "`ddp-before-per-token-flag`",
        "LossContractError at iteration 1 naming gradient_scaling_factor 0.5 (= 1/2)",
        "none",
    )


@pytest.mark.parametrize(
    "case, flags, extra, difference",
    [
        (
            "global batch size",
            CONSTANT,
            "--global-batch-size 32",
            "--global-batch-size is '16' on rank 0 and '32' on rank 1",
        ),
        (
            "schedule",
            SCHEDULE,
            f"--step-batch-size-schedule '{CHANGED_TEXT}'",
            f"--step-batch-size-schedule is '{SCHEDULE_TEXT}' on rank 0 and '{CHANGED_TEXT}' on "
            "rank 1",
        ),
    ],
)
def test_ranks_launched_with_another_batch_configuration_fail_at_start(
    launches, newest_source, case, flags, extra, difference
):
    run, checkpoints = faulty(
        launches,
        newest_source,
        f"ranks-{case.replace(' ', '-')}",
        flags,
        MEGATRON_GA_EXTRA_ARGS_RANK1=extra,
    )
    failed_with(
        run,
        "GuardError",
        "the ranks were launched with different batch configurations (compared once, at the "
        "first forward/backward call)",
        difference,
    )
    assert run.iterations == []
    nothing_saved(checkpoints)
    row(
        newest_source,
        f"rank 1 launched with another {case}",
        f'`MEGATRON_GA_EXTRA_ARGS_RANK1="{extra}"`',
        f"GuardError at the first forward/backward call: {difference}",
        "none",
    )


@pytest.mark.parametrize("checks", ["sync", "async"])
def test_an_iteration_that_bypassed_the_hooks_is_caught_and_named(launches, newest_source, checks):
    """The training loop gets upstream's schedule instead of the one install() wrapped: finalize
    (bound by name in training.py) still runs, the guarded schedule does not. The optimizer step's
    liveness check names the bypass, before that step (sync) or after it (async); either way before
    Megatron logs or saves iteration 1."""
    run, checkpoints = faulty(
        launches,
        newest_source,
        f"bypass-hooks-{checks}",
        [*CONSTANT, "--ga-checks", checks],
        MEGATRON_GA_FAULT="bypass-hooks",
    )
    prefix = "--ga-checks async, after the optimizer step: " if checks == "async" else ""
    failed_with(
        run,
        "GuardError",
        f"{prefix}training iteration 1 reached the optimizer step through megatron-ga-ext's "
        "finalize_model_grads but not through its guarded forward/backward schedule",
        "not taken from megatron.core.pipeline_parallel.get_forward_backward_func()",
    )
    assert run.iterations == []
    nothing_saved(checkpoints)
    row(
        newest_source,
        f"forward/backward bypassing the schedule hook, --ga-checks {checks}",
        "`bypass-hooks`",
        "GuardError at the optimizer step of iteration 1 "
        f"({'after' if checks == 'async' else 'before'} it), naming "
        "a forward_backward_func not taken from get_forward_backward_func",
        "none",
    )


def test_under_ga_on_violation_log_a_bypass_is_logged_once_counted_and_training_goes_on(
    launches, newest_source
):
    """The bypass of the test above, under ``--ga-on-violation log`` (the observe mode): the
    liveness rule is logged once, with its iteration, and every iteration of the run is trained and
    saved."""
    run, checkpoints = faulty(
        launches,
        newest_source,
        "bypass-hooks-observed",
        [*CONSTANT, "--ga-on-violation", "log"],
        MEGATRON_GA_FAULT="bypass-hooks",
    )
    assert run.rc == 0 and run.error is None, run.describe()
    assert [row["iteration"] for row in run.iterations] == list(range(1, 9))  # 128 samples / GBS 16
    said = [line for line in run.output.splitlines() if "--ga-on-violation log: iteration" in line]
    assert len({line.split("megatron-ga-ext", 1)[1] for line in said}) == 1, (
        said
    )  # once per rule (each rank)
    assert "iteration 1 broke the rule 'liveness' (GuardError: " in said[0], said
    assert saved(checkpoints)[0] == 8, saved(checkpoints)
    row(
        newest_source,
        "forward/backward bypassing the schedule hook, --ga-on-violation log",
        "`bypass-hooks`",
        "the liveness rule logged once (iteration 1), counted; all 8 iterations trained",
        "every iteration",
    )


def _zero_token_rows(launches, source: Path) -> None:
    """test_pretrain_gpt.py's zero-token launches, where they ran in this session."""
    for name, policy in (("zero-error", "error"), ("zero-skip", "skip")):
        run = launches.done.get((source, "dp2", name))
        if run is None:
            continue
        if run.error:
            outcome = (
                f"{run.error.split(':')[0]} at iteration {len(run.iterations) + 1}: 0 "
                "non-padding tokens"
            )
        else:
            skipped = ", ".join(str(r["iteration"]) for r in run.iterations if r["skipped"])
            outcome = f"iteration {skipped} skipped (N = 0, LR held); the run goes on to its end"
        latest, _ = saved(launches.workdir / source.name / "dp2" / f"{name}-checkpoints")
        row(
            source,
            f"global batch without loss tokens, --ga-zero-token-policy {policy}",
            "`zero-tokens-at:3`",
            outcome,
            f"iterations 1-{latest}, none of 3" if latest else "-",
        )


@pytest.fixture(scope="session", autouse=True)
def _record_outcomes(launches):
    yield
    sources = {key[0] for key in launches.done if source_name(key[0]) in _ROWS}
    for source in sorted(sources):
        _zero_token_rows(launches, source)
    record("faults", [r for rows in _ROWS.values() for r in rows])
