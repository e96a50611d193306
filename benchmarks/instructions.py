"""Instructions per training step, install() against upstream, counted by callgrind: a side-by-side
ratio that the machine's noise does not move.

Step times on this machine swing 2x from one second to the next (docs/performance.md), far more than
the 1% the extension may add; the instructions a step executes do not. overhead.py's setting (two
gloo ranks, DP 2, megatron's own schedule and finalize, ``calculate_per_token_loss=True``) runs
under ``valgrind --tool=callgrind``, which counts each rank's instructions whatever else the machine
runs:

* the main thread's only, where upstream's Python and the extension's run (gloo's threads run the
  same collectives in every variant), with one intra-op thread (OpenMP's workers spin while they
  wait, and spinning is counted);
* a round installs each variant once, in an order drawn at random per round (upstream after the same
  ``install()`` and ``uninstall()``, as in overhead.py); an installation's first step runs its
  start-up checks and is left out; the garbage collector is held off while steps are counted (a
  collection's cost is the whole heap's);
* callgrind dumps its counters around the counted steps at a client request
  (``CALLGRIND_DUMP_STATS_AT``, from a three-line C helper built here with gcc and valgrind's
  header; ``callgrind_control`` does not reach forked ranks).

Per variant: instructions per step (the mean of the two ranks, the median over rounds), the ratio to
upstream per round (median, min, max), the instructions added per micro-batch, and that in
microseconds at upstream's rate (its instructions per step over its main thread's CPU time per step,
timed on the same ranks just before, outside valgrind). ``spread`` is max / min of upstream's
rounds: the floor of what a ratio resolves.

    python benchmarks/instructions.py --quick    # the position-wise model at GA 4: one JSON object on the last line
    python benchmarks/instructions.py --write    # GA 4, 16 and 64 on both models: JSON, docs table
    python benchmarks/instructions.py --noise-scale  # --ga-noise-scale 1 against upstream and the extension (GPT, GA 4)

With ``--noise-scale`` the extension's variants are sync checks without and with the noise scale
measured every step; the second's extra all-reduce runs on gloo's threads, which are not counted
(its main-thread call is).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # the harness and the variants (benchmarks/ is not a package)

from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

DP, VARIANTS = overhead.DP, overhead.VARIANTS
#: Counted steps per installation, per model (a callgrind step of the tiny GPT: seconds at GA 4,
#: half a minute at 16, two minutes at 64, where one step is counted).
STEPS = {"positionwise": 4, "gpt": 2}
#: The full run's rows (--quick: the first).
PLAN = (
    ("positionwise", 4),
    ("positionwise", 16),
    ("positionwise", 64),
    ("gpt", 4),
    ("gpt", 16),
    ("gpt", 64),
)
VALGRIND = ("valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes")
#: The client requests the ranks make (no-ops outside valgrind), and where the helper that makes
#: them is.
HELPER_SOURCE = """#include <valgrind/callgrind.h>
void megatron_ga_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void megatron_ga_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
HELPER_ENV = "MEGATRON_GA_CALLGRIND_HELPER"


#: The variants of --noise-scale.
NOISE_SCALE_VARIANTS = ("upstream", "extension", "extension_noise_scale")


def rank_main(
    num_microbatches: int,
    model: str,
    rounds: int,
    steps: int,
    counting: bool,
    variants: tuple[str, ...] = VARIANTS,
) -> dict:
    """This rank's rounds: under callgrind (``counting``) dumps labelled "<rank> <variant> <round>"
    around each installation's counted steps; outside it, their CPU times."""
    import torch

    import megatron_ga_ext
    from megatron_ga_ext.testing.shims import cpu_shims

    helper = ctypes.CDLL(os.environ[HELPER_ENV]) if counting else None
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    with cpu_shims():
        harness = overhead._setup(num_microbatches, model, DP)

        def installation(variant: str, timed_steps: int, label: str | None) -> float:
            one_step = overhead.installed_step(variant, harness)
            one_step()
            # Held off while counted, as overhead.py times: a collection's cost is the heap's, not
            # the step's.
            gc.collect()
            gc.disable()
            if label:
                helper.megatron_ga_dump(f"{rank} skip".encode())
            start = (
                time.thread_time()
            )  # this thread's CPU time: no waits for the other rank, no gloo threads
            for _ in range(timed_steps):
                one_step()
            elapsed = (time.thread_time() - start) / timed_steps
            if label:
                helper.megatron_ga_dump(label.encode())
            gc.enable()
            megatron_ga_ext.uninstall()
            return elapsed

        for variant in variants:  # warm-up, not counted
            installation(variant, 1, None)
        if counting:
            helper.megatron_ga_start()
        order = random.Random(
            num_microbatches
        )  # the same orders on both ranks (they step together)
        times = {variant: [] for variant in variants}
        for index in range(rounds):
            for variant in order.sample(variants, len(variants)):
                label = f"{rank} {variant} {index}" if counting else None
                times[variant].append(installation(variant, steps, label))
        return {"times": times}


def build_helper(directory: Path) -> Path:
    """The client-request helper, compiled into ``directory``."""
    source, library = directory / "callgrind_requests.c", directory / "callgrind_requests.so"
    source.write_text(HELPER_SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    return library


def read_dumps(directory: Path) -> dict[str, int]:
    """{dump label: instructions} from callgrind's dump files in ``directory``: a client request's
    label (its ``desc: Trigger:`` line) and the dump's total (``summary:``), of each rank's main
    thread (``thread: 1``; the others are gloo's, which run the same collectives in every variant);
    what each process dumps at its end is left out."""
    counts = {}
    for path in directory.glob("callgrind.*"):
        text = path.read_text(errors="replace")
        thread = re.search(r"^thread: (\d+)$", text, re.MULTILINE)
        if thread and thread.group(1) != "1":
            continue
        trigger = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.MULTILINE)
        summary = re.search(r"^summary: (\d+)$", text, re.MULTILINE)
        if trigger and summary:
            counts[trigger.group(1).strip()] = int(summary.group(1))
    return counts


def summarize(
    num_microbatches: int,
    model: str,
    counts: dict[str, int],
    native: dict,
    steps: int,
    variants: tuple[str, ...] = VARIANTS,
) -> dict:
    """One GA's row from the dumps ({"<rank> <variant> <round>": instructions}) and the native CPU
    times."""
    rounds = sorted({int(label.split()[2]) for label in counts if label.split()[1] in variants})
    per_step = {
        v: [
            statistics.mean(counts[f"{rank} {v} {r}"] for rank in range(DP)) / steps for r in rounds
        ]
        for v in variants
    }
    upstream = per_step["upstream"]
    ratios = {v: [e / u for e, u in zip(per_step[v], upstream)] for v in variants[1:]}
    added = {
        v: [(e - u) / num_microbatches for e, u in zip(per_step[v], upstream)] for v in variants[1:]
    }
    upstream_us = 1e6 * statistics.median(native["times"]["upstream"])
    rate = (
        statistics.median(upstream) / upstream_us
    )  # upstream's instructions per microsecond of CPU time
    return {
        "model": model,
        "num_microbatches": num_microbatches,
        "rounds": len(rounds),
        "steps": len(rounds) * steps,
        "instructions_per_step": {v: round(statistics.median(per_step[v])) for v in variants},
        "ratio_median": {v: round(statistics.median(ratios[v]), 5) for v in variants[1:]},
        "ratio_min": {v: round(min(ratios[v]), 5) for v in variants[1:]},
        "ratio_max": {v: round(max(ratios[v]), 5) for v in variants[1:]},
        "spread": round(max(upstream) / min(upstream), 5),
        "added_instructions_per_microbatch": {
            v: round(statistics.median(added[v])) for v in variants[1:]
        },
        "upstream_cpu_us_per_step": round(upstream_us, 1),
        "upstream_instructions_per_us": round(rate, 1),
        "added_us_per_microbatch": {
            v: round(statistics.median(added[v]) / rate, 2) for v in variants[1:]
        },
    }


def run(
    num_microbatches: int, model: str, rounds: int, variants: tuple[str, ...] = VARIANTS
) -> dict:
    """Native times first (the rate), then the same rounds under callgrind, in a process of its
    own."""
    steps = 1 if (model, num_microbatches) == ("gpt", 64) else STEPS[model]
    launch = LaunchConfig(timeout_s=3600)
    native = run_on_ranks(
        rank_main, DP, (num_microbatches, model, rounds, steps, False, variants), launch
    )[0]
    with tempfile.TemporaryDirectory(prefix="callgrind-") as out:
        helper = build_helper(Path(out))
        command = [
            *VALGRIND,
            f"--callgrind-out-file={out}/callgrind.%p",
            sys.executable,
            __file__,
            "--inside",
            json.dumps([num_microbatches, model, rounds, steps, variants]),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", HELPER_ENV: str(helper)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(
                f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}"
            )
        counts = read_dumps(Path(out))
    if not counts:
        raise RuntimeError(
            f"callgrind wrote no labelled dump; its output ends:\n{done.stderr[-4000:]}"
        )
    return summarize(num_microbatches, model, counts, native, steps, variants)


def table(rows: list[dict]) -> str:
    header = (
        "| model | GA | upstream: instructions per step (rate, per us) | extension: ratio, "
        "median [min, max] | instructions per micro-batch | us per micro-batch at "
        "upstream's rate | async: ratio, median [min, max] | instructions per "
        "micro-batch | us per micro-batch | upstream's spread |"
    )
    lines = [header, "|" + "---|" * 10]
    for r in rows:
        cells = [
            overhead.MODELS[r["model"]],
            str(r["num_microbatches"]),
            f"{r['instructions_per_step']['upstream']:,} "
            f"({r['upstream_instructions_per_us']:,.0f})",
        ]
        for v in VARIANTS[1:]:
            cells += [
                f"{r['ratio_median'][v]:.4f} [{r['ratio_min'][v]:.4f}, {r['ratio_max'][v]:.4f}]",
                f"{r['added_instructions_per_microbatch'][v]:,}",
                f"{r['added_us_per_microbatch'][v]:.1f}",
            ]
        cells.append(f"{r['spread']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(rows: list[dict], env: dict) -> None:
    """benchmarks/results/instructions-<date>.json and the table of docs/performance.md."""
    stamp = (
        f"\nRun on {env['date'][:10]}: Python {env['versions']['python']}, torch "
        f"{env['versions']['torch']}, megatron-core {env['versions']['megatron-core']}; "
        f"{env['layout']}, one intra-op "
        "thread.\n\n"
    )
    overhead.record("instructions", rows, env, stamp + table(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the position-wise model at GA 4 only")
    parser.add_argument(
        "--write",
        action="store_true",
        help="write benchmarks/results/*.json and docs/performance.md",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per model and GA (default 3)")
    parser.add_argument(
        "--noise-scale",
        action="store_true",
        help="--ga-noise-scale 1 against upstream and the extension: the tiny GPT at GA 4",
    )
    parser.add_argument(
        "--inside", help=argparse.SUPPRESS
    )  # the process callgrind runs: its ranks count
    args = parser.parse_args(argv)
    import megatron.core.pipeline_parallel.schedules  # noqa: F401  (once here: every launch forks with it loaded)

    if args.inside:
        num_microbatches, model, rounds, steps, variants = json.loads(args.inside)
        run_on_ranks(
            rank_main,
            DP,
            (num_microbatches, model, rounds, steps, True, tuple(variants)),
            LaunchConfig(timeout_s=7200),
        )
        return 0
    if args.noise_scale:
        row = run(4, "gpt", args.rounds, NOISE_SCALE_VARIANTS)
        print(json.dumps(row))
        return 0
    plan = PLAN[:1] if args.quick else PLAN
    rows = []
    for model, num_microbatches in plan:
        rows.append(run(num_microbatches, model, args.rounds))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    env = overhead.environment()
    if args.write:
        write(rows, env)
    print(table(rows))
    print(json.dumps(rows[0] if args.quick else {**env, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
