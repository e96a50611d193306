"""The measured parts of docs/noise-scale.md: the unbiasedness table and the --suggest example.

    python -m tools.noise_scale            # print the unbiasedness table
    python -m tools.noise_scale --write    # render both into docs/noise-scale.md, write the example trace and plot

The table comes from tests.support.noise_scale (4000 trials of synthetic gradients of known
covariance, fixed seeds: the same numbers on every run of one torch build). The example trace,
examples/noise-scale-trace.json, is synthetic (a smooth rise to a plateau, the shape Merrill et al.
2025 measured, with a fixed wobble), so the page can show the command and its plot before the in-run
measurement exists. No test writes these files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
from pathlib import Path

from .docs import replace_block

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "noise-scale.md"
TRACE = ROOT / "examples" / "noise-scale-trace.json"
PLOT = ROOT / "docs" / "noise-scale-suggest.png"
#: The example's layout and limits, as a user would pass them (paths relative to the repository
#: root).
SUGGEST = [
    "--suggest",
    "examples/noise-scale-trace.json",
    "--micro-batch-size",
    "2",
    "--data-parallel-size",
    "64",
    "--seq-length",
    "4096",
    "--max-global-batch-size",
    "4096",
    "--lr-warmup-samples",
    "1M",
    "--lr-decay-samples",
    "40M",
    "--lr-wsd-decay-samples",
    "8M",
    "--train-samples",
    "40M",
]


def example_trace(
    global_batch_size: int = 256, every: int = 2000, steps: int = 156_000
) -> list[dict]:
    """A synthetic trace of a run at constant GBS: B_simple = 3000 (1 - exp(-c / 4M)) x (1 + 0.08
    sin(k)) samples at consumed samples c, one row every ``every`` steps; b_simple_tokens with 4096
    tokens per sample."""
    rows = []
    for k, iteration in enumerate(range(0, steps + 1, every)):
        consumed = iteration * global_batch_size
        samples = 3000 * (1 - math.exp(-consumed / 4e6)) * (1 + 0.08 * math.sin(1.7 * k))
        rows.append(
            {
                "iteration": iteration,
                "consumed_samples": consumed,
                "b_simple_samples": round(samples, 1) if samples > 0 else None,
                "b_simple_tokens": round(samples * 4096) if samples > 0 else None,
            }
        )
    return rows


def suggest_output() -> str:
    """What ``megatron-ga schedule`` prints for the example (run in this process, from the
    repository root)."""
    from megatron_ga_ext.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.chdir(ROOT):
        status = main(["schedule", *SUGGEST])
    if status:
        raise SystemExit(f"megatron-ga schedule {' '.join(SUGGEST)} failed (exit {status})")
    return out.getvalue().rstrip("\n")


def write() -> None:
    from tests.support.noise_scale import unbiasedness_table

    TRACE.write_text(json.dumps(example_trace(), indent=1) + "\n")
    text = replace_block(
        DOC.read_text(), "unbiasedness", unbiasedness_table(), "docs/noise-scale.md"
    )
    pairs = [" ".join(SUGGEST[i : i + 2]) for i in range(0, len(SUGGEST), 2)]
    command = " \\\n    ".join(
        ["megatron-ga schedule " + pairs[0]]
        + [" ".join(pairs[i : i + 3]) for i in range(1, len(pairs), 3)]
    )
    text = replace_block(
        text, "suggest-example", f"```\n$ {command}\n{suggest_output()}\n```", "docs/noise-scale.md"
    )
    DOC.write_text(text)
    from megatron_ga_ext.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(ROOT):
        main(["schedule", *SUGGEST, "--plot", str(PLOT)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="render into docs/noise-scale.md and examples/"
    )
    if parser.parse_args().write:
        write()
    else:
        from tests.support.noise_scale import unbiasedness_table

        print(unbiasedness_table())


if __name__ == "__main__":
    main()
