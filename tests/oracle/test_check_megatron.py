"""megatron-ga check --megatron PATH on a snapshot tree (make oracle: it imports torch and the tree,
~10 s): upstream's verdict and message printed beside check's, and in --json."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from megatron_ga_ext.cli.main import main
from tests.support.json_schema import errors
from tools import regress

pytestmark = pytest.mark.oracle

MODEL = shlex.split(
    "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 16 "
    "--train-iters 100 --lr 1e-4"
)
LINE = ["torchrun", "--nnodes", "1", "--nproc-per-node", "8", "pretrain_gpt.py", *MODEL]


@pytest.fixture(scope="module")
def tree():
    tarball = regress.snapshot_dir() / "megatron-lm-core_v0.19.0.tar.gz"
    if not tarball.exists():
        pytest.fail(
            f"no snapshot {tarball}: make oracle needs MEGATRON_LM_SNAPSHOTS (default "
            "../shared/upstream)"
        )
    return regress.tree(tarball)


def test_upstream_refusal_is_printed_beside_checks(tree, capsys):
    rc = main(["check", "--megatron", str(tree), "--", *LINE, "--tensor-model-parallel-size", "8"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"Megatron-LM at {tree}" in out
    assert (
        "refused at TransformerConfig: ValueError: num_attention_heads (12) must be a multiple "
        "of tensor_model_parallel_size (8)." in out
    )


def test_upstream_numbers_in_json(tree, capsys):
    rc = main(
        [
            "check",
            "--json",
            "--megatron",
            str(tree),
            "--",
            *LINE,
            "--tensor-model-parallel-size",
            "2",
        ]
    )
    answer = json.loads(capsys.readouterr().out)
    assert rc == 0
    megatron = answer["megatron"]
    assert megatron["accepted"] is True
    assert (
        megatron["data_parallel_size"],
        megatron["global_batch_size"],
        megatron["num_microbatches"],
    ) == (4, 16, 4)
    assert answer["ledger"]["num_microbatches"] == 4 and megatron["differs"] == []
    schema = json.loads((Path(__file__).parents[2] / "docs" / "check.schema.json").read_text())
    assert errors(answer, schema) == []
