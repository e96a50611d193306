"""The critical batch size of a small GPT on real text, by its definition and by the in-run noise scale, and whether
``--ga-batch-size-warmup auto`` saves steps (issue 28).

Every run is Megatron-LM's pretrain_gpt.py (the newest release snapshot of this Python) through the drop-in entry,
DP 2 on the CPU over gloo (tests/support/pretrain_runs.py's launcher), token mode, on benchmarks/corpus.py's corpus
(``--data-path``, ``--eod-mask-loss``), Adam at a constant LR after a warmup of WARMUP_SAMPLES, every run the same
SAMPLES and evaluated every EVAL_EVERY samples on EVAL_SAMPLES of the validation split, ``--ga-noise-scale``
measuring every NOISE_EVERY samples into a trace:

* McCandlish's sweep: each GBS of the sweep at each of its learning rates (LR_RULE x sqrt(GBS / 16) x each factor);
  per target, per GBS, the run that reaches it in the fewest steps; ``megatron-ga critical-batch --json`` on those
  runs' logs gives S_min, E_min and B_crit per target;
* B_simple (the EMA, in samples) of the same runs where each reaches each target (the first trace row at or after
  its E), and its spread over the batch sizes;
* Merrill's test, at the same sample budget: the smallest and the largest GBS at their best LR, and
  ``--ga-batch-size-warmup auto`` from the smallest with ``--ga-lr-scaling sqrt`` at trust 1: steps to each target
  and the final validation loss.

    python benchmarks/critical_batch.py [--quick] [--seed N]   # JSON under benchmarks/results/ (--quick: .cache)
    python benchmarks/critical_batch.py --seed 7 --like benchmarks/results/critical-batch-DATE.json   # a second seed
    python benchmarks/critical_batch.py --refit benchmarks/results/critical-batch-DATE.json   # its fits, again

``--quick`` (a few minutes: three batch sizes, one LR, few samples) keeps the pipeline working; it measures nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import corpus  # noqa: E402
from benchmarks.critical_batch_report import geometric_mean, plot  # noqa: E402
from tests.support.pretrain_runs import launch  # noqa: E402
from tools.regress import sources  # noqa: E402

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--micro-batch-size",
    "4",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--calculate-per-token-loss",
    "--lr-decay-style",
    "constant",
    "--log-interval",
    "1",
    "--weight-decay",
    "0.01",
    "--adam-beta2",
    "0.95",
]
LR_RULE = 2e-3


@dataclass(frozen=True)
class Plan:
    sweep: tuple[int, ...]
    lr_factors: tuple[float, ...]
    samples: int
    eval_every: int
    eval_samples: int
    noise_every: int
    warmup_samples: int
    num_targets: int

    def lr(self, gbs: int, factor: float) -> float:
        return LR_RULE * math.sqrt(gbs / 16) * factor


FULL = Plan(
    sweep=(8, 16, 32, 64, 128),
    lr_factors=(0.5, 1.0),
    samples=32768,
    eval_every=1024,
    eval_samples=256,
    noise_every=256,
    warmup_samples=2048,
    num_targets=3,
)
QUICK = Plan(
    sweep=(8, 16, 32),
    lr_factors=(1.0,),
    samples=1024,
    eval_every=64,
    eval_samples=32,
    noise_every=64,
    warmup_samples=64,
    num_targets=2,
)


def flags(plan: Plan, gbs: int, lr: float, trace: Path, extra: tuple[str, ...] = (), eval_gbs: int = 0) -> list[str]:
    """One run's flags beyond the launcher's tiny GPT (later flags win): the model, the data, its batch and LR;
    evaluated every ``plan.eval_every`` samples at GBS ``eval_gbs`` (default: its own)."""
    every = max(1, plan.noise_every // gbs)
    return [
        *MODEL,
        "--global-batch-size",
        str(gbs),
        "--train-samples",
        str(plan.samples),
        "--lr",
        str(lr),
        "--min-lr",
        str(lr),
        "--lr-warmup-samples",
        str(plan.warmup_samples),
        "--eval-interval",
        str(max(1, plan.eval_every // (eval_gbs or gbs))),
        "--eval-iters",
        str(max(1, plan.eval_samples // gbs)),
        "--ga-noise-scale",
        str(every),
        "--ga-noise-scale-trace",
        str(trace),
        *extra,
    ]


def trace_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def critical_batch(logs: list[Path], targets: list[float] | None, num_targets: int) -> dict:
    """``megatron-ga critical-batch --json`` on ``logs``, as a user runs it."""
    chosen = ["--targets", ",".join(map(repr, targets))] if targets else ["--num-targets", str(num_targets)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ga_ext.cli.main",
            "critical-batch",
            *map(str, logs),
            *chosen,
            "--interpolate",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr).strip()}
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few minutes: the pipeline, not the science")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--like",
        type=Path,
        metavar="RESULT",
        help="a first seed's result JSON: the sweep only (no "
        "warmup test), at its targets and, per GBS, at the LR its fits chose at most targets",
    )
    parser.add_argument(
        "--refit",
        type=Path,
        metavar="RESULT",
        help="fit a result's targets again from its runs' "
        "logs in .cache/critical-batch (after a change to the fit); trains nothing",
    )
    args = parser.parse_args(argv)
    if args.refit:
        return refit(args.refit)
    first = json.loads(args.like.read_text()) if args.like else None
    plan = QUICK if args.quick else FULL
    trees = sources([])
    if not trees:
        raise SystemExit("no Megatron-LM source snapshot for this Python (tools/regress.py)")
    tree = next(t for t in reversed(trees) if "core_v" in t.name)  # the newest release
    out = ROOT / ".cache" / "critical-batch" / ("quick" if args.quick else f"seed{args.seed}")
    out.mkdir(parents=True, exist_ok=True)
    data = [*corpus.data_flags(tree), "--data-cache-path", str(out / "index-cache"), "--seed", str(args.seed)]
    start = time.monotonic()
    runs = []

    def train(name: str, gbs: int, lr: float, extra: tuple[str, ...] = (), eval_gbs: int = 0) -> dict:
        trace = out / f"{name}.trace.jsonl"
        trace.unlink(missing_ok=True)
        run = launch(
            tree,
            "dp2",
            [*data, *flags(plan, gbs, lr, trace, extra, eval_gbs)],
            extension=True,
            name=name,
            workdir=out,
            timeout=1800,
        )
        if run.rc != 0 or run.error is not None:
            raise SystemExit(run.describe())
        log = out / f"{name}.log"
        rows = trace_rows(trace)
        record = {
            "name": name,
            "gbs": gbs,
            "lr": lr,
            "extra": list(extra),
            "seconds": round(run.seconds, 1),
            "log": str(log),
            "steps": len(run.iterations),
            "trace": rows,
            "b_simple": [
                [r["consumed_samples"], r["b_simple_samples"]] for r in rows if r["b_simple_samples"] is not None
            ],
        }
        print(f"{name}: {record['steps']} steps in {record['seconds']} s", flush=True)
        return record

    factors = _chosen_factors(first) if first else {gbs: plan.lr_factors for gbs in plan.sweep}
    for gbs in plan.sweep:
        for factor in factors.get(gbs, plan.lr_factors):
            runs.append(train(f"gbs{gbs}-lr{factor:g}", gbs, plan.lr(gbs, factor)))
    if first:
        targets = [fit["target"] for fit in first["fits"]]
    else:  # the command's default targets, on the runs at the last LR factor (one per GBS)
        whole = critical_batch(
            [Path(r["log"]) for r in runs if r["lr"] == plan.lr(r["gbs"], plan.lr_factors[-1])], None, plan.num_targets
        )
        if "error" in whole and not args.quick:
            raise SystemExit(f"critical-batch on the sweep: {whole['error']}")
        targets = [fit["target"] for fit in whole.get("targets", [])]
    fits = fit_targets(runs, targets, plan)
    small, large = plan.sweep[0], plan.sweep[-1]
    if first:
        return _write(args, plan, tree, start, runs, fits, {})
    best_small = min((r for r in runs if r["gbs"] == small), key=lambda r: _final_loss(Path(r["log"])))
    best_large = min((r for r in runs if r["gbs"] == large), key=lambda r: _final_loss(Path(r["log"])))
    ratios = sorted(
        f["fit"]["targets"][0]["b_crit"] / geometric_mean(f["b_simple"].values())
        for f in fits
        if (f["fit"].get("targets") or [{}])[0].get("fittable") and geometric_mean(f["b_simple"].values())
    )
    trusts = [1.0] + ([float(f"{ratios[len(ratios) // 2]:.3g}")] if ratios else [])  # the median B_crit / B_simple
    warmups = [
        train(
            f"warmup-auto-trust{trust:g}",
            small,
            best_small["lr"],
            (
                "--ga-batch-size-warmup",
                "auto",
                "--ga-batch-size-warmup-max",
                str(large),
                "--ga-lr-scaling",
                "sqrt",
                "--ga-batch-size-warmup-trust",
                f"{trust:g}",
            ),
            eval_gbs=plan.sweep[len(plan.sweep) // 2],
        )
        for trust in trusts
    ]  # its batch grows: evaluated every eval_every samples at the sweep's middle GBS
    merrill = {}
    for record in (best_small, best_large, *warmups):
        merrill[record["name"]] = {
            "steps_to": {f"{t:.6g}": _steps_to(Path(record["log"]), t) for t in targets},
            "final_validation_loss": _final_loss(Path(record["log"])),
        }
    return _write(args, plan, tree, start, runs + warmups, fits, merrill)


def fit_targets(runs: list[dict], targets: list[float], plan: Plan) -> list[dict]:
    """Per target: per GBS the run that reaches it in the fewest steps, ``megatron-ga critical-batch`` on those, and
    their B_simple there."""
    fits = []
    for target in targets:
        best = {}
        for record in runs:
            reached = _steps_to(Path(record["log"]), target)
            if reached is not None and (record["gbs"] not in best or reached < best[record["gbs"]][0]):
                best[record["gbs"]] = (reached, record)
        chosen = [record for _, record in best.values()]
        fit = critical_batch([Path(r["log"]) for r in chosen], [target], plan.num_targets)
        fits.append(
            {
                "target": target,
                "runs": [r["name"] for r in chosen],
                "fit": fit,
                "b_simple": {r["name"]: _b_simple_at(r, target) for r in chosen},
            }
        )
    return fits


def refit(path: Path, cache: Path = ROOT / ".cache" / "critical-batch") -> int:
    """Fit a result's targets again from its runs' logs and traces in the cache (after a change to the fit), keeping
    its runs, its warmup test and its time; the JSON records the date of the refit."""
    result = json.loads(path.read_text())
    out = cache / ("quick" if result["quick"] else f"seed{result['seed']}")
    runs = [
        {**r, "log": str(out / f"{r['name']}.log"), "trace": trace_rows(out / f"{r['name']}.trace.jsonl")}
        for r in result["runs"]
        if r["name"].startswith("gbs")
    ]
    missing = [r["log"] for r in runs if not Path(r["log"]).exists()]
    if missing:
        raise SystemExit(f"--refit needs the runs' logs in the cache; missing: {', '.join(missing)}")
    result["fits"] = fit_targets(runs, [f["target"] for f in result["fits"]], Plan(**result["plan"]))
    result["refit"] = datetime.date.today().isoformat()
    path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _write(
    args: argparse.Namespace, plan: Plan, tree: Path, start: float, runs: list[dict], fits: list[dict], merrill: dict
) -> int:
    """The result JSON (benchmarks/results/, --quick: .cache) and its plots beside it."""
    result = {
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "seed": args.seed,
        "like": args.like.name if args.like else None,
        "source": tree.name,
        "plan": plan.__dict__,
        "seconds": round(time.monotonic() - start, 1),
        "runs": [{k: v for k, v in r.items() if k not in ("trace", "log")} for r in runs],
        "fits": fits,
        "merrill": merrill,
    }
    directory = ROOT / ".cache" / "critical-batch" if args.quick else ROOT / "benchmarks" / "results"
    path = directory / f"critical-batch-{result['date']}{'' if args.seed == 1234 else f'-seed{args.seed}'}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(""))
    print(
        json.dumps(
            {
                "seconds": result["seconds"],
                "result": str(path),
                "b_crit": {f"{f['target']:.6g}": (f["fit"].get("targets") or [{}])[0].get("b_crit") for f in fits},
            }
        )
    )
    return 0


def _chosen_factors(first: dict) -> dict[int, tuple[float, ...]]:
    """Per GBS, the LR factor of the run a first seed's fits chose at most targets (the earlier target's on a tie)."""
    votes: dict[int, list[float]] = {}
    for fit in first["fits"]:
        for name in fit["runs"]:
            gbs, factor = re.fullmatch(r"gbs(\d+)-lr([\d.]+)", name).groups()
            votes.setdefault(int(gbs), []).append(float(factor))
    return {gbs: (max(factors, key=factors.count),) for gbs, factors in votes.items()}


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+)")
_VALIDATION = re.compile(r"validation loss at iteration\s+(\d+)(?: on validation set)? \| lm loss value: (\S+)")


def _validation(log: Path) -> list[tuple[int, int, float]]:
    """(iteration, consumed samples, validation loss) of Megatron's validation lines (the one after training last),
    read also where the batch changes (``megatron-ga critical-batch``'s reader refuses such a run)."""
    consumed, points = {}, []
    for line in log.read_text(errors="replace").splitlines():
        if (match := _ITERATION.search(line)) is not None:
            consumed[int(match.group(1))] = int(match.group(2))
        elif (match := _VALIDATION.search(line)) is not None:
            points.append((int(match.group(1)), consumed.get(int(match.group(1)), 0), float(match.group(2))))
    return points


def _reached(log: Path, target: float) -> tuple[float, float] | None:
    """(steps, samples) where the validation loss first reaches ``target``, interpolated linearly in the loss
    between that validation and the one before it (critical-batch --interpolate's rule)."""
    before = None
    for step, samples, loss in _validation(log):
        if loss <= target:
            if before is None or before[2] <= loss:
                return float(step), float(samples)
            share = (before[2] - target) / (before[2] - loss)
            return before[0] + share * (step - before[0]), before[1] + share * (samples - before[1])
        before = (step, samples, loss)
    return None


def _steps_to(log: Path, target: float) -> float | None:
    reached = _reached(log, target)
    return None if reached is None else round(reached[0], 1)


def _final_loss(log: Path) -> float:
    points = _validation(log)
    return points[-1][2] if points else math.inf


def _b_simple_at(record: dict, target: float) -> float | None:
    """The noise-scale EMA (samples) at the first measurement at or after the samples where the run reached
    ``target``."""
    reached = _reached(Path(record["log"]), target)
    if reached is None:
        return None
    rows = [r for r in record["trace"] if r["consumed_samples"] is not None and r["consumed_samples"] >= reached[1]]
    return rows[0]["b_simple_samples"] if rows else None


if __name__ == "__main__":
    sys.exit(main())
