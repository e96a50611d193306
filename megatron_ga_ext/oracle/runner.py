"""Run Megatron-LM's own argument parsing and validation on launch lines: one subprocess per (source
tree, batch of lines), the worker (``worker.py``) importing torch and the tree. Pure Python on this
side.

A source tree is a Megatron-LM checkout or an unpacked snapshot: the directory that holds
``megatron/training/arguments.py``. The worker's answers come back as :class:`UpstreamVerdict`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_ga_ext.errors import UsageError

__all__ = ["UpstreamVerdict", "megatron_argv", "run_upstream", "source_tree"]

#: The worker's answer line on stdout (worker.MARKER; not imported: that module imports torch's
#: world).
_MARKER = "megatron-ga-oracle: "
#: Seconds a batch may take: the import (5-12 s) plus well under a second a line.
_TIMEOUT = 600
#: Scripts whose argv follows them on a launch line.
_SCRIPT_SUFFIX = ".py"


@dataclass(frozen=True)
class UpstreamVerdict:
    """What Megatron-LM says of one line: accepted, or refused at ``step`` with its exception and
    message; the numbers known up to where it stopped (DP after validate_args, GBS and GA after the
    calculator)."""

    accepted: bool
    error_type: str | None
    message: str | None
    step: str | None = None
    data_parallel_size: int | None = None
    global_batch_size: int | None = None
    num_microbatches: int | None = None
    stages: tuple[tuple[int, int, int], ...] | None = None
    """(threshold in samples, GBS, GA) at each stage of a step schedule, replayed in order."""

    def summary(self) -> str:
        """One line: the verdict, the message, the numbers."""
        if not self.accepted:
            return f"refused at {self.step}: {self.error_type}: {self.message}"
        numbers = (
            f"DP {self.data_parallel_size}, GBS {self.global_batch_size}, GA "
            f"{self.num_microbatches}"
        )
        if self.stages:
            numbers += ", stages " + " ".join(f"{t}:{g}/GA {a}" for t, g, a in self.stages)
        return f"accepted: {numbers}"


def source_tree(path: str | Path) -> Path:
    """The Megatron-LM tree at ``path`` (a checkout or an unpacked snapshot); UsageError where it is
    none."""
    root = Path(path).expanduser().resolve()
    if not (root / "megatron" / "training" / "arguments.py").is_file():
        raise UsageError(
            f"--megatron {path}: no megatron/training/arguments.py there; give the root of a "
            "Megatron-LM "
            f"checkout (the directory holding pretrain_gpt.py and megatron/)"
        )
    return root


def megatron_argv(tokens: Sequence[str]) -> list[str]:
    """The words a launch line hands Megatron's parser: those after the training script (``*.py``),
    inside a ``bash -c "..."`` where the line wraps one, without the extension's ``--ga-*`` flags
    (the drop-in entry adds those to the parser; plain Megatron-LM does not know them)."""
    words = list(tokens)
    for word in words:
        if " " in word and _SCRIPT_SUFFIX + " " in word + " ":
            return megatron_argv(shlex.split(word))
    start = next((i + 1 for i, w in enumerate(words) if w.endswith(_SCRIPT_SUFFIX)), None)
    if start is None:
        raise UsageError(
            "--megatron: no training script (a .py file) on the line, so no Megatron arguments"
        )
    argv, skipping = [], False
    for word in words[start:]:
        if word.startswith("--"):
            skipping = word.startswith("--ga-") or word.startswith("--no-ga-")
        if not skipping:
            argv.append(word)
    return argv


def run_upstream(
    root: str | Path, lines: Sequence[tuple[Sequence[str], int]], python: str | None = None
) -> list[UpstreamVerdict]:
    """Upstream's verdict on each (argv, world size) of ``lines``, from the tree at ``root``, in one
    process of ``python`` (this interpreter by default). UsageError where torch or the tree does not
    import."""
    tree = source_tree(root)
    request = {"root": str(tree), "lines": [{"argv": list(a), "world_size": w} for a, w in lines]}
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")])
    )
    result = subprocess.run(
        [python or sys.executable, "-m", "megatron_ga_ext.oracle.worker"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
        env=env,
    )
    answers = [
        line[len(_MARKER) :] for line in result.stdout.splitlines() if line.startswith(_MARKER)
    ]
    if not answers:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise UsageError(
            f"--megatron {root}: upstream's validation did not run (exit "
            f"{result.returncode}):\n{tail}"
        )
    answer = json.loads(answers[-1])
    if "import_error" in answer:
        raise UsageError(
            f"--megatron {root}: cannot import Megatron-LM there with {python or sys.executable} "
            f"({answer['import_error']}); run check where torch and that checkout import "
            "(the training image)"
        )
    return [_verdict(v) for v in answer["verdicts"]]


def _verdict(raw: dict) -> UpstreamVerdict:
    stages = raw.get("stages")
    return UpstreamVerdict(
        accepted=raw["accepted"],
        error_type=raw["error_type"],
        message=raw["message"],
        step=raw.get("step"),
        data_parallel_size=raw.get("data_parallel_size"),
        global_batch_size=raw.get("global_batch_size"),
        num_microbatches=raw.get("num_microbatches"),
        stages=None if stages is None else tuple((t, g, a) for t, g, a in stages),
    )
