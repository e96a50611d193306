"""megatron-ga schedule --suggest: a measured trace in, the doubling rule's schedule, table and plot
out."""

import json

import pytest

from megatron_ga_ext import StepSchedule
from megatron_ga_ext.cli import schedule as command
from megatron_ga_ext.cli.main import build_parser
from megatron_ga_ext.errors import (
    InterleaveError,
    NoiseScaleError,
    ScheduleError,
    SizeError,
    UsageError,
)
from megatron_ga_ext.science.core.noise_trace import log_line

ROWS = [
    {"iteration": 0, "consumed_samples": 0, "b_simple_samples": 5},
    {"iteration": 100, "consumed_samples": 3200, "b_simple_samples": 70},
    {"iteration": 200, "consumed_samples": 9600, "b_simple_samples": 140},
    {"iteration": 300, "consumed_samples": 22400, "b_simple_samples": None},
    {"iteration": 400, "consumed_samples": 48000, "b_simple_samples": 300, "grad_sq": 0.01},
    {"iteration": 500, "consumed_samples": 99200, "b_simple_tokens": 700 * 4096},
    {"iteration": 600, "consumed_samples": 150000, "b_simple_samples": 2000},
]
LAYOUT = [
    "--micro-batch-size",
    "2",
    "--data-parallel-size",
    "16",
    "--max-global-batch-size",
    "512",
    "--seq-length",
    "4096",
]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(ROWS))
    return str(path)


def invoke(*argv: str) -> int:
    """The command's own run(), so a bad input surfaces as its typed error (main() prints it, exit
    2)."""
    return command.run(build_parser("schedule").parse_args(["schedule", *argv]))


def test_json_gives_the_schedule_and_each_doubling(cli, trace):
    answer = cli("schedule", "--suggest", trace, *LAYOUT, "--lr-warmup-samples", "5K", "--json")
    assert answer.status == 0, answer.err
    out = answer.json()
    assert out["schedule_samples"] == "0:32 9600:64 48K:128 99200:256 150K:512"
    assert (
        StepSchedule.parse(out["schedule_tokens"], 4096).stages
        == StepSchedule.parse(out["schedule_samples"]).stages
    )
    first = out["decisions"][0]
    assert (first["consumed_samples"], first["before"], first["after"]) == (9600, 32, 64)
    assert (
        out["decisions"][2]["b_simple_samples"] == 700
    )  # read from b_simple_tokens / --seq-length
    assert [(h["consumed_samples"], h["reason"]) for h in out["held"]] == [
        (3200, "the LR warmup (--lr-warmup-samples 5,000)")
    ]
    assert [s["global_batch_size"] for s in out["stages"]] == [32, 64, 128, 256, 512]


def test_text_prints_the_strings_the_table_and_the_notes(cli, trace):
    answer = cli(
        "schedule",
        "--suggest",
        trace,
        *LAYOUT,
        "--trust",
        "0.5",
        "--lr-decay-samples",
        "200K",
        "--lr-wsd-decay-samples",
        "60K",
        "--train-samples",
        "200K",
    )
    assert answer.status == 0, answer.err
    lines = answer.out.splitlines()
    assert lines[0].endswith("(7 rows; trust 0.5; first GBS 32; cap 512):")
    assert lines[4] == '    --step-batch-size-schedule "0:32 9600:64 48K:128 99200:256"'
    assert "steps for --train-samples 200,000" in answer.out and "3 doubling(s)" in answer.out
    assert "note: held by the final decay (from 140,000 samples) at 1 row(s)" in answer.out


def test_the_first_stage_and_the_cap(cli, trace):
    out = cli(
        "schedule",
        "--suggest",
        trace,
        "--micro-batch-size",
        "2",
        "--data-parallel-size",
        "16",
        "--seq-length",
        "4096",
        "--global-batch-size",
        "64",
        "--max-global-batch-size",
        "256",
        "--json",
    ).json()
    assert out["schedule_samples"] == "0:64 9600:128 48K:256"
    assert out["held"][0]["reason"] == "the cap --max-global-batch-size 256"


def test_plot_draws_the_trace_against_the_schedule(cli, trace, tmp_path):
    pytest.importorskip("matplotlib")
    figure = tmp_path / "suggest.png"
    answer = cli(
        "schedule",
        "--suggest",
        trace,
        *LAYOUT,
        "--lr-warmup-samples",
        "5000",
        "--trust",
        "1.5",
        "--plot",
        str(figure),
    )
    assert answer.status == 0, answer.err
    assert (
        figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        and f"plot written to {figure}" in answer.out
    )


def test_an_error_is_one_line_and_exit_2(cli, trace):
    answer = cli(
        "schedule", "--suggest", trace, "--micro-batch-size", "2", "--data-parallel-size", "16"
    )
    assert answer.status == 2
    assert answer.err == (
        "megatron-ga schedule: error: --suggest needs --max-global-batch-size: the largest batch "
        "the run may reach (memory, the data, or where the loss stops improving per "
        "sample).\n"
    )


@pytest.mark.parametrize(
    "extra, error, match",
    [
        (["0:32"], UsageError, r"--suggest writes the schedule itself"),
        (["--trust", "x"], UsageError, r"--trust 'x' is not a number"),
        (["--trust", "-1"], UsageError, r"--trust -1.0 must be a positive finite number"),
        (
            ["--lr-decay-samples", "100K"],
            UsageError,
            r"--lr-decay-samples and --lr-wsd-decay-samples go together",
        ),
        (
            ["--lr-decay-samples", "10", "--lr-wsd-decay-samples", "20"],
            UsageError,
            r"--lr-wsd-decay-samples 20 is longer than --lr-decay-samples 10",
        ),
        (["--lr-warmup-samples", "-5"], SizeError, r"--lr-warmup-samples -5 must be at least 0"),
        (
            ["--global-batch-size", "48"],
            ScheduleError,
            r"--global-batch-size 48 \(the first stage\) is not a multiple",
        ),
        (
            ["--consumed-samples", "5", "--warn-future-stages"],
            UsageError,
            r"--consumed-samples, --warn-future-stages do\(es\) not apply to --suggest",
        ),
        (
            ["--virtual-pipeline-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"],
            InterleaveError,
            r"interleaved schedule needs num_microbatches >= N = 4",
        ),
    ],
)
def test_bad_input_raises_a_typed_error(trace, extra, error, match):
    positional = [e for e in extra if e == "0:32"]
    rest = [e for e in extra if e != "0:32"]
    with pytest.raises(error, match=match):
        invoke(*positional, "--suggest", trace, *LAYOUT, *rest)


def test_a_missing_or_bad_trace_file(tmp_path):
    with pytest.raises(UsageError, match=r"--suggest .*nope.json: cannot read the trace"):
        invoke("--suggest", str(tmp_path / "nope.json"), *LAYOUT)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(UsageError, match=r"not UTF-8 text at byte 0"):
        invoke("--suggest", str(bad), *LAYOUT)
    bad.write_text(
        '[{"consumed_samples": 5, "b_simple_samples": 1}, {"consumed_samples": 4, '
        '"b_simple_samples": 1}]'
    )
    with pytest.raises(
        NoiseScaleError, match=r"trace row 2 has consumed_samples 4, not above row 1's 5"
    ):
        invoke("--suggest", str(bad), *LAYOUT)
    bad.write_text('[{"consumed_samples": 5, "b_simple_tokens": 100}]')
    with pytest.raises(
        UsageError, match=r'trace row 1 gives "b_simple_tokens" only: give --seq-length'
    ):
        invoke("--suggest", str(bad), *LAYOUT[:6])


def test_a_run_log_with_k_not_a_multiple_of_the_log_interval(cli, tmp_path):
    """``--log-interval 10 --ga-noise-scale 5``: Megatron logs iterations 10 and 20, the extension's
    line (as the run prints it) every 5; --suggest reads the consumed samples from the noise-scale
    lines."""
    lines = []
    for iteration in range(1, 21):
        consumed = 16 * iteration
        if iteration % 10 == 0:
            lines.append(
                f" [2026-12-02 08:12:50] iteration {iteration:8d}/      20 | consumed samples: "
                f"{consumed:12d} "
                "| elapsed time per iteration (ms): 302.9 | global batch size:    16 | lm loss: "
                "6.31E+00 |"
            )
        if iteration % 5 == 0:
            lines.append(
                log_line(
                    {  # the line the run prints
                        "iteration": iteration,
                        "consumed_samples": consumed,
                        "b_simple_tokens": 640.0 * iteration,
                        "b_simple_samples": 10.0 * iteration,
                        "grad_sq": 6.5,
                        "grad_sq_ema": 10.0,
                        "trace_sigma": 50.9,
                        "trace_sigma_ema": 97.7,
                        "tokens": 898,
                        "replicas": 2,
                    }
                )
            )
    log = tmp_path / "run.log"
    log.write_text("\n".join(lines) + "\n")
    answer = cli(
        "schedule",
        "--suggest",
        str(log),
        "--micro-batch-size",
        "2",
        "--data-parallel-size",
        "2",
        "--global-batch-size",
        "16",
        "--max-global-batch-size",
        "64",
        "--seq-length",
        "64",
        "--json",
    )
    assert answer.status == 0, answer.err
    out = answer.json()
    assert out["schedule_samples"] == "0:16 80:32 160:64", (
        out
    )  # B_simple 50 at 80 samples, 100 at 160
    assert [(d["iteration"], d["consumed_samples"]) for d in out["decisions"]] == [
        (5, 80),
        (10, 160),
    ], out
    assert [h["consumed_samples"] for h in out["held"]] == [240, 320], out  # the cap 64


@pytest.mark.parametrize("flag", [flag for _, flag in command.SUGGEST_ONLY])
def test_suggest_flags_without_suggest_are_refused(flag):
    with pytest.raises(UsageError, match=f"{flag} goes with --suggest TRACE.json"):
        invoke("0:32", "--micro-batch-size", "2", "--data-parallel-size", "16", flag, "1")


def test_the_docs_example_is_current():
    """docs/noise-scale.md shows what --suggest prints for examples/noise-scale-trace.json (python
    -m tools.noise_scale --write renders both; this test only reads them)."""
    from tools import docs, noise_scale

    assert json.loads(noise_scale.TRACE.read_text()) == noise_scale.example_trace()
    shown = docs.block(noise_scale.DOC.read_text(), "suggest-example")
    assert noise_scale.suggest_output() in shown, (
        "run python -m tools.noise_scale --write and commit"
    )
