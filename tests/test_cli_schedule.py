"""megatron-ga schedule: table, JSON, rampup conversion, plot, one-line errors, and its speed."""

import time

import pytest

from megatron_ga_ext import StepSchedule

TOKENS = [
    "0:768 250B:1536 500B:3072 750B:6144",
    "--micro-batch-size",
    "4",
    "--data-parallel-size",
    "64",
    "--seq-length",
    "4096",
]


def run_json(cli, *args: str) -> dict:
    answer = cli("schedule", *args, "--json")
    assert answer.status == 0, answer.err
    return answer.json()


def test_json_rows_and_iterations(cli):
    out = run_json(cli, *TOKENS, "--train-tokens", "1T")
    assert (
        out["schedule"] == "0:768 250B:1536 500B:3072 750B:6144"
        and out["thresholds_in"] == "tokens"
    )
    assert out["train_samples"] == -(-(10**12) // 4096)
    stages = out["stages"]
    assert [s["num_microbatches"] for s in stages] == [3, 6, 12, 24]
    assert [s["threshold_samples"] for s in stages] == [0, 61035156, 122070312, 183105468]
    assert stages[1]["first_token"] == stages[1]["first_sample"] * 4096 >= 250 * 10**9
    assert out["iterations"] == sum(s["steps"] for s in stages)
    schedule = StepSchedule.parse(TOKENS[0], seq_length=4096)
    assert out["iterations"] == schedule.iterations(4, 64, out["train_samples"])


def test_table_text(cli):
    answer = cli("schedule", *TOKENS, "--train-samples", "200M")
    assert answer.status == 0
    out = answer.out
    lines = out.splitlines()
    assert lines[0] == (
        '--step-batch-size-schedule "0:768 250B:1536 500B:3072 750B:6144" (thresholds in tokens, '
        "--seq-length 4096)"
    )
    assert "first token" in out and "micro-batches" in out
    assert any(line.split()[:4] == ["2", "250B:1536", "1,536", "6"] for line in lines)
    assert "steps for --train-samples 200,000,000" in out


def test_sample_thresholds_with_seq_length(cli):
    out = run_json(
        cli,
        "0:8 100:16",
        "--micro-batch-size",
        "1",
        "--data-parallel-size",
        "8",
        "--seq-length",
        "1024",
        "--sample-thresholds",
    )
    assert (
        out["stages"][1]["threshold_samples"] == 100
        and out["stages"][1]["threshold_tokens"] == 102400
    )
    assert out["schedule_tokens"] == "0:8 102400:16"


def test_from_rampup_prints_the_converted_schedule(cli):
    answer = cli(
        "schedule",
        "--from-rampup",
        "16",
        "8",
        "300000",
        "--global-batch-size",
        "1024",
        "--micro-batch-size",
        "4",
        "--data-parallel-size",
        "2",
        "--seq-length",
        "4096",
    )
    assert answer.status == 0
    out = answer.out
    assert (
        "--rampup-batch-size 16 8 300000 --global-batch-size 1024 is this step schedule (127 "
        "stages):" in out
    )
    samples_line = next(
        line
        for line in out.splitlines()
        if line.strip().startswith('--step-batch-size-schedule "0:16 2381:24')
    )
    text = samples_line.split('"')[1]
    assert StepSchedule.parse(text).stages == StepSchedule.from_rampup(16, 8, 300000, 1024).stages
    tokens_line = next(line for line in out.splitlines() if '"0:16 9752576:24' in line)
    assert (
        StepSchedule.parse(tokens_line.split('"')[1], 4096).stages
        == StepSchedule.parse(text).stages
    )


def test_lr_hints_are_labelled(cli):
    answer = cli("schedule", *TOKENS, "--lr", "3e-4", "--lr-base-batch-size", "768")
    assert answer.status == 0
    out = answer.out
    assert "lr linear (hint)" in out and "lr sqrt (hint)" in out
    assert "hints only" in out and "Neither is a prescription" in out
    data = run_json(cli, *TOKENS, "--lr", "3e-4", "--lr-base-batch-size", "768")
    assert data["stages"][3]["lr_linear"] == pytest.approx(3e-4 * 8)
    assert data["stages"][3]["lr_sqrt"] == pytest.approx(3e-4 * 8**0.5)


def test_warn_future_stages(cli):
    answer = cli(
        "schedule",
        "0:256 100:384",
        "--micro-batch-size",
        "1",
        "--data-parallel-size",
        "128",
        "--planned-data-parallel-sizes",
        "256",
        "--warn-future-stages",
    )
    assert answer.status == 0
    assert "warning: --step-batch-size-schedule entry 2 '100:384'" in answer.err


RESUMED = [
    "0:8 1000:64",
    "--micro-batch-size",
    "4",
    "--data-parallel-size",
    "16",
    "--consumed-samples",
    "2000",
]


def test_consumed_samples_starts_the_table_at_the_stage_in_force(cli):
    """Resumed after a scale-up: stage 1 (8 < 4 x 16) is past, so it is neither checked nor run."""
    out = run_json(cli, *RESUMED, "--train-samples", "3000")
    assert out["consumed_samples"] == 2000
    assert [(s["first_sample"], s["steps"]) for s in out["stages"]] == [(None, 0), (2000, 16)]
    assert (out["iterations"], out["samples_at_end"]) == (16, 3024)
    answer = cli("schedule", *RESUMED, "--train-samples", "3000")
    assert answer.status == 0
    assert (
        "16 steps from --consumed-samples 2,000 to --train-samples 3,000; the last step ends at "
        "3,024" in answer.out
    )
    assert "stage(s) 1 already passed at --consumed-samples 2,000" in answer.out
    assert "never used" not in answer.out and not answer.err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["0:8 100:12", "--micro-batch-size", "4", "--data-parallel-size", "2"],
            "entry 2 '100:12' (from 100 samples, global batch size 12) is not a multiple of "
            "--micro-batch-size 4",
        ),
        (
            ["0:8 2.5:16", "--micro-batch-size", "4", "--data-parallel-size", "2"],
            "is not a whole number of samples",
        ),
        (
            ["0:8", "--micro-batch-size", "0", "--data-parallel-size", "2"],
            "--micro-batch-size 0 must be at least 1",
        ),
        (
            ["0:8", "--micro-batch-size", "-4", "--data-parallel-size", "2"],
            "error: --micro-batch-size -4 must be at least 1; give an integer >= 1.",
        ),
        (
            [
                "0:8",
                "--micro-batch-size",
                "4",
                "--data-parallel-size",
                "2",
                "--consumed-samples",
                "-5",
            ],
            "error: --consumed-samples -5 must be at least 0; give an integer >= 0.",
        ),
        (
            ["0:8", "--micro-batch-size", "4", "--data-parallel-size", "2", "--sample-thresholds"],
            "--sample-thresholds goes with --seq-length",
        ),
        (
            [
                "--from-rampup",
                "16",
                "8",
                "100",
                "--global-batch-size",
                "64",
                "--micro-batch-size",
                "4",
                "--data-parallel-size",
                "2",
                "--seq-length",
                "1024",
                "--sample-thresholds",
            ],
            "--sample-thresholds applies to a given schedule, not --from-rampup",
        ),
        (
            ["0:8 1000:nan5", "--micro-batch-size", "4", "--data-parallel-size", "2"],
            "entry 2 '1000:nan5': batch size 'nan5' is not a finite number",
        ),
        (["--micro-batch-size", "4", "--data-parallel-size", "2"], "give a schedule"),
        (
            [
                "--from-rampup",
                "16",
                "8",
                "100",
                "--micro-batch-size",
                "4",
                "--data-parallel-size",
                "2",
            ],
            "--from-rampup needs --global-batch-size",
        ),
        (
            ["0:8", "--micro-batch-size", "4", "--data-parallel-size", "2", "--train-tokens", "1M"],
            "--train-tokens needs --seq-length",
        ),
        (
            ["0:8", "--micro-batch-size", "4", "--data-parallel-size", "2", "--lr", "1e-3"],
            "--lr and --lr-base-batch-size go together",
        ),
        (
            [
                "0:8",
                "--micro-batch-size",
                "4",
                "--data-parallel-size",
                "2",
                "--plot",
                "/nonexistent/dir/x.png",
            ],
            "--plot /nonexistent/dir/x.png: cannot write the figure",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli, args, message):
    answer = cli("schedule", *args)
    assert answer.status == 2
    lines = answer.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron-ga schedule: error: ")
    assert message in lines[0]
    assert "Traceback" not in answer.err


def test_plot_png(tmp_path, cli):
    import matplotlib.image

    path = tmp_path / "schedule.png"
    answer = cli("schedule", *TOKENS, "--train-tokens", "1T", "--plot", str(path))
    assert answer.status == 0 and f"plot written to {path}" in answer.out
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    image = matplotlib.image.imread(str(path))
    assert image.shape[:2] == (500, 800)
    rgb = image[..., :3]
    not_white = (rgb < 0.95).any(axis=-1).mean()
    assert (
        0.01 < not_white < 0.5
    )  # axes, labels and the two step lines: drawn, not blank, not a solid fill
    assert rgb.std() > 0.05


def test_console_script_answers_in_under_half_a_second(cli_script):
    args = [
        "schedule",
        *TOKENS,
        "--train-tokens",
        "1T",
        "--lr",
        "3e-4",
        "--lr-base-batch-size",
        "768",
    ]
    best = float("inf")
    for _ in range(3):  # best of three: the machine is shared
        start = time.perf_counter()
        result = cli_script(*args)
        best = min(best, time.perf_counter() - start)
        assert result.returncode == 0, result.stderr
    assert best < 0.5, f"megatron-ga schedule took {best:.3f} s"


def test_plot_reads_as_a_person_reads_a_schedule(tmp_path, monkeypatch):
    """Token axis in K/M/B/T, each stage labelled with its GBS and first step, whole micro-batch
    ticks, and MBS, DP and the sequence length in the title (issue 38, item 9)."""
    from megatron_ga_ext import StepSchedule
    from megatron_ga_ext.cli import plots

    assert [plots.count_label(v) for v in (0, 512, 2.4e9, 5e8, 1e12)] == [
        "0",
        "512",
        "2.4B",
        "500M",
        "1T",
    ]
    seen = {}
    monkeypatch.setattr(plots, "save_figure", lambda plt, figure, path: seen.update(figure=figure))
    schedule = StepSchedule.parse("0:64 20B:128 60B:256", seq_length=4096)
    rows = schedule.table(1, 8, train_samples=50_000_000)
    plots.plot_schedule(
        rows,
        str(tmp_path / "x.png"),
        seq_length=4096,
        train_samples=50_000_000,
        micro_batch_size=1,
        data_parallel_size=8,
    )
    top, bottom = seen["figure"].axes
    assert top.get_title() == "step batch-size schedule (MBS 1, DP 8, seq 4,096)"
    assert [t.get_text() for t in top.texts] == [
        "GBS 64\nstep 0",
        "GBS 128\nstep 76,294",
        "GBS 256\nstep 152,588",
    ]
    assert all(float(t).is_integer() for t in bottom.get_yticks())
    seen["figure"].canvas.draw()
    assert any(label.get_text().endswith("B") for label in bottom.get_xticklabels())
