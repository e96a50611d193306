"""Megatron-LM's own argument parser at a source snapshot, for the tests that hold our flag
declarations and the coverage table to it (tests/support/megatron_parser_flags.py,
tests/support/coverage_upstream_args.py, run in subprocesses).

Optional packages the training code imports but the parser never uses are stubbed when they are not
installed.
"""

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path

from megatron_ga_ext.integration.compat import UPSTREAM
from megatron_ga_ext.oracle.stubs import install_stubs

__all__ = ["install_stubs", "option_strings", "parser_of"]


@contextlib.contextmanager
def first_on_path(root: str):
    # A snapshot is another project's source tree, not an installed package, and its code imports
    # itself as top-level `megatron`: only its root first on sys.path makes that import resolve to
    # this snapshot.
    sys.path.insert(0, root)
    try:
        yield
    finally:
        sys.path.remove(root)


def parser_of(root: str) -> argparse.ArgumentParser:
    """The parser that ``root``'s megatron/training/arguments.py builds
    (``add_megatron_arguments``)."""
    for key in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
        del sys.modules[key]
    with first_on_path(root):
        arguments = importlib.import_module("megatron.training.arguments")
        assert arguments.__file__.startswith(root), arguments.__file__
        return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(s for action in parser._actions for s in action.option_strings)


def release(name: str) -> tuple[int, ...]:
    """core_v0.18.2 -> (0, 18, 2); a main-branch commit sorts after every release, the tested ones
    in the order of compat.UPSTREAM (a ref, or a snapshot directory named after it), any other after
    them."""
    match = re.search(r"core_v(\d+)\.(\d+)\.(\d+)$", Path(name).name)
    if match:
        return tuple(int(g) for g in match.groups())
    mains = [u.ref for u in UPSTREAM if not u.is_release]
    return (
        99,
        next((i for i, ref in enumerate(mains) if Path(name).name.endswith(ref)), len(mains)),
    )
