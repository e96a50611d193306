"""``schedule --suggest`` checks every number as the table does (cli/schedule_args.py): the same
refusal, the same message, before the trace is read."""

import json
import re

import pytest

from megatron_ga_ext.cli import schedule as command
from megatron_ga_ext.cli.main import build_parser
from megatron_ga_ext.errors import GAError, SizeError, UsageError

LAYOUT = ["--micro-batch-size", "2", "--data-parallel-size", "16"]
ROWS = [
    {"consumed_samples": 0, "b_simple_samples": 5},
    {"consumed_samples": 3200, "b_simple_samples": 70},
]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(ROWS))
    return str(path)


def refusal(*argv: str) -> GAError:
    """The typed error ``megatron-ga schedule ARGV`` raises (main() prints it and exits 2)."""
    with pytest.raises(GAError) as caught:
        command.run(build_parser("schedule").parse_args(["schedule", *argv]))
    return caught.value


BAD = [
    (
        ["--lr", "nan", "--lr-base-batch-size", "32"],
        UsageError,
        r"--lr nan must be a positive finite number",
    ),
    (
        ["--lr", "inf", "--lr-base-batch-size", "32"],
        UsageError,
        r"--lr inf must be a positive finite number",
    ),
    (
        ["--lr", "-0.001", "--lr-base-batch-size", "32"],
        UsageError,
        r"--lr -0.001 must be a positive finite number",
    ),
    (
        ["--lr", "0", "--lr-base-batch-size", "32"],
        UsageError,
        r"--lr 0.0 must be a positive finite number",
    ),
    (["--lr", "3e-4"], UsageError, r"--lr and --lr-base-batch-size go together"),
    (["--lr-base-batch-size", "32"], UsageError, r"--lr and --lr-base-batch-size go together"),
    (["--lr", "3e-4", "--lr-base-batch-size", "0"], SizeError, r"--lr-base-batch-size"),
    (
        ["--lr", "3e-4", "--lr-base-batch-size", "2.5"],
        SizeError,
        r"--lr-base-batch-size '2.5' is not a whole number",
    ),
    (["--train-samples", "0"], SizeError, r"--train-samples"),
    (["--train-tokens", "1M"], UsageError, r"--train-tokens needs --seq-length"),
]


@pytest.mark.parametrize(("flags", "error", "message"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_suggest_refuses_what_the_table_refuses(trace, flags, error, message):
    table = refusal("0:32", *LAYOUT, *flags)
    suggested = refusal("--suggest", trace, *LAYOUT, "--max-global-batch-size", "512", *flags)
    assert type(suggested) is type(table) is error
    assert str(suggested) == str(table) and re.search(message, str(table))


def test_a_bad_number_fails_before_the_trace_is_read(tmp_path):
    """The flags are checked first: a missing trace is not what a bad --lr reports."""
    missing = str(tmp_path / "no-such-trace.json")
    bad_lr = refusal(
        "--suggest",
        missing,
        *LAYOUT,
        "--max-global-batch-size",
        "512",
        "--lr",
        "nan",
        "--lr-base-batch-size",
        "32",
    )
    assert isinstance(bad_lr, UsageError) and "--lr nan must be a positive finite number" in str(
        bad_lr
    )
    no_trace = refusal("--suggest", missing, *LAYOUT, "--max-global-batch-size", "512")
    assert isinstance(no_trace, UsageError) and "cannot read the trace" in str(no_trace)


@pytest.mark.parametrize("trust", ["nan", "inf", "-0.5", "0"])
def test_suggest_refuses_a_trust_that_is_not_positive_and_finite(trace, trust):
    error = refusal("--suggest", trace, *LAYOUT, "--max-global-batch-size", "512", "--trust", trust)
    assert isinstance(error, UsageError) and re.search(
        r"--trust \S+ must be a positive finite number", str(error)
    )


def test_suggest_hints_follow_a_good_lr(cli, trace):
    """A valid --lr gives the same hint columns as the table: lr x GBS / base and lr x sqrt(GBS /
    base)."""
    out = cli(
        "schedule",
        "--suggest",
        trace,
        *LAYOUT,
        "--max-global-batch-size",
        "512",
        "--lr",
        "1e-3",
        "--lr-base-batch-size",
        "32",
        "--json",
    ).json()
    assert [(s["global_batch_size"], s["lr_linear"]) for s in out["stages"]] == [
        (32, 1e-3),
        (64, 2e-3),
    ]
    assert out["stages"][1]["lr_sqrt"] == pytest.approx(1e-3 * 2**0.5, rel=1e-15)
    assert out["lr_note"] is not None
