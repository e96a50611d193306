"""The upstream sources we test, and fingerprints of every upstream function the extension hooks
(and of those whose arithmetic an auxiliary-loss correction assumes without wrapping them:
``Target.assumed_by``).

A fingerprint is the first 16 hex digits of sha256 over a function's *normalised* source: its AST
(decorators included) without docstrings, positions, comments or formatting, and without the fields
one Python version has and another not (:func:`normalised`), so a reformatted or commented fork has
the tested fingerprint, on any Python. ``install()`` compares the live functions with the table
before it patches anything, **by source, not by version string**: a main-branch checkout reports an
unreleased version, and what matters is whether each hooked function is one we have tested. Where a
source is none of them, its behaviour decides (acceptance.py): a start-up probe measures upstream's
arithmetic where a correction rests on it (probes.py), the router's, z-loss's and MTP's corrections
measure theirs at their first call (upstream_factors.py), and a function nothing measures is refused
in strict mode unless ``MEGATRON_GA_ACCEPT_SOURCE`` names it.

:data:`UPSTREAM` is the one list of tested sources: adding a release or a main-branch commit is one line
there, then ``make fingerprints`` (``python -m megatron_ga_ext.integration.compat --write``)
regenerates ``fingerprints.json`` from the sources. Its format: ``{qualified function name:
{fingerprint: [tested sources whose function has it]}}``, one key per :data:`TARGETS` entry (an
empty object where no tested source defines it). Everything else (the Makefile, the end-to-end tier,
the patches, the tests) reads the list from here.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron_ga_ext.errors import CompatError
from megatron_ga_ext.logs import get_logger

__all__ = [
    "RELEASES",
    "TARGETS",
    "UPSTREAM",
    "Calculator",
    "Target",
    "Upstream",
    "defines_function",
    "fingerprint",
    "known_fingerprints",
    "live_targets",
    "megatron_core_version",
    "tree_targets",
]

logger = get_logger(__name__)

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
FINALIZE = "megatron.core.distributed.finalize_model_grads"
CALCULATOR = "megatron.core.num_microbatches_calculator"
TRAINING = "megatron.training.training"
GPT_MODEL = "megatron.core.models.gpt.gpt_model"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
MTP = "megatron.core.transformer.multi_token_prediction"
ROUTER = "megatron.core.transformer.moe.router"
MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
SCHEDULE_PLAN = "megatron.core.models.common.model_chunk_schedule_plan"
MAPPINGS = "megatron.core.tensor_parallel.mappings"
FINGERPRINTS = Path(__file__).with_name("fingerprints.json")


@dataclass(frozen=True)
class Upstream:
    """A Megatron-LM source we test: a release (its megatron-core wheel) or a main-branch commit."""

    name: str
    """How we call it: the megatron-core release ("0.19.2"), or "main@<commit>"."""
    ref: str
    """Its Megatron-LM snapshot: a tag (core_v0.19.0, whose core files equal the 0.19.2 wheel) or a
    commit."""
    python: str
    """The test leg that runs it: 0.16.1 on Python 3.11, everything from 0.17 on 3.12."""

    @property
    def is_release(self) -> bool:
        return not self.name.startswith("main@")


#: Every source the extension is tested on, oldest first. One line per release or commit.
UPSTREAM = (
    Upstream("0.16.1", "core_v0.16.1", "3.11"),
    Upstream("0.17.1", "core_v0.17.1", "3.12"),
    Upstream("0.18.2", "core_v0.18.2", "3.12"),
    Upstream("0.19.2", "core_v0.19.0", "3.12"),
    Upstream("main@9f3fe8c925fb", "9f3fe8c925fb", "3.12"),
    Upstream("main@dd8c825b3ad5", "dd8c825b3ad5", "3.12"),
    Upstream("main@d98e8a64ddf3", "d98e8a64ddf3", "3.12"),
    Upstream("main@e8fef4ebb23e", "e8fef4ebb23e", "3.12"),
)
RELEASES = tuple(u.name for u in UPSTREAM if u.is_release)


@dataclass(frozen=True)
class Target:
    """An upstream function (or ``Class.method``) the extension replaces or wraps, or whose
    arithmetic a correction assumes."""

    module: str
    name: str
    since: str | None = None
    """The first tested release that defines it (None: every one); hooked and fingerprinted where it
    is defined."""
    assumed_by: str | None = None
    """Not wrapped: the correction (aux_losses.py) that assumes its arithmetic, as
    upstream_factors.py measures it."""

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def optional(self) -> bool:
        """Megatron-LM's training package: not in every megatron-core wheel, checked where it is
        loaded."""
        return self.module.startswith("megatron.training")

    def resolve(self) -> Callable:
        found: Any = importlib.import_module(self.module)
        for part in self.name.split("."):
            found = getattr(found, part)
        function: Callable = found
        return function

    def path_in(self, root: Path) -> Path:
        return root / (self.module.replace(".", "/") + ".py")


TARGETS = (
    Target(SCHEDULES, "forward_step_calc_loss"),
    Target(SCHEDULES, "forward_backward_no_pipelining"),
    Target(SCHEDULES, "forward_backward_pipelining_with_interleaving"),
    Target(SCHEDULES, "forward_backward_pipelining_without_interleaving"),
    Target(FINALIZE, "finalize_model_grads"),
    Target(CALCULATOR, "_configure_global_num_microbatches_calculator"),
    Target(CALCULATOR, "get_num_microbatches"),
    Target(CALCULATOR, "update_num_microbatches"),
    Target(GPT_MODEL, "GPTModel.forward"),
    # combined 1F1B's path to the router (--overlap-moe-expert-parallel-comm)
    Target(GPT_MODEL, "GPTModel.build_schedule_plan"),
    Target(SCHEDULE_PLAN, "TransformerModelChunkSchedulePlan.run"),
    Target(MOE_LAYER, "MoELayer.route"),
    Target(MOE_UTILS, "get_tokens_per_expert_and_token_count"),  # #7452 finding 10
    Target(MOE_UTILS, "z_loss_func"),
    Target(MTP, "process_mtp_loss", since="0.17.1"),  # #7452 finding 3
    Target(ROUTER, "TopKRouter._apply_expert_bias"),
    # not wrapped: the router's and MTP's arithmetic that the auxiliary-loss corrections assume
    # (Megatron-LM #7481, #7498, #7570, #7213 would change it); upstream_factors.py measures the
    # factors at the first step as well
    *(
        Target(ROUTER, f"TopKRouter.{name}", assumed_by="exact_token_counts")
        for name in (
            "_apply_aux_loss",
            "_apply_seq_aux_loss",
            "_apply_global_aux_loss",
            "attach_and_log_load_balancing_loss",
        )
    ),
    Target(MOE_UTILS, "switch_load_balancing_loss_func", assumed_by="exact_token_counts"),
    Target(
        MAPPINGS, "_reduce", assumed_by="exact_token_counts"
    ),  # all-reduces the per-expert counts in place
    Target(ROUTER, "TopKRouter.apply_z_loss", assumed_by="tp_cp_scaled_z_loss"),
    Target(MTP, "roll_tensor", assumed_by="global_count_mtp_loss"),
    Target(TRAINING, "update_train_iters"),
    Target(TRAINING, "get_train_valid_test_num_samples"),
)


def known_fingerprints() -> dict[str, dict[str, list[str]]]:
    """{qualified function name: {fingerprint: [tested sources that have it]}} from
    fingerprints.json."""
    known: dict[str, dict[str, list[str]]] = json.loads(FINGERPRINTS.read_text())
    return known


class Calculator(Protocol):
    """Megatron's num-microbatches calculator interface, as its training loop calls it: upstream's
    calculators, the step-schedule calculator (calculator.py) and the consumed-samples guard around
    either (guards.py)."""

    def get(self) -> int: ...

    def get_current_global_batch_size(self) -> int: ...

    def get_micro_batch_size(self) -> int: ...

    def get_current_running_global_batch_size(self) -> int: ...

    def update(
        self, consumed_samples: int, consistency_check: bool, verbose: bool = False
    ) -> None: ...


def live_calculator() -> Calculator | None:
    """Megatron's global num-microbatches calculator (``_GLOBAL_NUM_MICROBATCHES_CALCULATOR``); None
    before it is built."""
    return getattr(sys.modules.get(CALCULATOR), "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)


def set_live_calculator(calculator: Calculator) -> None:
    """Make ``calculator`` the one ``get_num_microbatches()`` and the training loop read."""
    setattr(sys.modules[CALCULATOR], "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", calculator)  # noqa: B010 (a module)


def megatron_core_version() -> str:
    """The version of the megatron-core code that is imported (``megatron.core.package_info``, which
    a tree on PYTHONPATH carries too), else the installed distribution's."""
    try:
        from megatron.core import package_info

        return str(package_info.__version__).split("+")[
            0
        ]  # a source tree in a git checkout adds "+<hash>"
    except ImportError:
        import importlib.metadata  # only where megatron.core lacks package_info

        return importlib.metadata.version("megatron-core")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: AST fields that say nothing about behaviour, or that one Python version has and another not
#: (3.12's ``type_params``): left out of the normalised form.
_IGNORED_FIELDS = frozenset({"type_comment", "kind", "type_params"})


def _without_docstrings(node: ast.AST) -> ast.AST:
    """``node`` with the docstring of every function and class in it dropped (in place)."""
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if not isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not body:
            continue
        first = body[0]
        if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
            inner.body = body[1:]
    return node


def normalised(node: Any) -> str:
    """The behaviour-bearing form of an AST: node types, fields and constants, without positions,
    comments, formatting, docstrings, empty fields, or fields that differ between Python
    versions."""
    if isinstance(node, ast.AST):
        fields = [
            f"{name}={normalised(value)}"
            for name, value in ast.iter_fields(node)
            if name not in _IGNORED_FIELDS and value is not None and value != []
        ]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(normalised(item) for item in node) + "]"
    return repr(node)


def _node_digest(node: ast.AST) -> str:
    return _digest(normalised(_without_docstrings(node)))


#: id(code object) -> (that code object, its fingerprint): a loaded function's source is read once.
_FINGERPRINTS: dict[int, tuple[Any, str]] = {}


def fingerprint(function: Callable) -> str:
    """Fingerprint of a live function: sha256 of its normalised AST, decorators included (read once
    per code object: the code that is loaded, not the file as it may have changed on disk since)."""
    unwrapped = inspect.unwrap(function)
    code = getattr(unwrapped, "__code__", unwrapped)
    cached = _FINGERPRINTS.get(id(code))
    if cached is None or cached[0] is not code:
        node = ast.parse(textwrap.dedent(inspect.getsource(unwrapped))).body[0]
        cached = _FINGERPRINTS[id(code)] = (code, _node_digest(node))
    return cached[1]


def fingerprint_file(path: Path, name: str) -> str:
    """Fingerprint of the top-level function (or ``Class.method``) ``name`` in a source file,
    without importing it: the same normalised AST as :func:`fingerprint` of the loaded function."""
    body = ast.parse(path.read_text()).body
    *classes, function = name.split(".")
    for class_name in classes:
        body = next(
            (n.body for n in body if isinstance(n, ast.ClassDef) and n.name == class_name), []
        )
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            return _node_digest(node)
    raise CompatError(f"{name} is not defined in {path}.")


def defines_function(path: Path, name: str) -> bool:
    """The source file defines the top-level function ``name``."""
    return any(
        isinstance(n, ast.FunctionDef) and n.name == name for n in ast.parse(path.read_text()).body
    )


def tree_targets(root: Path, targets: tuple[Target, ...] = TARGETS) -> list[Target]:
    """The targets a source tree has: optional ones where their file is there, those of a later
    release where the file defines them (the others, gone, are kept: the caller names them)."""

    def has(target: Target) -> bool:
        path = target.path_in(root)
        if target.optional and not path.exists():
            return False
        return target.since is None or (path.exists() and defines_function(path, target.name))

    return [t for t in targets if has(t)]


def live_targets(targets: tuple[Target, ...]) -> list[Target]:
    """The targets that exist here: optional ones only where their module is loaded, and those of a
    later release only where this one defines them."""
    live = [t for t in targets if not t.optional or t.module in sys.modules]
    return [t for t in live if t.since is None or _defined(t)]


def _defined(target: Target) -> bool:
    try:
        target.resolve()
    except AttributeError:
        return False
    return True


def matching_sources(targets: tuple[Target, ...] = TARGETS) -> list[str]:
    """The tested sources whose hooked functions all equal the live ones (for the start-up log)."""
    known = known_fingerprints()
    found = [
        set(known.get(t.qualified, {}).get(fingerprint(t.resolve()), []))
        for t in live_targets(targets)
    ]
    common = set.intersection(*found) if found else set()
    return [u.name for u in UPSTREAM if u.name in common]


def table_from_trees(trees: dict[str, Path]) -> dict[str, dict[str, list[str]]]:
    """Fingerprints of :data:`TARGETS` in source trees ``{source name: root holding
    megatron/...}``."""
    table: dict[str, dict[str, list[str]]] = {t.qualified: {} for t in TARGETS}
    for source, root in trees.items():
        for target in tree_targets(root):
            table[target.qualified].setdefault(
                fingerprint_file(target.path_in(root), target.name), []
            ).append(source)
    return table


#: The patch set's sources (patches/upstream/<source>/) and the tested source each patches: a tree
#: with the set applied is a tested source too (verify --upstream and verify through install() run on
#: it), named "<source> + patches/upstream".
FIXED_SOURCES = {"megatron-core-0.19.2": "0.19.2", "megatron-lm-d98e8a64": "main@d98e8a64ddf3"}


def fixed_trees(root: Path) -> dict[str, Path]:
    """``{"0.19.2 + patches/upstream": root/megatron-core-0.19.2/patched, ...}`` where the tree was
    made (``patches/upstream.py tree``)."""
    trees = {
        f"{name} + patches/upstream": root / source / "patched"
        for source, name in FIXED_SOURCES.items()
    }
    return {name: tree for name, tree in trees.items() if (tree / "megatron").is_dir()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description="regenerate fingerprints.json from the tested sources"
    )
    parser.add_argument(
        "--snapshots",
        type=Path,
        default=Path(".cache/megatron-lm"),
        help="holds megatron-lm-<ref>/ for every ref in UPSTREAM (tools/megatron-lm.sh unpacks "
        "them)",
    )
    parser.add_argument(
        "--write", action="store_true", help=f"write {FINGERPRINTS.name} (else print it)"
    )
    parser.add_argument(
        "--list",
        metavar="PYTHON",
        nargs="?",
        const="",
        help="print the tested source names (those of one Python leg, if given) and exit",
    )
    parser.add_argument(
        "--fixed",
        type=Path,
        default=Path(".cache/upstream-trees"),
        help="holds <source>/patched/ for the patch set's sources (patches/upstream.py tree)",
    )
    args = parser.parse_args()
    if args.list is not None:
        print(" ".join(u.name for u in UPSTREAM if args.list in ("", u.python)))
        return
    trees = {u.name: args.snapshots / f"megatron-lm-{u.ref}" for u in UPSTREAM}
    table = table_from_trees({**trees, **fixed_trees(args.fixed)})
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if args.write:
        FINGERPRINTS.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
