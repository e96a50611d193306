"""Make and check the patches that wire megatron-ga-ext into a vendored megatron/core (no
install()).

Each patched upstream module calls ``megatron_ga_ext.integration.lifecycle.wire_vendored(__name__)``
as the last thing it does on import, which wires that module exactly as install() would (same hooks,
same checks). The pretrain_gpt.py patch is the one-line drop-in: install() adds the ``--ga-*`` flags
to Megatron's parser.

    python patches/patches.py generate --sources DIR        # DIR/<version>/megatron/core (tools/unpack-wheels.sh)
    python patches/patches.py check --sources DIR           # committed == regenerated, and each applies
    python patches/patches.py apply --sources DIR --version V --into DEST   # a patched copy of V
    python patches/patches.py generate-megatron-lm --megatron-lm CHECKOUT   # pretrain_gpt.py at d98e8a64ddf3
    python patches/patches.py check-megatron-lm              # uses $MEGATRON_LM_DIR; skips without it

These wire the plugin in. The fixes to megatron-core itself (one patch per defect, no plugin) are
patches/upstream/, checked and applied by patches/upstream.py (docs/upstream.md).
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from megatron_ga_ext.integration.compat import RELEASES as VERSIONS

HERE = Path(__file__).resolve().parent
MODULES = (
    "megatron/core/pipeline_parallel/schedules.py",
    "megatron/core/distributed/finalize_model_grads.py",
    "megatron/core/num_microbatches_calculator.py",
)
WIRING = (
    "\n\n# megatron-ga-ext: checked batch arithmetic, wired into this vendored tree (no "
    "install() needed).\nfrom megatron_ga_ext.integration.lifecycle import wire_vendored "
    "as _megatron_ga_wire  # noqa: E402\n\n_megatron_ga_wire(__name__)\n"
)
MEGATRON_LM_COMMIT = "d98e8a64ddf3"
PRETRAIN_GPT_EDITS = (
    (
        "# Copyright",
        "import megatron_ga_ext; megatron_ga_ext.install()  # megatron-ga-ext: the whole "
        "drop-in\n# Copyright",
    ),
)


def patch_path(version: str) -> Path:
    return HERE / f"megatron-core-{version}" / "megatron-ga-ext.patch"


def megatron_lm_patch_path() -> Path:
    return HERE / f"Megatron-LM-{MEGATRON_LM_COMMIT}" / "pretrain_gpt.py.patch"


def _diff(path: str, before: str, after: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            f"a/{path}",
            f"b/{path}",
        )
    )


def core_patch(root: Path) -> str:
    """The patch for one release's ``megatron/core`` under ``root``: the wiring appended to each
    module."""
    texts = {m: (root / m).read_text() for m in MODULES}
    return "".join(_diff(m, texts[m], texts[m].rstrip("\n") + "\n" + WIRING) for m in MODULES)


def pretrain_gpt_patch(checkout: Path) -> str:
    text = (checkout / "pretrain_gpt.py").read_text()
    edited = text
    for anchor, replacement in PRETRAIN_GPT_EDITS:
        if edited.count(anchor) != 1:
            raise SystemExit(
                f"pretrain_gpt.py in {checkout}: the anchor {anchor.strip()!r} is not there "
                "exactly once"
            )
        edited = edited.replace(anchor, replacement)
    return _diff("pretrain_gpt.py", text, edited)


def git_apply(patch: Path, directory: Path, check_only: bool) -> None:
    """``git apply`` (works outside a repository too); raise with its message when it does not
    apply."""
    cmd = ["git", "apply", "--whitespace=nowarn", *(["--check"] if check_only else []), str(patch)]
    result = subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{patch} does not apply to {directory}: {result.stderr.strip()}")


def apply(sources: Path, version: str, into: Path) -> Path:
    """A copy of ``sources/version`` with its patch applied, at ``into`` (replaced if it exists)."""
    if into.exists():
        shutil.rmtree(into)
    shutil.copytree(sources / version / "megatron", into / "megatron")
    git_apply(patch_path(version), into, check_only=False)
    return into


def generate(sources: Path) -> None:
    for version in VERSIONS:
        path = patch_path(version)
        path.parent.mkdir(exist_ok=True)
        path.write_text(core_patch(sources / version))
        print(f"wrote {path.relative_to(HERE.parent)}")


def check(sources: Path) -> None:
    for version in VERSIONS:
        path = patch_path(version)
        if path.read_text() != core_patch(sources / version):
            raise SystemExit(
                f"{path} is stale: run patches/patches.py generate --sources {sources}"
            )
        git_apply(path, sources / version, check_only=True)
        print(f"ok: {path.relative_to(HERE.parent)} applies cleanly to megatron-core {version}")


def check_megatron_lm(checkout: str | None) -> None:
    path = megatron_lm_patch_path()
    if not checkout:
        print(
            f"skipped: set MEGATRON_LM_DIR to a Megatron-LM checkout at {MEGATRON_LM_COMMIT} to "
            f"check {path.name}"
        )
        return
    git_apply(path, Path(checkout), check_only=True)
    print(f"ok: {path.relative_to(HERE.parent)} applies cleanly to {checkout}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("generate", "check", "apply"):
        p = sub.add_parser(name)
        p.add_argument(
            "--sources", type=Path, required=True, help="holds <version>/megatron/core per release"
        )
        if name == "apply":
            p.add_argument("--version", choices=VERSIONS, required=True)
            p.add_argument("--into", type=Path, required=True)
    sub.add_parser("generate-megatron-lm").add_argument("--megatron-lm", type=Path, required=True)
    sub.add_parser("check-megatron-lm")
    args = parser.parse_args(argv)
    if args.command == "generate":
        generate(args.sources)
    elif args.command == "check":
        check(args.sources)
    elif args.command == "apply":
        print(apply(args.sources, args.version, args.into))
    elif args.command == "generate-megatron-lm":
        path = megatron_lm_patch_path()
        path.parent.mkdir(exist_ok=True)
        path.write_text(pretrain_gpt_patch(args.megatron_lm))
        print(f"wrote {path.relative_to(HERE.parent)}")
    else:
        check_megatron_lm(os.environ.get("MEGATRON_LM_DIR"))


if __name__ == "__main__":
    sys.exit(main())
