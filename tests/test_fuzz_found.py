"""What the fuzz tests (tests/test_fuzz.py) found, each pinned by its smallest example."""

import pytest

from megatron_ga_ext.cli import main


@pytest.mark.parametrize("argv, flag", [
    (["ledger", "--world-size=8", "--micro-batch-size=--"], "--micro-batch-size"),
    (["check", "--world-size=--", "--", "torchrun", "--nproc-per-node", "8"], "--world-size"),
    (["schedule", "0:8", "--micro-batch-size", "1", "--data-parallel-size", "1", "--lr=--",
      "--lr-base-batch-size", "8"], "--lr"),
])
def test_a_flag_given_as_flag_equals_dashdash_is_a_usage_error(capsys, argv, flag):
    """argparse reads ``--flag=--`` as an empty list, which reached read_int (AttributeError) or math.isfinite
    (TypeError) as a traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}=--: '--' is not a value for {flag}; give {flag} a value, or leave it out." in err
    assert "Traceback" not in err
