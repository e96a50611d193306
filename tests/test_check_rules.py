"""The registry's rules of upstream's validation (launch/rules_*.py), each against a launch line
that breaks it alone: check names that one rule, in Megatron's own words with the upstream line, and
its fix (where it is an edit) gives a line check accepts.
"""

import shlex

import pytest

from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.line import parse_launch
from megatron_ga_ext.launch.registry import RULES, registry_problems
from megatron_ga_ext.launch.rule import REFS
from megatron_ga_ext.launch.view import build_view

#: 8 ranks, a plain Megatron line (no megatron-ga-ext) check accepts.
BASE = (
    "torchrun --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 1 --global-batch-size 16 "
    "--seq-length 2048"
)
FSDP2 = "--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights"
MFSDP = "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format fsdp_dtensor"
HYBRID = "--hybrid-context-parallel --context-parallel-size 2 --calculate-per-token-loss"


def report(line: str):
    return check_launch(parse_launch(shlex.split(line)))


def line_with(flags: str, base: str = BASE) -> str:
    """``base`` with ``flags``; a flag in both takes the value of ``flags``."""
    words, extra = shlex.split(base), shlex.split(flags)
    for i, word in enumerate(extra):
        if (
            word in words
            and word.startswith("--")
            and i + 1 < len(extra)
            and not extra[i + 1].startswith("--")
        ):
            at = words.index(word)
            del words[at : at + 2]
    return shlex.join([*words, *extra])


# (a line's flags over BASE, the one rule it breaks, Megatron's words the message quotes)
CASES = [
    ("--batch-size 4", "batch-size-removed", "--batch-size argument is no longer valid"),
    ("--eval-global-batch-size 20 --eval-micro-batch-size 2", "eval-global-batch-size",
     "eval_global_batch_size (20) must be divisible by eval_micro_batch_size (2) * "
         "data_parallel_size (8)"),
    ("--micro-batch-size 2 --perform-rl-step --rl-use-sequence-packing", "rl-sequence-packing",
     "micro_batch_size must be 1 when using sequence packing"),
    ("--train-iters 100 --train-samples 1000", "train-length-units", "expected iteration-based "
        "training"),
    ("--train-iters 100 --lr-decay-samples 1000", "train-length-units",
     "expected iteration-based learning rate decay"),
    ("--train-iters 100 --lr-warmup-samples 10", "train-length-units",
     "expected iteration-based learning rate warmup"),
    ("--train-samples 1000 --lr-decay-iters 10", "train-length-units", "expected sample-based "
        "learning rate decay"),
    ("--train-samples 1000 --lr-warmup-iters 10", "train-length-units", "expected sample-based "
        "learnig rate warmup"),
    ("--train-iters 100 --lr-wsd-decay-samples 10", "train-length-units", "this value is ignored"),
    ("--train-samples 1000 --lr-wsd-decay-iters 10", "train-length-units", "this value is ignored"),
    ("--train-iters 100 --lr-warmup-fraction 0.01 --lr-warmup-iters 10", "lr-warmup-fraction",
     "can only specify one of lr-warmup-fraction and lr-warmup-iters"),
    ("--train-samples 1000 --lr-warmup-fraction 0.01 --lr-warmup-samples 10", "lr-warmup-fraction",
     "can only specify one of lr-warmup-fraction and lr-warmup-samples"),
    ("--step-batch-size-schedule 0:16", "schedule-and-global-batch-size",
     "Cannot specify both --step-batch-size-schedule and --global-batch-size"),
    ("--context-parallel-size 2 --hierarchical-context-parallel-sizes 2 2", "hierarchical-context-parallel",
     "args.context_parallel_size == prod(args.hierarchical_context_parallel_sizes)"),
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p", "hierarchical-context-parallel",
     "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm"),
    ("--context-parallel-size 8 --seq-length 1000", "seq-length-context-parallel",
     "seq-length should be a multiple of 2 * context-parallel-size"),
    ("--max-position-embeddings 1024", "max-position-embeddings",
     "max_position_embeddings (1024) must be greater than or equal to seq_length (2048)."),
    ("--max-position-embeddings 2048 --decoder-seq-length 4096", "max-position-embeddings",
     "args.max_position_embeddings >= args.decoder_seq_length"),
    (f"{HYBRID} --pipeline-model-parallel-size 2 --num-layers 4", "hybrid-context-parallel",
     "Hybrid context parallelism not supported with pipeline parallelism"),
    (f"{HYBRID} --dataloader-type cyclic", "hybrid-context-parallel",
     "Hybrid context parallelism only supported with single dataloader type"),
    ("--hybrid-context-parallel --context-parallel-size 2", "hybrid-context-parallel",
     "Hybrid context parallelism must be used with --calculate-per-token-loss"),
    (f"{HYBRID} --enable-cuda-graph", "hybrid-context-parallel",
     "Hybrid context parallelism not supported with CUDA Graph"),
    (f"{HYBRID} {MFSDP}", "hybrid-context-parallel", "Hybrid context parallelism not supported "
        "with Megatron FSDP"),
    ("--pipeline-model-parallel-size 2 --num-layers 8 --num-virtual-stages-per-pipeline-rank 2 "
     "--no-overlap-p2p-communication", "interleave-p2p-overlap", "pipeline-model-parallel size "
         "should be greater "
     "than 2"),
    ("--overlap-param-gather --overlap-grad-reduce", "overlap-param-gather",
     "--overlap-param-gather only supported with distributed optimizer"),
    ("--overlap-param-gather --use-distributed-optimizer", "overlap-param-gather",
     "Must use --overlap-param-gather with --overlap-grad-reduce"),
    ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --overlap-param-gather-with-optimizer-step "
     "--overlap-param-gather --overlap-grad-reduce --pipeline-model-parallel-size 4 --num-layers 8 "
     "--num-virtual-stages-per-pipeline-rank 2", "overlap-param-gather",
     "--overlap-param-gather-with-optimizer-step only supported with distributed optimizer"),
    ("--overlap-param-gather-with-optimizer-step --use-distributed-optimizer "
        "--pipeline-model-parallel-size 4 "
     "--num-layers 8 --num-virtual-stages-per-pipeline-rank 2", "overlap-param-gather",
     "Must use --overlap-param-gather-with-optimizer-step with --overlap-param-gather"),
    ("--overlap-param-gather-with-optimizer-step --use-distributed-optimizer "
        "--overlap-param-gather "
     "--overlap-grad-reduce", "overlap-param-gather",
     "--overlap-param-gather-with-optimizer-step only supported with interleaved pipeline "
         "parallelism"),
    ("--perform-rl-step --global-batch-size 48 --micro-batch-size 2", "rl-global-batch-size",
     "grpo_group_size * grpo_prompts_per_step * grpo_iterations should be divisible by "
         "global_batch_size"),
    ("--num-experts 8 --expert-model-parallel-size 2 --tensor-model-parallel-size 2", "moe-bias-expert-tensor-parallel",
     "Bias in Moe is only supported when ETP==1"),
    ("--use-distributed-optimizer --num-distributed-optimizer-instances 3", "distributed-optimizer-instances",
     "Data parallel size should be divisible by partial DistOpt shard factor"),
    ("--tp-comm-overlap --tensor-model-parallel-size 2", "tp-comm-overlap",
     "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is "
         "enabled"),
    ("--num-attention-heads 0", "count-below-one", "must be at least 1"),
    ("--num-query-groups -2 --group-query-attention", "count-below-one", "must be at least 1"),
    ("--num-distributed-optimizer-instances 0", "count-below-one", "must be at least 1"),
    ("--delay-wgrad-compute --transformer-impl local", "delay-wgrad-compute",
     "Delaying wgrad compute is only supported with transformer_engine implementation"),
    ("--num-layers 24 --decoder-first-pipeline-num-layers 4", "layer-split",
     "Mismatch: 20 middle layers remaining but 0 middle PP stages available."),
    ("--expert-model-parallel-size 2", "expert-parallel-experts",
     "num_experts must be non None to use expert model parallelism"),
    ("--num-attention-heads 12 --tensor-model-parallel-size 8", "attention-heads-tensor-parallel",
     "num_attention_heads (12) must be a multiple of tensor_model_parallel_size (8)."),
    ("--num-attention-heads 12 --group-query-attention --num-query-groups 3 "
        "--tensor-model-parallel-size 2",
     "query-groups-tensor-parallel", "num_query_groups (3) must be a multiple or divisor of"),
    ("--pipeline-model-parallel-size 2 --num-layers 12 --pipeline-model-parallel-layout Et*7|t*6L",
     "layout-layers", "Number of decoder layers 13must match num_layers 12"),
    ("--pipeline-model-parallel-size 2 --num-layers 12 --pipeline-model-parallel-layout Et*6|t*6mL "
     "--position-embedding-type rope", "layout-mtp", "Number of mtp layers in layout must match "
         "mtp_num_layers"),
    ("--mtp-num-layers 1", "layout-mtp",
     "Multi-Token Prediction (MTP) is not supported with learned_absolute position embedding "
         "type."),
    (f"{FSDP2} --pipeline-model-parallel-size 2 --num-layers 4", "torch-fsdp2",
     "--use-torch-fsdp2 is not supported with pipeline parallelism"),
    (f"{FSDP2} --expert-model-parallel-size 2 --num-experts 8", "torch-fsdp2",
     "--use-torch-fsdp2 is not supported with expert parallelism"),
    (f"{FSDP2} --use-distributed-optimizer", "torch-fsdp2",
     "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"),
    ("--use-torch-fsdp2 --untie-embeddings-and-output-weights", "torch-fsdp2",
     "--use-torch-fsdp2 is not supported with gradient accumulation fusion"),
    (f"{FSDP2} --ckpt-format torch", "torch-fsdp2", "--use-torch-fsdp2 requires --ckpt-format "
        "torch_dist or torch_dcp"),
    ("--use-torch-fsdp2 --no-gradient-accumulation-fusion", "torch-fsdp2",
     "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
    (f"{FSDP2} --fp16", "torch-fsdp2", "--use-torch-fsdp2 not supported with fp16 yet"),
    (f"{MFSDP} --optimizer muon", "megatron-fsdp", "Megatron-FSDP does not support the muon "
        "optimizer yet."),
    ("--use-megatron-fsdp --use-distributed-optimizer", "megatron-fsdp",
     "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format."),
    ("--ckpt-format torch_dcp", "ckpt-format", "--ckpt-format torch_dcp is only tested with FSDP."),
    (f"{FSDP2} --ckpt-format torch_dcp --tensor-model-parallel-size 2", "ckpt-format",
     "--ckpt-format torch_dcp is not tested with megatron tensor parallelism."),
    # torch_dcp needs FSDP2, which refuses PP too: this rule never breaks alone
    (f"{FSDP2} --ckpt-format torch_dcp --pipeline-model-parallel-size 2 --num-layers 4", "torch-fsdp2,ckpt-format",
     "--ckpt-format torch_dcp is not tested with megatron pipeline parallelism."),
    ("--ckpt-format fsdp_dtensor", "ckpt-format", "--ckpt-format fsdp_dtensor is only tested "
        "with Megatron FSDP."),
]  # fmt: skip


def test_the_base_lines_are_accepted():
    for flags in ("", FSDP2, MFSDP, HYBRID):
        assert report(line_with(flags)).problems == (), flags


@pytest.mark.parametrize(
    "flags, rule, words", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)]
)
def test_a_line_that_breaks_one_rule_gets_that_rule_alone(flags, rule, words):
    line = line_with(flags)
    problems = report(line).problems
    assert [p.rule for p in problems] == rule.split(","), [p.message for p in problems]
    problem = next(p for p in problems if words in p.message)
    assert problem.fix
    if len(problems) > 1:
        return  # the other rule's fix comes first
    if problem.edit is not None:
        fixed = parse_launch(shlex.split(line)).edited(problem.edit)
        assert check_launch(fixed).problems == (), (
            problem.edit.words(),
            check_launch(fixed).problems,
        )


def test_every_rule_is_broken_by_a_case():
    """Each declaration of the registry fires on one of CASES (none is dead)."""
    fired = set()
    for flags, _, _ in CASES:
        launch = parse_launch(shlex.split(line_with(flags)))
        from megatron_ga_ext.launch.line_layout import read_layout

        view = build_view(launch, read_layout(launch, missing_ok=True).kwargs)
        fired |= {id(rule) for rule in RULES if rule.broken(view)}
        assert registry_problems(view)
    assert [(r.id, r.about) for r in RULES if id(r) not in fired] == []


def test_every_upstream_rule_cites_a_line_per_source_and_says_since_when():
    for rule in RULES:
        if rule.source is None:
            assert rule.ours
            continue
        assert len(rule.source.lines) == len(REFS) and rule.source.lines[-1] is not None
    eval_rule = next(r for r in RULES if r.id == "eval-global-batch-size")
    assert eval_rule.source.since() == "core_v0.18.2"
    assert "(from core_v0.18.2 on)" in report(line_with(CASES[1][0])).problems[0].message


# -- no false problem
# ------------------------------------------------------------------------------------


def test_a_schedule_written_out_of_order_runs_sorted_as_upstream_sorts_it():
    line = line_with("--step-batch-size-schedule '1M:32 0:16' --train-samples 100000").replace(
        " --global-batch-size 16", ""
    )
    got = report(line)
    assert got.problems == ()
    assert [(r.entry, r.global_batch_size) for r in got.stages.rows] == [
        ("0:16", 16),
        ("1M:32", 32),
    ]
    assert any("written out of order" in n.text and "'0:16 1M:32'" in n.text for n in got.notes)


def test_decrease_batch_size_if_needed_runs_at_the_rounded_global_batch():
    got = report(
        line_with("--micro-batch-size 4 --global-batch-size 100 --decrease-batch-size-if-needed")
    )
    assert got.ledger["global_batch_size"] == 96 and got.ledger["num_microbatches"] == 3
    assert any("runs at 96" in n.text for n in got.notes)
    # from 0.18 the eval batch defaults to the unrounded GBS and must divide (arguments.py:694 at
    # core_v0.19.0)
    (problem,) = got.problems
    assert problem.rule == "eval-global-batch-size"
    assert "eval_global_batch_size (100) must be divisible" in problem.message
    assert problem.edit.words() == "add --global-batch-size 96"
    flags = (
        "--micro-batch-size 4 --global-batch-size 100 --decrease-batch-size-if-needed "
        "--eval-global-batch-size 64"
    )
    given = report(line_with(flags))
    assert given.problems == () and given.ledger["global_batch_size"] == 96
    refused = report(line_with("--micro-batch-size 4 --global-batch-size 100"))
    assert [p.rule for p in refused.problems] == ["global-batch-size"]


def test_a_world_size_prefix_and_an_equal_world_size_are_read():
    prefixed = (
        "WORLD_SIZE=16 python pretrain_gpt.py --tensor-model-parallel-size 2 --micro-batch-size 1 "
    )
    got = report(prefixed + "--global-batch-size 32 --seq-length 2048")
    assert (
        got.problems == ()
        and got.ledger["data_parallel_size"] == 8
        and got.ledger["num_microbatches"] == 4
    )
    assert got.sources["world_size"] == "the prefix WORLD_SIZE=16"
    line = (
        "torchrun --nnodes 64 --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 1 "
        "--seq-length 2048"
    )
    equal = check_launch(parse_launch(shlex.split(line)), 512)
    assert equal.problems == () and equal.ledger["world_size"] == 512


def test_the_seq_aux_loss_note_only_above_micro_batch_size_1():
    moe = "--num-experts 4 --moe-router-load-balancing-type seq_aux_loss --calculate-per-token-loss"
    ext = BASE.replace("pretrain_gpt.py", "-m megatron_ga_ext pretrain_gpt.py")
    at_1 = report(line_with(moe, ext)).notes
    at_2 = report(line_with(f"{moe} --micro-batch-size 2", ext)).notes
    assert not any("seq_aux_loss" in n.text for n in at_1)
    assert any("seq_aux_loss before megatron-core 0.19" in n.text for n in at_2)


def test_the_docs_table_is_the_registry():
    from pathlib import Path

    from megatron_ga_ext.launch.registry import ADDITIONS
    from tools.doc_rules import not_applied_table, rules_table

    page = (Path(__file__).resolve().parents[1] / "docs" / "check-rules.md").read_text()
    assert f"<!-- table:check-rules -->\n{rules_table()}\n<!-- /table:check-rules -->" in page
    assert f"<!-- table:check-rules-not-applied -->\n{not_applied_table()}\n" in page
    assert page.count("\n| `") == len(RULES) + len(ADDITIONS)


def test_the_middle_stage_rule_is_reported_once_above_pp_1():
    flags = (
        "--num-layers 24 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 4 "
    )
    problems = report(line_with(flags + "--decoder-last-pipeline-num-layers 20")).problems
    assert [p.rule for p in problems] == ["layer-split"], [p.message for p in problems]
