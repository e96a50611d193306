"""megatron-ga ledger and check, run as a user runs them (a subprocess of the console script)."""

import json
import time

import pytest

LEDGER = [
    "ledger",
    "--nnodes",
    "2",
    "--nproc-per-node",
    "8",
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "128",
    "--seq-length",
    "2048",
]


def test_ledger_json_keys_and_values(cli_script):
    result = cli_script(*LEDGER, "--json")
    assert result.returncode == 0, result.stderr
    ledger = json.loads(result.stdout)
    assert {
        k: ledger[k]
        for k in (
            "world_size",
            "data_parallel_size",
            "micro_batch_size",
            "global_batch_size",
            "num_microbatches",
            "samples_per_step",
            "tokens_per_step",
            "dp_syncs_per_step",
        )
    } == {
        "world_size": 16,
        "data_parallel_size": 4,
        "micro_batch_size": 4,
        "global_batch_size": 128,
        "num_microbatches": 8,
        "samples_per_step": 128,
        "tokens_per_step": 262144,
        "dp_syncs_per_step": 1,
    }
    assert ledger["pipeline_bubble_fraction"] == pytest.approx(1 / 9)


def test_ledger_table_is_plain_text_off_a_terminal(cli_script):
    result = cli_script(*LEDGER)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0] == "megatron-ga ledger"
    assert any(line.split()[:5] == ["GA", "=", "num_microbatches", "8", "GBS"] for line in lines)
    assert "\x1b[" not in result.stdout


def test_ledger_vpp_from_layers_per_virtual_stage(cli_script):
    result = cli_script(
        "ledger",
        "--world-size",
        "8",
        "--pipeline-model-parallel-size",
        "4",
        "--num-layers",
        "16",
        "--num-layers-per-virtual-pipeline-stage",
        "2",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["virtual_pipeline_model_parallel_size"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--world-size", "16", "--micro-batch-size", "4", "--global-batch-size", "96"],
            "--global-batch-size 96 is not a multiple of --micro-batch-size 4 x data-parallel "
            "size 16 = 64",
        ),
        (
            ["--world-size", "16", "--micro-batch-size", "2.5"],
            "--micro-batch-size '2.5' is not an integer",
        ),
        (["--world-size", "16"], "--micro-batch-size is missing"),
        (
            [
                "--world-size",
                "8",
                "--pipeline-model-parallel-size",
                "3",
                "--num-layers",
                "12",
                "--num-layers-per-virtual-pipeline-stage",
                "3",
                "--micro-batch-size",
                "1",
            ],
            "--num-layers-per-virtual-pipeline-stage 3 does not divide the 4 layers",
        ),
    ],
)
def test_ledger_bad_input_exits_2_without_traceback(args, message, cli_script):
    result = cli_script("ledger", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_ledger_answers_in_under_0_3_seconds(cli_script):
    best = min(_wall(cli_script, LEDGER) for _ in range(5))
    assert best < 0.3, f"megatron-ga ledger took {best:.3f} s"


def _wall(cli_script, args: list[str]) -> float:
    start = time.perf_counter()
    assert cli_script(*args).returncode == 0
    return time.perf_counter() - start


# Without --calculate-per-token-loss, the default --ga-loss-reduction token is itself a problem.
BARE_LAUNCH = (
    "torchrun --nproc_per_node=8 --nnodes 2 --master-addr host0 pretrain_gpt.py --bf16 "
    "--tensor-model-parallel-size 2 --micro-batch-size 2 --seq-length 4096 "
    "--use-mcore-models"
)
LAUNCH = BARE_LAUNCH + " --calculate-per-token-loss"


def test_check_clean_launch_exits_0(cli_script):
    result = cli_script("check", "--", *LAUNCH.split(), "--global-batch-size=64")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no problems found" in result.stdout


def test_check_reads_a_single_quoted_line_and_reports_every_problem(cli_script):
    line = LAUNCH + " --global-batch-size 100 --micro-batch-size 4 --rampup-batch-size 16 8 300000"
    result = cli_script("check", "--json", "--", line)
    assert result.returncode == 1
    problems = [p["message"] for p in json.loads(result.stdout)["problems"]]
    assert any("--micro-batch-size is given 2 times (2, 4)" in p for p in problems)
    assert any(
        "--global-batch-size 100 is not a multiple of --micro-batch-size 4 x data-parallel size "
        "8 = 32"
        in p
        and "Nearest valid --global-batch-size: 96, 128" in p
        for p in problems
    )
    ignored = (
        "--rampup-batch-size 16 8 300000: megatron-core >= 0.18 ignores the rampup on the "
        "training path and logs nothing"
    )
    assert any(ignored in p for p in problems)


def test_check_step_schedule_with_train_iters_and_gbs(cli_script):
    result = cli_script(
        "check",
        "--",
        *LAUNCH.split(),
        "--train-iters",
        "1000",
        "--global-batch-size",
        "64",
        "--step-batch-size-schedule",
        "0:32 1000000:64",
    )
    assert result.returncode == 1
    assert "--step-batch-size-schedule with --train-iters" in result.stdout
    assert "--global-batch-size is given together with --step-batch-size-schedule" in result.stdout


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "torchrun --nproc-per-node gpu pretrain_gpt.py --micro-batch-size 2",
            "--nproc-per-node gpu leaves the world size",
        ),
        (
            "torchrun --nnodes 1:4 --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 2",
            "--nnodes 1:4 is an elastic range",
        ),
        (
            "torchrun --nproc-per-node 8 pretrain_gpt.py --micro-batch-size $MBS",
            "--micro-batch-size '$MBS' is not an integer",
        ),
        ("python pretrain_gpt.py --micro-batch-size 2", "the world size is unknown"),
    ],
)
def test_check_unusable_input_exits_2(line, message, cli_script):
    result = cli_script("check", "--", line)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_check_world_size_override(cli_script):
    result = cli_script(
        "check",
        "--world-size",
        "64",
        "--json",
        "--",
        "torchrun --nproc-per-node gpu x.py --micro-batch-size 2 --calculate-per-token-loss",
    )
    assert result.returncode == 0
    assert json.loads(result.stdout)["ledger"]["data_parallel_size"] == 64


def test_check_prints_the_schedule_equivalent_to_a_rampup(cli_script):
    result = cli_script(
        "check", "--json", "--", LAUNCH + " --global-batch-size 64 --rampup-batch-size 16 16 1000"
    )
    assert result.returncode == 1
    report = json.loads(result.stdout)
    (problem,) = report["problems"]
    assert problem["rule"] == "rampup-ignored"
    assert "ignores the rampup on the training path and logs nothing" in problem["message"]
    assert not report["stages"]["runs"]
    schedule = report["stages"]["equivalent_schedule"]
    from megatron_ga_ext import StepSchedule

    # Thresholds in tokens (pretrain_gpt passes --seq-length 4096), reproducing the rampup's stages.
    assert (
        StepSchedule.parse(schedule, seq_length=4096).stages
        == StepSchedule.from_rampup(16, 16, 1000, 64).stages
    )
    assert report["ledger"]["global_batch_size"] == 64  # the constant GBS the run trains at


def test_check_validates_every_stage_of_a_step_schedule(cli_script):
    result = cli_script(
        "check", "--", LAUNCH + " --step-batch-size-schedule '0:16 8192K:24 16384K:8'"
    )
    assert result.returncode == 1
    assert "entry 2 '8192K:24'" in result.stdout
    assert "not a multiple of --micro-batch-size 2 x data-parallel size 8 = 16" in result.stdout
    assert "entry 3 '16384K:8'" in result.stdout


def test_check_holds_the_loss_mode_to_the_extension_only_where_it_is_on(cli_script):
    result = cli_script("check", "--", BARE_LAUNCH + " --global-batch-size 64")
    assert result.returncode == 0, result.stdout
    assert "info: upstream's mean of means" in result.stdout and "not on this line" in result.stdout
    result = cli_script(
        "check", "--", BARE_LAUNCH + " --global-batch-size 64 --ga-loss-reduction token"
    )
    assert result.returncode == 0, result.stdout
    assert "install() turns on --calculate-per-token-loss" in result.stdout
    result = cli_script(
        "check", "--", LAUNCH + " --global-batch-size 64 --ga-loss-reduction microbatch"
    )
    assert result.returncode == 1 and "drop one of them" in result.stdout
    result = cli_script("check", "--", LAUNCH + " --global-batch-size 64 --ga-loss-reduction=token")
    assert result.returncode == 0, result.stdout


def test_version_names_the_installed_distribution(cli_script):
    from importlib.metadata import version

    result = cli_script("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"megatron-ga {version('megatron-ga-ext')}\n"
