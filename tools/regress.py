"""Regression runs against Megatron-LM sources: which sources, and the behaviour suite on each.

    python tools/regress.py sources               # the trees to test, one per line (unpacking tarballs)
    python tools/regress.py behaviour [PATH ...]  # the behaviour suite on each; its cell of the compatibility row
    python tools/regress.py drift PATH ...        # what upstream changed there that the project has not classified

Sources: the PATHs given (a Megatron-LM checkout or a .tar.gz of one; ``MEGATRON_LM`` in the
Makefile), else every snapshot ``megatron-lm-<ref>.tar.gz`` in ``MEGATRON_LM_SNAPSHOTS`` (default
../shared/upstream) of a tested source (compat.UPSTREAM) that runs on this Python, else this
Python's released megatron-core wheels (their megatron/core only: enough for the behaviour suite,
not for the end-to-end tier). Tarballs and wheels are unpacked once under .cache/. The behaviour
suite's outcome is recorded (tools/results.py) where ``MEGATRON_GA_RESULTS`` is set, for ``make
docs`` to render into docs/compatibility.md.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from megatron_ga_ext.config.coverage import unclassified
from megatron_ga_ext.errors import CompatError
from megatron_ga_ext.integration.compat import (
    TARGETS,
    UPSTREAM,
    fingerprint_file,
    known_fingerprints,
    tree_targets,
)

if __package__:  # tools.regress: the tests, python -m tools.regress
    from .compatibility import source_name
    from .results import record
else:  # python tools/regress.py: the script's own directory is first on sys.path
    from compatibility import source_name
    from results import record

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
LEG = f"{sys.version_info.major}.{sys.version_info.minor}"
BEHAVIOUR_TESTS = (
    "tests/test_lifecycle.py",
    "tests/test_install_pipeline_schedule.py",
    "tests/test_guards.py",
    "tests/test_loss_contract.py",
    "tests/test_packing_scheduler.py",
)
NO_SOURCE = (
    "no Megatron-LM source: pass MEGATRON_LM=<checkout or .tar.gz>, or "
    "MEGATRON_LM_SNAPSHOTS=<dir of megatron-lm-<ref>.tar.gz> (default ../shared/upstream)"
)


def snapshot_dir() -> Path:
    return Path(os.environ.get("MEGATRON_LM_SNAPSHOTS") or ROOT.parent / "shared" / "upstream")


def tree(path: Path) -> Path:
    """A checkout as it is, or a tarball unpacked once under .cache/megatron-lm: the dir holding
    megatron/."""
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
        raise SystemExit(
            f"{path}: no megatron/core in it; give a Megatron-LM checkout or a .tar.gz of one"
        )
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
    subprocess.run(
        ["bash", str(ROOT / "tools" / "unpack-wheels.sh"), str(target), *releases],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    return [target / r for r in releases]


def behaviour(trees: list[Path]) -> int:
    """The behaviour suite with each tree's megatron first on the path; one recorded cell each. Exit
    status."""
    failed = 0
    for root in trees:
        name = source_name(root) if root.parent.name != "megatron-core-sources" else root.name
        print(f"== behaviour suite on {name} ({root}) ==", flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BEHAVIOUR_TESTS],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
        )
        print(done.stdout[-3000:], done.stderr[-3000:], sep="", flush=True)
        summary = (
            done.stdout.strip().splitlines()[-1]
            if done.stdout.strip()
            else f"exit {done.returncode}"
        )
        record("compatibility", [{"Source": name, "Behaviour suite": summary.strip("= ")}])
        failed += done.returncode != 0
    return 1 if failed else 0


def changed_functions(root: Path) -> tuple[str, list[str]]:
    """(the nearest tested source, the hooked functions whose source in ``root`` no tested source
    has): a hooked function that is gone is listed as such. The nearest source shares the most
    hooked functions with ``root``."""
    known = known_fingerprints()
    counts = {u.name: 0 for u in UPSTREAM}
    changed = []
    for target in tree_targets(root):
        path = target.path_in(root)
        try:
            found = fingerprint_file(path, target.name) if path.exists() else None
        except CompatError:
            found = None
        if found is None:
            changed.append(f"{target.qualified} (gone)")
            continue
        tested = known.get(target.qualified, {}).get(found)
        if tested is None:
            changed.append(target.qualified)
        for source in tested or ():
            if source in counts:  # a patched tree (patches/upstream) is no nearest source
                counts[source] += 1
    nearest = max(
        counts, key=lambda source: counts[source]
    )  # ties: the oldest, as UPSTREAM is ordered
    return nearest, changed


#: Names through which Megatron reaches the hooked functions without naming them: the schedule is
#: called as get_forward_backward_func()(...) and finalize as config.finalize_model_grads_func(...).
REACHED_THROUGH = (
    "get_forward_backward_func",
    "forward_backward_func",
    "finalize_model_grads_func",
)


def callers(root: Path) -> dict[str, str]:
    """{'module:Class.function': sha256 of its source} of every function under megatron/ (and the
    pretrain_*.py scripts) that names a hooked function or a name in :data:`REACHED_THROUGH`.
    GPTModel.forward is left out: it is reached as model(...), which names nothing."""
    names = {t.name.rsplit(".", 1)[-1] for t in TARGETS if "." not in t.name} | set(REACHED_THROUGH)
    found = {}
    for path in sorted([*(root / "megatron").rglob("*.py"), *root.glob("pretrain_*.py")]):
        text = path.read_text(errors="replace")
        if not any(name in text for name in names):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")

        def visit(body: list[ast.stmt], prefix: str, module: str, lines: list[str]) -> None:
            for node in body:
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.", module, lines)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
                        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                    }
                    if names & named and f"{module}.{prefix}{node.name}" not in {
                        t.qualified for t in TARGETS
                    }:
                        source = "".join(lines[node.lineno - 1 : node.end_lineno])
                        found[f"{module}:{prefix}{node.name}"] = hashlib.sha256(
                            source.encode()
                        ).hexdigest()[:16]

        visit(tree.body, "", module, lines)
    return found


def changed_callers(root: Path, nearest: Path) -> list[str]:
    """The callers of hooked functions in ``root`` whose source differs from ``nearest``'s, or that
    it lacks ('(new)'), and the ones only ``nearest`` has ('(gone)')."""
    here, there = callers(root), callers(nearest)
    changed = [
        name + ("" if name in there else " (new)") for name in here if here[name] != there.get(name)
    ]
    return changed + [f"{name} (gone)" for name in there if name not in here]


def nearest_tree(name: str) -> Path | None:
    """The unpacked snapshot of the tested source ``name`` (any Python's), or None where it is not
    at hand."""
    upstream = next(u for u in UPSTREAM if u.name == name)
    tarball = snapshot_dir() / f"megatron-lm-{upstream.ref}.tar.gz"
    return tree(tarball) if tarball.exists() else None


def parser_flags(roots: list[Path]) -> dict[Path, list[str]]:
    """The option strings of Megatron-LM's own parser at each root (one subprocess:
    tests/support/megatron_parser_flags.py)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.megatron_parser_flags", *map(str, roots)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"building Megatron's parsers failed:\n{done.stderr[-3000:]}")
    return {Path(root): flags for root, flags in json.loads(done.stdout.splitlines()[-1]).items()}


def drift_report(
    name: str, flags: list[str], nearest: str, changed: list[str], moved: list[str] | None
) -> str:
    """What ``make regress`` prints for a checkout: its unclassified flags, its changed hooked
    functions and the changed callers of hooked functions (``moved``; None where the nearest
    source's snapshot is not at hand)."""
    lines = [f"== drift of {name} against the tested sources =="]
    lines += _listed(
        flags,
        f"{len(flags)} flag(s) of its parser that neither a row of the coverage table "
        "(config/coverage/) nor the off-path list (config/off_path.py) names; read each and give "
        "it a "
        f"row or an off-path reason:",
        "every flag of its parser is named by a coverage row or the off-path list",
    )
    lines += _listed(
        changed,
        f"{len(changed)} hooked function(s) whose source no tested source has (nearest tested "
        f"source: {nearest}); read the change, then add the source to compat.UPSTREAM "
        "(make fingerprints):",
        f"every hooked function's source is a tested one (nearest tested source: {nearest})",
    )
    if moved is None:
        lines.append(f"callers not compared: no snapshot of {nearest} in {snapshot_dir()}")
    else:
        lines += _listed(
            moved,
            f"{len(moved)} caller(s) of hooked functions changed since {nearest}; read each for a "
            "path that reaches the step without the hooks (a row of the coverage table, or a "
            "hook):",
            f"every caller of a hooked function is as in {nearest}",
        )
    return "\n".join(lines)


def _listed(items: list[str], header: str, none: str) -> list[str]:
    """``header`` and the items indented, or the line that says there are none."""
    return [header, *(f"  {item}" for item in items)] if items else [none]


def drift(trees: list[Path]) -> int:
    """:func:`drift_report` for each tree: its parser's flags that neither list names (a tested source's parser has
    none: tests/test_coverage_complete.py), whether or not a tested source has them. Exit status 0:
    a listing, for a person to read (the behaviour suite and the end-to-end tier are the
    pass/fail)."""
    flags = parser_flags(trees)
    for root in trees:
        nearest, changed = changed_functions(root)
        nearest_root = nearest_tree(nearest)
        moved = changed_callers(root, nearest_root) if nearest_root else None
        print(
            drift_report(source_name(root), unclassified(flags[root]), nearest, changed, moved),
            flush=True,
        )
    return 0


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
    if command == "drift":
        if not paths:
            print(
                "drift: give the checkout (a Megatron-LM checkout or a .tar.gz of one)",
                file=sys.stderr,
            )
            return 2
        return drift(trees)
    print(f"unknown command {command!r}: sources, behaviour or drift", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
