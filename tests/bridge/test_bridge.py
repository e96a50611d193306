"""Megatron-Bridge 0.6.2 with the extension (make test-bridge: .venv-bridge; docs/bridge.md).

Bridge's own ``pretrain()`` on the CPU, DP 2, through ``ga_bridge.install(cfg)`` as a user calls it, against
Bridge's own per-token run (tests/support/bridge_runs.py: one import of Bridge, two forked ranks per case); and the
configuration from the ConfigContainer, in this process: the ``ga`` section through Bridge's own overrides and YAML,
the refusals, and Bridge's field names in their messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bridge
ROOT = Path(__file__).resolve().parents[2]
CASES = ("bridge", "bridge-microbatch", "extension", "schedule-bridge", "schedule-extension", "resume-save",
         "resume-load", "dropped-finalize-bridge", "dropped-finalize-extension")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[list[dict]]]:
    """Each case's rows, per rank."""
    out = tmp_path_factory.mktemp("bridge-runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "bridge_runs.py"), str(out), *CASES],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {case: [[json.loads(line) for line in (out / f"{case}.rank{rank}.jsonl").read_text().splitlines()]
                   for rank in range(2)] for case in CASES}


def test_the_extension_trains_exactly_bridges_own_per_token_run(runs):
    """The recipe has per-token loss off; ga_bridge.install() turns it on: loss, grad norm, LR and consumed samples
    equal Bridge's own per-token run at every iteration on both ranks, and differ from Bridge's mean of means."""
    reference = runs["bridge"]
    assert [row["iteration"] for row in reference[0]] == [1, 2, 3, 4, 5, 6]
    for rank in range(2):
        assert runs["extension"][rank] == reference[rank]
    microbatch = runs["bridge-microbatch"][0]
    assert all(row["loss"] != ref["loss"] for row, ref in zip(microbatch[1:], reference[0][1:]))


def test_a_step_schedule_trains_the_planned_samples_with_the_lr_ending_on_the_last_step(runs):
    """train.train_samples 56 under train.step_batch_size_schedule "0:8 1536:16" (tokens; 24 samples at seq 64),
    linear decay in samples from 1e-3 to 1e-4: Bridge alone drops the schedule and trains 7 steps of 8; through
    the extension, 3 steps of 8 then 2 of 16, 56 samples in all, each step's LR that of its consumed samples, and
    min_lr on the last. The steps before the switch equal Bridge's own."""
    bare = runs["schedule-bridge"][0]
    assert [row["consumed_samples"] for row in bare] == [8, 16, 24, 32, 40, 48, 56]
    for rank in runs["schedule-extension"]:
        assert [row["consumed_samples"] for row in rank] == [8, 16, 24, 40, 56]
        assert {row["train_iters"] for row in rank} == {5}
        for row in rank:
            assert row["lr"] == pytest.approx(1e-3 - 9e-4 * row["consumed_samples"] / 56, rel=1e-12)
        assert rank[-1]["lr"] == pytest.approx(1e-4, rel=1e-12)
        same = ("consumed_samples", "loss", "lr", "grad_norm")
        assert [[row[k] for k in same] for row in rank[:3]] == [[row[k] for k in same] for row in bare[:3]]
        assert rank[3]["grad_norm"] != bare[3]["grad_norm"]


def test_a_resume_at_the_stage_switch_trains_on_as_the_uninterrupted_run(runs):
    """The schedule's run saved at iteration 3 (torch_dist; Bridge writes its config, holding the extension's
    finalize, as YAML beside it) and stopped, then resumed: iterations 4 and 5 (GBS 16 from consumed sample 24)
    equal the uninterrupted run's in consumed samples, loss, LR and grad norm."""
    whole = runs["schedule-extension"]
    for rank in range(2):
        assert runs["resume-save"][rank] == whole[rank][:3]
        assert runs["resume-load"][rank] == whole[rank][3:]


def test_a_dropped_finalize_is_stopped_at_the_first_step(runs):
    """Bridge #4974's shape (the model config holds no finalize_model_grads_func): Bridge alone trains all six
    steps on unreduced, undivided gradients (grad norms 100x the reference's, the replicas apart); with the
    extension each rank stops at step 1, before any optimizer step, naming the hook."""
    bare = runs["dropped-finalize-bridge"]
    assert len(bare[0]) == 6 and all(row["grad_norm"] > 100 * ref["grad_norm"]
                                     for row, ref in zip(bare[0], runs["bridge"][0]))
    assert bare[0][-1]["grad_norm"] != bare[1][-1]["grad_norm"]
    for rank in runs["dropped-finalize-extension"]:
        assert len(rank) == 1 and rank[0]["type"] == "GuardError"
        assert "never called megatron-ga-ext's finalize_model_grads" in rank[0]["error"]


@pytest.fixture(scope="module")
def ga_bridge():
    from megatron_ga_ext.testing.shims import bridge_import_shim

    with bridge_import_shim():
        from megatron_ga_ext.integration import bridge
    return bridge


@pytest.fixture
def cfg(ga_bridge):
    from megatron_ga_ext.integration.install import uninstall
    from tests.support.bridge_runs import tiny_config

    yield tiny_config()
    uninstall()


def test_the_ga_section_takes_bridges_overrides_and_yaml(ga_bridge, cfg, tmp_path):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    container = ga_bridge.with_ga(cfg, guards=False)
    process_config_with_overrides(container, cli_overrides=["ga.zero_token_policy=skip", "train.train_iters=9"])
    config = ga_bridge.ga_config(container)
    assert (config.zero_token_policy, config.guards, config.seq_length, container.train.train_iters) == (
        "skip", False, 64, 9)
    path = tmp_path / "run.yaml"
    container.to_yaml(str(path))
    again = ga_bridge.GAContainer.from_yaml(str(path))
    assert (again.ga.zero_token_policy, again.ga.guards) == ("skip", False)
    assert ga_bridge.ga_config(cfg) == ga_bridge.ga_config(ga_bridge.with_ga(cfg))  # no section: the defaults


def test_install_turns_on_per_token_loss_and_installs(ga_bridge, cfg):
    cfg.model.calculate_per_token_loss = False
    state = ga_bridge.install(ga_bridge.with_ga(cfg))
    assert cfg.model.calculate_per_token_loss is True and state.config.loss_reduction == "token"
    cfg.model.calculate_per_token_loss = False
    ga_bridge.install(ga_bridge.with_ga(cfg, loss_reduction="microbatch"))
    assert cfg.model.calculate_per_token_loss is False


@pytest.mark.parametrize(("change", "settings", "error", "message"), [
    ({}, {"noise_scale": 1}, "OptionError",
     r"^ga\.noise_scale 1 is not supported on Megatron-Bridge yet: its log line"),
    ({}, {"lr_scaling": "sqrt"}, "OptionError", r"^ga\.lr_scaling 'sqrt' is not supported on "
     r"Megatron-Bridge yet"),
    ({}, {"batch_size_warmup": "auto", "noise_scale": 1}, "OptionError",
     r"^ga\.batch_size_warmup auto needs ga\.batch_size_warmup_max"),  # the flags' own rules first
    ({}, {"zero_token_policy": "never"}, "OptionError", r"ga\.zero_token_policy"),
    ({("train", "rampup_batch_size"): [2, 2, 64]}, {}, "OptionError",
     r"^train\.rampup_batch_size \[2, 2, 64\]: megatron-core 0\.18 and later drop it"),
    ({("model", "overlap_moe_expert_parallel_comm"): True}, {}, "CoverageError",
     r"megatron-ga-ext refuses model\.overlap_moe_expert_parallel_comm in token mode"),
])
def test_refusals_name_bridges_fields(ga_bridge, cfg, change, settings, error, message):
    from megatron_ga_ext.integration.install import installed

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
    with pytest.raises(ScheduleError, match=r"needs a GAContainer \(ga_bridge\.with_ga\(cfg\)\): Bridge passes no "
                                            "schedule to the calculator"):
        ga_bridge.install(cfg)
    container = ga_bridge.with_ga(cfg)
    ga_bridge.install(container)
    container.data_parallel_size = 2  # what Bridge's validation sets, and GAContainer.validate() reads after it
    with pytest.raises(ScheduleError, match=r"^train\.train_samples 50: .* the last of its 5 steps ends at 56 "
                                            r"samples, .* Set train\.train_samples to 56"):
        _plan_only(ga_bridge, container)


def _plan_only(ga_bridge, container):
    """GAContainer.validate() after Bridge's own (which needs torch.distributed for the world size)."""
    base = ga_bridge.ConfigContainer.validate
    try:
        ga_bridge.ConfigContainer.validate = lambda self: None
        container.validate()
    finally:
        ga_bridge.ConfigContainer.validate = base


def test_an_unknown_ga_setting_is_named(ga_bridge, cfg):
    from megatron_ga_ext.errors import OptionError

    with pytest.raises(OptionError, match=r"^ga\.noise: not a megatron-ga-ext setting; the ga section holds .*"
                                          r"noise_scale"):
        ga_bridge.with_ga(cfg, noise=1)


def test_moe_or_mtp_in_token_mode_is_said_to_count_padding_on_bridge(ga_bridge, cfg, caplog):
    """Bridge's gpt_step passes no loss_mask to the model (Bridge #6103): the limit is logged at install."""
    cfg.model.mtp_num_layers = 1
    with caplog.at_level("WARNING", logger="megatron_ga_ext.integration.bridge"):
        ga_bridge.install(ga_bridge.with_ga(cfg))
    assert ("megatron-ga-ext coverage, limited on Megatron-Bridge: model.mtp_num_layers: Bridge's "
            "gpt_step.forward_step does not pass loss_mask to the model (Bridge #6103)") in caplog.text
