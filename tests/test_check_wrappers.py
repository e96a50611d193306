"""Container and wrapper launches read as the container runs them: srun with pyxis's
--container-image and ``bash -c "..."``, ``docker run ... bash -c``, enroot, ``python -m
torch.distributed.run``; what check cannot read is a refusal (exit 2), never a ledger of
defaults."""

import shlex

import pytest

from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.line import parse_launch

TRAIN = (
    "python -m megatron_ga_ext pretrain_gpt.py --tensor-model-parallel-size 2 "
    "--pipeline-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 16 "
    "--seq-length 2048 --num-layers 8 --calculate-per-token-loss"
)


def report(line: str):
    return check_launch(parse_launch([line]))


@pytest.mark.parametrize(
    "line",
    [
        f'srun --nodes 2 --ntasks-per-node 8 --container-image img.sqsh bash -c "{TRAIN}"',
        "srun -N 2 --ntasks-per-node=8 --container-image=img.sqsh --container-mounts "
        f"/data:/data sh -c '{TRAIN}'",
        'srun --nodes 2 --ntasks-per-node 8 enroot start --mount /d:/d img bash -lc "cd '
        f'/workspace && {TRAIN}"',
    ],
)
def test_srun_in_a_container_reads_the_command_the_shell_runs(line):
    got = report(line)
    assert got.problems == (), [p.message for p in got.problems]
    ledger = got.ledger
    assert (
        ledger["world_size"],
        ledger["tensor_model_parallel_size"],
        ledger["pipeline_model_parallel_size"],
    ) == (
        16,
        2,
        4,
    )
    assert ledger["data_parallel_size"] == 2 and ledger["num_microbatches"] == 8
    assert not any("not on this line" in n.text for n in got.notes)
    assert any("-c runs" in n.text for n in got.notes)


def test_docker_run_bash_c_and_torch_distributed_run():
    inner = TRAIN.replace(
        "python -m megatron_ga_ext",
        "python -m torch.distributed.run --nproc-per-node 8 -m megatron_ga_ext",
    )
    got = report(
        f"docker run --gpus all --ipc=host -v /d:/d nvcr.io/nvidia/pytorch:25.01 bash -c '{inner}'"
    )
    assert (
        got.problems == ()
        and got.ledger["world_size"] == 8
        and got.ledger["data_parallel_size"] == 1
    )


def test_a_command_in_a_variable_is_refused_plainly():
    with pytest.raises(UsageError, match=r"bash -c \$CMD: the command is in a shell variable"):
        parse_launch(shlex.split("srun --nodes 2 --container-image img.sqsh bash -c '$CMD'"))


def test_variables_assigned_earlier_in_a_pasted_script_reach_the_wrapped_command():
    script = (
        "#!/bin/bash\nTP=2\nPP=4\n"
        f'CMD="{TRAIN.replace("size 2 ", "size $TP ").replace("size 4 ", "size $PP ")}"\n'
        'srun --nodes 2 --ntasks-per-node 8 --container-image img.sqsh bash -c "$CMD"\n'
    )
    got = report(script)
    assert got.problems == () and "pasted script" in got.kind
    assert (
        got.ledger["tensor_model_parallel_size"],
        got.ledger["pipeline_model_parallel_size"],
    ) == (2, 4)


def test_a_script_the_wrapper_runs_is_refused_plainly_not_read_as_defaults():
    with pytest.raises(
        UsageError, match=r"the launch runs train\.sh, whose flags check cannot see"
    ):
        parse_launch(
            shlex.split(
                "srun --nodes 2 --ntasks-per-node 8 --container-image img.sqsh bash train.sh"
            )
        )
