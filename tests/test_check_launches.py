"""megatron-ga check on launch-line shapes that are easy to misread, each built from a real launch
line's shape.

Which flags exist is Megatron's own parser at each tested release (core_v0.16.1 ... main d98e8a64):
``--virtual-pipeline-model-parallel-size`` is defined by none of them; the VPP comes from
``--num-virtual-stages-per-pipeline-rank``, ``--num-layers-per-virtual-pipeline-stage``,
``--pipeline-model-parallel-layout`` or the '|' segments of ``--hybrid-layer-pattern``.
"""

import shlex

import pytest

from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.check import launch_problems
from megatron_ga_ext.launch.line import parse_launch
from megatron_ga_ext.launch.problems import loss_reduction_note

# 16 ranks, per-token loss on (the default --ga-loss-reduction token needs it).
BASE = (
    "torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py --calculate-per-token-loss "
    "--micro-batch-size 1 --seq-length 2048"
)


def check(line: str, world_size: int | None = None):
    """(ledger dict or None, problems) of a launch line, read as check reads it."""
    layout, problems = launch_problems(parse_launch(shlex.split(line)), world_size)
    return (layout.ledger() if layout else None), problems


def one_problem(line: str) -> str:
    _, problems = check(line)
    assert len(problems) == 1, problems
    return problems[0]


# -- 1. a schedule split into words by an unquoted shell array -----------------------------------


def test_unquoted_schedule_words_are_reported_not_passed_over():
    # Megatron-LM's GPT-3 175B example expands its argument array unquoted.
    line = BASE + " --num-layers 96 --step-batch-size-schedule 0:16 2.4B:320 4.8B:640 --lr 6e-5"
    problem = one_problem(line)
    assert problem.startswith(
        "--step-batch-size-schedule 0:16 is followed by 2.4B:320 4.8B:640: the schedule was "
        "split into words"
    )
    assert (
        "Megatron reads only '0:16' and stops with \"unrecognized arguments: 2.4B:320 4.8B:640\""
        in problem
    )
    assert (
        'Quote the whole schedule: --step-batch-size-schedule "0:16 2.4B:320 4.8B:640"' in problem
    )


def test_unquoted_schedule_is_checked_as_if_quoted():
    _, problems = check(BASE + " --step-batch-size-schedule 0:16 2.4B:24")
    assert any("split into words" in p for p in problems)
    assert any(
        "entry 2 '2.4B:24'" in p
        and "not a multiple of --micro-batch-size 1 x data-parallel size 16" in p
        for p in problems
    )


def test_stray_words_after_any_megatron_value_flag():
    problem = one_problem(BASE + " --global-batch-size 64 128")
    assert "--global-batch-size 64 is followed by 128, which no flag takes" in problem
    assert "unrecognized arguments: 128" in problem


def test_words_after_launcher_flags_are_the_script_not_strays():
    ledger, problems = check(BASE + " --global-batch-size 64")
    assert problems == [] and ledger["global_batch_size"] == 64


# -- 2. VPP from --pipeline-model-parallel-layout and from '|' segments ---------------------------


def test_vpp_from_pipeline_layout_gives_the_bubble_and_the_interleave_check():
    layout = "Ett|(tt|)*6ttL"  # 8 stages over PP 4: VPP 2
    ledger, problems = check(
        BASE + f" --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout '{layout}' "
        "--global-batch-size 32"
    )
    assert problems == []
    assert ledger["virtual_pipeline_model_parallel_size"] == 2
    assert ledger["pipeline_bubble_fraction"] == pytest.approx(3 / (2 * 8 + 3))
    problem = one_problem(
        BASE + f" --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout '{layout}' "
        "--global-batch-size 24"
    )
    assert (
        "= 6 with virtual pipeline size 2 (--pipeline-model-parallel-layout: 8 stages / "
        "--pipeline-model-parallel-size 4)" in problem
    )
    assert "Nearest valid --global-batch-size: 16, 32" in problem


def test_pipeline_layout_stages_must_divide_by_pp():
    problem = one_problem(
        BASE + " --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout 'Et|(tt|)*7tL' "
        "--global-batch-size 16"
    )
    assert (
        "has 9 stages, not a multiple of --pipeline-model-parallel-size 4; Megatron asserts"
        in problem
    )


def test_vpp_from_hybrid_pattern_segments():
    pattern = "M*M*|M*M*|M*M*|M*M*"  # 4 segments over PP 2: VPP 2
    ledger, problems = check(
        BASE + f" --pipeline-model-parallel-size 2 --hybrid-layer-pattern '{pattern}' "
        "--global-batch-size 32"
    )
    assert problems == [] and ledger["virtual_pipeline_model_parallel_size"] == 2
    problem = one_problem(
        BASE + f" --pipeline-model-parallel-size 2 --hybrid-layer-pattern '{pattern}' "
        "--global-batch-size 24"
    )
    assert "= 3 with virtual pipeline size 2 (--hybrid-layer-pattern: 4 segments" in problem
    # No pipes: Megatron splits the layers over PP itself, without interleaving.
    ledger, problems = check(
        BASE + " --pipeline-model-parallel-size 2 --hybrid-layer-pattern 'M*M*M*M*' "
        "--global-batch-size 24"
    )
    assert problems == [] and ledger["virtual_pipeline_model_parallel_size"] == 1


def test_hybrid_pattern_refuses_the_other_vpp_flags_as_megatron_does():
    problem = one_problem(
        BASE + " --pipeline-model-parallel-size 2 --hybrid-layer-pattern 'M*|M*' "
        "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 32"
    )
    assert (
        "--num-virtual-stages-per-pipeline-rank is given with --hybrid-layer-pattern; Megatron "
        "asserts" in problem
    )


# -- 3. the embedding and loss counted as layers ---------------------------------------------------


def test_account_for_embedding_and_loss_count_in_the_layers(cli):
    # 30 layers + embedding + loss = 32 over PP 4 = 8 per stage, 2 per virtual stage: VPP 4. A valid
    # launch.
    line = BASE + (
        " --pipeline-model-parallel-size 4 --num-layers 30 "
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
        "--num-layers-per-virtual-pipeline-stage 2 --global-batch-size 32"
    )
    ledger, problems = check(line)
    assert problems == [] and ledger["virtual_pipeline_model_parallel_size"] == 4
    assert cli("check", "--", *shlex.split(line)).status == 0


def test_one_accounted_layer_breaks_the_even_split():
    problem = one_problem(
        BASE + " --pipeline-model-parallel-size 4 --num-layers 32 "
        "--account-for-embedding-in-pipeline-split --global-batch-size 32"
    )
    assert problem.startswith(
        "--num-layers 32 + 1 for each of --account-for-embedding-in-pipeline-split = 33 is not a "
        "multiple of --pipeline-model-parallel-size 4"
    )
    assert "Nearest valid --num-layers: 31, 35" in problem


# -- 4. --num-layers against PP, uneven first/last stages -----------------------------------------


def test_layers_not_divisible_by_pp_are_caught_without_any_vpp_flag():
    problem = one_problem(
        BASE + " --pipeline-model-parallel-size 8 --num-layers 12 --global-batch-size 32"
    )
    assert "--num-layers 12 is not a multiple of --pipeline-model-parallel-size 8" in problem
    assert (
        'Megatron asserts "Number of layers should be divisible by the pipeline-model-parallel '
        'size"' in problem
    )


def test_uneven_first_and_last_stages_split_the_middle_as_megatron_does():
    _, problems = check(
        BASE + " --pipeline-model-parallel-size 4 --num-layers 30 "
        "--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6 "
        "--global-batch-size 32"
    )
    assert problems == []  # 18 middle layers over 2 middle stages
    problem = one_problem(
        BASE + " --pipeline-model-parallel-size 4 --num-layers 31 "
        "--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6 "
        "--global-batch-size 32"
    )
    assert "leaves 19 layers for the 2 middle pipeline stage(s)" in problem


def test_uneven_stages_with_layers_per_virtual_stage_fail_for_megatrons_reason():
    problem = one_problem(
        BASE + " --pipeline-model-parallel-size 4 --num-layers 30 "
        "--decoder-first-pipeline-num-layers 6 --num-layers-per-virtual-pipeline-stage 2 "
        "--global-batch-size 32"
    )
    assert (
        "please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel "
        "degree when enable uneven pipeline parallelism" in problem
    )
    assert "Give --num-virtual-stages-per-pipeline-rank N instead" in problem


# -- 5. --encoder-seq-length / --decoder-seq-length ------------------------------------------------


def test_encoder_seq_length_is_the_seq_length_for_tokens_and_thresholds():
    line = (
        "torchrun --nproc_per_node 8 pretrain_t5.py --calculate-per-token-loss "
        "--micro-batch-size 1 --encoder-seq-length 512 --decoder-seq-length 128 "
        "--step-batch-size-schedule '0:8 1M:16'"
    )
    ledger, problems = check(line)
    assert problems == []
    assert (ledger["seq_length"], ledger["tokens_per_step"]) == (512, 16 * 512)
    # thresholds are tokens: 1000 tokens // 512 = sample 1, so 1000 and 1001 tokens collide
    problem = one_problem(line.replace("'0:8 1M:16'", "'0:8 1000:16 1001:24'"))
    assert "both become sample threshold 1 with --seq-length 512" in problem


def test_seq_lengths_megatron_refuses():
    problem = one_problem(BASE + " --encoder-seq-length 512 --global-batch-size 16")
    assert (
        "--seq-length 2048 and --encoder-seq-length 512 are both given; Megatron asserts" in problem
    )
    line = BASE.replace("--seq-length 2048", "--decoder-seq-length 512") + " --global-batch-size 16"
    assert (
        "--decoder-seq-length 512 is given without --seq-length or --encoder-seq-length"
        in one_problem(line)
    )


# -- 6. the loss mode, the default token mode included
# ----------------------------------------------


def test_loss_reduction_of_a_launch_without_the_extension_is_information():
    line = BASE.replace(" --calculate-per-token-loss", "") + " --global-batch-size 16"
    assert check(line)[1] == []
    note = loss_reduction_note(parse_launch(shlex.split(line)))
    assert str(note) == (
        "info: upstream's mean of means: each micro-batch's loss over its own tokens, averaged. "
        "megatron-ga-ext is not on this line."
    )
    assert (
        "per-token loss (--calculate-per-token-loss)"
        in loss_reduction_note(parse_launch(shlex.split(BASE))).text
    )


@pytest.mark.parametrize("on", ["--ga-loss-reduction token", "--ga-checks sync", "ENTRY"])
def test_token_mode_of_the_extension_needs_no_per_token_flag(on):
    line = BASE.replace(" --calculate-per-token-loss", "") + " --global-batch-size 16"
    line = (
        line.replace("pretrain_gpt.py", "-m megatron_ga_ext pretrain_gpt.py")
        if on == "ENTRY"
        else f"{line} {on}"
    )
    assert check(line)[1] == []
    assert str(loss_reduction_note(parse_launch(shlex.split(line)))) == (
        "info: token-level loss (--ga-loss-reduction token), checked every step; install() turns "
        "on --calculate-per-token-loss."
    )


def test_microbatch_mode_must_not_have_the_per_token_flag():
    problem = one_problem(BASE + " --global-batch-size 16 --ga-loss-reduction microbatch")
    assert problem.startswith(
        "--ga-loss-reduction microbatch is upstream's mean of means, but "
        "--calculate-per-token-loss makes Megatron run the token mean"
    )
    line = (
        BASE.replace(" --calculate-per-token-loss", "")
        + " --global-batch-size 16 --ga-loss-reduction microbatch"
    )
    assert check(line)[1] == []


def test_a_loss_mode_that_is_not_a_choice_names_the_choices():
    problem = one_problem(BASE + " --global-batch-size 16 --ga-loss-reduction tokens")
    assert problem == (
        "--ga-loss-reduction 'tokens' is not one of token, microbatch; did you mean "
        "--ga-loss-reduction token?"
    )
    problem = one_problem(BASE + " --global-batch-size 16 --ga-zero-token-policy ignore")
    assert problem == "--ga-zero-token-policy 'ignore' is not one of error, skip; pick one of them."
    problem = one_problem(
        BASE + " --global-batch-size 16 --ga-checks async --ga-zero-token-policy skip"
    )
    assert problem.startswith(
        "--ga-checks async reads a step's token count only after its optimizer step"
    )
    assert check(BASE + " --global-batch-size 16 --ga-checks async")[1] == []


@pytest.mark.parametrize(
    "flags", ["--hybrid-context-parallel", "--perform-rl-step --rl-use-sequence-packing"]
)
def test_schedules_with_other_forward_counts_need_no_ga_guards(flags):
    line = BASE.replace("pretrain_gpt.py", "-m megatron_ga_ext pretrain_gpt.py")
    problem = one_problem(line + f" --global-batch-size 16 {flags}")
    assert f"{flags} run(s) another number of forward passes per step" in problem
    assert problem.endswith("Add --no-ga-guards.")
    assert check(line + f" --global-batch-size 16 {flags} --no-ga-guards")[1] == []


@pytest.mark.parametrize(
    "flags", ["--hybrid-context-parallel", "--perform-rl-step --rl-use-sequence-packing"]
)
def test_a_plain_megatron_line_gets_no_rule_or_fix_of_the_extension(flags):
    """Megatron's parser rejects --no-ga-guards: a line without the extension is never told to add
    it."""
    _, problems = check(BASE + f" --global-batch-size 16 {flags}")
    assert not any("--ga-" in p for p in problems), problems


# -- 7. flags Megatron does not define, fixed worlds, the flag the user gave, JSON errors
# -----------


def test_virtual_pipeline_model_parallel_size_is_not_a_megatron_flag():
    problem = one_problem(
        BASE + " --pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 2 "
        "--global-batch-size 32"
    )
    assert problem.startswith(
        "--virtual-pipeline-model-parallel-size 2 is not a flag of Megatron's parser"
    )
    assert (
        "--num-virtual-stages-per-pipeline-rank N" in problem
        and "--pipeline-model-parallel-layout" in problem
    )


def test_fixed_nnodes_range_is_a_fixed_world():
    ledger, problems = check(BASE.replace("--nnodes 2", "--nnodes 2:2") + " --global-batch-size 16")
    assert problems == [] and ledger["world_size"] == 16
    with pytest.raises(UsageError, match=r"--nnodes 1:4 is an elastic range"):
        check(BASE.replace("--nnodes 2", "--nnodes 1:4"))


@pytest.mark.parametrize(
    "launcher, named",
    [
        ("torchrun --nproc_per_node 12", "world size 12 (--nproc_per_node 12)"),
        ("torchrun --nproc-per-node 12", "world size 12 (--nproc-per-node 12)"),
        (
            "torchrun --nnodes=3 --nproc_per_node=4",
            "world size 12 (--nnodes 3 x --nproc_per_node 4)",
        ),
        ("python --world-size 12", "--world-size 12"),
    ],
)
def test_world_size_message_names_the_flags_the_user_gave(launcher, named):
    problem = one_problem(
        f"{launcher} pretrain_gpt.py --calculate-per-token-loss --micro-batch-size 1 "
        "--tensor-model-parallel-size 8"
    )
    assert problem.startswith(f"{named} is not divisible by --tensor-model-parallel-size 8")


def test_unreadable_values_name_the_flag_as_spelled():
    with pytest.raises(
        UsageError, match=r"^--nproc_per_node gpu leaves the world size to the machine"
    ):
        check("torchrun --nproc_per_node gpu x.py --micro-batch-size 1")


def test_json_prints_an_error_object_when_the_line_cannot_be_read(cli):
    captured = cli(
        "check",
        "--json",
        "--",
        "torchrun",
        "--nproc_per_node",
        "gpu",
        "x.py",
        "--micro-batch-size",
        "1",
    )
    assert captured.status == 2
    report = captured.json()
    assert (
        report["error_type"] == "UsageError"
        and report["ledger"] is None
        and report["problems"] == []
    )
    assert report["error"].startswith("--nproc_per_node gpu leaves the world size to the machine")
    assert captured.err.startswith("megatron-ga check: error: --nproc_per_node gpu")


def test_a_pasted_script_line_reads_as_the_shell_reads_it():
    line = (
        BASE + " \\\n  --global-batch-size 64 \\\n  --tensor-model-parallel-size 2   # the layout"
    )
    ledger, problems = check_text(line)
    assert problems == [] and (
        ledger["global_batch_size"],
        ledger["tensor_model_parallel_size"],
    ) == (64, 2)
    # A comment ends the command: the next line is a command of its own, as bash runs it.
    line = BASE + " \\\n  --global-batch-size 64   # the batch\n  --tensor-model-parallel-size 2"
    ledger, problems = check_text(line)
    assert ledger["tensor_model_parallel_size"] == 1
    assert problems == [
        "the script runs '--tensor-model-parallel-size 2' as a command of its own: the line "
        "before it does not end with '\\', so the launch never gets "
        "--tensor-model-parallel-size and what follows it. End the line before with '\\'."
    ]
    with pytest.raises(UsageError, match=r"^--nproc_per_node '\$GPUS' is not an integer"):
        check_text("torchrun --nproc_per_node $GPUS x.py --micro-batch-size 1")


def check_text(line: str):
    """As ``megatron-ga check -- "<line>"``: the whole line in one argument, split like a shell."""
    layout, problems = launch_problems(parse_launch([line]), None)
    return (layout.ledger() if layout else None), problems
