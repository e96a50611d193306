"""The installed package stays lean: install() in token mode (the default) imports none of the
batch-size science (``megatron_ga_ext.science``: the noise scale, the critical batch, ``--suggest``,
the warmup, LR scaling), none of the verify harness and its CPU support, and none of the commands;
``--ga-noise-scale`` and ``--ga-lr-scaling`` load the science they use. One fresh interpreter for
both (megatron-core's import costs 5-12 s); docs/performance.md gives the token-only path's modules,
lines and import time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]

#: The subpackages a token-only install() loads modules of: the public API ("" is the root:
#: errors.py, logs.py), the pure core and its step schedules, the configuration and its coverage
#: table, the Megatron integration and its features.
TOKEN_ONLY_PACKAGES = {
    "",
    "core",
    "core.schedule",
    "config",
    "config.coverage",
    "integration",
    "integration.features",
}
#: Never loaded by a token-only install(): the science, the verify harness and its CPU shims, the
#: commands.
NEVER = ("science", "testing", "verify", "cli", "launch", "oracle")

RUN = """
import json, sys

import megatron_ga_ext
from megatron_ga_ext import GAConfig


def ours():
    return sorted(name for name in sys.modules if name.startswith("megatron_ga_ext"))


megatron_ga_ext.install(GAConfig(loss_reduction="token"))
token = ours()
megatron_ga_ext.uninstall()
megatron_ga_ext.install(GAConfig(loss_reduction="token", noise_scale=10, lr_scaling="sqrt"))
print(json.dumps({"token": token, "science": ours()}))
megatron_ga_ext.uninstall()
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", RUN],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


PACKAGE = ROOT / "megatron_ga_ext"
PACKAGES = {
    ".".join(("megatron_ga_ext", *path.relative_to(PACKAGE).parent.parts))
    for path in PACKAGE.rglob("__init__.py")
}


def _package(module: str) -> str:
    """``megatron_ga_ext.core.schedule.stages`` -> ``core.schedule``; the root and its modules ->
    ``""``."""
    package = module if module in PACKAGES else module.rpartition(".")[0]
    return package.removeprefix("megatron_ga_ext").removeprefix(".")


def test_a_token_only_install_loads_no_science_verify_or_commands(loaded):
    token = loaded["token"]
    strays = [name for name in token if name.split(".")[1:2] and name.split(".")[1] in NEVER]
    assert strays == [], f"a token-only install() imports {strays}"
    assert {_package(name) for name in token} == TOKEN_ONLY_PACKAGES, token


def test_the_science_loads_where_its_flags_ask(loaded):
    """The check above can fail: with --ga-noise-scale and --ga-lr-scaling the science's modules are
    loaded."""
    science = {name for name in loaded["science"] if name.startswith("megatron_ga_ext.science.")}
    assert "megatron_ga_ext.science.core.noise_scale" in science, sorted(science)
    assert set(loaded["token"]) < set(loaded["science"])
