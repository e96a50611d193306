"""``megatron-ga check --bridge``: a Megatron-Bridge launch (run_recipe.py with Hydra overrides)
read as the Megatron-LM line it configures, with Bridge's refusals and Bridge's field names
(launch/bridge_line.py)."""

import json
import re

RECIPE = [
    "torchrun",
    "--nnodes",
    "2",
    "--nproc-per-node",
    "8",
    "scripts/training/run_recipe.py",
    "--recipe",
    "llama32_1b_pretrain_config",
]


def test_the_overrides_give_the_ledger_and_the_recipes_values_are_said_to_be_unread(cli):
    out = cli(
        "check",
        "--bridge",
        "--json",
        "--",
        *RECIPE,
        "train.micro_batch_size=2",
        "++train.global_batch_size=512",
        "model.tensor_model_parallel_size=2",
        "+model.seq_length=4096",
        "model.calculate_per_token_loss=false",
        "ga.strict=false",
        "ga.zero_token_policy=skip",
        "logger.log_interval=10",
    )
    assert out.status == 0, out.out
    data = json.loads(out.out)
    ledger = data["ledger"]
    assert [
        ledger[k]
        for k in (
            "world_size",
            "tensor_model_parallel_size",
            "data_parallel_size",
            "micro_batch_size",
            "global_batch_size",
            "num_microbatches",
        )
    ] == [16, 2, 8, 2, 512, 32]
    assert ledger["seq_length"] == 4096
    assert data["problems"] == []
    assert data["kind"] == "a Megatron-Bridge launch"
    assert re.match(
        r"a Megatron-Bridge launch: 7 field\(s\) set by its overrides; the recipe's own values "
        r"are not on the line",
        data["notes"][0]["text"],
    )
    assert "install() turns on model.calculate_per_token_loss" in data["notes"][1]["text"]


def test_refusals_name_bridges_fields(cli):
    out = cli(
        "check",
        "--bridge",
        "--",
        *RECIPE,
        "train.micro_batch_size=2",
        "train.global_batch_size=20",
        "rerun_state_machine.rerun_mode=report_stats",
        "train.rampup_batch_size=[32,32,1000]",
    )
    assert out.status == 1
    problems = out.out.split("problem(s):", 1)[1]
    assert "megatron-ga-ext refuses rerun_state_machine.rerun_mode report_stats:" in problems
    assert (
        "train.global_batch_size 20 is not a multiple of train.micro_batch_size 2 x "
        "data-parallel size 16" in problems
    )
    assert (
        "train.rampup_batch_size [32, 32, 1000]: megatron-core 0.18 and later drop it with a "
        "warning"
        in problems
        and "Set ga.convert_rampup=true to run it as its exact step schedule" in problems
        and "megatron-ga schedule --from-rampup 32 32 1000 --global-batch-size=20 prints that "
        "schedule"
        in problems
    )
    assert (
        "--ga-convert-rampup" not in out.out and "Pass ga.convert_rampup" not in out.out
    )  # Megatron-LM's advice


def test_a_run_recipe_line_is_read_as_bridge_without_the_flag(cli):
    """Issue 38: a run_recipe.py line without --bridge said "--micro-batch-size is missing"."""
    out = cli(
        "check", "--json", "--", *RECIPE, "train.micro_batch_size=2", "train.global_batch_size=512"
    )
    data = json.loads(out.out)
    assert out.status == 0 and data["kind"] == "a Megatron-Bridge launch", out.out
    assert data["ledger"]["micro_batch_size"] == 2 and data["ledger"]["global_batch_size"] == 512
    out = cli(
        "check", "--json", "--", " ".join([*RECIPE, "train.micro_batch_size=2"])
    )  # one pasted line
    assert json.loads(out.out)["ledger"]["micro_batch_size"] == 2


def test_a_converted_rampup_is_checked_as_its_schedule_under_bridges_names(cli):
    """ga.convert_rampup=true: the ramp is not refused; its stages are checked against the layout
    like a step schedule's, named as the train.step_batch_size_schedule install() writes (16 is
    under MBS 2 x DP 16)."""
    ramp = [
        *RECIPE,
        "train.micro_batch_size=2",
        "train.global_batch_size=128",
        "+model.seq_length=1024",
        "train.train_samples=20000",
        "ga.convert_rampup=true",
    ]
    out = cli("check", "--bridge", "--", *ramp, "train.rampup_batch_size=[32,32,1000]")
    assert out.status == 0, out.out
    out = cli("check", "--bridge", "--", *ramp, "train.rampup_batch_size=[16,16,1000]")
    assert out.status == 1
    assert re.search(
        r"train\.step_batch_size_schedule entry 1 '0:16' \(from 0 samples, global batch size "
        r"16\) is smaller than train\.micro_batch_size 2 x data-parallel size 16 = 32",
        out.out,
    ), out.out
    assert "train.rampup_batch_size [16, 16, 1000]" not in out.out


def test_a_yaml_config_file_is_read_under_the_overrides(cli, tmp_path):
    """Bridge's example scripts merge --config-file's YAML, then the command line's overrides (which
    win), over the recipe; run_recipe.py's --seq_length sets the recipe's model.seq_length. A null
    leaves the recipe's value."""
    path = tmp_path / "overrides.yaml"
    path.write_text(
        "train:\n  micro_batch_size: 4\n  global_batch_size: 512\n  rampup_batch_size: "
        "null\nmodel:\n  tensor_model_parallel_size: 2\n  sequence_parallel: true\nga:\n "
        " zero_token_policy: skip\nlogger:\n  log_interval: 10\n"
    )
    out = cli(
        "check",
        "--bridge",
        "--json",
        "--",
        *RECIPE[:-3],
        "examples/recipes/llama/pretrain_llama3_8b.py",
        "--config-file",
        str(path),
        "train.micro_batch_size=2",
        "--seq_length",
        "4096",
    )
    assert out.status == 0, out.out
    data = json.loads(out.out)
    assert [
        data["ledger"][k]
        for k in (
            "tensor_model_parallel_size",
            "micro_batch_size",
            "global_batch_size",
            "seq_length",
        )
    ] == [2, 2, 512, 4096]
    assert data["notes"][0]["text"].startswith(
        f"a Megatron-Bridge launch: 6 field(s) set by its overrides and {path};"
    )


def test_a_yaml_config_file_that_cannot_be_read_is_named(cli, tmp_path):
    missing = tmp_path / "missing.yaml"
    out = cli("check", "--bridge", "--", *RECIPE, f"--config-file={missing}")
    assert (
        out.status == 2
        and f"--config-file {missing}: cannot read it (No such file or directory)" in out.err
    )
    listed = tmp_path / "list.yaml"
    listed.write_text("- train\n")
    out = cli("check", "--bridge", "--", *RECIPE, "--config_file", str(listed))
    assert out.status == 2 and (
        f"--config_file {listed}: the file holds list, not the sections of a config" in out.err
    )
