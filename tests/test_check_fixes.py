"""Every fix check prints is one Megatron accepts: refused lines drawn from the shapes people write,
each printed edit applied (all of them, in order), and the edited line is accepted by check; every
value of a printed list of valid values gives an accepted line."""

import re
import shlex

import pytest

from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.line import parse_launch
from megatron_ga_ext.launch.report import Edit

GPT = "torchrun --nproc_per_node 8 pretrain_gpt.py --seq-length 2048"
README = (
    "torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 8 "
    "--pipeline-model-parallel-size 16 --micro-batch-size 1 --seq-length 2048 "
    "--train-samples 1000000 --step-batch-size-schedule '0:16 2.4B:320 4.8B:624 "
    "12B:1536' --calculate-per-token-loss --use-torch-fsdp2"
)

REFUSED = [
    (README, 128),
    (f"{GPT} --micro-batch-size 4 --global-batch-size 100", None),
    (f"{GPT} --micro-batch-size 1 --global-batch-size 16 --use-torch-fsdp2 "
        "--pipeline-model-parallel-size 2", None),
    (f"{GPT.replace('2048', '1000')} --micro-batch-size 2 --global-batch-size 64 "
        "--context-parallel-size 8", None),
    (f"{GPT} --micro-batch-size 1 --global-batch-size 20 --eval-global-batch-size 20 "
        "--eval-micro-batch-size 2",
     None),
    (f"{GPT} --micro-batch-size 1 --global-batch-size 16 --overlap-param-gather "
        "--use-megatron-fsdp", None),
    (f"{GPT} --micro-batch-size 1 --train-iters 10 --lr-decay-samples 5 --lr-warmup-fraction 0.1 "
     "--lr-warmup-iters 2", None),
    (f"{GPT} --batch-size 4 --global-batch-size 64", None),
    (f"{GPT} --micro-batch-size 4 --global-batch-size 100 --decrease-batch-size-if-needed", None),
    (f"{GPT} --micro-batch-size 1 --hybrid-context-parallel --context-parallel-size 2", None),
    (f"{GPT} --micro-batch-size 1 --step-batch-size-schedule '0:16 1M:64' --global-batch-size 16 "
     "--train-samples 100", None),
]  # fmt: skip


def _edited(line: str, world_size: int | None):
    launch = parse_launch(shlex.split(line))
    report = check_launch(launch, world_size)
    assert report.problems, line
    edit = Edit()
    for problem in report.problems:
        assert problem.edit is not None, problem.message
        edit += problem.edit
    return launch.edited(edit), report


@pytest.mark.parametrize("line, world_size", REFUSED)
def test_every_printed_edit_applied_gives_a_line_check_accepts(line, world_size):
    fixed, before = _edited(line, world_size)
    after = check_launch(fixed, world_size)
    assert after.problems == (), (
        [p.message for p in before.problems],
        [p.message for p in after.problems],
    )


#: (a refused line, the flag of the printed list of valid values, its world size)
LISTS = [
    (f"{GPT} --micro-batch-size 1 --expert-model-parallel-size 4 --num-experts 6", "--expert-model-parallel-size"),
    (f"{GPT} --micro-batch-size 1 --num-attention-heads 12 --tensor-model-parallel-size 8 "
        "--global-batch-size 8",
     "--tensor-model-parallel-size"),
    (f"{GPT} --micro-batch-size 1 --num-attention-heads 16 --group-query-attention "
        "--num-query-groups 6 --tensor-model-parallel-size 4", "--tensor-model-parallel-size"),
]  # fmt: skip


@pytest.mark.parametrize("line, flag", LISTS)
def test_every_value_of_a_printed_list_is_accepted(line, flag):
    launch = parse_launch(shlex.split(line))
    (problem,) = check_launch(launch).problems
    listed = re.search(rf"Valid {flag}: ([\d, ]+)", problem.message)
    assert listed, problem.message
    for value in listed.group(1).split(", "):
        edited = launch.edited(Edit(give=((flag, (value,)),)))
        assert check_launch(edited).problems == (), (value, check_launch(edited).problems)


@pytest.mark.parametrize("seed", range(3))
def test_drawn_refused_lines_are_accepted_once_their_printed_edits_are_applied(seed):
    """Lines drawn at random from the shapes the registry refuses: each one's printed edits give an
    accepted line."""
    import random

    draw = random.Random(seed)
    flags = [
        "--use-torch-fsdp2 --pipeline-model-parallel-size 2 --num-layers 8",
        "--use-torch-fsdp2 --fp16",
        "--overlap-param-gather",
        "--context-parallel-size 2 --seq-length 1001",
        "--hybrid-context-parallel --context-parallel-size 2",
        "--max-position-embeddings 1024",
        "--num-experts 8 --expert-model-parallel-size 2 --tensor-model-parallel-size 2",
        "--ckpt-format torch_dcp",
        "--train-iters 10 --lr-warmup-samples 5",
        "--tp-comm-overlap --tensor-model-parallel-size 2",
    ]
    for _ in range(8):
        picked = draw.sample(flags, 2)
        mbs, gbs = draw.choice([1, 2]), draw.choice([16, 24, 48, 100])
        line = (
            f"torchrun --nproc_per_node 8 pretrain_gpt.py --micro-batch-size {mbs} "
            f"--global-batch-size {gbs} "
        )
        line += " ".join(picked)
        if "--seq-length" not in line:
            line += " --seq-length 2048"
        launch = parse_launch(shlex.split(line))
        report = check_launch(launch)
        edits = [p.edit for p in report.problems if p.edit is not None]
        if not report.problems or len(edits) < len(report.problems):
            continue  # a problem with words only (no edit) is not drawn here
        edit = Edit()
        for more in edits:
            edit += more
        after = check_launch(launch.edited(edit))
        assert after.problems == (), (line, edit.words(), [p.message for p in after.problems])


def test_the_virtual_stages_advised_for_an_uneven_split_are_accepted():
    line = (
        f"{GPT} --micro-batch-size 1 --global-batch-size 16 --num-layers 16 "
        "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2 "
        "--decoder-last-pipeline-num-layers 2 "
    )
    (problem,) = check_launch(
        parse_launch(shlex.split(line + "--num-layers-per-virtual-pipeline-stage 2"))
    ).problems
    listed = re.search(r"valid N: ([\d, ]+)", problem.message)
    assert listed and listed.group(1) == "1, 2", problem.message
    for n in listed.group(1).split(", "):
        fixed = check_launch(
            parse_launch(shlex.split(line + f"--num-virtual-stages-per-pipeline-rank {n}"))
        )
        assert fixed.problems == (), (n, [p.message for p in fixed.problems])


def test_a_plain_line_with_a_rampup_is_told_megatrons_own_schedule_not_a_ga_flag():
    line = (
        f"{GPT} --micro-batch-size 1 --global-batch-size 64 --rampup-batch-size 16 16 1000 "
        "--train-iters 1000"
    )
    launch = parse_launch(shlex.split(line))
    (problem,) = check_launch(launch).problems
    assert problem.edit is not None and "--ga-" not in problem.edit.words()
    assert check_launch(launch.edited(problem.edit)).problems == ()
