"""The one-line drop-in against Megatron-LM's own argument parser: install() adds the --ga-* flags
to it and, in token mode, turns on --calculate-per-token-loss; ``python -m megatron_ga_ext SCRIPT``
runs a script that way."""

import subprocess
import sys

import pytest

import megatron_ga_ext
from megatron_ga_ext.integration import megatron_lm as ga_arguments

arguments = pytest.importorskip(
    "megatron.training.arguments",
    reason="megatron.training ships in the megatron-core wheel from 0.19 on",
)
LINE = ["pretrain_gpt.py", "--micro-batch-size", "2", "--no-ga-strict"]


@pytest.fixture
def installed():
    original = arguments.parse_args
    megatron_ga_ext.install()
    yield
    megatron_ga_ext.uninstall()
    assert arguments.parse_args is original


def parse(monkeypatch, *flags: str, provider=None):
    monkeypatch.setattr(sys, "argv", [*LINE, *flags])
    return arguments.parse_args(provider, False)


def test_install_adds_the_ga_flags_to_megatrons_parser(installed, monkeypatch):
    args = parse(monkeypatch, "--ga-convert-rampup", "--step-batch-size-schedule", "0:16 1M:32")
    assert (args.ga_loss_reduction, args.ga_strict, args.ga_convert_rampup) == (
        "token",
        False,
        True,
    )
    assert args.step_batch_size_schedule == "0:16 1M:32"  # Megatron's own flag, not a second copy
    assert args.micro_batch_size == 2


def test_token_mode_turns_on_per_token_loss_and_says_so_once(installed, monkeypatch, caplog):
    caplog.set_level("INFO", logger=ga_arguments.__name__)
    assert parse(monkeypatch).calculate_per_token_loss is True
    assert parse(monkeypatch, "--ga-loss-reduction", "token").calculate_per_token_loss is True
    said = [
        r.getMessage()
        for r in caplog.records
        if "turns on --calculate-per-token-loss" in r.getMessage()
    ]
    assert (
        len(said) == 1
        and "--ga-loss-reduction microbatch keeps upstream's mean of means" in said[0]
    )


def test_microbatch_mode_keeps_upstreams_mean_of_means(installed, monkeypatch):
    assert parse(monkeypatch, "--ga-loss-reduction", "microbatch").calculate_per_token_loss is False


def test_a_scripts_own_provider_runs_and_args_provider_still_works(installed, monkeypatch):
    def own(parser):
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    args = parse(monkeypatch, "--my-flag", "3", "--ga-checks", "async", provider=own)
    assert (args.my_flag, args.ga_checks) == (3, "async")
    args = parse(monkeypatch, "--ga-checks", "async", provider=megatron_ga_ext.args_provider(own))
    assert args.ga_checks == "async"  # the flags added once, whichever provider adds them first


def test_uninstalled_parser_has_no_ga_flags(monkeypatch):
    monkeypatch.setattr(sys, "argv", [*LINE, "--ga-checks", "async"])
    args = arguments.parse_args(None, True)
    assert not hasattr(args, "ga_checks")


def test_module_entry_needs_a_script():
    for argv, message in (
        ([], "usage: python -m megatron_ga_ext SCRIPT"),
        (["no_such_script.py"], "no_such_script.py: no such script"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "megatron_ga_ext", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1 and message in result.stderr


def test_module_entry_runs_the_script_installed_with_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    (tmp_path / "helper_module.py").write_text("VALUE = 7\n")
    script.write_text(
        "import sys\nimport helper_module  # the script's directory is on the path, as `python "
        "SCRIPT` has it\nfrom megatron_ga_ext.integration.lifecycle import "
        "installed\nprint(sys.argv[1:], installed() is not None, helper_module.VALUE, "
        "__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "megatron_ga_ext", str(script), "--micro-batch-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path.parent,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "['--micro-batch-size', '2'] True 7 __main__"
