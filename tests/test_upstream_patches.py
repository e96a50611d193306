"""patches/upstream.py's apply (dry run, apply, reverse, refusal) on a copy of the installed
0.19.2's files, and verify --upstream's check that nothing of this package is in megatron-core's
step."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ga_ext import install, uninstall
from megatron_ga_ext.errors import VerifyError
from megatron_ga_ext.integration.compat import (
    fingerprint_file,
    known_fingerprints,
    megatron_core_version,
    tree_targets,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "patches" / "upstream.py"
SOURCE = "megatron-core-0.19.2"

# The patch set's release is 0.19.2: its files are copied from the installed megatron-core (the
# compatibility leg's 0.16.1 is not what the patches fix; make patches-check runs the snapshots).
pytestmark = pytest.mark.skipif(
    megatron_core_version() != "0.19.2", reason="patches/upstream's release is 0.19.2"
)


def upstream(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files the 0.19.2 patches change, and package_info.py, copied from the installed
    megatron-core."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    site = Path(next(iter(spec.submodule_search_locations))).parents[1]
    touched = {"megatron/core/package_info.py"}
    for patch in (ROOT / "patches" / "upstream" / SOURCE).glob("*.patch"):
        touched |= {
            line[6:] for line in patch.read_text().splitlines() if line.startswith("+++ b/")
        }
    for path in touched:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / path, tmp_path / path)
    return tmp_path


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.py"))}


def test_dry_run_apply_reverse_and_a_refusal_that_changes_nothing(tree):
    pristine = snapshot(tree)

    dry = upstream("apply", "--into", str(tree), "--dry-run")
    assert dry.returncode == 0 and f"{SOURCE}: would apply 6 patches" in dry.stdout, dry.stderr
    assert snapshot(tree) == pristine

    applied = upstream("apply", "--into", str(tree))
    assert applied.returncode == 0 and "applied 6 patches" in applied.stdout, applied.stderr
    patched = snapshot(tree)
    assert (
        "def scale_gradients"
        in patched["megatron/core/distributed/torch_fully_sharded_data_parallel.py"].decode()
    )

    again = upstream("apply", "--into", str(tree))
    assert again.returncode == 1
    assert "0001-fsdp2-scale-gradients.patch does not apply" in again.stderr
    assert (
        "(nothing changed)" in again.stderr
        and "already applied: --reverse removes it" in again.stderr
    )
    assert snapshot(tree) == patched

    reversed_ = upstream("apply", "--into", str(tree), "--reverse")
    assert reversed_.returncode == 0 and "reversed 6 patches" in reversed_.stdout, reversed_.stderr
    assert snapshot(tree) == pristine


def test_a_tree_without_the_files_is_refused(tmp_path):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 19\nPATCH = 2\n"
    )
    result = upstream("apply", "--into", str(tmp_path))
    assert result.returncode == 1
    assert "no megatron/core/distributed/torch_fully_sharded_data_parallel.py" in result.stderr


def test_verify_upstream_refuses_a_step_with_install_hooks():
    from megatron_ga_ext.verify.upstream import check_unhooked

    check_unhooked()  # megatron-core alone
    install()
    try:
        with pytest.raises(
            VerifyError,
            match=r"not upstream's own: .*finalize_model_grads runs code from .*megatron_ga_ext",
        ):
            check_unhooked()
    finally:
        uninstall()
    check_unhooked()


@pytest.mark.slow
def test_verify_upstream_measures_the_pristine_release_factors():
    """verify --upstream on the installed (pristine) 0.19.2, megatron-core alone: torch FSDP2's
    gradient N / DP = 36 times the token reference (N = 72), global_aux_loss's router gradient DP =
    2 times its target (patches 0001, 0002; the patched trees' 1.0000 is measured by make
    patches-check's tree and docs/upstream.md)."""
    from megatron_ga_ext.verify.aux import UPSTREAM
    from megatron_ga_ext.verify.launches import launch_all
    from megatron_ga_ext.verify.layouts import Layout

    layouts = (
        Layout(
            data_parallel_size=2,
            num_microbatches=4,
            model="gpt_untied",
            data_parallel="torch_fsdp2",
        ),
        Layout(data_parallel_size=2, num_microbatches=4, model="moe_global"),
    )
    _, coefficients = launch_all(
        [], device="cpu", timeout_s=300, aux_layouts=layouts, upstream=True
    )
    measured = {c.layout: round(c.coefficient, 4) for c in coefficients if c.variant == UPSTREAM}
    assert measured == {layouts[0].name: 36.0, layouts[1].name: 2.0}


def test_the_patched_hooked_functions_are_tested_sources(tree):
    """install() under --ga-strict accepts a megatron-core with the patch set applied: every hooked
    function the patches change has the patched tree's fingerprint in fingerprints.json (make
    fingerprints reads the patched trees), so a vendored, fixed tree is not refused as unknown."""

    assert upstream("apply", "--into", str(tree)).returncode == 0
    known = known_fingerprints()
    copied = [t for t in tree_targets(tree) if t.path_in(tree).exists()]
    found = {t.name: fingerprint_file(t.path_in(tree), t.name) for t in copied}
    assert {"forward_backward_no_pipelining", "process_mtp_loss"} <= set(found)
    for target in copied:
        sources = known[target.qualified].get(found[target.name], [])
        assert "0.19.2 + patches/upstream" in sources, target.qualified
