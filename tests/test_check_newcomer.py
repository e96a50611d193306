"""The newcomer's set (issue 38): launch lines as a new user writes them, each with its whole answer
from ``megatron-ga check --json``: the verdict, the ledger, the stage table where there is a
schedule, every problem and the notes that matter. Every answer is validated against
docs/check.schema.json and held to 0.5 s."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.json_schema import errors

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "check.schema.json").read_text())

GPT = "torchrun --nproc_per_node 8 pretrain_gpt.py --micro-batch-size 1 --seq-length 2048"
EXT = GPT.replace("pretrain_gpt.py", "-m megatron_ga_ext pretrain_gpt.py")
#: What Megatron's validate_args needs of every --use-torch-fsdp2 line (arguments.py:1006, 1010 at
#: core_v0.19.0).
FSDP2_OK = "--no-gradient-accumulation-fusion --untie-embeddings-and-output-weights"

#: A pasted script in the style of Megatron-LM's example scripts: variables, arithmetic, arrays
#: expanded without quotes, a comment with parentheses inside an array.
SCRIPT = """#!/bin/bash
GPUS_PER_NODE=8
NUM_NODES=16
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
CHECKPOINT_PATH=$1 # <path>
DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
)
MODEL_ARGS=(
    --num-layers 96
    --seq-length 2048
    --attention-backend auto # flash, fused (or local)
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --rampup-batch-size 16 16 5859375
    --train-iters 500000
    --lr-warmup-fraction .001
    --lr-decay-iters 430000
)
PARALLEL_ARGS=(
\t--tensor-model-parallel-size 8
\t--pipeline-model-parallel-size 16
)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \\
    ${MODEL_ARGS[@]} \\
    ${TRAINING_ARGS[@]} \\
    ${PARALLEL_ARGS[@]} \\
    --save $CHECKPOINT_PATH
"""


@dataclass
class Case:
    """One line and what check must answer."""

    id: str
    argv: list[str]
    status: int
    ledger: dict = field(default_factory=dict)
    """Ledger values that must hold (None: not known, never made up)."""
    rules: list[str] = field(default_factory=list)
    """The rule of every problem, in order."""
    said: list[str] = field(default_factory=list)
    """Text every problem or note, taken together, must contain."""
    not_said: list[str] = field(default_factory=list)
    steps: list[int | None] | None = None
    """The stage table's steps per stage (None: no stage table)."""


def line(text: str, *before: str) -> list[str]:
    return [*before, "--", *shlex.split(text)]


CASES = [
    # 1. the schedule: stages never reached, the ledger of the stage the run trains
    Case(
        "schedule-never-reached",
        line(
            f"{GPT} --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
            "--step-batch-size-schedule '0:16 2.4B:320 4.8B:624 12B:1536' --train-samples 1000000",
            "--world-size",
            "128",
        ),
        1,
        ledger={"world_size": 128, "global_batch_size": 16, "num_microbatches": 16},
        rules=["stage-never-reached"] * 3,
        said=[
            "entry 2 '2.4B:320' (GBS 320) is never reached",
            "Give --train-samples 1,171,889 or more",
        ],
        steps=[62500, 0, 0, 0],
    ),
    Case(
        "schedule-reached",
        line(
            f"{GPT} --pipeline-model-parallel-size 2 --step-batch-size-schedule '0:16 1M:32' "
            "--train-samples 1000"
        ),
        0,
        ledger={"global_batch_size": 32, "num_microbatches": 8},
        steps=[31, 16],
    ),
    Case(
        "warmup-cap",
        line(
            f"{EXT} --global-batch-size 16 --ga-batch-size-warmup auto --ga-noise-scale 10 "
            "--ga-batch-size-warmup-max 256 --train-samples 100000"
        ),
        0,
        ledger={"global_batch_size": 16},
    ),
    Case(
        "rampup-and-schedule",
        line(f"{GPT} --rampup-batch-size 16 16 1000 --step-batch-size-schedule '0:16 1M:32'"),
        1,
        ledger={"global_batch_size": None, "num_microbatches": None},
        rules=["schedule"],
        said=["--rampup-batch-size 16 16 1000 and --step-batch-size-schedule are both given"],
    ),
    # 2. upstream's traps without the extension
    Case(
        "fsdp2-per-token-stock",
        line(
            f"{GPT} --global-batch-size 16 --calculate-per-token-loss --use-torch-fsdp2 {FSDP2_OK}"
        ),
        1,
        rules=["upstream:torch-fsdp2-token"],
        said=["N / (DP x CP) times the per-token mean"],
        not_said=["every non-padding token of the global batch weighs the same"],
    ),
    Case(
        "fsdp2-per-token-extension",
        line(f"{EXT} --global-batch-size 16 --use-torch-fsdp2 {FSDP2_OK}"),
        0,
        not_said=["torch-fsdp2-token"],
    ),
    Case(
        "moe-router-stock",
        line(
            f"{GPT} --global-batch-size 16 --calculate-per-token-loss --num-experts 4 "
            "--moe-z-loss-coeff 1e-3 "
            # MoE biases need ETP 1 (TransformerConfig)
            "--tensor-model-parallel-size 2 --disable-bias-linear"
        ),
        0,
        said=[
            "careful: MoE with --calculate-per-token-loss",
            "(positions / loss tokens)",
            "1 / (TP x CP) of the target",
        ],
    ),
    Case(
        "mtp-stock",
        line(
            f"{GPT} --global-batch-size 16 --calculate-per-token-loss --mtp-num-layers 1 "
            "--position-embedding-type rope"
        ),
        0,
        said=["careful: MTP with --calculate-per-token-loss"],
    ),
    # 3. every problem in one pass, fixes checked against the other rules
    Case(
        "rampup-train-iters",
        line(f"{EXT} --global-batch-size 64 --rampup-batch-size 16 16 1000 --train-iters 100"),
        1,
        rules=["rampup-ignored"],
        said=[
            "Pass --ga-convert-rampup",
            "Then also: Replace --train-iters 100 by --train-samples",
        ],
    ),
    Case(
        "four-bad-entries",
        line(f"{GPT} --step-batch-size-schedule '0:16.5 1G:32 2M:x 3M:nan' --train-samples 1000"),
        1,
        rules=["schedule-entry"] * 4,
        said=["entry 1 '0:16.5'", "entry 2 '1G:32'", "entry 3 '2M:x'", "entry 4 '3M:nan'"],
    ),
    # 4. the ledger always
    Case(
        "ledger-beside-a-problem",
        line(f"{GPT} --global-batch-size 10 --tensor-model-parallel-size 2"),
        1,
        ledger={"global_batch_size": 10, "data_parallel_size": 4, "num_microbatches": None},
        rules=["global-batch-size"],
        said=["Nearest valid --global-batch-size: 8, 12"],
    ),
    # 5. sources: a --world-size the line contradicts; did you mean; no note on a value the line
    #    does not set
    Case(
        "world-size-contradicts",
        line(
            "torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 1 "
            "--global-batch-size 8",
            "--world-size",
            "16",
        ),
        1,
        ledger={"world_size": 8},
        rules=["world-size-contradiction"],
    ),
    Case(
        "loss-mode-typo",
        line(f"{EXT} --global-batch-size 16 --ga-loss-reduction tokens"),
        1,
        rules=["flag:loss_reduction"],
        said=["did you mean --ga-loss-reduction token?"],
        not_said=[
            "microbatch, chosen explicitly",
            "upstream's mean of means (--ga-loss-reduction microbatch)",
        ],
    ),
    # 6. words generated from what is tested
    Case(
        "tensor-parallel-note",
        line(f"{EXT} --global-batch-size 16 --tensor-model-parallel-size 2"),
        0,
        said=["megatron-ga verify runs TP 2"],
        not_said=["no verify row runs TP > 1"],
    ),
    Case(
        "rampup-wording",
        line(f"{GPT} --global-batch-size 64 --rampup-batch-size 16 16 1000"),
        1,
        rules=["rampup-ignored"],
        said=["ignores the rampup on the training path and logs nothing"],
        not_said=["logs a deprecation warning"],
    ),
    # 7. how jobs launch
    Case(
        "srun",
        line(
            "srun --nodes 32 --ntasks-per-node 8 python pretrain_gpt.py --micro-batch-size 1 "
            "--global-batch-size 256 --tensor-model-parallel-size 8"
        ),
        0,
        ledger={"world_size": 256, "data_parallel_size": 32},
        said=["srun starts each rank itself"],
    ),
    Case(
        "srun-torchrun-without-nnodes",
        line(
            "srun -N 4 --ntasks-per-node 1 torchrun --nproc-per-node 8 pretrain_gpt.py "
            "--micro-batch-size 1"
        ),
        1,
        ledger={"world_size": 8},
        rules=["slurm-torchrun-nodes"],
    ),
    Case(
        "pasted-script",
        ["--", SCRIPT],
        1,
        ledger={"world_size": 128, "global_batch_size": 1536, "data_parallel_size": 1},
        rules=["rampup-ignored"],
        said=["--train-samples 743443552", "--lr-decay-samples 635923552"],
    ),
    Case(
        "pasted-script-split-schedule",
        [
            "--",
            'ARGS=( --micro-batch-size 1 --step-batch-size-schedule "0:16 1M:32" )\n'
            "torchrun --nproc_per_node 8 pretrain_gpt.py ${ARGS[@]} --seq-length 2048 "
            "--train-samples 1000",
        ],
        1,
        rules=["split-schedule"],
        said=["Quote the whole schedule"],
    ),
    Case(
        "run-recipe-without-bridge",
        line(
            "torchrun --nproc-per-node 8 scripts/training/run_recipe.py --recipe "
            "llama32_1b_pretrain_config train.micro_batch_size=2 "
            "train.global_batch_size=64"
        ),
        0,
        ledger={"micro_batch_size": 2, "global_batch_size": 64},
        said=["a Megatron-Bridge launch"],
    ),
]


def answer(cli, argv: list[str]) -> tuple[int, dict, float]:
    start = time.perf_counter()
    result = cli("check", "--json", *argv)
    return result.status, json.loads(result.out), time.perf_counter() - start


def _text(item) -> str:
    return item if isinstance(item, str) else item.get("message") or str(item)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_newcomers_set(case, cli):
    status, report, seconds = answer(cli, case.argv)
    problems = report["problems"]
    assert status == case.status, problems
    assert errors(report, SCHEMA) == []
    assert seconds < 0.5, f"{case.id}: {seconds:.2f} s"
    assert report["ledger"] is not None, "the ledger is printed beside every problem"
    for key, value in case.ledger.items():
        assert report["ledger"][key] == value, (key, report["ledger"][key])
    assert [p["rule"] for p in problems] == case.rules, [
        (p["rule"], p["message"][:100]) for p in problems
    ]
    said = " ".join(
        [
            *(p["message"] for p in problems),
            *(f"{n['severity']}: {n['text']}" for n in report["notes"]),
        ]
    )
    for text in case.said:
        assert text in said, text
    for text in case.not_said:
        assert text not in said, text
    if case.steps is not None:
        assert [row["steps"] for row in report["stages"]["stages"]] == case.steps
    if case.id == "warmup-cap":
        assert report["stages"]["warmup_batch_sizes"] == [16, 32, 64, 128, 256]
    for problem in problems:
        assert problem["message"] and problem["rule"]
    for note in report["notes"]:  # read in one breath
        assert len(note["text"].split()) <= 28 and "\n" not in note["text"], note["text"]


def test_the_yaml_cfg_is_read_like_its_flags(cli, tmp_path):
    """--yaml-cfg used to give '--micro-batch-size is missing'."""
    path = tmp_path / "gpt.yaml"
    path.write_text(
        "model_parallel:\n  tensor_model_parallel_size: 2\n  "
        "virtual_pipeline_model_parallel_size: null\nmicro_batch_size: "
        "2\nglobal_batch_size: 128\nseq_length: 4096\ntrain_samples: 100000\n"
    )
    status, report, _ = answer(
        cli, line(f"torchrun --nproc-per-node 8 pretrain_gpt.py --yaml-cfg {path}")
    )
    assert status == 0 and errors(report, SCHEMA) == []
    assert [
        report["ledger"][k]
        for k in (
            "tensor_model_parallel_size",
            "micro_batch_size",
            "global_batch_size",
            "data_parallel_size",
        )
    ] == [2, 2, 128, 4]
    assert (
        report["sources"]["tensor_model_parallel_size"]
        == f"{path}: model_parallel.tensor_model_parallel_size"
    )
    status, report, _ = answer(
        cli,
        line(f"torchrun --nproc-per-node 8 pretrain_gpt.py --yaml-cfg {path} --micro-batch-size 4"),
    )
    assert status == 1 and [p["rule"] for p in report["problems"]] == ["yaml-cfg-ignores-line"]
    assert report["ledger"]["micro_batch_size"] == 2


def test_slurm_variables_of_the_allocation_give_the_world(cli, monkeypatch):
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")
    status, report, _ = answer(cli, line("srun python pretrain_gpt.py --micro-batch-size 1"))
    assert status == 0 and report["ledger"]["world_size"] == 16
    assert report["sources"]["world_size"] == (
        "SLURM_NNODES=2 from the environment x SLURM_NTASKS_PER_NODE=8(x2) from the environment"
    )
    monkeypatch.setenv("NODES", "4")
    status, report, _ = answer(
        cli,
        [
            "--",
            "torchrun --nproc_per_node 8 --nnodes $NODES pretrain_gpt.py --micro-batch-size 1\n",
        ],
    )
    assert report["ledger"]["world_size"] == 32
    assert any(
        n["text"] == "$NODES is 4, from the environment check runs in." for n in report["notes"]
    )


def test_the_checked_fix_leaves_a_clean_line():
    """Taking the rampup's advice gave the next error (--train-iters with a schedule); the advice
    now carries what that run needs, and the edited line has no problem."""
    from megatron_ga_ext.launch.check import check_launch
    from megatron_ga_ext.launch.line import parse_launch

    launch = parse_launch(
        shlex.split(
            f"{EXT} --global-batch-size 64 --rampup-batch-size 16 16 1000 --train-iters 100 "
            "--lr-decay-iters 80"
        )
    )
    (problem,) = check_launch(launch).problems
    assert problem.edit is not None
    assert check_launch(launch.edited(problem.edit)).problems == ()


def test_the_error_form_is_in_the_schema(cli):
    result = cli("check", "--json", "--", "python", "pretrain_gpt.py", "--micro-batch-size", "1")
    assert result.status == 2 and errors(json.loads(result.out), SCHEMA) == []


def test_every_rule_check_reports_is_documented(cli):
    guide = (ROOT / "docs" / "guide.md").read_text()
    table = guide[guide.index("| rule | the problem |") :]
    documented = {
        name.strip("`")
        for name in (
            cell
            for line in table.splitlines()[2:]
            if line.startswith("| `")
            for cell in line.split("|")[1].split(",")
        )
    }
    documented = {name.strip().strip("`") for name in documented}
    for case in CASES:
        _, report, _ = answer(cli, case.argv)
        for problem in report["problems"]:
            rule = problem["rule"]
            prefix = rule.split(":")[0] + ":<" if ":" in rule else rule
            assert rule in documented or any(d.startswith(prefix) for d in documented), rule


def test_the_readme_shows_what_check_prints(cli):
    """The README's example is check's own output for the command it shows (regenerate it from a
    run)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- check-example -->\n```\n")[1].split("```\n<!-- /check-example -->")[
        0
    ]
    lines = block.splitlines(keepends=True)
    command_lines = []
    while lines and (not command_lines or command_lines[-1].rstrip().endswith("\\")):
        command_lines.append(lines.pop(0))
    command = "".join(command_lines).replace("\\\n", " ")
    argv = shlex.split(command)
    assert argv[:2] == ["$", "megatron-ga"]
    result = cli(*argv[2:])
    assert result.status == 1 and "".join(lines) == result.out
