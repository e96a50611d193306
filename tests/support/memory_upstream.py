"""Upstream's own formulas, executed from a Megatron-LM source snapshot (a tarball of
../shared/upstream).

``megatron/training/theoretical_memory_usage.py`` is executed whole, its one import (``.utils``:
is_hybrid_model, print_rank_0) stubbed; ``num_floating_point_operations`` is taken out of
``megatron/training/training.py`` by its syntax tree (the module imports torch and half of megatron)
and executed with the two helpers it calls stubbed as upstream defines them (is_hybrid_model: a
--hybrid-layer-pattern is given; is_linear_attention_variant: a gated_delta_net variant). Nothing is
copied into the project: the text is read from the snapshot at test time.
"""

import ast
import contextlib
import io
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SNAPSHOTS = Path(
    os.environ.get("MEGATRON_LM_SNAPSHOTS") or Path(__file__).parents[3] / "shared" / "upstream"
)
#: The snapshots the tier runs: the 0.19 release and the newest main of the manifest.
REFS = ("core_v0.19.0", "d98e8a64ddf3")


@dataclass(frozen=True)
class Upstream:
    ref: str
    report_theoretical_memory: Callable[..., Any]
    num_floating_point_operations: Callable[..., Any]

    def memory_mib(self, args: Any, num_microbatches: int | None) -> tuple[float, float]:
        """(weights and optimizer, activations) in MiB, as report_theoretical_memory gives them."""
        with contextlib.redirect_stdout(io.StringIO()):
            weights, activations, _ = self.report_theoretical_memory(
                args, num_microbatches=num_microbatches
            )
        return weights, activations


def tarball(ref: str) -> Path:
    return SNAPSHOTS / f"megatron-lm-{ref}.tar.gz"


def _read(ref: str, *paths: str) -> list[str]:
    with tarfile.open(tarball(ref)) as tar:
        files = [tar.extractfile(f"megatron-lm-{ref}/{p}") for p in paths]
        return [f.read().decode() for f in files if f is not None]


def _is_linear_attention_variant(variant: Any) -> bool:
    return variant in ("gated_delta_net",)


def load(ref: str) -> Upstream:
    memory_text, training_text = _read(
        ref, "megatron/training/theoretical_memory_usage.py", "megatron/training/training.py"
    )
    helpers = {
        "is_hybrid_model": lambda args: getattr(args, "hybrid_layer_pattern", None) is not None,
        "print_rank_0": lambda *a, **k: None,
        "is_linear_attention_variant": _is_linear_attention_variant,
    }
    memory_tree = ast.parse(memory_text)
    memory_tree.body = [
        n for n in memory_tree.body if not (isinstance(n, ast.ImportFrom) and n.level)
    ]
    memory_ns: dict[str, Any] = dict(helpers)
    exec(compile(memory_tree, f"{ref}/theoretical_memory_usage.py", "exec"), memory_ns)
    training_tree = ast.parse(training_text)
    flops = [
        n for n in training_tree.body if getattr(n, "name", None) == "num_floating_point_operations"
    ]
    flops_ns: dict[str, Any] = dict(helpers)
    exec(compile(ast.Module(body=flops, type_ignores=[]), f"{ref}/training.py", "exec"), flops_ns)
    return Upstream(
        ref, memory_ns["report_theoretical_memory"], flops_ns["num_floating_point_operations"]
    )
