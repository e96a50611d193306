"""``--ga-noise-scale 1`` in Megatron-LM's own training loop (pretrain_gpt.py through the drop-in
entry), DP 2 on the CPU over gloo, token mode, on the newest release and main
commit of this Python (conftest.py's newest_source).

One run measures every iteration (8 of GBS 16), logs to TensorBoard, writes the trace and saves at
iteration 3; one launch resumes it from that checkpoint; one runs the same without
``--ga-noise-scale``. Checked:

* the run exits 0 and its loss and grad norm equal the run without the measurement, every iteration;
* one noise-scale line per iteration, after Megatron's iteration line of that iteration (the last
  rank prints both), with finite |G|^2 and tr(Sigma);
* one trace row per iteration: consumed samples and loss tokens as the recorder saw them, 2
  replicas;
* the noise-scale/* scalars in Megatron's TensorBoard event files, equal to the trace's;
* the checkpoint sidecar, and the resumed run's EMAs at iterations 4-8 equal to the uninterrupted
  run's;
* with non-persistent global checkpoints (torch_dist, where psutil is importable), the sidecar
  beside the latest, and a resume from it continuing the EMAs (iterations 7-8 equal to the run's
  own);
* ``megatron-ga schedule --suggest`` on the trace prints a schedule (recorded for
  docs/noise-scale.md), and on the run's log and its TensorBoard directory the same one (with a
  trust that makes it double);
* PP 2 x DP 2 measures every iteration too, with the loss tokens of each step and 2 replicas,
  training as without it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ga_ext.integration.sidecar import SIDECAR, sidecar_path
from tests.support.event_files import tensorboard_scalars
from tests.support.plans import BOUNDED
from tools.compatibility import source_name
from tools.results import record

pytestmark = pytest.mark.e2e

ITERATIONS, SAVE_AT = 8, 3
# Dropout off: a step's gradients are then a function of the weights and the samples alone, so the
# resumed run's measurements can equal the uninterrupted run's.
FLAGS = [
    "--calculate-per-token-loss",
    "--global-batch-size",
    "16",
    "--train-samples",
    str(16 * ITERATIONS),
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    *BOUNDED,
]
SUGGEST = [
    "--micro-batch-size",
    "2",
    "--data-parallel-size",
    "2",
    "--global-batch-size",
    "16",
    "--max-global-batch-size",
    "64",
    "--seq-length",
    "64",
    "--train-samples",
    "1024",
]
MEGATRON_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|")
NOISE_LINE = re.compile(
    r"megatron-ga-ext noise scale \| iteration (\d+) \| .*?\|G\|\^2: (\S+) \(EMA (\S+)\) \| "
    r"tr\(Sigma\): (\S+) \(EMA (\S+)\)"
)
#: The trace's values logged as TensorBoard scalars (noise-scale/<name with dashes>); the B_simple
#: ones are left out where the EMAs give none.
ALWAYS_LOGGED = ("grad_sq", "trace_sigma", "grad_sq_ema", "trace_sigma_ema")


def measured(launches, source: Path, layout: str = "dp2"):
    """The measuring run (saving at SAVE_AT), its trace, TensorBoard directory and checkpoints."""
    workdir = launches.workdir / source.name / layout
    trace, tensorboard, checkpoints = (
        workdir / f"noise-scale-{part}" for part in ("trace.jsonl", "tb", "checkpoints")
    )
    run = launches.get(
        source,
        layout,
        "noise-scale",
        [
            *FLAGS,
            "--ga-noise-scale",
            "1",
            "--ga-noise-scale-trace",
            str(trace),
            "--tensorboard-dir",
            str(tensorboard),
            "--save",
            str(checkpoints),
            "--save-interval",
            str(SAVE_AT),
            "--ckpt-format",
            "torch",
        ],
    )
    return run, trace, tensorboard, checkpoints


def trace_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def line_order(output: str) -> list[tuple[str, int]]:
    """("megatron" | "noise", iteration) for each iteration line of the output, in order."""
    found = []
    for line in output.splitlines():
        noise = NOISE_LINE.search(line)
        if noise:
            found.append(("noise", int(noise.group(1))))
        elif (megatron := MEGATRON_LINE.search(line)) and "noise scale" not in line:
            found.append(("megatron", int(megatron.group(1))))
    return found


def test_the_run_logs_the_noise_scale_and_trains_as_without_it(
    launches, newest_source, record_property
):
    run, trace, tensorboard, _ = measured(launches, newest_source)
    assert run.rc == 0 and run.error is None, run.describe()
    reference = launches.get(newest_source, "dp2", "noise-scale-off", FLAGS)
    assert reference.rc == 0, reference.describe()
    iterations = [r["iteration"] for r in run.iterations]
    assert iterations == list(range(1, ITERATIONS + 1)), iterations
    for ours, theirs in zip(
        run.iterations, reference.iterations, strict=True
    ):  # the measurement changes nothing
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"]), (
            ours,
            theirs,
        )

    lines = [m.groups() for m in NOISE_LINE.finditer(run.output)]
    assert [int(g[0]) for g in lines] == iterations, run.describe()
    for _, *numbers in lines:
        assert all(math.isfinite(float(n)) for n in numbers), lines
    order = line_order(run.output)
    for i in iterations:  # the noise line of i after Megatron's line of i, before its line of i + 1
        noise = order.index(("noise", i))
        assert order[noise - 1] == ("megatron", i), (i, order)

    rows = trace_rows(trace)
    assert [r["iteration"] for r in rows] == iterations, rows
    consumed = [r["consumed_samples"] for r in rows]
    assert consumed == sorted(set(consumed)) == [r["consumed_samples"] for r in run.iterations], (
        consumed
    )
    assert [r["tokens"] for r in rows] == [r["num_tokens"] for r in run.iterations], rows
    assert all(r["replicas"] == 2 for r in rows), rows
    for row, (_, grad_sq, grad_sq_ema, trace_sigma, trace_sigma_ema) in zip(rows, lines):
        for name, shown in (
            ("grad_sq", grad_sq),
            ("grad_sq_ema", grad_sq_ema),
            ("trace_sigma", trace_sigma),
            ("trace_sigma_ema", trace_sigma_ema),
        ):
            assert f"{row[name]:.4E}" == shown, (name, row, shown)

    scalars = tensorboard_scalars(tensorboard)
    for name in ALWAYS_LOGGED:
        events = scalars.get(f"noise-scale/{name.replace('_', '-')}")
        assert events is not None, sorted(scalars)
        assert [step for step, _ in events] == iterations, (name, events)
        assert [value for _, value in events] == pytest.approx([r[name] for r in rows], rel=1e-6), (
            name,
            events,
        )

    last = rows[-1]
    record_property(
        "rows",
        [
            {
                "source": source_name(newest_source),
                "layout": "dp2",
                "mode": "token",
                "case": "--ga-noise-scale 1",
                "iterations": f"{len(rows)} measured",
                "samples": f"{consumed[-1]}",
                "loss_vs_upstream": "equal to the run without it (loss, grad norm)",
                "N": f"B_simple {_shown(last['b_simple_tokens'])} tokens (EMA)",
            }
        ],
    )


def test_pipeline_parallel_measures_each_replica_once(launches, newest_source):
    """PP 2 x DP 2: each replica's two stages add their layers' parts (the tied embedding left out),
    counted once."""
    run, trace, _, _ = measured(launches, newest_source, "pp2dp2")
    assert run.rc == 0 and run.error is None, run.describe()
    reference = launches.get(newest_source, "pp2dp2", "noise-scale-off", FLAGS)
    assert reference.rc == 0, reference.describe()
    for ours, theirs in zip(run.iterations, reference.iterations, strict=True):
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"]), (
            ours,
            theirs,
        )
    rows = trace_rows(trace)
    assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1)), rows
    assert [r["tokens"] for r in rows] == [r["num_tokens"] for r in run.iterations], rows
    assert all(
        r["replicas"] == 2 and math.isfinite(r["grad_sq"] + r["trace_sigma"]) for r in rows
    ), rows


def test_a_resume_continues_the_emas(launches, newest_source, record_property):
    run, trace, _, checkpoints = measured(launches, newest_source)
    assert run.rc == 0 and run.error is None, run.describe()
    sidecar = json.loads(sidecar_path(checkpoints, SAVE_AT).read_text())
    kept = sidecar["features"]["noise_scale"]["state"]
    assert sidecar["iteration"] == SAVE_AT and kept["measurements"] == SAVE_AT, sidecar
    assert kept["ema"]["updates"] == SAVE_AT, sidecar
    assert sorted(p.parent.name for p in checkpoints.glob(f"iter_*/{SIDECAR}")) == sorted(
        p.name for p in checkpoints.glob("iter_*")
    ), list(checkpoints.iterdir())

    workdir = launches.workdir / newest_source.name / "dp2"
    resumed_trace = workdir / "noise-scale-resumed-trace.jsonl"
    resumed = launches.get(
        newest_source,
        "dp2",
        "noise-scale-resumed",
        [
            *FLAGS,
            "--ga-noise-scale",
            "1",
            "--ga-noise-scale-trace",
            str(resumed_trace),
            "--load",
            str(checkpoints),
            "--ckpt-step",
            str(SAVE_AT),
            "--ckpt-format",
            "torch",
        ],
    )
    assert resumed.rc == 0 and resumed.error is None, resumed.describe()
    assert "noise-scale EMAs continued from" in resumed.output, resumed.describe()
    whole = trace_rows(trace)[SAVE_AT:]
    again = trace_rows(resumed_trace)
    assert (
        [r["iteration"] for r in again]
        == [r["iteration"] for r in whole]
        == list(range(SAVE_AT + 1, ITERATIONS + 1))
    )
    for ours, theirs in zip(again, whole):
        for name in ("grad_sq_ema", "trace_sigma_ema", "grad_sq", "trace_sigma"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-9), (name, ours, theirs)
    record_property(
        "rows",
        [
            {
                "source": source_name(newest_source),
                "layout": "dp2",
                "mode": "token",
                "case": f"--ga-noise-scale resume at {SAVE_AT}",
                "iterations": f"{SAVE_AT + 1}-{ITERATIONS} = uninterrupted",
                "N": "EMAs of |G|^2, tr(Sigma) equal to 1e-9",
            }
        ],
    )
    record(
        "noise-scale",
        [
            {
                "Source": source_name(newest_source),
                "Layout": "dp2",
                "Resume": (
                    f"saved at {SAVE_AT}, resumed to {ITERATIONS}: grad_sq_ema and "
                    "trace_sigma_ema equal to the uninterrupted run's (1e-9 relative)"
                ),
            }
        ],
    )


NON_PERSISTENT_AT = 3


def test_a_resume_from_a_non_persistent_checkpoint_continues_the_emas(launches, newest_source):
    """--non-persistent-ckpt-type global: the sidecar beside each non-persistent checkpoint
    (iterations 3 and 6 in --non-persistent-global-ckpt-dir; Megatron keeps the latest), and a
    resume that loads the latest (its --load holds no persistent one) continues the EMAs there:
    iterations 7-8 equal the run's own."""
    workdir = launches.workdir / newest_source.name / "dp2"
    trace, non_persistent = (
        workdir / "noise-scale-np-trace.jsonl",
        workdir / "noise-scale-np-checkpoints",
    )
    psutil = pytest.importorskip(
        "psutil",
        reason="Megatron's torch_dist checkpoints (non-persistent global ones need that format) "
        "import psutil",
    )
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), str(Path(psutil.__file__).parents[1])]
        )
    }
    checkpoints = [
        "--ckpt-format",
        "torch_dist",
        "--non-persistent-ckpt-type",
        "global",
        "--non-persistent-global-ckpt-dir",
        str(non_persistent),
    ]
    run = launches.get(
        newest_source,
        "dp2",
        "noise-scale-np",
        [
            *FLAGS,
            "--ga-noise-scale",
            "1",
            "--ga-noise-scale-trace",
            str(trace),
            "--save",
            str(workdir / "noise-scale-np-persistent"),
            "--save-interval",
            "1000",
            "--non-persistent-save-interval",
            str(NON_PERSISTENT_AT),
            *checkpoints,
        ],
        env=env,
    )
    assert run.rc == 0 and run.error is None, run.describe()
    latest = 2 * NON_PERSISTENT_AT
    sidecar = json.loads(sidecar_path(non_persistent, latest).read_text())
    measurements = sidecar["features"]["noise_scale"]["state"]["measurements"]
    assert (sidecar["version"], sidecar["iteration"], measurements) == (3, latest, latest), sidecar

    resumed_trace = workdir / "noise-scale-np-resumed-trace.jsonl"
    resumed = launches.get(
        newest_source,
        "dp2",
        "noise-scale-np-resumed",
        [
            *FLAGS,
            "--ga-noise-scale",
            "1",
            "--ga-noise-scale-trace",
            str(resumed_trace),
            "--load",
            str(workdir / "noise-scale-np-no-persistent"),
            *checkpoints,
        ],
        env=env,
    )
    assert resumed.rc == 0 and resumed.error is None, resumed.describe()
    assert (
        f"noise-scale EMAs continued from {sidecar_path(non_persistent, latest)}" in resumed.output
    ), resumed.describe()
    whole, again = trace_rows(trace)[latest:], trace_rows(resumed_trace)
    assert (
        [r["iteration"] for r in again]
        == [r["iteration"] for r in whole]
        == list(range(latest + 1, ITERATIONS + 1))
    )
    for ours, theirs in zip(again, whole):
        for name in (
            "grad_sq_ema",
            "trace_sigma_ema",
            "grad_sq",
            "trace_sigma",
            "consumed_samples",
        ):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-9), (name, ours, theirs)


def test_suggest_reads_the_runs_trace(launches, newest_source):
    run, trace, tensorboard, _ = measured(launches, newest_source)
    assert run.rc == 0 and run.error is None, run.describe()
    exe = Path(sys.executable).with_name("megatron-ga")
    done = subprocess.run(
        [str(exe), "schedule", "--suggest", str(trace), *SUGGEST],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    schedule = re.search(r'--step-batch-size-schedule "([^"]+)"', done.stdout)
    assert schedule is not None, done.stdout
    rows = trace_rows(trace)
    print(f"$ megatron-ga schedule --suggest {trace.name} {' '.join(SUGGEST)}\n{done.stdout}")
    log = trace.with_name("noise-scale-run.log")
    log.write_text(run.output)
    for other in (
        log,
        tensorboard,
    ):  # the run's log and its TensorBoard directory give the same rows
        again = subprocess.run(
            [str(exe), "schedule", "--suggest", str(other), *SUGGEST, "--trust", "400", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert again.returncode == 0, again.stderr
        reference = subprocess.run(
            [str(exe), "schedule", "--suggest", str(trace), *SUGGEST, "--trust", "400", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        ours, theirs = json.loads(again.stdout), json.loads(reference.stdout)
        decisions = [
            [(d["consumed_samples"], d["after"]) for d in x["decisions"]] for x in (ours, theirs)
        ]
        assert ours["schedule"] == theirs["schedule"] and decisions[0] == decisions[1] != [], (
            other,
            ours,
            theirs,
        )
    record(
        "noise-scale",
        [
            {
                "Source": source_name(newest_source),
                "Layout": "dp2",
                "Measured": f"{len(rows)} iterations of GBS 16, {rows[-1]['tokens']} loss tokens "
                "at the last",
                "B_simple (EMA) at the last": f"{_shown(rows[-1]['b_simple_tokens'])} tokens, "
                f"{_shown(rows[-1]['b_simple_samples'])} samples",
                "Suggested (--suggest)": f"`{' '.join(SUGGEST)}`: `--step-batch-size-schedule "
                f'"{schedule.group(1)}"`',
            }
        ],
    )


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
