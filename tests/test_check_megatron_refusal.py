"""megatron-ga check --megatron PATH where upstream's validation cannot run: a clear refusal (rc 2)
naming what is missing, never a traceback (the run itself: tests/oracle/test_check_megatron.py, make
oracle)."""

from __future__ import annotations

import shlex

import pytest

from megatron_ga_ext.cli.main import main
from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.oracle.runner import megatron_argv, run_upstream

LINE = shlex.split(
    "torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py --num-layers 12 --hidden-size 768 "
    "--num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 "
    "--micro-batch-size 1 --global-batch-size 16"
)


def test_a_path_without_megatron_lm_is_refused(tmp_path, capsys):
    assert main(["check", "--megatron", str(tmp_path), "--", *LINE]) == 2
    err = capsys.readouterr().err
    assert f"--megatron {tmp_path}: no megatron/training/arguments.py there" in err
    assert "Traceback" not in err


@pytest.fixture
def tree_without_torch(tmp_path, monkeypatch):
    """A Megatron-LM tree whose import needs torch, and a torch that does not import (as on a login
    node without the training image)."""
    tree = tmp_path / "megatron-lm"
    (tree / "megatron" / "training").mkdir(parents=True)
    (tree / "megatron" / "__init__.py").write_text("import torch\n")
    (tree / "megatron" / "training" / "arguments.py").write_text("")
    absent = tmp_path / "site"
    (absent / "torch").mkdir(parents=True)
    (absent / "torch" / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    monkeypatch.setenv("PYTHONPATH", str(absent))
    return tree


def test_without_torch_check_refuses_naming_torch(tree_without_torch, capsys):
    assert main(["check", "--megatron", str(tree_without_torch), "--", *LINE]) == 2
    err = capsys.readouterr().err
    assert "cannot import Megatron-LM there" in err and "No module named torch" in err
    assert "Traceback" not in err


def test_without_torch_the_runner_raises_a_usage_error(tree_without_torch):
    with pytest.raises(
        UsageError, match=r"cannot import Megatron-LM there .*ImportError: No module named torch"
    ):
        run_upstream(tree_without_torch, [(["--micro-batch-size", "1"], 8)])


@pytest.mark.parametrize(
    ("line", "argv"),
    [
        (
            "torchrun --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 2",
            ["--micro-batch-size", "2"],
        ),
        (
            "python -m megatron_ga_ext pretrain_gpt.py --ga-guards off --micro-batch-size 2",
            ["--micro-batch-size", "2"],
        ),
        (
            "srun -N 2 bash -c 'torchrun --nproc-per-node 8 pretrain_gpt.py --seq-length 8 "
            "--no-ga-guards'",
            ["--seq-length", "8"],
        ),
    ],
)
def test_the_words_megatron_parses(line, argv):
    """After the training script, inside bash -c, without the extension's --ga-* flags."""
    assert megatron_argv(shlex.split(line)) == argv


def test_a_line_without_a_training_script_is_refused():
    with pytest.raises(UsageError, match=r"no training script \(a \.py file\) on the line"):
        megatron_argv(["torchrun", "--nproc-per-node", "8"])


def test_a_bridge_launch_is_refused(tree_without_torch, capsys):
    """Megatron-Bridge takes no Megatron-LM argv: refused before any import."""
    line = [
        "torchrun",
        "--nproc-per-node",
        "8",
        "run_recipe.py",
        "--recipe",
        "llama3_8b",
        "train.global_batch_size=16",
    ]
    assert main(["check", "--megatron", str(tree_without_torch), "--", *line]) == 2
    assert (
        "--megatron runs Megatron-LM's parse_args; a Megatron-Bridge launch is configured otherwise"
        in (capsys.readouterr().err)
    )
