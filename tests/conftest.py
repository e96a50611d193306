"""Fixtures shared by the test files: ``megatron-ga`` run in-process and as the installed console
script."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from megatron_ga_ext.cli.main import main

#: The console script pip installed beside this interpreter.
CONSOLE_SCRIPT = Path(sys.executable).with_name("megatron-ga")


@dataclass(frozen=True)
class Answer:
    """What one ``megatron-ga`` command did: its exit status (0, 1 problems, 2 an error) and its
    output."""

    status: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Answer]:
    """``cli("check", "--", ...)``: the command run in this process (its own main), output
    captured."""

    def run(*argv: str) -> Answer:
        capsys.readouterr()  # what the test printed before is not the command's
        status = main(list(argv))
        captured = capsys.readouterr()
        return Answer(status, captured.out, captured.err)

    return run


@pytest.fixture
def cli_script() -> Callable[..., subprocess.CompletedProcess]:
    """``cli_script("ledger", ...)``: the installed console script in a subprocess, as a user runs
    it."""
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"the console script is not installed ({CONSOLE_SCRIPT})")

    def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(CONSOLE_SCRIPT), *argv], capture_output=True, text=True, timeout=timeout
        )

    return run


@pytest.fixture
def clean_install():
    """No installation and no num-microbatches calculator before and after the test
    (``usefixtures``)."""
    from megatron.core import num_microbatches_calculator as calculators

    from megatron_ga_ext import uninstall

    uninstall()
    calculators.unset_num_microbatches_calculator()
    yield
    uninstall()
    calculators.unset_num_microbatches_calculator()
