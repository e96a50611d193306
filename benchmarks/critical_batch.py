"""The critical batch size of a small GPT on real text, by its definition (McCandlish et al. 2018's
sweep) and by the in-run noise scale, and whether ``--ga-batch-size-warmup auto`` saves steps
against the right baselines (issue 39).

Every run is Megatron-LM's pretrain_gpt.py (the newest release snapshot of this Python) through the
drop-in entry, DP 2 on the CPU over gloo (tests/support/pretrain_runs.py's launcher), token mode, on
benchmarks/corpus.py's held-out split (``--train-data-path`` / ``--valid-data-path`` with
``--full-validation``: every evaluation of every run is on the same validation set; its iterator
cycles across the DP ranks, so evaluating the same weights twice differs by a median 0.0028 nats),
Adam at a constant LR after a warmup of WARMUP_SAMPLES, every run the same SAMPLES, evaluated every
EVAL_EVERY samples (every step at and above that GBS), ``--ga-noise-scale`` measuring every
NOISE_EVERY samples into a trace. The phases, in the order they run (the B_crit table first):

1. ``grid``: each GBS of SIZES at the LRs ``lr(gbs, k) = LR16 x (gbs / 16) ** LR_POWER x 2 ** k``
   for k in GRID, seed 1; where the best k (lowest mean validation loss after the LR warmup) is at
   an edge of what ran, the next k beyond it runs, up to EXTEND more per GBS, so the best is
   interior;
2. ``seeds``: the best k of each GBS again at each further seed of SEEDS; at LONG_SIZES, whose runs
   reach no target within SAMPLES, the best k at every seed for LONG_SAMPLES instead (evaluated
   every LONG_EVAL_EVERY samples);
3. ``warmup``: ``--ga-batch-size-warmup auto`` from the start size at trust 1 and at T
   (``--warmup-trust T``; by default the trust benchmarks/critical_batch_analysis.py measures from 1
   and 2), against constant batches at the start and end sizes and a hand schedule that doubles at
   fixed samples, at equal samples, evaluated every WARMUP_EVAL_STEPS steps, at each seed.

Each run is cached as ``.cache/critical-batch/<plan>/<name>.json`` (its validation curve and its
trace rows) once it finished: the sweep can be stopped and run again, and a run again skips what
finished. ``--collect`` writes every cached run into the result JSON
(benchmarks/results/critical-batch-DATE.json) and benchmarks/critical_batch_analysis.py fits it.

Issue 51 added four phases to the 2026-12-03 sweep, run in this order:

4. ``large``: GBS 64 and 128 on the long horizon at LRs down to two below the old grid, judged by
   log steps to a target, then seeds at the best (``Sweep.large``);
5. ``edges``: the edge rule over every size by the analysis's criterion (the fitted quantity), and
   seeds at each size's chosen k (``Sweep.edges``; ``seeds`` and ``all`` end with it, so a new
   sweep's LRs are chosen by the fitted quantity, the grid's mean loss only seeding them);
6. ``branch`` and 7. ``arms``: critical_batch_phases.py's branched runs and warmup arms.

    nice -n 19 python benchmarks/critical_batch.py [--phase grid|seeds|warmup|all] [--warmup-trust
    T] [--quick]
    nice -n 19 python benchmarks/critical_batch.py --phase large|edges|branch|arms
    python benchmarks/critical_batch.py --collect [--quick]
    python benchmarks/critical_batch.py --plan      # issue 51's runs, costed; trains nothing

``--quick`` (about a minute: three batch sizes, one LR, few samples) keeps the pipeline working; it
measures nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import corpus  # noqa: E402
from benchmarks import critical_batch_phases as phases  # noqa: E402
from benchmarks.critical_batch_analysis import (  # noqa: E402
    analyse,
    distinct,
    measured_trust,
    reached,
)
from benchmarks.critical_batch_plan import LARGE_GRID, LARGE_SIZES, extends  # noqa: E402
from benchmarks.critical_batch_plan import render as render_plan  # noqa: E402
from tests.support.pretrain_runs import launch  # noqa: E402
from tools.regress import sources  # noqa: E402

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
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
    "--eval-micro-batch-size",
    "1",
    "--eval-global-batch-size",
    "2",
]
#: The sweep ``--plan`` plans from (benchmarks/critical_batch_plan.py).
PLAN_FROM = ROOT / "benchmarks" / "results" / "critical-batch-2026-12-03.json"
#: --seq-length of MODEL: a step schedule's thresholds are tokens.
SEQ_LENGTH = 64
#: The trace keys a run's record keeps (science/core/noise_trace.py): the per-step estimates and the
#: EMA's B_simple.
TRACE_KEYS = (
    "iteration",
    "consumed_samples",
    "grad_sq",
    "trace_sigma",
    "tokens_per_sample",
    "b_simple_samples",
)


@dataclass(frozen=True)
class Plan:
    name: str
    sizes: tuple[int, ...]
    samples: int
    eval_every: int
    noise_every: int
    warmup_samples: int
    lr16: float
    lr_power: float
    grid: tuple[int, ...]
    extend: int
    seeds: tuple[int, ...]
    warmup_start: int
    warmup_end: int
    warmup_eval_steps: int
    long_sizes: tuple[int, ...] = ()
    long_samples: int = 0
    long_eval_every: int = 0

    def lr(self, gbs: int, k: int) -> float:
        return float(f"{self.lr16 * (gbs / 16) ** self.lr_power * 2.0**k:.4g}")


FULL = Plan(
    name="sweep",
    sizes=(4, 8, 16, 32, 64, 128),
    samples=8192,
    eval_every=128,
    noise_every=32,
    warmup_samples=512,
    lr16=2e-3,
    lr_power=0.35,
    grid=(0, 1, 2),
    extend=2,
    seeds=(1, 2, 3),
    warmup_start=8,
    warmup_end=64,
    warmup_eval_steps=16,
    long_sizes=(64, 128),
    long_samples=24576,
    long_eval_every=256,
)
QUICK = Plan(
    name="quick",
    sizes=(4, 8, 16),
    samples=512,
    eval_every=64,
    noise_every=16,
    warmup_samples=64,
    lr16=2e-3,
    lr_power=0.35,
    grid=(0,),
    extend=0,
    seeds=(1,),
    warmup_start=4,
    warmup_end=16,
    warmup_eval_steps=8,
)


def flags(
    plan: Plan, gbs: int, lr: float, seed: int, trace: Path, eval_interval: int, samples: int
) -> list[str]:
    """One run's flags beyond the launcher's tiny GPT (later flags win): the model, its batch, LR,
    seed, samples, evaluation and noise-scale measurement."""
    return [
        *MODEL,
        "--micro-batch-size",
        str(min(8, gbs // 2)),
        "--global-batch-size",
        str(gbs),
        "--train-samples",
        str(samples),
        "--lr",
        str(lr),
        "--min-lr",
        str(lr),
        "--lr-warmup-samples",
        str(plan.warmup_samples),
        "--eval-interval",
        str(eval_interval),
        "--eval-iters",
        "1",
        "--seed",
        str(seed),
        "--ga-noise-scale",
        str(max(1, plan.noise_every // gbs)),
        "--ga-noise-scale-trace",
        str(trace),
    ]


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+)")
_VALIDATION = re.compile(
    r"validation(?:-0)? loss at iteration\s+(\d+)(?: on validation set)? \| lm loss value: (\S+)"
)


def validation_curve(text: str) -> list[list[float]]:
    """[iteration, consumed samples, validation loss] of Megatron's validation lines, in order (the
    one after training last), read also where the batch changes."""
    consumed, points = {0: 0}, []
    for line in text.splitlines():
        if (match := _ITERATION.search(line)) is not None:
            consumed[int(match.group(1))] = int(match.group(2))
        elif (match := _VALIDATION.search(line)) is not None:
            iteration = int(match.group(1))
            points.append([iteration, consumed.get(iteration, 0), float(match.group(2))])
    return points


class Sweep:
    """The runs of one plan, each cached once it finished (see the module docstring)."""

    def __init__(self, plan: Plan) -> None:
        trees = sources([])
        if not trees:
            raise SystemExit("no Megatron-LM source snapshot for this Python (tools/regress.py)")
        self.plan = plan
        self.tree = next(t for t in reversed(trees) if "core_v" in t.name)  # the newest release
        self.out = ROOT / ".cache" / "critical-batch" / plan.name
        self.out.mkdir(parents=True, exist_ok=True)
        self.data = [
            *corpus.heldout_flags(self.tree),
            "--data-cache-path",
            str(self.out / "index-cache"),
        ]

    def cached(self, name: str) -> dict | None:
        path = self.out / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def train(
        self,
        name: str,
        gbs: int,
        lr: float,
        seed: int,
        phase: str,
        extra: tuple[str, ...] = (),
        long: bool = False,
        samples: int | None = None,
        interval: int | None = None,
    ) -> dict:
        """One run (``long``: of ``plan.long_samples``; ``samples`` and ``interval``, the
        evaluation's in steps, where given): from the cache where it finished, else trained and
        cached."""
        if (record := self.cached(name)) is not None:
            return record
        trace = self.out / f"{name}.trace.jsonl"
        trace.unlink(missing_ok=True)
        every = self.plan.long_eval_every if long else self.plan.eval_every
        if interval is None:
            interval = self.plan.warmup_eval_steps if phase == "warmup" else max(1, every // gbs)
        if samples is None:
            samples = self.plan.long_samples if long else self.plan.samples
        given = flags(self.plan, gbs, lr, seed, trace, interval, samples)
        if (
            "--step-batch-size-schedule" in extra
        ):  # the schedule gives the batch; Megatron refuses both
            at = given.index("--global-batch-size")
            del given[at : at + 2]
        run = launch(
            self.tree,
            "dp2",
            [*self.data, *given, *extra],
            extension=True,
            name=name,
            workdir=self.out,
            timeout=3600,
        )
        if run.rc != 0 or run.error is not None:
            raise SystemExit(run.describe())
        rows = (
            [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
            if trace.exists()
            else []
        )
        record = {
            "name": name,
            "phase": phase,
            "gbs": gbs,
            "lr": lr,
            "seed": seed,
            "extra": list(extra),
            "seconds": round(run.seconds, 1),
            "steps": len(run.iterations),
            "curve": validation_curve((self.out / f"{name}.log").read_text(errors="replace")),
            "trace": [{k: r.get(k) for k in TRACE_KEYS} for r in rows],
        }
        (self.out / f"{name}.json").write_text(json.dumps(record) + "\n")
        print(f"{name}: {record['steps']} steps in {record['seconds']} s", flush=True)
        return record

    def grid_run(self, gbs: int, k: int, seed: int, phase: str) -> dict:
        return self.train(f"gbs{gbs}-k{k:+d}-seed{seed}", gbs, self.plan.lr(gbs, k), seed, phase)

    def grid(self) -> dict[int, int]:
        """Phase 1: per GBS, the grid and its extension past an edge best; the best k per GBS."""
        best = {}
        for gbs in self.plan.sizes:
            scores = {k: score(self.grid_run(gbs, k, 1, "grid"), self.plan) for k in self.plan.grid}
            for _ in range(self.plan.extend):
                k = min(scores, key=scores.get)
                if min(scores) < k < max(scores):
                    break
                step = -1 if k == min(scores) else 1
                scores[k + step] = score(self.grid_run(gbs, k + step, 1, "grid"), self.plan)
            best[gbs] = min(scores, key=scores.get)
        return best

    def seeds(self, best: dict[int, int]) -> None:
        """Phase 2: each GBS's best k at the further seeds; at the sizes of ``plan.long_sizes``
        (which reach no target after every run's LR warmup within ``plan.samples``), its best k at
        every seed, of ``plan.long_samples``."""
        for gbs in self.plan.sizes:
            if gbs in self.plan.long_sizes:
                continue
            for seed in self.plan.seeds[1:]:
                self.grid_run(gbs, best[gbs], seed, "seeds")
        for gbs in self.plan.long_sizes:
            for seed in self.plan.seeds:
                self.long_run(gbs, best[gbs], seed)

    def warmup(self, best: dict[int, int], trust: float) -> None:
        """Phase 3: the adaptive warmup at trust 1 and ``trust`` against constant batches at its
        start and end sizes and a hand schedule, at the start size's best LR (scaled by sqrt(GBS /
        start) where the batch grows)."""
        start, end = self.plan.warmup_start, self.plan.warmup_end
        lr = self.plan.lr(start, best[start])
        hand = hand_schedule(start, end, self.plan.samples)
        configs = [
            (f"warmup-auto-trust{t:g}", start, lr, auto_flags(end, t))
            for t in dict.fromkeys((1.0, trust))
        ]
        configs += [
            (f"constant-gbs{start}", start, lr, ()),
            (f"constant-gbs{end}", end, self.plan.lr(end, best[end]), ()),
            (
                "hand-schedule",
                start,
                lr,
                ("--step-batch-size-schedule", hand, "--ga-lr-scaling", "sqrt"),
            ),
        ]
        for seed in self.plan.seeds:
            for name, gbs, run_lr, extra in configs:
                self.train(f"{name}-seed{seed}", gbs, run_lr, seed, "warmup", extra)

    def large(self) -> dict[int, int]:
        """Issue 51, item 1 (benchmarks/critical_batch_plan.py's ``large``): GBS 64 and 128 on the
        long horizon at each k of LARGE_GRID, seed 1, past an edge while the edge rule extends, LRs
        judged in log steps to the lowest of the committed sweep's targets that its long runs at
        that size all reach; then each size's best k at the further seeds. The committed sweep's
        long runs count as run (and are copied into the cache for a later ``--collect``). The best
        k per size."""
        committed = json.loads(PLAN_FROM.read_text())
        done = {r["name"]: r for r in committed["runs"]}
        for name, record in done.items():
            if self.cached(name) is None:
                (self.out / f"{name}.json").write_text(json.dumps(record) + "\n")
        targets = [t["target"] for t in analyse(committed)["targets"]]
        best = {}
        for gbs in LARGE_SIZES:

            def run(k: int, seed: int, gbs: int = gbs) -> dict:
                return done.get(long_name(gbs, k, seed)) or self.long_run(gbs, k, seed)

            old = next(
                int(m[1])
                for n in done
                if (m := re.fullmatch(rf"gbs{gbs}-k([+-]\d+)-seed2-long", n))
            )  # the committed sweep's best k, run long at every seed
            seeds = [run(old, s) for s in self.plan.seeds]
            # the lowest target they all reach (GBS 128's: the sweep's second)
            target = min(t for t in targets if all(map(math.isfinite, _log_steps(seeds, t))))
            log_steps = {k: _log_steps([run(k, 1)], target) for k in LARGE_GRID}
            log_steps[old] = _log_steps(seeds, target)
            for _ in range(self.plan.extend):
                if (k := extends(log_steps)) is None:
                    break
                log_steps[k] = _log_steps([run(k, 1)], target)
            best[gbs] = min(log_steps, key=lambda k: statistics.fmean(log_steps[k]))
            for seed in self.plan.seeds[1:]:
                run(best[gbs], seed)
        return best

    def edges(self) -> dict[int, int]:
        """The edge rule over every size, by the analysis's criterion (the fitted quantity, on the
        cached runs): where it adds a k, that k at seed 1 on the size's horizon, up to
        ``plan.extend`` times; then each size's chosen k at the seeds it lacks. The chosen k per
        size."""
        analysis = self.analysis()
        for _ in range(self.plan.extend):
            added = {g: v["extends"] for g, v in analysis["lr"].items() if v["extends"]}
            if not added:
                break
            for gbs, k in added.items():
                self.grid_or_long(gbs, k, 1)
            analysis = self.analysis()
        best = {gbs: v["best"] for gbs, v in analysis["lr"].items()}
        for gbs, k in best.items():
            for seed in self.plan.seeds:
                self.grid_or_long(gbs, k, seed)
        return best

    def grid_or_long(self, gbs: int, k: int, seed: int) -> dict:
        if gbs not in self.plan.long_sizes:
            return self.grid_run(gbs, k, seed, "grid" if seed == 1 else "seeds")
        return self.long_run(gbs, k, seed)

    def long_run(self, gbs: int, k: int, seed: int) -> dict:
        """A run of ``plan.long_samples`` at LR k."""
        return self.train(
            long_name(gbs, k, seed), gbs, self.plan.lr(gbs, k), seed, "long", long=True
        )

    def runs(self) -> list[dict]:
        return [
            json.loads(p.read_text())
            for p in sorted(self.out.glob("*.json"))
            if "critical-batch-" not in p.name
        ]

    def analysis(self) -> dict:
        return analyse({"plan": asdict(self.plan), "runs": self.runs()})

    def measured_trust(self) -> float | None:
        """benchmarks/critical_batch_analysis.py's trust from the cached grid and seed runs."""
        return measured_trust(self.analysis())

    def collect(self) -> Path:
        """The result JSON: the plan and every cached run."""
        runs = self.runs()
        result = {
            "date": datetime.date.today().isoformat(),
            "source": self.tree.name,
            "plan": asdict(self.plan),
            "validation": {k: v for k, v in corpus.heldout()["valid"].items() if k != "data_path"},
            "runs": runs,
        }
        directory = self.out if self.plan.name == "quick" else ROOT / "benchmarks" / "results"
        path = directory / f"critical-batch-{result['date']}.json"
        path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
        return path


def long_name(gbs: int, k: int, seed: int) -> str:
    return f"gbs{gbs}-k{k:+d}-seed{seed}-long"


def auto_flags(end: int, trust: float) -> tuple[str, ...]:
    return (
        "--ga-batch-size-warmup",
        "auto",
        "--ga-batch-size-warmup-max",
        str(end),
        "--ga-lr-scaling",
        "sqrt",
        "--ga-batch-size-warmup-trust",
        f"{trust:g}",
    )


def hand_schedule(start: int, end: int, samples: int, seq_length: int = SEQ_LENGTH) -> str:
    """Doubling from ``start`` to ``end`` at equal shares of the first half of the samples, as
    pretrain_gpt.py reads ``--step-batch-size-schedule`` (``THRESHOLD:BS``, the threshold in tokens:
    samples x ``--seq-length``)."""
    sizes = [start * 2**i for i in range(int(math.log2(end // start)) + 1)]
    share = samples // 2 // len(sizes)
    return phases.schedule([(i * share, gbs) for i, gbs in enumerate(sizes)], seq_length)


def _log_steps(records: list[dict], target: float) -> list[float]:
    """log of the steps each run takes to ``target`` (inf where it never reaches it)."""
    hits = [reached(distinct(r["curve"]), target) for r in records]
    return [math.log(hit[0]) if hit is not None else math.inf for hit in hits]


def score(record: dict, plan: Plan) -> float:
    """The LR grid's criterion: the mean validation loss over the evaluations after the LR warmup
    (inf where a loss is not finite)."""
    losses = [loss for _, samples, loss in record["curve"] if samples >= plan.warmup_samples]
    return sum(losses) / len(losses) if losses and all(map(math.isfinite, losses)) else math.inf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="about a minute: the pipeline, not the science"
    )
    parser.add_argument(
        "--phase",
        choices=("grid", "seeds", "warmup", "all", "large", "edges", "branch", "arms"),
        default="all",
    )
    parser.add_argument(
        "--warmup-trust",
        type=float,
        default=None,
        help="the warmup's second trust (default: measured)",
    )
    parser.add_argument(
        "--collect", action="store_true", help="write the result JSON from the cached runs"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the runs issue 51 added and their cost; train nothing",
    )
    args = parser.parse_args(argv)
    if args.plan:
        print(render_plan(json.loads(PLAN_FROM.read_text())))
        return 0
    sweep = Sweep(QUICK if args.quick else FULL)
    start = time.monotonic()
    if args.collect:
        print(sweep.collect())
        return 0
    if args.phase in ("large", "edges"):  # then --collect
        best = sweep.large() if args.phase == "large" else sweep.edges()
        print(json.dumps({"best_k": best}), flush=True)
    elif args.phase in ("branch", "arms"):
        base = next(  # the start size's best LR in the committed sweep
            r["lr"] for r in json.loads(PLAN_FROM.read_text())["runs"]
            if r["name"] == f"constant-gbs{phases.START}-seed1"
        )  # fmt: skip
        if args.phase == "branch":
            phases.branches(sweep, base, SEQ_LENGTH)
        else:
            phases.arms(sweep, base, sweep.plan.samples, SEQ_LENGTH, sweep.plan.warmup_eval_steps)
    if args.phase in ("large", "edges", "branch", "arms"):
        print(f"done in {time.monotonic() - start:.0f} s; the runs are in {sweep.out}", flush=True)
        return 0
    best = sweep.grid()
    print(json.dumps({"best_k": best}), flush=True)
    if args.phase in ("seeds", "all"):
        sweep.seeds(best)
        print(json.dumps({"best_k": sweep.edges()}), flush=True)  # by the fitted quantity
    if args.phase in ("warmup", "all"):
        trust = args.warmup_trust or sweep.measured_trust()
        print(json.dumps({"warmup_trust": trust}), flush=True)
        sweep.warmup(best, trust or 1.0)
    print(f"done in {time.monotonic() - start:.0f} s; collect: {sweep.collect()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
