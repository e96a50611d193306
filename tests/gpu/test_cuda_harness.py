"""The GPU tier's harness, checked on the CPU (no GPU needed): what ``launch(..., device="cuda")``
runs, and the shims a rank runs under there. The launches themselves are test_cuda_graphs.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.pretrain_runs import SERVER, launch_command

ROOT = Path("/megatron-lm")  # never run: the command is only built
FLAGS = ["--global-batch-size", "16"]


def _backend(command: list[str]) -> str:
    return command[command.index("--distributed-backend") + 1]


def test_a_cuda_launch_is_one_rank_over_nccl_in_its_own_interpreter(tmp_path):
    command, env = launch_command(
        ROOT, "dp1", FLAGS, extension=True, name="run", workdir=tmp_path, device="cuda"
    )
    # the launcher runs the rank itself (no --nproc-per-node, so no fork), the drop-in entry, then
    # the flags
    assert command[1:5] == [
        SERVER,
        "-m",
        "megatron_ga_ext",
        str(ROOT / "pretrain_gpt.py"),
    ]
    assert _backend(command) == "nccl" and "gloo" not in command and command[-2:] == FLAGS
    assert env["MEGATRON_GA_DEVICE"] == "cuda" and env["MEGATRON_GA_RECORD"] == str(
        tmp_path / "run"
    )
    assert [env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")] == [
        "0",
        "0",
        "1",
        "127.0.0.1",
    ]
    assert int(env["MASTER_PORT"]) > 0


def test_a_cpu_launch_is_forked_ranks_over_gloo(tmp_path):
    command, env = launch_command(ROOT, "dp2", FLAGS, extension=False, name="run", workdir=tmp_path)
    assert command[2:5] == ["--nproc-per-node", "2", str(ROOT / "pretrain_gpt.py")]
    assert _backend(command) == "gloo" and env["MEGATRON_GA_DEVICE"] == "cpu"


def test_a_cuda_launch_takes_one_rank(tmp_path):
    with pytest.raises(ValueError, match="layout 'dp2' has 2 ranks; a CUDA launch runs one"):
        launch_command(
            ROOT, "dp2", FLAGS, extension=True, name="run", workdir=tmp_path, device="cuda"
        )
    with pytest.raises(ValueError, match="device 'tpu' is not one of"):
        launch_command(
            ROOT, "dp1", FLAGS, extension=True, name="run", workdir=tmp_path, device="tpu"
        )


def test_a_cuda_rank_leaves_torch_cuda_alone_and_skips_compiling_the_dataset_helpers():
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.datasets import utils as dataset_utils

    from tests.support.pretrain_server import rank_shims

    is_available, zeros, compile_helpers = (
        torch.cuda.is_available,
        torch.zeros,
        dataset_utils.compile_helpers,
    )
    with rank_shims("cuda"):
        assert (
            torch.cuda.is_available is is_available and torch.zeros is zeros
        )  # none of the CPU shims
        assert dataset_utils.compile_helpers is not compile_helpers
        dataset_utils.compile_helpers()  # rank 0 would run make here
    assert dataset_utils.compile_helpers is compile_helpers
    with pytest.raises(ValueError, match="MEGATRON_GA_DEVICE='tpu' is not one of 'cpu', 'cuda'"):
        rank_shims("tpu")
