"""examples/: the drop-in pretrain_gpt_ga.py against Megatron's real argument parser, and launch.sh."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_example():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_ga", ROOT / "examples" / "pretrain_gpt_ga.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_drop_in_adds_the_ga_flags_to_megatrons_own_parser(monkeypatch):
    arguments = pytest.importorskip(
        "megatron.training.arguments", reason="megatron.training ships in the megatron-core wheel from 0.19 on")
    original = arguments.parse_args
    example = load_example()
    try:
        example.add_ga_args_to_megatron()
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--micro-batch-size", "2", "--ga-loss-reduction", "microbatch",
                                          "--no-ga-strict", "--ga-convert-rampup", "--step-batch-size-schedule", "0:16 1M:32"])
        args = arguments.parse_args(None, False)
    finally:
        arguments.parse_args = original
    assert (args.ga_loss_reduction, args.ga_strict, args.ga_convert_rampup) == ("microbatch", False, True)
    assert args.step_batch_size_schedule == "0:16 1M:32"  # Megatron's own flag, not a second copy
    assert args.micro_batch_size == 2


def test_launch_script_is_valid_bash_and_checks_before_it_launches(cli_script):
    subprocess.run(["bash", "-n", str(ROOT / "examples" / "launch.sh")], check=True)
    text = (ROOT / "examples" / "launch.sh").read_text()
    assert text.index('megatron-ga check -- "${LAUNCH[@]}"') < text.index('exec "${LAUNCH[@]}"')
    # Its launch line passes megatron-ga check as it is.
    line = text.split("LAUNCH=(")[1].split("\n)")[0]
    tokens = [t for t in subprocess.run(
        ["bash", "-c", f'NNODES=2 DATA_PATH=d VOCAB_FILE=v MERGE_FILE=m; here=.; LAUNCH=({line}); printf "%s\\n" "${{LAUNCH[@]}}"'],
        capture_output=True, text=True, check=True).stdout.splitlines()]
    result = cli_script("check", "--", *tokens)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no problems found" in result.stdout
