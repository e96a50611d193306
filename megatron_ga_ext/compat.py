"""megatron-core version detection, and fingerprints of every upstream function the extension patches.

A fingerprint is the first 16 hex digits of sha256 over a function's source text (decorators
included), so it does not depend on the Python version. ``install()`` compares the live functions
with :data:`KNOWN` before it patches anything: unknown source is refused in strict mode and warned
about otherwise, naming the function and the version. The table is made by
``python -m megatron_ga_ext.compat --wheel-dir DIR`` over the released wheels.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megatron_ga_ext.errors import CompatError

__all__ = ["KNOWN", "TESTED_VERSIONS", "TARGETS", "Target", "megatron_core_version", "fingerprint", "check_targets"]

logger = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
FINALIZE = "megatron.core.distributed.finalize_model_grads"
CALCULATOR = "megatron.core.num_microbatches_calculator"


@dataclass(frozen=True)
class Target:
    """An upstream function the extension replaces or wraps."""

    module: str
    name: str

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"

    def resolve(self) -> Callable:
        return getattr(importlib.import_module(self.module), self.name)


TARGETS = (
    Target(SCHEDULES, "forward_step_calc_loss"),
    Target(SCHEDULES, "forward_backward_no_pipelining"),
    Target(SCHEDULES, "forward_backward_pipelining_with_interleaving"),
    Target(SCHEDULES, "forward_backward_pipelining_without_interleaving"),
    Target(FINALIZE, "finalize_model_grads"),
    Target(CALCULATOR, "_configure_global_num_microbatches_calculator"),
    Target(CALCULATOR, "get_num_microbatches"),
    Target(CALCULATOR, "update_num_microbatches"),
)

#: {qualified function name: {megatron-core version: fingerprint}}, from the released wheels.
KNOWN: dict[str, dict[str, str]] = {
    'megatron.core.pipeline_parallel.schedules.forward_step_calc_loss': {
        '0.16.1': '0b552e0742e6d330',
        '0.17.1': 'd972e4b02f520f34',
        '0.18.2': '24757f83c3ded7a4',
        '0.19.2': '9990d300271b7dfc',
    },
    'megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining': {
        '0.16.1': '84399467bcc06296',
        '0.17.1': 'c86c3a0d6fb4551f',
        '0.18.2': '897d736956bfbd1f',
        '0.19.2': 'b52848b05720fd61',
    },
    'megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving': {
        '0.16.1': 'bd10736079d7ed41',
        '0.17.1': '45dd6edc2bf81d9f',
        '0.18.2': '450e85c2b5211399',
        '0.19.2': '091263d1c27eb438',
    },
    'megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving': {
        '0.16.1': 'ecf7d69308cda660',
        '0.17.1': '79bb2ba211d57422',
        '0.18.2': 'c8fd558b6fdcd51b',
        '0.19.2': '772d6b7d81825e7a',
    },
    'megatron.core.distributed.finalize_model_grads.finalize_model_grads': {
        '0.16.1': '8e8e2bb919cc02fc',
        '0.17.1': '8e8e2bb919cc02fc',
        '0.18.2': '1ea6af88d1ec1a5c',
        '0.19.2': '36d18a1e17302e34',
    },
    'megatron.core.num_microbatches_calculator._configure_global_num_microbatches_calculator': {
        '0.16.1': '69c23fc1f25958c3',
        '0.17.1': '69c23fc1f25958c3',
        '0.18.2': 'b494e0c360ef7c68',
        '0.19.2': 'b494e0c360ef7c68',
    },
    'megatron.core.num_microbatches_calculator.get_num_microbatches': {
        '0.16.1': 'b3955d22e52f53fc',
        '0.17.1': 'b3955d22e52f53fc',
        '0.18.2': 'b3955d22e52f53fc',
        '0.19.2': 'b3955d22e52f53fc',
    },
    'megatron.core.num_microbatches_calculator.update_num_microbatches': {
        '0.16.1': 'efa0b6d9e726424f',
        '0.17.1': 'efa0b6d9e726424f',
        '0.18.2': 'efa0b6d9e726424f',
        '0.19.2': 'efa0b6d9e726424f',
    },
}


def megatron_core_version() -> str:
    """The version of the megatron-core code that is imported (``megatron.core.package_info``, which a
    tree on PYTHONPATH carries too), else the installed distribution's."""
    try:
        from megatron.core import package_info

        return package_info.__version__.split("+")[0]  # a source tree in a git checkout adds "+<hash>"
    except ImportError:
        import importlib.metadata  # only where megatron.core lacks package_info

        return importlib.metadata.version("megatron-core")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(function: Callable) -> str:
    """Fingerprint of a live function: sha256 of its source, decorators included."""
    return _digest(inspect.getsource(inspect.unwrap(function)))


def fingerprint_file(path: Path, name: str) -> str:
    """Fingerprint of the top-level function ``name`` in a source file, without importing it."""
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = text.splitlines(keepends=True)[first - 1 : node.end_lineno]
            return _digest("".join(lines))
    raise CompatError(f"{name} is not defined in {path}.")


def check_targets(version: str, strict: bool, targets: tuple[Target, ...] = TARGETS) -> list[str]:
    """Compare each target's live source with :data:`KNOWN`; raise (strict) or warn on a mismatch.

    Returns the mismatch messages (empty when everything is known)."""
    problems = []
    for target in targets:
        seen = fingerprint(target.resolve())
        known = KNOWN.get(target.qualified, {})
        if known.get(version) == seen:
            continue
        twins = sorted(v for v, fp in known.items() if fp == seen)
        where = f"matches {', '.join(twins)}" if twins else "matches no release we know"
        problems.append(
            f"{target.qualified} in megatron-core {version} has fingerprint {seen}, not the known "
            f"{known.get(version, 'none recorded')} ({where})"
        )
    if not problems:
        return []
    message = (
        f"unknown upstream source: {'; '.join(problems)}. The extension is tested on megatron-core "
        f"{', '.join(TESTED_VERSIONS)}: use one of them, or pass strict=False (--no-ga-strict) to patch "
        f"anyway with a warning."
    )
    if strict:
        raise CompatError(message)
    logger.warning(message)
    return [message]


def _table_from_wheels(wheel_dir: Path) -> dict[str, dict[str, str]]:
    """Fingerprints of :data:`TARGETS` in unpacked wheels ``wheel_dir/<version>/megatron/core/...``."""
    table: dict[str, dict[str, str]] = {t.qualified: {} for t in TARGETS}
    for version in TESTED_VERSIONS:
        root = wheel_dir / version
        for target in TARGETS:
            path = root / (target.module.replace(".", "/") + ".py")
            table[target.qualified][version] = fingerprint_file(path, target.name)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description="print the fingerprint table of the released wheels")
    parser.add_argument("--wheel-dir", type=Path, required=True, help="holds <version>/megatron/core/... per release")
    table = _table_from_wheels(parser.parse_args().wheel_dir)
    print("KNOWN: dict[str, dict[str, str]] = {")
    for name, by_version in table.items():
        print(f"    {name!r}: {{")
        for version, digest in by_version.items():
            print(f"        {version!r}: {digest!r},")
        print("    },")
    print("}")


if __name__ == "__main__":
    main()
