"""check's notes are read in one breath: one line, severity first, plain words, the detail one link
away; and every coverage row that records an upstream defect speaks for a launch without the
extension (issue 38, items 2 and 8)."""

import re
import shlex

import pytest

from megatron_ga_ext.config.coverage.rows import ROWS
from megatron_ga_ext.config.coverage.upstream import upstream_traps
from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.line import parse_launch
from megatron_ga_ext.launch.problems import launch_setting

#: Internal terms a newcomer does not know (the row's text, one link away, may use them).
JARGON = re.compile(r"\bN\b|finalize|verify row|liveness|n\(u\)|T\(m\)|\bNOT_YET\b")


@pytest.mark.parametrize("row", [r for r in ROWS if r.support != "supported"], ids=lambda r: r.id)
def test_every_limited_or_refused_row_has_a_brief_in_plain_words(row):
    assert row.brief, f"{row.id}: no brief"
    assert len(row.brief.split()) <= 25, f"{row.id}: {len(row.brief.split())} words"
    assert "\n" not in row.brief and not JARGON.search(row.brief), row.brief
    assert row.severity in ("careful", "info")


def report(line: str, world_size: int | None = None):
    return check_launch(parse_launch(shlex.split(line)), world_size)


BASE = (
    "torchrun --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 1 --global-batch-size 16 "
    "--seq-length 2048"
)


def test_notes_start_with_their_severity_and_link_to_their_row():
    found = report(
        BASE.replace("pretrain_gpt.py", "-m megatron_ga_ext pretrain_gpt.py") + " --fp16 --bf16"
    )
    by_link = {n.link: n for n in found.notes}
    assert str(by_link["docs/coverage.md#fp16"]).startswith("info: --fp16: the loss scale")
    assert str(by_link["docs/coverage.md#fp16"]).endswith("(docs/coverage.md#fp16)")
    assert all(n.severity in ("wrong", "careful", "info") for n in found.notes)


#: For each upstream defect a row records: a launch without the extension that meets it.
UPSTREAM_LINES = {
    "torch-fsdp2-token": "--calculate-per-token-loss --use-torch-fsdp2",
    "average-in-collective-token": "--calculate-per-token-loss --ddp-average-in-collective",
    "rl-context-parallel-token": "--calculate-per-token-loss --perform-rl-step "
    "--context-parallel-size 2",
    "router-aux-loss": "--calculate-per-token-loss --num-experts 4 --moe-z-loss-coeff 1e-3 "
    "--tensor-model-parallel-size 2",
    "mtp": "--calculate-per-token-loss --mtp-num-layers 1 --position-embedding-type rope",
    "megatron-fsdp-checkpoint": "--use-megatron-fsdp --use-distributed-optimizer --save ckpt "
    "--save-interval 100",
    "megatron-fsdp-optimizer": "--use-megatron-fsdp",
    **{
        f"megatron-fsdp-{strategy.replace('_', '-')}": "--use-megatron-fsdp "
        "--data-parallel-sharding-strategy "
        f"{strategy} --num-experts 8 --expert-model-parallel-size 8"
        for strategy in ("optim_grads", "optim_grads_params")
    },
}


def test_every_upstream_defect_has_a_launch_here():
    assert {row.id for row in ROWS if row.upstream} == set(UPSTREAM_LINES)


@pytest.mark.parametrize("row_id, flags", UPSTREAM_LINES.items(), ids=list(UPSTREAM_LINES))
def test_a_launch_without_the_extension_is_told_what_upstream_does(row_id, flags):
    line = f"{BASE} {flags}"
    traps = [
        trap
        for row, trap in upstream_traps(launch_setting(parse_launch(shlex.split(line))))
        if row.id == row_id
    ]
    assert traps
    found = report(line)
    link = f"docs/coverage.md#{row_id}"
    problems = [p for p in found.problems if p.rule == f"upstream:{row_id}"]
    notes = [n for n in found.notes if n.link == link and n.severity == "careful"]
    assert len(problems) == sum(t.severity == "wrong" for t in traps)
    assert len(notes) == sum(t.severity == "careful" for t in traps)
    for problem in problems:
        assert problem.message.startswith("without megatron-ga-ext, ") and link in problem.message
    # With the extension on the line the same row is the extension's: its refusal or its support,
    # never the trap.
    with_extension = report(line.replace("pretrain_gpt.py", "-m megatron_ga_ext pretrain_gpt.py"))
    assert not [p for p in with_extension.problems if p.rule.startswith("upstream:")]


def test_fsdp2_with_the_per_token_loss_is_a_problem_whose_fix_is_checked():
    """The issue's line: rc 0 and 'every token weighs the same' before; now a problem naming the
    factor, and its fix (drop --calculate-per-token-loss) leaves a clean line."""
    line = f"{BASE} --calculate-per-token-loss --use-torch-fsdp2 --no-gradient-accumulation-fusion"
    line += " --untie-embeddings-and-output-weights"  # what Megatron's validate_args needs of FSDP2
    (problem,) = report(line).problems
    assert (
        problem.rule == "upstream:torch-fsdp2-token"
        and "N / (DP x CP) times the per-token mean" in problem.message
    )
    assert (
        problem.edit is not None
        and report(line.replace(" --calculate-per-token-loss", "")).problems == ()
    )
    assert "every non-padding token" not in " ".join(str(n) for n in report(line).notes)


def test_install_hints_never_name_a_registry_package_we_do_not_own():
    """megatron-ga-ext is not on the package registry (the name is unclaimed): a hint gives a
    checkout or a wheel."""
    from pathlib import Path

    from megatron_ga_ext.cli.hints import install_hint

    root = Path(__file__).resolve().parents[1]
    for path in [
        *(root / "megatron_ga_ext").rglob("*.py"),
        root / "README.md",
        *(root / "docs").glob("*.md"),
    ]:
        text = path.read_text()
        for bad in (
            "install megatron-ga-ext",
            "install 'megatron-ga-ext[",
            'install "megatron-ga-ext[',
        ):
            assert bad not in text, f"{path}: {bad}"
    assert "./megatron-ga-ext[plot]" in install_hint(
        "plot"
    ) and "pip install matplotlib" in install_hint("plot")


def test_the_tensor_parallel_note_says_what_verify_runs():
    """The note's claim is held to verify's own layouts: every TP > 1 layout runs sequence
    parallelism on MoE."""
    from megatron_ga_ext.config.coverage.rows import ROWS
    from megatron_ga_ext.verify.layouts import DEFAULT_LAYOUTS

    brief = next(row.brief for row in ROWS if row.id == "tensor-parallel")
    tp = [layout for layout in DEFAULT_LAYOUTS if layout.tensor_model_parallel_size > 1]
    assert {layout.tensor_model_parallel_size for layout in tp} == {2} and "runs TP 2 only" in brief
    assert all(layout.sequence_parallel and layout.model.startswith("moe") for layout in tp)
    assert "with sequence parallelism (an MoE model)" in brief


def test_every_careful_upstream_defect_has_a_brief():
    for row in ROWS:
        for trap in row.upstream:
            if trap.severity == "careful":
                assert (
                    trap.brief and len(trap.brief.split()) <= 25 and not JARGON.search(trap.brief)
                ), trap.brief
