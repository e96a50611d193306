"""docs/compatibility.md: one row per Megatron-LM source (release or commit), written by the runs themselves.

    update(doc, source, **columns)    # merge one row's columns (other rows and columns are kept)

The behaviour suite (``make matrix`` / ``make regress``) fills "Behaviour suite", the end-to-end tier
(``make e2e`` / ``make regress``) fills "End-to-end" and the descriptive columns.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from megatron_ga_ext.integration.compat import TARGETS, UPSTREAM, fingerprint_file, known_fingerprints

COLUMNS = ("Source", "megatron-core", "Python, torch", "Hooked functions", "Behaviour suite", "End-to-end", "Run on")
HEADER = """# Compatibility

Written by the runs themselves (`make matrix`, `make e2e`, `make regress MEGATRON_LM=...`): one row per
Megatron-LM release or main-branch commit. "Hooked functions" compares the source of every upstream function
the extension hooks with the fingerprints of the tested sources (strict mode accepts a source whose hooked
functions are all known, whatever its version string). "Behaviour suite" is the megatron-core tier (install,
guards, reduction, the PP 2 x DP 2 schedule through install()) on that source; "End-to-end" is Megatron-LM's
own `pretrain_gpt.py` through `examples/pretrain_gpt_ga.py` on the CPU over gloo (DP 2 and PP 2 x DP 2; token
and microbatch mode; constant GBS, a converted rampup, a step schedule or its backport, checkpoint resume, the
PP guard), each check against `megatron-ga schedule`'s plan and upstream's own `--calculate-per-token-loss` run.

"""


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
    for target in TARGETS:
        path = target.path_in(root)
        if not path.exists():
            unknown.append(target.name)
            continue
        having = set(known.get(target.qualified, {}).get(fingerprint_file(path, target.name), []))
        if not having:
            unknown.append(target.name)
        sources = having if sources is None else sources & having
    if unknown:
        return f"{len(unknown)} of {len(TARGETS)} unknown: {', '.join(unknown)}"
    same = ", ".join(u.name for u in UPSTREAM if u.name in (sources or set()))
    return f"all {len(TARGETS)} known" + (f" (as {same})" if same else " (mixed)")


def core_version(root: Path) -> str:
    text = (root / "megatron" / "core" / "package_info.py").read_text()
    parts = {}
    for line in text.splitlines():
        if "=" in line and line.split("=")[0].strip() in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
            key, value = (p.strip() for p in line.split("=", 1))
            parts[key] = value.strip("'\"")
    return ".".join(parts.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH")) + parts.get("PRE_RELEASE", "")


def _parse(doc: Path) -> dict[str, dict[str, str]]:
    rows: dict[str, dict[str, str]] = {}
    if not doc.exists():
        return rows
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(COLUMNS) and cells[0] not in ("Source", "---"):
            rows[cells[0]] = dict(zip(COLUMNS, cells))
    return rows


def update(doc: Path, source: str, **columns: str) -> None:
    """Merge ``columns`` (keyword names with ``_`` for spaces, e.g. end_to_end) into the row of ``source``."""
    rows = _parse(doc)
    row = rows.setdefault(source, {c: "" for c in COLUMNS})
    row["Source"] = source
    for key, value in columns.items():
        name = {"megatron_core": "megatron-core", "python_torch": "Python, torch", "hooked_functions": "Hooked functions",
                "behaviour_suite": "Behaviour suite", "end_to_end": "End-to-end", "run_on": "Run on"}[key]
        row[name] = value.replace("|", "/").replace("\n", " ")
    row["Run on"] = columns.get("run_on") or datetime.date.today().isoformat()
    order = [u.name for u in UPSTREAM]
    ranked = sorted(rows.values(), key=lambda r: (order.index(r["Source"]) if r["Source"] in order else len(order),
                                                  r["Source"]))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.get(c, "") for c in COLUMNS) + " |" for r in ranked]
    doc.write_text(HEADER + "\n".join(lines) + "\n")
