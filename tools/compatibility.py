"""What a Megatron-LM source is, read from its tree: the cells of its row of docs/compatibility.md.

    source_name(root)        # the tested source it is (0.19.2, main@d98e8a64ddf3), else the directory name
    hooked_functions(root)   # whether every upstream function install() hooks has a known fingerprint
    core_version(root)       # megatron-core's version, from package_info.py

The behaviour suite (``make matrix`` / ``make regress``, tools/regress.py) and the end-to-end tier
(``make e2e``, tests/e2e/conftest.py) record the row (tools/results.py); ``make docs`` renders it.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ga_ext.integration.compat import (
    UPSTREAM,
    fingerprint_file,
    known_fingerprints,
    tree_targets,
)


def source_name(root: Path) -> str:
    """The tested source this tree is (by its directory name), else the directory name."""
    for upstream in UPSTREAM:
        if root.name.endswith(upstream.ref):
            return upstream.name
    return root.name


def hooked_functions(root: Path) -> str:
    """'all N known (as <source>)' or the unknown functions, from the tree's files (no import)."""
    known = known_fingerprints()
    unknown, sources = [], None
    targets = tree_targets(root)
    for target in targets:
        path = target.path_in(root)
        if not path.exists():
            unknown.append(target.name)
            continue
        having = set(known.get(target.qualified, {}).get(fingerprint_file(path, target.name), []))
        if not having:
            unknown.append(target.name)
        sources = having if sources is None else sources & having
    if unknown:
        return f"{len(unknown)} of {len(targets)} unknown: {', '.join(unknown)}"
    same = ", ".join(u.name for u in UPSTREAM if u.name in (sources or set()))
    return f"all {len(targets)} known" + (f" (as {same})" if same else " (mixed)")


def core_version(root: Path) -> str:
    text = (root / "megatron" / "core" / "package_info.py").read_text()
    parts = {}
    for line in text.splitlines():
        if "=" in line and line.split("=")[0].strip() in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
            key, value = (p.strip() for p in line.split("=", 1))
            parts[key] = value.strip("'\"")
    return ".".join(parts.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH")) + parts.get(
        "PRE_RELEASE", ""
    )
