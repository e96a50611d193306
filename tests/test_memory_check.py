"""``megatron-ga check`` with a model's flags: the memory split, the alternatives at the same GBS
(each valid under check's whole pass), the --gpu-memory budget, and the model flags Megatron
refuses."""

import json
import shlex
from pathlib import Path

import pytest

from megatron_ga_ext.core.memory import GiB, Parallel, Precision, Recompute, memory
from megatron_ga_ext.core.model_shape import ModelShape
from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.costs import Layout
from megatron_ga_ext.launch.gpu_budget import gpu_memory
from megatron_ga_ext.launch.line import parse_launch
from megatron_ga_ext.launch.model_flags import read_model_args
from tests.support.json_schema import errors

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "check.schema.json").read_text())

#: SC21's GPT-3 175B launch (Narayanan et al. 2021, §5.1): 1024 GPUs, TP 8, PP 16, B 1536, MBS 1.
GPT3 = (
    "torchrun --nnodes 128 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 8 "
    "--pipeline-model-parallel-size 16 --num-layers 96 --hidden-size 12288 "
    "--num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
    "--micro-batch-size 1 --global-batch-size 1536 --bf16 --use-distributed-optimizer "
    "--sequence-parallel --recompute-activations"
)
LLAMA = (
    "torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 --num-layers 32 "
    "--hidden-size 4096 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
    "--disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 128256 "
    "--seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 "
    "--global-batch-size 64 --bf16"
)


def _json(cli, *argv):
    answer = cli("check", "--json", *argv)
    return answer, json.loads(answer.out)


def test_gpt3_memory_equals_the_formula(cli):
    """The launch's row is core/memory.py's number for the model the flags give (the oracle tier
    ties that to upstream): GPT-2's vocabulary padded for TP 8, SP with selective recompute,
    distributed optimizer."""
    answer, out = _json(cli, "--", *shlex.split(GPT3))
    assert answer.status == 0, out["problems"]
    model = ModelShape(
        num_layers=96,
        hidden_size=12288,
        num_attention_heads=96,
        seq_length=2048,
        padded_vocab_size=51200,
    )
    par = Parallel(
        world_size=1024,
        tensor_model_parallel_size=8,
        pipeline_model_parallel_size=16,
        sequence_parallel=True,
    )
    expected = memory(
        model,
        par,
        Precision(use_distributed_optimizer=True),
        1,
        192,
        Recompute(granularity="selective"),
    )
    launch = out["costs"]["launch"]
    assert launch["total_bytes"] == expected.total
    assert launch["activations_peak_bytes"] == expected.activations_peak
    assert launch["optimizer_bytes"] == expected.optimizer
    assert launch["in_flight_microbatches"] == 16


def test_check_prints_split_and_alternatives_in_one_screen(cli):
    answer = cli("check", "--", *shlex.split(GPT3))
    lines = answer.out.splitlines()
    assert len(lines) <= 40, answer.out
    assert any(line.startswith("  MBS moves nothing of: parameters") for line in lines)
    assert any(line.startswith("  MBS 1 moves: activations") for line in lines)
    own = [line for line in lines if line.startswith("*  TP8 PP16 CP1 DP8")]
    assert len(own) == 1


def test_every_alternative_keeps_gbs_and_world_and_passes_check(cli):
    _, out = _json(cli, "--", *shlex.split(GPT3))
    rows = out["costs"]["alternatives"]
    assert sum(r["launch"] for r in rows) == 1 and len(rows) >= 4
    line = parse_launch(shlex.split(GPT3))
    own = Layout(8, 16, 1, 1)
    for row in rows:
        sizes = (row["tensor_model_parallel_size"], row["pipeline_model_parallel_size"])
        world = sizes[0] * sizes[1] * row["context_parallel_size"] * row["data_parallel_size"]
        assert world == 1024
        assert row["micro_batch_size"] * row["data_parallel_size"] * row["num_microbatches"] == 1536
        layout = Layout(*sizes, row["context_parallel_size"], row["micro_batch_size"])
        assert check_launch(line.edited(layout.edit(own))).problems == ()
    same = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    mbs = {r["micro_batch_size"]: r for r in rows if tuple(r[k] for k in same) == (8, 16, 1)}
    assert mbs[2]["activations_peak_bytes"] == pytest.approx(2 * mbs[1]["activations_peak_bytes"])
    assert mbs[2]["optimizer_bytes"] == mbs[1]["optimizer_bytes"]


def test_budget_fits(cli):
    answer = cli("check", "--gpu-memory", "H100", "--", *shlex.split(GPT3))
    assert answer.status == 0
    assert "fits H100, 79.6 GiB with" in answer.out


def test_budget_too_small_offers_the_nearest_valid_layouts_that_fit(cli):
    answer, out = _json(cli, "--gpu-memory", "16GiB", "--", *shlex.split(GPT3))
    assert answer.status == 1
    assert errors(out, SCHEMA) == []
    assert out["costs"]["fits"] is False
    problem = next(p for p in out["problems"] if p["rule"] == "memory-budget")
    assert problem["message"].startswith(
        "--gpu-memory: the launch needs 19.7 GiB per GPU, 3.7 GiB over 16GiB."
    )
    fitting = out["costs"]["fitting"]
    assert fitting and all(r["total_bytes"] <= 16 * GiB for r in fitting)
    line = parse_launch(shlex.split(GPT3))
    for row in fitting:
        sizes = (row["tensor_model_parallel_size"], row["pipeline_model_parallel_size"])
        layout = Layout(*sizes, row["context_parallel_size"], row["micro_batch_size"])
        assert check_launch(line.edited(layout.edit(Layout(8, 16, 1, 1)))).problems == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 1024**3),
        ("80GB", 80e9),
        ("96 GiB", 96 * 1024**3),
        ("H100", 81_559 * 1024**2),
        ("a100-80gb", 81_920 * 1024**2),
        ("H200", 143_771 * 1024**2),
        ("B200", 183_359 * 1024**2),
    ],
)
def test_gpu_memory_forms(text, expected):
    assert gpu_memory(text)[0] == expected


@pytest.mark.parametrize(
    ("text", "message"), [("A100", "ambiguous"), ("80", "neither a size"), ("0GiB", "no memory")]
)
def test_gpu_memory_refused(text, message):
    with pytest.raises(UsageError, match=message):
        gpu_memory(text)


@pytest.mark.parametrize(
    ("edit", "flag", "rule"),
    [
        (("--hidden-size", "4100"), "--hidden-size", "hidden-size-attention-heads"),
        (
            ("--make-vocab-size-divisible-by", "0"),
            "--make-vocab-size-divisible-by",
            "vocab-size-padding",
        ),
        (("--ffn-hidden-size", "14335"), "--ffn-hidden-size", "ffn-hidden-size-tensor-parallel"),
        (("--num-query-groups", "3"), "--num-query-groups", "query-groups-tensor-parallel"),
    ],
)
def test_bad_model_flags_are_problems_naming_the_flag(cli, edit, flag, rule):
    words = shlex.split(LLAMA)
    index = words.index(edit[0]) if edit[0] in words else None
    if index is None:
        words += list(edit)
    else:
        words[index + 1] = edit[1]
    answer, out = _json(cli, "--", *words)
    assert answer.status == 1
    problem = next(p for p in out["problems"] if p["flag"] == flag)
    assert problem["value"] == edit[1]
    assert problem["message"].startswith(f"{flag} {edit[1]} ")
    assert (
        any(p["rule"] == rule for p in out["problems"] if p["flag"] == flag)
        or problem["rule"] != rule
    )


def test_heads_not_divisible_by_tp_is_named(cli):
    words = shlex.split(
        LLAMA.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 3")
    )
    answer, out = _json(cli, "--world-size", "6", "--", *words)
    assert answer.status == 1
    assert any(p["flag"] == "--num-attention-heads" for p in out["problems"])


def test_a_line_without_model_flags_prints_no_memory(cli):
    answer = cli(
        "check",
        "--",
        "torchrun",
        "--nproc-per-node",
        "8",
        "pretrain_gpt.py",
        "--micro-batch-size",
        "2",
    )
    assert "memory per GPU" not in answer.out


def test_moe_layer_freq_pattern_and_switches_are_read():
    args, spelled = read_model_args(
        [
            "--moe_layer_freq",
            "([0]*3+[1]*2)",
            "--swiglu",
            "--disable-bias-linear",
            "--num-experts=8",
        ]
    )
    assert args == {
        "moe_layer_freq": (0, 0, 0, 1, 1),
        "swiglu": True,
        "add_bias_linear": False,
        "num_experts": 8,
    }
    assert spelled["moe_layer_freq"] == "--moe_layer_freq"


def test_ledger_takes_the_model_flags_and_the_budget(cli):
    words = shlex.split(GPT3)[1:]
    words.remove("pretrain_gpt.py")
    at = words.index("--max-position-embeddings")  # not the ledger's: it decides no size
    del words[at : at + 2]
    answer = cli("ledger", *words, "--gpu-memory", "16GiB")
    assert answer.status == 0
    assert "  total 19.7 GiB; does NOT fit 16GiB: 3.7 GiB over" in answer.out
    assert "problem: --gpu-memory: the launch needs 19.7 GiB per GPU" in answer.out


def test_gpu_memory_without_the_model_is_a_usage_error(cli):
    answer = cli(
        "ledger", "--nproc-per-node", "8", "--micro-batch-size", "2", "--gpu-memory", "H100"
    )
    assert answer.status == 2
    assert "--gpu-memory needs the model" in answer.err


def test_a_hybrid_model_is_not_estimated_as_upstream_refuses_it(cli):
    _, out = _json(cli, "--", *shlex.split(LLAMA), "--hybrid-layer-pattern", "M*M*M*M*")
    assert out["costs"] == {"estimated": False, "why": out["costs"]["why"]}
    assert out["costs"]["why"].startswith("hybrid Mamba models are not estimated")


def test_alternatives_of_a_launch_with_a_problem_keep_it_and_add_none(cli):
    """A problem of a flag the layout does not touch stays with every layout: the alternatives are
    listed, and each adds no problem of its own."""
    words = [*shlex.split(GPT3), "--overlap-param-gather"]
    _, out = _json(cli, "--", *words)
    own = {(p["rule"], p["flag"]) for p in out["problems"]}
    assert own and len(out["costs"]["alternatives"]) >= 4
    line = parse_launch(words)
    for row in out["costs"]["alternatives"]:
        sizes = (row["tensor_model_parallel_size"], row["pipeline_model_parallel_size"])
        layout = Layout(*sizes, row["context_parallel_size"], row["micro_batch_size"])
        after = check_launch(line.edited(layout.edit(Layout(8, 16, 1, 1)))).problems
        assert {(p.rule, p.flag) for p in after} <= own


def test_check_gpu_memory_without_the_model_is_a_usage_error(cli):
    line = ["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", "--micro-batch-size", "2"]
    answer = cli("check", "--gpu-memory", "80GiB", "--", *line)
    assert answer.status == 2
    assert "--gpu-memory needs the model: give --num-layers" in answer.err
