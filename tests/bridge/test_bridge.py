"""Megatron-Bridge 0.6.2 with the extension (make test-bridge: .venv-bridge; docs/bridge.md).

Bridge's own ``pretrain()`` on the CPU, DP 2, through ``ga_bridge.install(cfg)`` as a user calls it,
against Bridge's own per-token run (tests/support/bridge_runs.py: one import of Bridge, two forked
ranks per case); and the configuration from the ConfigContainer, in this process: the ``ga`` section
through Bridge's own overrides and YAML, the refusals, and Bridge's field names in their messages.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.event_files import tensorboard_scalars

pytestmark = pytest.mark.bridge
ROOT = Path(__file__).resolve().parents[2]
CASES = (
    "bridge",
    "bridge-microbatch",
    "extension",
    "schedule-bridge",
    "schedule-extension",
    "resume-save",
    "resume-load",
    "rampup-extension",
    "schedule-lr-sqrt",
    "schedule-wsd",
    "warmup",
    "warmup-save",
    "warmup-load",
    "noise-scale",
    "noise-scale-save",
    "noise-scale-load",
    "moe-bridge",
    "moe-extension",
    "moe-extension-masked-step",
    "dropped-finalize-bridge",
    "dropped-finalize-extension",
    "bypassed-schedule-extension",
)
BRIDGE_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|")
NOISE_LINE = re.compile(
    r"^ ?megatron-ga-ext noise scale \| iteration (\d+) \| .* \| loss tokens: (\d+) over 2 "
    r"replicas \| consumed samples: (\d+) \|$"
)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """Every case run: OUT/CASE.rankR.jsonl (rows) and .log (what the rank printed and logged), and
    the runs' directories."""
    out = tmp_path_factory.mktemp("bridge-runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "bridge_runs.py"), str(out), *CASES],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    logs = "".join(
        f"{path.name}: ...{path.read_text()[-1500:]}\n" for path in sorted(out.glob("*.log"))
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs[-6000:]
    return out


@pytest.fixture(scope="module")
def runs(out) -> dict[str, list[list[dict]]]:
    """Each case's rows, per rank."""
    return {
        case: [
            [
                json.loads(line)
                for line in (out / f"{case}.rank{rank}.jsonl").read_text().splitlines()
            ]
            for rank in range(2)
        ]
        for case in CASES
    }


def test_the_extension_trains_exactly_bridges_own_per_token_run(runs):
    """The recipe has per-token loss off; ga_bridge.install() turns it on: loss, grad norm, LR and
    consumed samples equal Bridge's own per-token run at every iteration on both ranks, and differ
    from Bridge's mean of means."""
    reference = runs["bridge"]
    assert [row["iteration"] for row in reference[0]] == [1, 2, 3, 4, 5, 6]
    for rank in range(2):
        assert runs["extension"][rank] == reference[rank]
    microbatch = runs["bridge-microbatch"][0]
    assert all(row["loss"] != ref["loss"] for row, ref in zip(microbatch[1:], reference[0][1:]))


def test_a_step_schedule_trains_the_planned_samples_with_the_lr_ending_on_the_last_step(runs):
    """train.train_samples 56 under train.step_batch_size_schedule "0:8 1536:16" (tokens; 24 samples
    at seq 64), linear decay in samples from 1e-3 to 1e-4: Bridge alone drops the schedule and
    trains 7 steps of 8; through the extension, 3 steps of 8 then 2 of 16, 56 samples in all, each
    step's LR that of its consumed samples, and min_lr on the last. The steps before the switch
    equal Bridge's own."""
    bare = runs["schedule-bridge"][0]
    assert [row["consumed_samples"] for row in bare] == [8, 16, 24, 32, 40, 48, 56]
    for rank in runs["schedule-extension"]:
        assert [row["consumed_samples"] for row in rank] == [8, 16, 24, 40, 56]
        assert {row["train_iters"] for row in rank} == {5}
        for row in rank:
            assert row["lr"] == pytest.approx(1e-3 - 9e-4 * row["consumed_samples"] / 56, rel=1e-12)
        assert rank[-1]["lr"] == pytest.approx(1e-4, rel=1e-12)
        same = ("consumed_samples", "loss", "lr", "grad_norm")
        assert [[row[k] for k in same] for row in rank[:3]] == [
            [row[k] for k in same] for row in bare[:3]
        ]
        assert rank[3]["grad_norm"] != bare[3]["grad_norm"]


def test_the_lr_warmup_and_wsd_decay_end_where_their_samples_do(runs):
    """Bridge #3438's shape under the schedule: an LR warmup over 16 samples and WSD with a linear
    final decay over the last 24 of 56. Each rate written after a step (for the next) is
    megatron-core's at the consumed samples: half-way up at 8, the peak at 16 and 24 (the decay
    starts at 32), 2/3 of the way down at 40, min_lr at 56, the last step."""
    for rank in runs["schedule-wsd"]:
        assert [(row["consumed_samples"], row["train_iters"]) for row in rank] == [
            (8, 5),
            (16, 5),
            (24, 5),
            (40, 5),
            (56, 5),
        ]
        assert [row["lr"] for row in rank] == pytest.approx(
            [5e-4, 1e-3, 1e-3, 1e-4 + 9e-4 * 2 / 3, 1e-4], rel=1e-12
        )


def test_a_resume_at_the_stage_switch_trains_on_as_the_uninterrupted_run(runs):
    """The schedule's run saved at iteration 3 (torch_dist; Bridge writes its config, holding the
    extension's finalize, as YAML beside it) and stopped, then resumed: iterations 4 and 5 (GBS 16
    from consumed sample 24) equal the uninterrupted run's in consumed samples, loss, LR and grad
    norm."""
    whole = runs["schedule-extension"]
    for rank in range(2):
        assert runs["resume-save"][rank] == whole[rank][:3]
        assert runs["resume-load"][rank] == whole[rank][3:]


def test_a_converted_rampup_trains_exactly_its_step_schedule(runs):
    """train.rampup_batch_size [8, 8, 24] to GBS 16 under ga.convert_rampup (Bridge alone refuses a
    rampup with train_samples, and megatron-core 0.19 drops it): install() writes it as its
    schedule, "0:8 1536:16" in tokens, and the run equals the explicit schedule's in every row
    (consumed samples, loss, LR, grad norm)."""
    for rank in range(2):
        assert runs["rampup-extension"][rank] == runs["schedule-extension"][rank]


def test_lr_scaling_gives_each_stage_its_rate_on_bridge(runs):
    """ga.lr_scaling sqrt under the schedule "0:8 1536:16": the rate written after each step (the
    next step's) is Bridge's sample-based decay times sqrt(the next step's GBS / 8); the steps
    before the first scaled rate train as without it, and the step after trains at the scaled rate
    (another grad norm)."""
    plain = runs["schedule-extension"][0]
    for rank in runs["schedule-lr-sqrt"]:
        assert [row["consumed_samples"] for row in rank] == [8, 16, 24, 40, 56]
        for row in rank:
            factor = (16 / 8) ** 0.5 if row["consumed_samples"] >= 24 else 1.0
            assert row["lr"] == pytest.approx(
                (1e-3 - 9e-4 * row["consumed_samples"] / 56) * factor, rel=1e-12
            )
        same = ("loss", "grad_norm")
        assert [[row[k] for k in same] for row in rank[:4]] == [
            [row[k] for k in same] for row in plain[:4]
        ]
        assert rank[4]["grad_norm"] != plain[4]["grad_norm"]


def test_the_noise_scale_line_scalars_and_sidecar_on_bridge(runs, out, cli):
    """ga.noise_scale 1 on Bridge's loop: it trains as without it; on the last rank each iteration's
    line follows Bridge's iteration line, with the loss tokens and consumed samples of the trace
    row; the noise-scale/* scalars in Bridge's TensorBoard equal the trace; each checkpoint Bridge
    saved holds its sidecar."""
    from megatron_ga_ext.integration.sidecar import sidecar_path

    same = ("iteration", "consumed_samples", "loss", "lr", "grad_norm")
    for rank in range(2):
        assert [[r[k] for k in same] for r in runs["noise-scale"][rank]] == [
            [r[k] for k in same] for r in runs["extension"][rank]
        ]
    run = out / "noise-scale"
    trace = [json.loads(line) for line in (run / "trace-save.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["consumed_samples"], r["replicas"]) for r in trace] == [
        (i, 8 * i, 2) for i in range(1, 7)
    ]
    lines = (out / "noise-scale.rank1.log").read_text().splitlines()
    pairs = [
        (BRIDGE_LINE.search(line), NOISE_LINE.match(lines[n + 1]))
        for n, line in enumerate(lines[:-1])
        if BRIDGE_LINE.search(line)
    ]
    assert [(int(b[1]), int(b[2])) for b, _ in pairs] == [(i, 8 * i) for i in range(1, 7)]
    assert [tuple(map(int, m.groups())) for _, m in pairs] == [
        (r["iteration"], r["tokens"], r["consumed_samples"]) for r in trace
    ]
    assert "megatron-ga-ext noise scale" not in (out / "noise-scale.rank0.log").read_text()
    scalars = tensorboard_scalars(run / "tb")
    for name in ("grad_sq", "trace_sigma", "grad_sq_ema", "trace_sigma_ema", "b_simple_tokens"):
        steps, values = zip(*scalars[f"noise-scale/{name.replace('_', '-')}"], strict=True)
        assert steps == tuple(range(1, 7)), name
        assert values == pytest.approx([r[name] for r in trace], rel=1e-6), name
    for iteration in (3, 6):
        sidecar = json.loads(sidecar_path(run / "checkpoints", iteration).read_text())
        kept = sidecar["features"]["noise_scale"]["state"]
        assert (sidecar["iteration"], kept["measurements"], kept["ema"]["updates"]) == (
            iteration,
        ) * 3
    layout = (
        "--micro-batch-size",
        "2",
        "--data-parallel-size",
        "2",
        "--global-batch-size",
        "8",
        "--max-global-batch-size",
        "32",
        "--seq-length",
        "64",
        "--train-samples",
        "512",
    )
    from_trace, from_tensorboard = (
        cli("schedule", "--suggest", str(path), *layout)
        for path in (run / "trace-save.jsonl", run / "tb")
    )
    assert from_trace.status == from_tensorboard.status == 0, from_trace.err + from_tensorboard.err
    schedule = from_trace.out.split("\n", 1)[1]  # after the line naming what it read
    assert (
        "--step-batch-size-schedule" in schedule
        and from_tensorboard.out.split("\n", 1)[1] == schedule
    )


def test_a_resume_continues_the_noise_scale_emas_on_bridge(runs, out):
    """Saved at iteration 3 and stopped, then resumed by Bridge's load: the rows are the
    uninterrupted run's, the resumed EMAs at iterations 4-6 equal its to 1e-9, read from the sidecar
    Bridge loaded, and the loaded checkpoint is not saved again."""
    whole = [
        json.loads(line)
        for line in (out / "noise-scale" / "trace-save.jsonl").read_text().splitlines()
    ]
    resumed = out / "noise-scale-resume"
    again = [json.loads(line) for line in (resumed / "trace-load.jsonl").read_text().splitlines()]
    for rank in range(2):
        assert (
            runs["noise-scale-save"][rank] + runs["noise-scale-load"][rank]
            == runs["noise-scale"][rank]
        )
    assert [r["iteration"] for r in again] == [4, 5, 6]
    for ours, theirs in zip(again, whole[3:], strict=True):
        for name in (
            "grad_sq_ema",
            "trace_sigma_ema",
            "grad_sq",
            "trace_sigma",
            "consumed_samples",
        ):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-9), (name, ours, theirs)
    log = (out / "noise-scale-load.rank0.log").read_text()  # where Bridge prints and logs at INFO
    assert (
        f"noise-scale EMAs continued from {resumed / 'checkpoints' / 'iter_0000003'}" in log
        and "(3 measurements)" in log
    ), log[-2000:]
    assert re.findall(r"saving checkpoint at iteration\s+(\d+)", log) == ["6"]


def test_moe_on_bridges_gpt_step_routes_with_the_loss_mask(runs):
    """MoE (4 experts top-2, aux and z-loss) with Bridge's own gpt_step, which passes no loss_mask
    to the model (Bridge #6103): through the extension every row equals the run of a forward step
    that passes it (the fix a user writes), and differs from Bridge's own, whose router counts the
    masked positions."""
    for rank in range(2):
        assert runs["moe-extension"][rank] == runs["moe-extension-masked-step"][rank]
    assert all(
        ours["grad_norm"] != theirs["grad_norm"]
        for ours, theirs in zip(runs["moe-extension"][0], runs["moe-bridge"][0], strict=True)
    )


def test_the_batch_size_warmup_doubles_and_the_run_ends_at_its_samples_on_bridge(runs, out):
    """ga.batch_size_warmup auto from GBS 8 (trust 2000, cap 32) over train.train_samples 88: GBS 16
    after the first measured step, 32 after the second, so 4 steps where Bridge planned 11;
    train.train_iters follows each decision (Bridge's loop ends on it), the LR decays in samples to
    min_lr on the last step, and the dataset holds the samples. Saved at iteration 2 (the sidecar
    keeps the stages) and resumed: the rows are the uninterrupted run's, and the loaded checkpoint
    is not saved again."""
    from megatron_ga_ext.integration.sidecar import sidecar_path

    for rank in range(2):
        whole = runs["warmup"][rank]
        assert [(row["consumed_samples"], row["train_iters"]) for row in whole] == [
            (8, 6),
            (24, 4),
            (56, 4),
            (88, 4),
        ]
        assert [row["lr"] for row in whole] == pytest.approx(
            [1e-3 - 9e-4 * row["consumed_samples"] / 88 for row in whole], rel=1e-12
        )
        assert whole[-1]["lr"] == pytest.approx(1e-4, rel=1e-12)
        assert runs["warmup-save"][rank] + runs["warmup-load"][rank] == whole
    checkpoints = out / "warmup-resume" / "checkpoints"
    saved = json.loads(sidecar_path(checkpoints, 2).read_text())["features"]["batch_schedule"]
    assert saved == {"version": 1, "state": {"stages": [[0, 8], [8, 16], [24, 32]]}}
    log = (out / "warmup-load.rank0.log").read_text()
    assert (
        'batch-size warmup: resumed with --step-batch-size-schedule "0:8 512:16 1536:32"' in log
    ), log[-2000:]
    assert re.findall(r"saving checkpoint at iteration\s+(\d+)", log) == ["4"]


def test_a_dropped_finalize_is_stopped_at_the_first_step(runs):
    """Bridge #4974's shape (the model config holds no finalize_model_grads_func): Bridge alone
    trains all six steps on unreduced, undivided gradients (grad norms 100x the reference's, the
    replicas apart); with the extension each rank stops at step 1, before any optimizer step, naming
    the hook."""
    bare = runs["dropped-finalize-bridge"]
    assert len(bare[0]) == 6 and all(
        row["grad_norm"] > 100 * ref["grad_norm"] for row, ref in zip(bare[0], runs["bridge"][0])
    )
    assert bare[0][-1]["grad_norm"] != bare[1][-1]["grad_norm"]
    for rank in runs["dropped-finalize-extension"]:
        assert len(rank) == 1 and rank[0]["type"] == "GuardError"
        assert "never called megatron-ga-ext's finalize_model_grads" in rank[0]["error"]


def test_a_schedule_bound_before_install_is_stopped_by_liveness(runs):
    """Bridge's loop given megatron-core's forward/backward function as it was before install() (the
    liveness case of Megatron-LM's loop): each rank stops at step 1, before its optimizer step,
    naming the path."""
    for rank in runs["bypassed-schedule-extension"]:
        assert len(rank) == 1 and rank[0]["type"] == "GuardError"
        assert (
            "training iteration 1 reached the optimizer step through megatron-ga-ext's "
            "finalize_model_grads but not through its guarded forward/backward schedule"
        ) in rank[0]["error"]


@pytest.fixture(scope="module")
def ga_bridge():
    from tests.support.bridge_shims import bridge_import_shim

    with bridge_import_shim():
        from megatron_ga_ext.integration import bridge
    return bridge


@pytest.fixture
def cfg(ga_bridge):
    from megatron_ga_ext.integration.lifecycle import uninstall
    from tests.support.bridge_runs import tiny_config

    yield tiny_config()
    uninstall()


def test_the_ga_section_takes_bridges_overrides_and_yaml(ga_bridge, cfg, tmp_path):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    container = ga_bridge.with_ga(cfg, guards=False)
    process_config_with_overrides(
        container, cli_overrides=["ga.zero_token_policy=skip", "train.train_iters=9"]
    )
    config = ga_bridge.ga_config(container)
    assert (
        config.zero_token_policy,
        config.guards,
        config.seq_length,
        container.train.train_iters,
    ) == (
        "skip",
        False,
        64,
        9,
    )
    path = tmp_path / "run.yaml"
    container.to_yaml(str(path))
    again = ga_bridge.GAContainer.from_yaml(str(path))
    assert (again.ga.zero_token_policy, again.ga.guards) == ("skip", False)
    assert ga_bridge.ga_config(cfg) == ga_bridge.ga_config(
        ga_bridge.with_ga(cfg)
    )  # no section: the defaults


def test_install_turns_on_per_token_loss_and_installs(ga_bridge, cfg):
    cfg.model.calculate_per_token_loss = False
    state = ga_bridge.install(ga_bridge.with_ga(cfg))
    assert cfg.model.calculate_per_token_loss is True and state.config.loss_reduction == "token"
    cfg.model.calculate_per_token_loss = False
    ga_bridge.install(ga_bridge.with_ga(cfg, loss_reduction="microbatch"))
    assert cfg.model.calculate_per_token_loss is False


@pytest.mark.parametrize(
    ("change", "settings", "error", "message"),
    [
        (
            {},
            {"batch_size_warmup": "auto", "noise_scale": 1},
            "OptionError",
            r"^ga\.batch_size_warmup auto needs ga\.batch_size_warmup_max",
        ),  # the flags' own rules first
        ({}, {"zero_token_policy": "never"}, "OptionError", r"ga\.zero_token_policy"),
        (
            {("train", "rampup_batch_size"): [2, 2, 64]},
            {},
            "OptionError",
            r"^train\.rampup_batch_size \[2, 2, 64\]: megatron-core 0\.18 and later drop it .* "
            r"Set ga\.convert_rampup=true to run it as its exact step schedule",
        ),
        (
            {("model", "cuda_graph_impl"): "full_iteration"},
            {},
            "CoverageError",
            r"megatron-ga-ext refuses a full-iteration CUDA graph \(model\.cuda_graph_impl "
            r"full_iteration, .*\) in token mode",
        ),
    ],
)
def test_refusals_name_bridges_fields(ga_bridge, cfg, change, settings, error, message):
    from megatron_ga_ext.integration.lifecycle import installed

    for (section, field), value in change.items():
        object.__setattr__(getattr(cfg, section), field, value)
    with pytest.raises(Exception, match=message) as raised:
        ga_bridge.install(ga_bridge.with_ga(cfg, **settings))
    assert type(raised.value).__name__ == error
    assert installed() is None


def test_a_step_schedule_needs_its_samples_and_a_ga_container(ga_bridge, cfg):
    from megatron_ga_ext.errors import ScheduleError

    cfg.train.train_iters, cfg.train.train_samples = None, 50
    cfg.train.step_batch_size_schedule = "0:8 1536:16"
    with pytest.raises(
        ScheduleError,
        match=r"needs a GAContainer \(ga_bridge\.with_ga\(cfg\)\): Bridge passes no "
        "schedule to the calculator",
    ):
        ga_bridge.install(cfg)
    container = ga_bridge.with_ga(cfg)
    ga_bridge.install(container)
    container.data_parallel_size = (
        2  # what Bridge's validation sets, and GAContainer.validate() reads after it
    )
    with pytest.raises(
        ScheduleError,
        match=r"^train\.train_samples 50: .* the last of its 5 steps ends at 56 "
        r"samples, .* Set train\.train_samples to 56",
    ):
        _plan_only(ga_bridge, container)


def _plan_only(ga_bridge, container):
    """GAContainer.validate() after Bridge's own (which needs torch.distributed for the world
    size)."""
    base = ga_bridge.ConfigContainer.validate
    try:
        ga_bridge.ConfigContainer.validate = lambda self: None
        container.validate()
    finally:
        ga_bridge.ConfigContainer.validate = base


def test_an_unknown_ga_setting_is_named(ga_bridge, cfg):
    from megatron_ga_ext.errors import OptionError

    with pytest.raises(
        OptionError,
        match=r"^ga\.noise: not a megatron-ga-ext setting; the ga section holds .*"
        r"noise_scale",
    ):
        ga_bridge.with_ga(cfg, noise=1)


def test_moe_or_mtp_in_token_mode_is_told_where_the_loss_mask_comes_from(ga_bridge, cfg, caplog):
    """Bridge's gpt_step passes no loss_mask to the model (Bridge #6103): install says the extension
    gives it the one gpt_step.get_batch returned, and that a forward step of the user's own must
    pass it."""
    cfg.model.mtp_num_layers = 1
    with caplog.at_level("INFO", logger="megatron_ga_ext.integration.bridge"):
        ga_bridge.install(ga_bridge.with_ga(cfg))
    assert (
        "megatron-ga-ext: model.mtp_num_layers in token mode: Bridge's gpt_step.forward_step "
        "does not pass loss_mask to the model (Bridge #6103); the extension gives the "
        "model the loss mask gpt_step.get_batch returned"
    ) in caplog.text


def test_a_rampup_is_converted_at_install(ga_bridge, cfg):
    """ga.convert_rampup: train.rampup_batch_size becomes its exact schedule in
    train.step_batch_size_schedule (tokens at model.seq_length 64), and is cleared; a run in
    train_iters is refused with the samples its steps take under the ramp (8 + 8 + 8 + 16 x 3 =
    72)."""
    from megatron_ga_ext.errors import ScheduleError

    cfg.train.global_batch_size, cfg.train.rampup_batch_size = 16, [8, 8, 24]
    with pytest.raises(
        ScheduleError,
        match=r"^train\.rampup_batch_size \[8, 8, 24\] with ga\.convert_rampup needs "
        r"train\.train_samples: .* The 6 steps of train\.train_iters take 72 "
        r"samples under the ramp: set train\.train_iters=null "
        r"train\.train_samples=72",
    ):
        ga_bridge.install(ga_bridge.with_ga(cfg, convert_rampup=True))
    cfg.train.train_iters, cfg.train.train_samples = None, 56
    container = ga_bridge.with_ga(cfg, convert_rampup=True)
    state = ga_bridge.install(container)
    assert (container.train.step_batch_size_schedule, container.train.rampup_batch_size) == (
        "0:8 1536:16",
        None,
    )
    assert state.config.step_batch_size_schedule == "0:8 1536:16"


@pytest.mark.parametrize(("world_size", "refused"), [("1", True), ("2", False)])
def test_the_layout_checks_read_the_world_size_bridge_reads(
    ga_bridge, cfg, monkeypatch, world_size, refused
):
    """Before pretrain() the container's dataset.data_parallel_size is Bridge's default 1: DP comes
    from the world size (WORLD_SIZE, as Bridge's get_world_size_safe reads it before
    torch.distributed starts)."""
    from megatron_ga_ext.errors import OptionError

    monkeypatch.setenv("WORLD_SIZE", world_size)
    container = ga_bridge.with_ga(cfg, noise_scale=1)
    if refused:
        with pytest.raises(
            OptionError,
            match=r"^ga\.noise_scale 1 with data-parallel size 1: .* Drop "
            r"ga\.noise_scale",
        ):
            ga_bridge.install(container)
    else:
        assert any(
            feature.name == "noise_scale" for feature in ga_bridge.install(container).features
        )
