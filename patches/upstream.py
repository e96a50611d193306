"""The fixes to megatron-core itself (patches/upstream/<source>/NNNN-*.patch, each with its .md):
check and apply them.

    python patches/upstream.py check [--source S ...]       each patch applies to its pristine source, alone and in
                                                           series; the upstream-style tests
                                                           (tests/upstream_style) fail on the
                                                           pristine tree as the patches say and pass
                                                           on the patched one (two gloo ranks, CPU)
    python patches/upstream.py tree --source S [--pristine] print a patched (or pristine) tree's
                                                           root, made once under
                                                           .cache/upstream-trees: put it first on
                                                           PYTHONPATH
    python patches/upstream.py apply (--into DIR | --installed) [--source S] [--dry-run | --reverse]
                                                           apply the set to a vendored tree (DIR
                                                           holds megatron/core) or to the importable
                                                           megatron-core; refuses, changing nothing,
                                                           where a hunk does not apply

Sources: ``megatron-core-0.19.2`` (the installed 0.19.2 wheel's files) and ``megatron-lm-d98e8a64``
(main, the snapshot megatron-lm-d98e8a64ddf3.tar.gz in $MEGATRON_LM_SNAPSHOTS, default
../shared/upstream). This script imports nothing from megatron_ga_ext: the patches stand alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATCHES = HERE / "upstream"
TREES = ROOT / ".cache" / "upstream-trees"
TESTS = "tests/upstream_style/unit_tests"
SOURCES = ("megatron-core-0.19.2", "megatron-lm-d98e8a64")
SNAPSHOT = "megatron-lm-d98e8a64ddf3.tar.gz"

#: The upstream-style tests each patch turns from failing to passing (node-id prefixes under TESTS).
FIXED_BY = {
    "0001": ("distributed/test_torch_fsdp2_per_token_loss.py",),
    "0002": ("transformer/moe/test_token_count.py",),
    "0003": ("transformer/test_mtp_per_token_loss.py",),
    "0004": ("transformer/moe/test_expert_bias_padding_mask.py",),
    "0005": (
        "pipeline_parallel/test_per_token_loss_schedules.py::TestPerTokenLossSchedules::test_token_count",
    ),
    "0006": (
        "pipeline_parallel/test_per_token_loss_schedules.py::TestPerTokenLossSchedules::test_two_tuple",
    ),
}


class PatchError(SystemExit):
    """A patch that does not apply, or a check that failed: the message says which and where."""


def patches(source: str) -> list[Path]:
    """The source's patches, in order."""
    found = sorted((PATCHES / source).glob("*.patch"))
    if not found:
        raise PatchError(f"no patches for {source!r} under {PATCHES}")
    return found


def _git_apply(patch: Path, root: Path, *flags: str) -> str | None:
    """``git apply`` at ``root`` (a tree, not a repository); its complaint, or None where it
    applied."""
    cmd = ["git", "apply", "--whitespace=nowarn", *flags, str(patch)]
    # Outside any repository: inside one (this checkout's .cache), git apply would skip the paths
    # outside it.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.resolve().parent)}
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
    return (
        result.stderr.strip() or f"git apply exited {result.returncode}"
        if result.returncode
        else None
    )


def apply_set(
    source: str, root: Path, *, reverse: bool = False, dry_run: bool = False
) -> list[str]:
    """Apply (or reverse) the source's patches at ``root``, all or none: every patch is checked
    first, in series on a scratch copy of the files they touch, and nothing is written where one
    does not apply."""
    series = patches(source)[::-1] if reverse else patches(source)
    flags = ("--reverse",) if reverse else ()
    scratch = TREES / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    for path in _touched(series):
        if not (root / path).is_file():
            raise PatchError(
                f"{root}: no {path}, which {source}'s patches change: is this a megatron-core tree?"
            )
        (scratch / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / path, scratch / path)
    for patch in series:
        complaint = _git_apply(patch, scratch, *flags)
        if complaint:
            done = not reverse and _git_apply(patch, scratch, "--reverse", "--check") is None
            shutil.rmtree(scratch, ignore_errors=True)
            verb = "reverse" if reverse else "apply"
            hint = "\nit is already applied: --reverse removes it" if done else ""
            raise PatchError(
                f"{patch.relative_to(ROOT)} does not {verb} to {root} (nothing "
                f"changed):\n{complaint}{hint}"
            )
    shutil.rmtree(scratch, ignore_errors=True)
    if not dry_run:
        for patch in series:
            _git_apply(patch, root, *flags)
    return [p.name for p in series]


def _touched(series: list[Path]) -> list[str]:
    """The files a patch series changes (its ``+++ b/`` lines)."""
    paths = []
    for patch in series:
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                paths.append(line[len("+++ b/") :])
    return sorted(set(paths))


def pristine_tree(source: str) -> Path:
    """A pristine copy of the source under .cache/upstream-trees/<source>/pristine (made once)."""
    tree = TREES / source / "pristine"
    if (tree / "megatron" / "core").is_dir():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    if source == "megatron-core-0.19.2":
        core = _installed_core()
        version = _version(core.parent.parent)
        if version != "0.19.2":
            raise PatchError(
                f"{source}: the installed megatron-core is {version}, not 0.19.2 ({core})"
            )
        shutil.copytree(
            core.parent, tree / "megatron", ignore=shutil.ignore_patterns("__pycache__")
        )
    else:
        snapshot = (
            Path(os.environ.get("MEGATRON_LM_SNAPSHOTS", ROOT.parent / "shared" / "upstream"))
            / SNAPSHOT
        )
        if not snapshot.is_file():
            raise PatchError(
                f"{source}: no {snapshot} (set MEGATRON_LM_SNAPSHOTS to the folder that holds it)"
            )
        with tarfile.open(snapshot) as tar:
            members = [
                m
                for m in tar.getmembers()
                if _strip(m.name).startswith(("megatron/", "pretrain_gpt.py"))
            ]
            for member in members:
                member.name = _strip(member.name)
            tar.extractall(tree, members=members, filter="data")
    return tree


def _strip(name: str) -> str:
    return name.split("/", 1)[1] if "/" in name else ""


def patched_tree(source: str) -> Path:
    """The pristine tree with the source's patches applied, under
    .cache/upstream-trees/<source>/patched; made again where a patch is newer than it."""
    tree = TREES / source / "patched"
    stamp = tree / ".applied"
    newest = max(p.stat().st_mtime for p in patches(source))
    if stamp.is_file() and stamp.stat().st_mtime >= newest:
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(pristine_tree(source), tree)
    apply_set(source, tree)
    stamp.touch()
    return tree


def _installed_core() -> Path:
    """The importable megatron/core, found without importing it (importing costs seconds and
    warns)."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("megatron-core is not importable here")
    return Path(next(iter(spec.submodule_search_locations)))


def _version(root: Path) -> str:
    """megatron-core's version from ``megatron/core/package_info.py`` under ``root``."""
    fields = {}
    for line in (root / "megatron" / "core" / "package_info.py").read_text().splitlines():
        name, _, value = line.partition(" = ")
        if name in ("MAJOR", "MINOR", "PATCH"):
            fields[name] = value.strip()
    return ".".join(fields.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))


def run_tests(tree: Path, world_size: int = 2, timeout: float = 900.0) -> dict[str, bool]:
    """The upstream-style tests on ``tree`` (first on PYTHONPATH), ``world_size`` gloo ranks of
    pytest: node id (under TESTS) -> passed on every rank."""
    out = TREES / "results"
    out.mkdir(parents=True, exist_ok=True)
    port = str(29500 + os.getpid() % 500)
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "MEGATRON_GA_UPSTREAM_STYLE": "1",
            "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)]),
            **dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)),
            **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1"),
        }
        xml = out / f"rank{rank}.xml"
        xml.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--confcutdir",
            "tests/upstream_style",
        ]
        cmd += ["-W", "ignore::UserWarning", f"--junitxml={xml}", TESTS]
        log = (out / f"rank{rank}.log").open("w")
        procs.append(
            (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), xml)
        )
    deadline = time.monotonic() + timeout
    for proc, _ in procs:
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            raise PatchError(
                f"the upstream-style tests on {tree} ran past {timeout:.0f} s (logs: {out})"
            ) from None
    results: dict[str, bool] = {}
    for _, xml in procs:
        for case in ET.parse(xml).getroot().iter("testcase"):
            node = _node_id(case)
            results[node] = results.get(node, True) and not list(case)
    if not results:
        raise PatchError(f"no upstream-style test ran on {tree} (logs: {out})")
    return results


def _node_id(case: ET.Element) -> str:
    """``path/under/TESTS.py::Class::name`` from a junit testcase."""
    parts = case.get("classname", "").split(".")
    cls = parts[-1] if parts[-1][:1].isupper() else None
    module = parts[:-1] if cls else parts
    path = "/".join(module[module.index("unit_tests") + 1 :]) + ".py"
    return "::".join([path, *([cls] if cls else []), case.get("name", "")])


def check(source: str, timeout: float = 900.0) -> None:
    """Apply, then the tests before and after (each run within ``timeout`` seconds); raise with
    every mismatch."""
    series = apply_set(source, pristine_tree(source), dry_run=True)
    print(
        f"ok: {source}: {len(series)} patches apply cleanly to the pristine tree, alone and in "
        "series"
    )
    fixed = [prefix for patch in series for prefix in FIXED_BY[patch[:4]]]
    problems = []
    for label, tree in (("pristine", pristine_tree(source)), ("patched", patched_tree(source))):
        start = time.perf_counter()
        results = run_tests(tree, timeout=timeout)
        for node, passed in sorted(results.items()):
            should_fail = label == "pristine" and node.startswith(tuple(fixed))
            if passed == should_fail:
                problems.append(f"{source} {label}: {node} {'passed' if passed else 'failed'}")
        failed = sum(not p for p in results.values())
        print(
            f"ok: {source} {label}: {failed} of {len(results)} tests failed "
            f"({time.perf_counter() - start:.0f} s)"
        )
    if problems:
        raise PatchError("upstream-style tests not as the patches say:\n  " + "\n  ".join(problems))


def _apply_command(args: argparse.Namespace) -> None:
    root = args.into if args.into else _installed_core().parent.parent
    source = args.source or _detect(root)
    verb = "reverse" if args.reverse else "apply"
    done = apply_set(source, root, reverse=args.reverse, dry_run=args.dry_run)
    what = "would " + verb if args.dry_run else {"apply": "applied", "reverse": "reversed"}[verb]
    print(f"{source}: {what} {len(done)} patches at {root}: {', '.join(done)}")


def _detect(root: Path) -> str:
    """The patch set for the tree at ``root``: 0.19.x -> megatron-core-0.19.2; anything else ->
    main's set."""
    version = _version(root)
    return "megatron-core-0.19.2" if version.startswith("0.19.") else "megatron-lm-d98e8a64"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check")
    p.add_argument("--source", choices=SOURCES, action="append", help="default: both")
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds for each test run (default 900)"
    )
    p = sub.add_parser("tree")
    p.add_argument("--source", choices=SOURCES, required=True)
    p.add_argument("--pristine", action="store_true")
    p = sub.add_parser("apply")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--into", type=Path, help="a tree's root: the folder that holds megatron/core"
    )
    where.add_argument(
        "--installed", action="store_true", help="the importable megatron-core's site-packages"
    )
    p.add_argument("--source", choices=SOURCES, help="default: from megatron/core/package_info.py")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--dry-run", action="store_true")
    how.add_argument("--reverse", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "check":
        for source in args.source or SOURCES:
            check(source, args.timeout)
    elif args.command == "tree":
        print(pristine_tree(args.source) if args.pristine else patched_tree(args.source))
    else:
        _apply_command(args)


if __name__ == "__main__":
    main()
