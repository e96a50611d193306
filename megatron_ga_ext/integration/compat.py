"""The upstream sources we test, and fingerprints of every upstream function the extension hooks (and of those whose
arithmetic an auxiliary-loss correction assumes without wrapping them: ``Target.assumed_by``).

A fingerprint is the first 16 hex digits of sha256 over a function's source text (decorators included),
so it does not depend on the Python version. ``install()`` compares the live functions with the table
before it patches anything, **by source, not by version string**: a main-branch checkout reports an
unreleased version, and what matters is whether each hooked function is one we have tested. Every
hooked function known: accepted, whatever the version says. One unknown: refused in strict mode, warned
about otherwise, naming the function, its fingerprint and the nearest tested source.

:data:`UPSTREAM` is the one list of tested sources: adding a release or a main-branch commit is one line
there, then ``make fingerprints`` (``python -m megatron_ga_ext.integration.compat --write``) regenerates
``fingerprints.json`` from the sources. Everything else (the Makefile, the end-to-end tier, the patches,
the tests) reads the list from here.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.errors import CompatError
from megatron_ga_ext.logs import get_logger

__all__ = [
    "RELEASES",
    "TARGETS",
    "UPSTREAM",
    "Calculator",
    "Target",
    "Upstream",
    "bridge_step_state",
    "check_targets",
    "consumed_train_samples",
    "defines_function",
    "fingerprint",
    "known_fingerprints",
    "live_targets",
    "megatron_args",
    "megatron_core_version",
    "megatron_iteration",
    "megatron_view",
    "run_settings",
    "set_bridge_step_state",
    "set_train_iters",
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
MAPPINGS = "megatron.core.tensor_parallel.mappings"
FINGERPRINTS = Path(__file__).with_name("fingerprints.json")


@dataclass(frozen=True)
class Upstream:
    """A Megatron-LM source we test: a release (its megatron-core wheel) or a main-branch commit."""

    name: str
    """How we call it: the megatron-core release ("0.19.2"), or "main@<commit>"."""
    ref: str
    """Its Megatron-LM snapshot: a tag (core_v0.19.0, whose core files equal the 0.19.2 wheel) or a commit."""
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
    """An upstream function (or ``Class.method``) the extension replaces or wraps, or whose arithmetic a correction
    assumes."""

    module: str
    name: str
    since: str | None = None
    """The first tested release that defines it (None: every one); hooked and fingerprinted where it is defined."""
    assumed_by: str | None = None
    """Not wrapped: the correction (aux_losses.py) that assumes its arithmetic, as upstream_factors.py measures it."""

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def optional(self) -> bool:
        """Megatron-LM's training package: not in every megatron-core wheel, checked where it is loaded."""
        return self.module.startswith("megatron.training")

    def resolve(self) -> Callable:
        found = importlib.import_module(self.module)
        for part in self.name.split("."):
            found = getattr(found, part)
        return found

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
    Target(MOE_UTILS, "get_tokens_per_expert_and_token_count"),  # #7452 finding 10
    Target(MOE_UTILS, "z_loss_func"),
    Target(MTP, "process_mtp_loss", since="0.17.1"),  # #7452 finding 3
    Target(ROUTER, "TopKRouter._apply_expert_bias"),
    # not wrapped: the router's and MTP's arithmetic that the auxiliary-loss corrections assume (Megatron-LM #7481,
    # #7498, #7570, #7213 would change it); upstream_factors.py measures the factors at the first step as well
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
    Target(MAPPINGS, "_reduce", assumed_by="exact_token_counts"),  # all-reduces the per-expert counts in place
    Target(ROUTER, "TopKRouter.apply_z_loss", assumed_by="tp_cp_scaled_z_loss"),
    Target(MTP, "roll_tensor", assumed_by="global_count_mtp_loss"),
    Target(TRAINING, "update_train_iters"),
    Target(TRAINING, "get_train_valid_test_num_samples"),
)


def known_fingerprints() -> dict[str, dict[str, list[str]]]:
    """{qualified function name: {fingerprint: [tested sources that have it]}} from fingerprints.json."""
    return json.loads(FINGERPRINTS.read_text())


class Calculator(Protocol):
    """Megatron's num-microbatches calculator interface, as its training loop calls it: upstream's calculators, the
    step-schedule calculator (calculator.py) and the consumed-samples guard around either (guards.py)."""

    def get(self) -> int: ...

    def get_current_global_batch_size(self) -> int: ...

    def get_micro_batch_size(self) -> int: ...

    def get_current_running_global_batch_size(self) -> int: ...

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None: ...


def live_calculator() -> Calculator | None:
    """Megatron's global num-microbatches calculator (``_GLOBAL_NUM_MICROBATCHES_CALCULATOR``); None before it is
    built."""
    return getattr(sys.modules.get(CALCULATOR), "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)


def set_live_calculator(calculator: Calculator) -> None:
    """Make ``calculator`` the one ``get_num_microbatches()`` and the training loop read."""
    sys.modules[CALCULATOR]._GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator


def megatron_args() -> argparse.Namespace | None:
    """Megatron-LM's parsed args (``get_args()``), or None before parsing or without Megatron-LM (megatron.training
    is not imported for this)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def megatron_view() -> MegatronArgs:
    """Megatron-LM's parsed args through the typed view (config/megatron_args.py); empty without them. The view of
    the same Namespace is kept (it reads the Namespace's values as they change): the step's hooks read it often."""
    global _VIEW
    args = megatron_args()
    if _VIEW[0] is not args:
        _VIEW = (args, MegatronArgs.of(args))
    return _VIEW[1]


#: The last args megatron_view() was asked for, and their view.
_VIEW: tuple[argparse.Namespace | None, MegatronArgs] = (None, MegatronArgs({}))


def megatron_iteration() -> int | None:
    """The Megatron iteration being trained, as its log numbers it: ``args.curr_iteration`` + 1 in Megatron-LM's
    loop, ``train_state.step`` + 1 in a Megatron-Bridge step (:func:`bridge_step_state`); None in neither."""
    current = megatron_view().curr_iteration
    if current is not None:
        return current + 1
    bridge = bridge_step_state()
    return None if bridge is None else bridge.train_state.step + 1


def consumed_train_samples() -> int | None:
    """The samples consumed before the step in progress (Megatron-LM's ``args.consumed_train_samples``, Bridge's
    ``train_state.consumed_train_samples``; both add the step's batch after it); None in neither loop."""
    view = megatron_view()
    if view.has("consumed_train_samples"):
        return view.consumed_train_samples
    bridge = bridge_step_state()
    return None if bridge is None else bridge.train_state.consumed_train_samples


def bridge_step_state() -> Any:
    """Megatron-Bridge's ``GlobalState`` while its ``train_step`` runs, or the extension reads the checkpoint its
    ``load_checkpoint`` loaded (bridge_loop.py sets it): the run state Bridge keeps where Megatron-LM keeps its
    parsed args and global writers; None outside those."""
    return _BRIDGE_STEP[0]


def run_settings() -> MegatronArgs:
    """The run's settings under Megatron-LM's names: its parsed args, or where Bridge's state is set
    (:func:`bridge_step_state`) its container's ``train``, ``scheduler`` and ``model`` fields, which have those
    names; empty in neither."""
    if megatron_args() is not None:
        return megatron_view()
    bridge = bridge_step_state()
    if bridge is None:
        return MegatronArgs({})
    import dataclasses

    values: dict[str, Any] = {}
    for section in (bridge.cfg.train, bridge.cfg.scheduler, bridge.cfg.model):
        for f in dataclasses.fields(section):
            values.setdefault(f.name, getattr(section, f.name))
    return MegatronArgs(values)


def set_train_iters(iterations: int) -> None:
    """The loop's run length, read at every iteration: Megatron-LM's ``args.train_iters``, Bridge's
    ``train.train_iters``."""
    args = megatron_args()
    if args is not None:
        args.train_iters = iterations
    elif bridge_step_state() is not None:
        bridge_step_state().cfg.train.train_iters = iterations


def set_bridge_step_state(state: Any) -> None:
    _BRIDGE_STEP[0] = state


_BRIDGE_STEP: list[Any] = [None]


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


#: id(code object) -> (that code object, its fingerprint): a loaded function's source is read once.
_FINGERPRINTS: dict[int, tuple[Any, str]] = {}


def fingerprint(function: Callable) -> str:
    """Fingerprint of a live function: sha256 of its source, decorators included (read once per code object:
    the code that is loaded, not the file as it may have changed on disk since)."""
    unwrapped = inspect.unwrap(function)
    code = getattr(unwrapped, "__code__", unwrapped)
    cached = _FINGERPRINTS.get(id(code))
    if cached is None or cached[0] is not code:
        cached = _FINGERPRINTS[id(code)] = (code, _digest(inspect.getsource(unwrapped)))
    return cached[1]


def fingerprint_file(path: Path, name: str) -> str:
    """Fingerprint of the top-level function (or ``Class.method``) ``name`` in a source file, without
    importing it. A method's source is dedented as ``inspect.getsource`` of the live method is not, so
    the indentation is kept: the same text either way."""
    text = path.read_text()
    body = ast.parse(text).body
    *classes, function = name.split(".")
    for class_name in classes:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == class_name), [])
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = text.splitlines(keepends=True)[first - 1 : node.end_lineno]
            return _digest("".join(lines))
    raise CompatError(f"{name} is not defined in {path}.")


def defines_function(path: Path, name: str) -> bool:
    """The source file defines the top-level function ``name``."""
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.parse(path.read_text()).body)


def tree_targets(root: Path, targets: tuple[Target, ...] = TARGETS) -> list[Target]:
    """The targets a source tree has: optional ones where their file is there, those of a later release where the
    file defines them (the others, gone, are kept: the caller names them)."""

    def has(target: Target) -> bool:
        path = target.path_in(root)
        if target.optional and not path.exists():
            return False
        return target.since is None or (path.exists() and defines_function(path, target.name))

    return [t for t in targets if has(t)]


def live_targets(targets: tuple[Target, ...]) -> list[Target]:
    """The targets that exist here: optional ones only where their module is loaded, and those of a later release
    only where this one defines them."""
    live = [t for t in targets if not t.optional or t.module in sys.modules]
    return [t for t in live if t.since is None or _defined(t)]


def _defined(target: Target) -> bool:
    try:
        target.resolve()
    except AttributeError:
        return False
    return True


def check_targets(version: str, strict: bool, targets: tuple[Target, ...] = TARGETS) -> list[str]:
    """Compare each live target's source with the tested fingerprints; raise (strict) or warn on a mismatch.

    Returns the mismatch messages (empty when every hooked function is one we have tested)."""
    known = known_fingerprints()
    seen = {t.qualified: fingerprint(t.resolve()) for t in live_targets(targets)}
    unknown = [name for name, fp in seen.items() if fp not in known.get(name, {})]
    if not unknown:
        return []
    nearest, matched = _nearest_source(seen, known)
    problems = "; ".join(f"{name} has fingerprint {seen[name]}, which no tested source has" for name in unknown)
    message = (
        f"unknown upstream source in megatron-core {version}: {problems}. The nearest tested source is {nearest} "
        f"({matched} of {len(seen)} hooked functions identical). The extension is tested on "
        f"{', '.join(u.name for u in UPSTREAM)}: use one of them, or pass strict=False (--no-ga-strict) to "
        f"patch anyway with a warning."
    )
    if strict:
        raise CompatError(message)
    logger.warning(message)
    return [message]


def _nearest_source(seen: dict[str, str], known: dict[str, dict[str, list[str]]]) -> tuple[str, int]:
    """The tested source that shares the most hooked functions with the live ones, and how many."""
    counts = {u.name: 0 for u in UPSTREAM}
    for name, fp in seen.items():
        for source in known.get(name, {}).get(fp, []):
            counts[source] = counts.get(source, 0) + 1
    best = max(counts, key=lambda source: counts[source])  # ties: the oldest, as UPSTREAM is ordered
    return best, counts[best]


def matching_sources(targets: tuple[Target, ...] = TARGETS) -> list[str]:
    """The tested sources whose hooked functions all equal the live ones (for the start-up log)."""
    known = known_fingerprints()
    found = [set(known.get(t.qualified, {}).get(fingerprint(t.resolve()), [])) for t in live_targets(targets)]
    common = set.intersection(*found) if found else set()
    return [u.name for u in UPSTREAM if u.name in common]


def table_from_trees(trees: dict[str, Path]) -> dict[str, dict[str, list[str]]]:
    """Fingerprints of :data:`TARGETS` in source trees ``{source name: root holding megatron/...}``."""
    table: dict[str, dict[str, list[str]]] = {t.qualified: {} for t in TARGETS}
    for source, root in trees.items():
        for target in tree_targets(root):
            table[target.qualified].setdefault(fingerprint_file(target.path_in(root), target.name), []).append(source)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description="regenerate fingerprints.json from the tested sources")
    parser.add_argument(
        "--snapshots",
        type=Path,
        default=Path(".cache/megatron-lm"),
        help="holds megatron-lm-<ref>/ for every ref in UPSTREAM (tools/megatron-lm.sh unpacks them)",
    )
    parser.add_argument("--write", action="store_true", help=f"write {FINGERPRINTS.name} (else print it)")
    parser.add_argument(
        "--list",
        metavar="PYTHON",
        nargs="?",
        const="",
        help="print the tested source names (those of one Python leg, if given) and exit",
    )
    args = parser.parse_args()
    if args.list is not None:
        print(" ".join(u.name for u in UPSTREAM if args.list in ("", u.python)))
        return
    table = table_from_trees({u.name: args.snapshots / f"megatron-lm-{u.ref}" for u in UPSTREAM})
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if args.write:
        FINGERPRINTS.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
