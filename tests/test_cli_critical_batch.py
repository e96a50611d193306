"""``megatron-ga critical-batch RUN...`` end to end, on Megatron-LM logs (and a TensorBoard
directory) written here in the format training_log and evaluate_and_print_results print, by runs
whose steps to every loss follow a known hyperbola: S(B, L) = S_min(L) (1 + B_crit / B)."""

import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: Each run's loss after s steps at batch B: 2 + 3 exp(-x / 300), x = s / ((1 + B_CRIT / B)
#: exp(noise)).
B_CRIT = 32.0
SIZES = (8, 16, 32, 64, 128, 256)


def loss_at(step: int, batch: int, b_crit: float, noise: float) -> float:
    return 2.0 + 3.0 * math.exp(-step / ((1 + b_crit / batch) * math.exp(noise)) / 300.0)


def s_min(loss: float) -> float:
    """The fewest steps to ``loss`` (B -> infinity) on the curve of :func:`loss_at`."""
    return -300.0 * math.log((loss - 2.0) / 3.0)


def megatron_log(
    batch: int,
    *,
    steps: int = 3500,
    interval: int = 5,
    b_crit: float = B_CRIT,
    noise: float = 0.0,
    eval_interval: int = 5,
    batch_from: dict | None = None,
) -> str:
    """A Megatron-LM stdout log: an iteration line every ``interval`` steps, a validation block
    every ``eval_interval`` (the formats of training.py's training_log and
    evaluate_and_print_results)."""
    lines, consumed = ["using world size: 2, data-parallel size: 2", "training ..."], 0
    for step in range(1, steps + 1):
        size = (batch_from or {}).get(step, batch)
        consumed += size
        loss = loss_at(step, batch, b_crit, noise)
        if step % interval == 0:
            lines.append(
                f" [2026-01-01 10:00:00.000000] iteration {step:8d}/{steps:8d} | consumed "
                f"samples: {consumed:12d} | "
                "elapsed time per iteration (ms): 101.2 | learning rate: 1.000000E-03 | global "
                "batch size: "
                f"{size:5d} | lm loss: {loss + 0.05:.6E} | loss scale: 1.0 | grad norm: 0.812 | "
                "number of skipped iterations:   0 | number of nan iterations:   0 |"
            )
        if step % eval_interval == 0:
            text = (
                f" validation loss at iteration {step} | lm loss value: {loss:.6E} | lm loss "
                f"PPL: {math.exp(loss):.6E} | "
            )
            lines += ["-" * (len(text) + 1), text, "-" * (len(text) + 1)]
    return "\n".join(lines) + "\n"


def write_runs(directory, sizes=SIZES, sigma: float = 0.03, seed: int = 0, **kwargs) -> list[str]:
    rng, paths = random.Random(seed), []
    for batch in sizes:
        path = directory / f"gbs{batch}.log"
        path.write_text(megatron_log(batch, noise=rng.gauss(0, sigma), **kwargs))
        paths.append(str(path))
    return paths


def test_recovers_the_known_b_crit_from_logs(cli, tmp_path):
    out = cli(
        "critical-batch",
        *write_runs(tmp_path),
        "--targets",
        "3.5,3.0,2.5",
        "--interpolate",
        "--json",
    )
    assert out.status == 0, out.err
    data = out.json()
    assert [r["global_batch_size"] for r in data["runs"]] == list(SIZES)
    assert "linear interpolation" in data["rule"]["reach"] and "validation" in data["rule"]["loss"]
    for target in data["targets"]:
        interval = target["b_crit_interval"]
        assert target["fittable"] and target["runs_reaching"] == len(SIZES)
        assert interval["low"] <= B_CRIT <= interval["high"], target
        assert interval["high"] / interval["low"] < 2.0, interval
        assert target["s_min"] == pytest.approx(s_min(target["target"]), rel=0.15)
        assert target["e_min"] == pytest.approx(target["s_min"] * target["b_crit"])
        assert target["rms_log_residual"] < 0.05


def test_first_point_rule_and_the_table(cli, tmp_path):
    """Without --interpolate a run reaches a target at its first logged point at or below it: a step
    the log printed; the table names the rule and every target."""
    paths = write_runs(tmp_path, sigma=0.0)
    data = cli("critical-batch", *paths, "--targets", "3.0", "--json").json()
    assert all(p["steps"] % 5 == 0 for p in data["targets"][0]["points"])
    assert "the first logged point at or below" in data["rule"]["reach"]
    assert data["targets"][0]["b_crit"] == pytest.approx(B_CRIT, rel=0.05)
    out = cli("critical-batch", *paths, "--targets", "3.0,2.5")
    assert out.status == 0, out.err
    assert "the first logged point at or below the target" in out.out
    assert "critical batch per target" in out.out and "B_crit 95% interval" in out.out
    assert "NOT FITTABLE" not in out.out


def test_a_run_already_below_the_target_at_its_first_log_is_left_out(cli, tmp_path):
    """At its first evaluation (step 5) the run at B 64 logs 4.967, at B 32 4.975: a target of 4.97
    was reached by the runs at 64, 128 and 256 at some step the log does not give."""
    args = (
        "--targets",
        "4.97",
        "--keep-dominated",
    )  # steps logged every 5: 8 and 16 both at step 5, 16 dominated
    data = cli("critical-batch", *write_runs(tmp_path, sigma=0.0), *args, "--json").json()
    (target,) = data["targets"]
    assert [Path(p).name for p in target["reached_before_first_log"]] == [
        "gbs64.log",
        "gbs128.log",
        "gbs256.log",
    ]
    assert [p["global_batch_size"] for p in target["points"]] == [8, 16, 32]
    out = cli("critical-batch", *write_runs(tmp_path, sigma=0.0), *args)
    assert "its first logged loss is already at or below the target" in out.out


def test_default_targets_lie_between_what_every_run_reaches(cli, tmp_path):
    data = cli(
        "critical-batch", *write_runs(tmp_path, sigma=0.0), "--num-targets", "4", "--json"
    ).json()
    targets = [t["target"] for t in data["targets"]]
    assert len(targets) == 4 and targets == sorted(targets, reverse=True)
    reached = max(r["lowest_loss"] for r in data["runs"])
    assert targets[-1] == pytest.approx(reached)
    assert all(t["runs_reaching"] == len(SIZES) for t in data["targets"])


def test_the_smoothed_training_loss(cli, tmp_path):
    data = cli(
        "critical-batch",
        *write_runs(tmp_path),
        "--targets",
        "3.0",
        "--train-loss-smoothing",
        "0.5",
        "--interpolate",
        "--json",
    ).json()
    assert "EMA decay 0.5" in data["rule"]["loss"]
    target = data["targets"][0]
    assert target["fittable"]
    assert target["b_crit_interval"]["low"] <= B_CRIT <= target["b_crit_interval"]["high"] * 1.1


def test_one_side_of_the_knee_and_too_few_runs_are_reported_not_fitted(cli, tmp_path):
    """Runs at 256..2048 with B_crit 8: all above the knee. Runs that stop early reach the lowest
    target two by two."""
    above = write_runs(tmp_path, sizes=(256, 512, 1024, 2048), b_crit=8.0, sigma=0.0)
    out = cli(
        "critical-batch", *above, "--targets", "3.0", "--keep-dominated"
    )  # S flat: equal at the logged steps
    assert out.status == 0, out.err
    assert "NOT FITTABLE: every run is above the knee" in out.out
    short = tmp_path / "short"
    short.mkdir()
    paths = write_runs(short, sizes=(8, 16, 32), sigma=0.0, steps=1200) + write_runs(
        short, sizes=(64, 128), sigma=0.0
    )
    data = cli("critical-batch", *paths, "--targets", "3.5,2.3", "--json").json()
    fitted, few = data["targets"]
    assert fitted["fittable"] and not few["fittable"]
    assert few["runs_reaching"] == 2 and "needs at least 3 runs" in few["reason"]
    assert "s_min" not in few and "b_crit" not in few


@pytest.mark.parametrize(
    ("make", "argv", "message"),
    [
        (
            "not_a_log",
            ["--targets", "3.0"],
            r"RUN \S+notes.txt is neither a Megatron-LM log .* nor a TensorBoard",
        ),
        (
            "same_gbs",
            ["--targets", "3.0"],
            r"3 RUN\(s\) at 2 global batch size\(s\) given; the fit .* needs runs at 3",
        ),
        (
            "nobody",
            ["--targets", "3.0,1.5"],
            r"--targets 1.5: no run reached it \(the lowest loss any run logged is 2\.",
        ),
        (
            "changes",
            ["--targets", "3.0"],
            r"global batch size changes \(16 from iteration 5, 32 from iteration 100\)",
        ),
        (
            "no_eval",
            ["--targets", "3.0"],
            r"no validation 'lm loss' was logged .* --train-loss-smoothing EMA_DECAY",
        ),
        (
            "two_runs",
            ["--targets", "3.0"],
            r"2 RUN\(s\) at 2 global batch size\(s\) given; the fit of S_min and E_min",
        ),
        ("twice", ["--targets", "3.0"], r"RUN \S+gbs8.log is given twice; give each run once"),
        ("ok", ["--targets", "3.0,x"], r"--targets 'x' is not a finite number"),
        ("ok", ["--bootstrap", "0"], r"--bootstrap 0 must lie from 1 to"),
        (
            "ok",
            ["--confidence", "95"],
            r"--confidence 95 must lie strictly between 0 and 1, e.g. 0.95",
        ),
        (
            "ok",
            ["--train-loss-smoothing", "1"],
            r"--train-loss-smoothing 1.0 must be an EMA decay in \[0, 1\)",
        ),
    ],
)
def test_bad_input_is_a_typed_error_on_the_one_path(cli, tmp_path, make, argv, message):
    paths = write_runs(tmp_path, sizes=(8, 16, 32), sigma=0.0, steps=1200)
    if make == "not_a_log":
        (tmp_path / "notes.txt").write_text("a shopping list\n")
        paths.append(str(tmp_path / "notes.txt"))
    elif make == "same_gbs":
        (tmp_path / "again.log").write_text(megatron_log(16, steps=500))
        paths = [paths[0], paths[1], str(tmp_path / "again.log")]
    elif make == "changes":
        (tmp_path / "ramp.log").write_text(
            megatron_log(16, steps=200, batch_from={s: 32 for s in range(100, 201)})
        )
        paths.append(str(tmp_path / "ramp.log"))
    elif make == "no_eval":
        (tmp_path / "noeval.log").write_text(megatron_log(64, steps=200, eval_interval=10**6))
        paths.append(str(tmp_path / "noeval.log"))
    elif make == "two_runs":
        paths = paths[:2]
    elif make == "twice":
        paths.append(paths[0])
    out = cli("critical-batch", *paths, *argv)
    assert out.status == 2 and out.out == ""
    assert out.err.startswith("megatron-ga critical-batch: error: ") and "Traceback" not in out.err
    assert re.search(message, out.err), out.err
    as_json = cli("critical-batch", *paths, *argv, "--json")
    assert as_json.status == 2 and as_json.json()["error_type"] == "CriticalBatchError"


def _tensorboard_run(directory, batch: int) -> None:
    """The scalars Megatron-LM's training_log and evaluate_and_print_results write, with
    tensorboard's own writer."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(directory))

    def scalar(tag: str, value: float, step: int) -> None:
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]
        )
        writer.add_event(event_pb2.Event(wall_time=0.0, step=step, summary=summary))

    for step in range(5, 3501, 5):
        loss, consumed = loss_at(step, batch, B_CRIT, 0.0), step * batch
        scalar("batch-size", batch, step)
        scalar("batch-size vs samples", batch, consumed)
        scalar("lm loss", loss + 0.05, step)
        scalar("lm loss vs samples", loss + 0.05, consumed)
        scalar("lm loss validation", loss, step)
        scalar("lm loss validation vs samples", loss, consumed)
    writer.close()


def test_a_tensorboard_directory_among_the_logs(cli, tmp_path):
    pytest.importorskip(
        "tensorboard", reason="reading a --tensorboard-dir needs the tensorboard package"
    )
    logs = write_runs(tmp_path, sizes=(8, 16, 32, 128, 256), sigma=0.0)
    board = tmp_path / "tb-gbs64"
    board.mkdir()
    _tensorboard_run(board, 64)
    data = cli("critical-batch", *logs, str(board), "--targets", "3.0", "--json").json()
    assert [r["global_batch_size"] for r in data["runs"]] == [8, 16, 32, 64, 128, 256]
    (point,) = [p for p in data["targets"][0]["points"] if p["run"] == str(board)]
    assert point["steps"] == 5 * math.ceil(
        s_min(3.0) * (1 + B_CRIT / 64) / 5
    )  # the first logged point at or below
    assert point["samples"] == point["steps"] * 64
    assert data["targets"][0]["b_crit"] == pytest.approx(B_CRIT, rel=0.05)
    empty = tmp_path / "empty"
    empty.mkdir()
    out = cli("critical-batch", *logs, str(empty), "--targets", "3.0")
    assert out.status == 2 and "a directory without TensorBoard event files" in out.err


def test_the_plot(cli, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    path = tmp_path / "fit.png"
    out = cli(
        "critical-batch", *write_runs(tmp_path), "--targets", "3.5,3.0,2.5", "--plot", str(path)
    )
    assert out.status == 0, out.err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written to {path}" in out.out


def test_runs_in_well_under_a_second_without_torch_megatron_or_matplotlib(tmp_path):
    """What the pure-Python commands promise (tests/test_architecture.py): nothing heavy is
    loaded."""
    paths = write_runs(tmp_path)
    code = (
        "import sys, time\nfrom megatron_ga_ext.cli.main import main\nstart = time.perf_counter()\n"
        f"status = main(['critical-batch', *{paths!r}, '--targets', '3.5,3.0,2.5'])\n"
        "print('seconds:', time.perf_counter() - start)\nprint('loaded:', *(m for m in ('torch', "
        "'megatron', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    *_, seconds, loaded = result.stdout.splitlines()
    assert loaded == "loaded:"
    assert float(seconds.split()[1]) < 1.0, seconds


def test_the_docs_example_is_what_the_command_prints(cli, tmp_path, monkeypatch):
    """docs/critical-batch.md's output block, up to its '...', on the same six logs."""
    page = (Path(__file__).parents[1] / "docs" / "critical-batch.md").read_text()
    block = page.split("$ megatron-ga critical-batch gbs8.log", 1)[1].split("```", 1)[0]
    expected = block.split("--interpolate\n", 1)[1].split("...\n", 1)[0]
    monkeypatch.chdir(tmp_path)
    write_runs(Path("."))
    out = cli(
        "critical-batch",
        *(f"gbs{b}.log" for b in SIZES),
        "--targets",
        "3.5,3.0,2.5",
        "--interpolate",
    )
    assert out.status == 0, out.err
    assert out.out.startswith(expected), out.out


def test_a_large_batch_that_needs_more_steps_is_named_and_its_end_left_open(cli, tmp_path):
    """GBS 128 takes twice its hyperbola's steps (as an LR-limited large batch does): by default it
    is left out as dominated; kept, with the bootstrap, the command names the rise, and the
    resamples that keep only the large batches run to B_crit -> 0, so the interval has no lower
    end."""
    paths = []
    for batch in (8, 16, 32, 64, 128):
        path = tmp_path / f"gbs{batch}.log"
        path.write_text(
            megatron_log(batch, b_crit=20.0, noise=math.log(2.0) if batch == 128 else 0.0)
        )
        paths.append(str(path))
    assert (
        "gbs128.log (GBS 128"
        in cli("critical-batch", *paths, "--targets", "3.0", "--interpolate").out
    )
    paths = [*paths, "--interval", "bootstrap", "--keep-dominated"]
    out = cli("critical-batch", *paths, "--targets", "3.0", "--interpolate")
    assert out.status == 0, out.err
    assert re.search(
        r"S rises from [\d.]+ steps at GBS 64 to [\d.]+ at GBS 128: the hyperbola has S fall",
        out.out,
    )
    assert re.search(
        r"\d+ of \d+ fitted resamples ran to B_crit -> 0 .*so that end of the interval is not "
        r"bounded",
        out.out,
    )
    assert re.search(r"below [\d.]+ ", out.out)
    target = cli("critical-batch", *paths, "--targets", "3.0", "--interpolate", "--json").json()[
        "targets"
    ][0]
    assert target["steps_rise"] == [[64, 128]]
    assert target["b_crit_interval"]["low"] is None and target["b_crit_interval"]["below"] > 0
    assert target["b_crit"] < target["b_crit_interval"]["high"]


def test_a_dominated_largest_run_is_left_out_named_and_b_crit_recovered(cli, tmp_path):
    """Three seeds at each of 8 ... 128 on the known hyperbola, and a GBS 256 run that takes three
    times its hyperbola's steps (an LR-limited large batch): by default it is left out, named, and
    the stated choice printed; the true B_crit lies within the profile interval; --keep-dominated
    fits it and says so."""
    rng, paths = random.Random(5), []
    for batch in (8, 16, 32, 64, 128):
        for seed in range(3):
            path = tmp_path / f"gbs{batch}-seed{seed}.log"
            path.write_text(megatron_log(batch, b_crit=20.0, noise=rng.gauss(0, 0.05)))
            paths.append(str(path))
    (tmp_path / "gbs256.log").write_text(megatron_log(256, b_crit=20.0, noise=math.log(3.0)))
    paths.append(str(tmp_path / "gbs256.log"))
    out = cli("critical-batch", *paths, "--targets", "3.0", "--interpolate")
    assert out.status == 0, out.err
    assert (
        "dominated runs: left out: a batch size needing at least as many steps and samples"
        in out.out
    )
    assert re.search(
        r"left out as dominated .*: \S+gbs256.log \(GBS 256: S [\d.]+, E \S+\)", out.out
    )
    assert "interval: profile likelihood" in out.out
    target = cli("critical-batch", *paths, "--targets", "3.0", "--interpolate", "--json").json()[
        "targets"
    ][0]
    interval = target["b_crit_interval"]
    assert [d["global_batch_size"] for d in target["dominated"]] == [256] and target[
        "runs_reaching"
    ] == 15
    assert interval["method"] == "profile" and interval["low"] <= 20.0 <= interval["high"], target
    kept = cli(
        "critical-batch", *paths, "--targets", "3.0", "--interpolate", "--keep-dominated", "--json"
    ).json()
    assert kept["rule"]["dominated_runs"] == "kept (--keep-dominated)"
    assert kept["targets"][0]["dominated"] == [] and kept["targets"][0]["b_crit"] < target["b_crit"]
