"""patches/: each release's patch applies to the released sources, and the patched tree behaves as
install() does, without install().

The sources are the wheels' own files, unpacked by tools/unpack-wheels.sh into $MEGATRON_GA_SOURCES
(default .cache/megatron-core-sources). Each release runs where its Python is: 0.16.1 on the 3.11
leg, 0.17.1, 0.18.2 and 0.19.2 on the 3.12 leg (they need Python 3.12).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = Path(os.environ.get("MEGATRON_GA_SOURCES", ROOT / ".cache" / "megatron-core-sources"))
from megatron_ga_ext.integration.compat import RELEASES, UPSTREAM  # noqa: E402

LEG = f"{sys.version_info.major}.{sys.version_info.minor}"
LEG_RELEASES = [u.name for u in UPSTREAM if u.is_release and u.python == LEG]

pytestmark = pytest.mark.slow


def patches(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "patches" / "patches.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def sources() -> Path:
    subprocess.run(
        ["bash", str(ROOT / "tools" / "unpack-wheels.sh"), str(SOURCES)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=600,
    )
    return SOURCES


def test_every_patch_is_current_and_applies_cleanly(sources):
    result = patches("check", "--sources", str(sources))
    assert result.returncode == 0, result.stdout + result.stderr
    for version in RELEASES:
        applies = (
            f"megatron-core-{version}/megatron-ga-ext.patch applies cleanly to megatron-core "
            f"{version}"
        )
        assert applies in result.stdout


def test_pretrain_gpt_patch_checks_a_named_checkout_or_says_it_skipped():
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_DIR"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "patches" / "patches.py"), "check-megatron-lm"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0 and "skipped: set MEGATRON_LM_DIR" in result.stdout
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if checkout:
        result = patches("check-megatron-lm")
        assert result.returncode == 0 and "applies cleanly" in result.stdout, (
            result.stdout + result.stderr
        )


@pytest.mark.parametrize("version", LEG_RELEASES)
def test_patched_tree_behaves_without_install(sources, tmp_path, version):
    tree = tmp_path / f"megatron-core-{version}"
    applied = patches("apply", "--sources", str(sources), "--version", version, "--into", str(tree))
    assert applied.returncode == 0, applied.stderr
    code = (
        "import sys, megatron.core, tests.test_install_pipeline_schedule as t; assert "
        "megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__; "
        "t.run_and_check('vendored'); print('vendored ok')"
    )
    # python -c puts its cwd first on sys.path, so ROOT makes `tests` importable; PYTHONPATH puts
    # the patched megatron before the installed one
    result = subprocess.run(
        [sys.executable, "-c", code, str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    assert result.returncode == 0 and "vendored ok" in result.stdout, result.stderr[-3000:]
