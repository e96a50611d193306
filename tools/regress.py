"""Regression runs against Megatron-LM sources: which sources, and the behaviour suite on each.

    python tools/regress.py sources               # the trees to test, one per line (unpacking tarballs)
    python tools/regress.py behaviour [PATH ...]  # the behaviour suite on each; its cell of the compatibility row

Sources: the PATHs given (a Megatron-LM checkout or a .tar.gz of one; ``MEGATRON_LM`` in the Makefile),
else every snapshot ``megatron-lm-<ref>.tar.gz`` in ``MEGATRON_LM_SNAPSHOTS`` (default ../shared/upstream)
of a tested source (compat.UPSTREAM) that runs on this Python, else this Python's released megatron-core
wheels (their megatron/core only: enough for the behaviour suite, not for the end-to-end tier).
Tarballs and wheels are unpacked once under .cache/. The behaviour suite's outcome is recorded (tools/results.py)
where ``MEGATRON_GA_RESULTS`` is set, for ``make docs`` to render into docs/compatibility.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from megatron_ga_ext.integration.compat import UPSTREAM

if __package__:  # tools.regress: the tests, python -m tools.regress
    from .compatibility import source_name
    from .results import record
else:  # python tools/regress.py: the script's own directory is first on sys.path
    from compatibility import source_name
    from results import record

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
LEG = f"{sys.version_info.major}.{sys.version_info.minor}"
BEHAVIOUR_TESTS = ("tests/test_install.py", "tests/test_install_distributed.py", "tests/test_guards.py",
                   "tests/test_reduction.py")
NO_SOURCE = ("no Megatron-LM source: pass MEGATRON_LM=<checkout or .tar.gz>, or MEGATRON_LM_SNAPSHOTS=<dir of "
             "megatron-lm-<ref>.tar.gz> (default ../shared/upstream)")


def snapshot_dir() -> Path:
    return Path(os.environ.get("MEGATRON_LM_SNAPSHOTS") or ROOT.parent / "shared" / "upstream")


def tree(path: Path) -> Path:
    """A checkout as it is, or a tarball unpacked once under .cache/megatron-lm: the dir holding megatron/."""
    if path.is_dir():
        root = path
    else:
        root = CACHE / "megatron-lm" / path.name.removesuffix(".tar.gz").removesuffix(".tgz")
        if not root.exists():
            partial = root.with_name(root.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            with tarfile.open(path) as archive:
                archive.extractall(partial, filter="data")
            inside = list(partial.iterdir())
            # A tarball of one top-level directory (git archive --prefix) becomes that directory.
            (inside[0] if len(inside) == 1 and inside[0].is_dir() else partial).rename(root)
            shutil.rmtree(partial, ignore_errors=True)
    if not (root / "megatron" / "core").is_dir():
        raise SystemExit(f"{path}: no megatron/core in it; give a Megatron-LM checkout or a .tar.gz of one")
    return root


def sources(given: list[str]) -> list[Path]:
    """The trees to test (see the module docstring); [] when there is none."""
    if given:
        return [tree(Path(p).expanduser().resolve()) for p in given]
    snapshots = snapshot_dir()
    tarballs = [snapshots / f"megatron-lm-{u.ref}.tar.gz" for u in UPSTREAM if u.python == LEG]
    return [tree(t) for t in tarballs if t.exists()]


def wheel_trees() -> list[Path]:
    """This Python's released megatron-core wheels, unpacked (tools/unpack-wheels.sh)."""
    releases = [u.name for u in UPSTREAM if u.is_release and u.python == LEG]
    target = CACHE / "megatron-core-sources"
    subprocess.run(["bash", str(ROOT / "tools" / "unpack-wheels.sh"), str(target), *releases], check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    return [target / r for r in releases]


def behaviour(trees: list[Path]) -> int:
    """The behaviour suite with each tree's megatron first on the path; one recorded cell each. Exit status."""
    failed = 0
    for root in trees:
        name = source_name(root) if root.parent.name != "megatron-core-sources" else root.name
        print(f"== behaviour suite on {name} ({root}) ==", flush=True)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BEHAVIOUR_TESTS],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True)
        print(done.stdout[-3000:], done.stderr[-3000:], sep="", flush=True)
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else f"exit {done.returncode}"
        record("compatibility", [{"Source": name, "Behaviour suite": summary.strip("= ")}])
        failed += done.returncode != 0
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    command, *paths = argv or ["sources"]
    trees = sources(paths)
    if command == "sources":
        if not trees:
            print(NO_SOURCE, file=sys.stderr)
            return 2
        print("\n".join(str(t) for t in trees))
        return 0
    if command == "behaviour":
        return behaviour(trees or wheel_trees())
    print(f"unknown command {command!r}: sources or behaviour", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
