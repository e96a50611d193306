"""``megatron-ga verify --fuzz``: the draws are valid and reproducible, a fixed seed passes, and
with install()'s router-count correction disabled the fuzzer finds Megatron-LM #7452's defect
(finding 10) itself."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_ga_ext.verify.fuzz import MAX_WORLD, SEQ_LENGTH, draw_layouts, megatron_refusal
from megatron_ga_ext.verify.layouts import Layout


def test_draws_are_reproducible_and_each_depends_on_its_index_alone():
    assert draw_layouts(20, seed=3) == draw_layouts(20, seed=3)
    assert draw_layouts(20, seed=3)[:5] == draw_layouts(5, seed=3)
    assert draw_layouts(5, seed=3) != draw_layouts(5, seed=4)


def test_every_draw_is_a_layout_megatron_core_runs_on_the_cpu():
    draws = draw_layouts(400, seed=0)
    for draw in draws:
        layout = draw.layout
        assert layout.world_size <= MAX_WORLD, draw
        assert len(draw.lengths) == layout.global_batch_size and all(
            0 <= n <= SEQ_LENGTH for n in draw.lengths
        )
        assert sum(draw.lengths) > 0 and (layout.micro_batch_size > 1 or min(draw.lengths) >= 1), (
            draw
        )
        if layout.context_parallel_size > 1:  # attention under CP needs Transformer Engine
            assert layout.model in ("positionwise", "moe_positionwise"), draw
        if (
            layout.pipeline_model_parallel_size > 1
        ):  # the interleaved schedule's rule, kept for every PP draw
            assert layout.num_microbatches % layout.pipeline_model_parallel_size == 0, draw
        if layout.expert_model_parallel_size > 1:
            assert (
                "moe" in layout.model
                and layout.data_parallel_size % layout.expert_model_parallel_size == 0
            )
    # the space is covered: every model, TP with and without SP, PP with VPP, CP, EP, ETP, MBS 2,
    # both DP-side options, zero-token samples, and the combinations an audit asked for
    layouts = [d.layout for d in draws]
    assert {lay.model for lay in layouts} == {
        "gpt",
        "positionwise",
        "moe",
        "moe_seq",
        "moe_global",
        "moe_global_z",
        "moe_bias",
        "moe_positionwise",
        "mtp",
        "mtp2",
        "moe_mtp",
        "gpt_untied",
    }
    assert {lay.sequence_parallel for lay in layouts if lay.tensor_model_parallel_size > 1} == {
        True,
        False,
    }
    assert not any(lay.sequence_parallel for lay in layouts if lay.tensor_model_parallel_size == 1)
    assert any(lay.virtual_pipeline_model_parallel_size > 1 for lay in layouts)
    assert any(lay.expert_model_parallel_size > 1 for lay in layouts)
    assert {lay.expert_tensor_parallel_size for lay in layouts if "moe" in lay.model} == {
        None,
        1,
        2,
    }
    assert any(lay.micro_batch_size > 1 for lay in layouts)
    assert any(lay.overlap_grad_reduce and lay.distributed_optimizer for lay in layouts)
    assert any(len(set(d.lengths)) > 1 for d in draws)
    assert any(0 in d.lengths for d in draws)
    assert any(
        "mtp" in lay.model and lay.tensor_model_parallel_size > 1 and lay.sequence_parallel
        for lay in layouts
    )
    assert any("mtp" in lay.model and lay.pipeline_model_parallel_size > 1 for lay in layouts)
    assert any(
        "moe" in lay.model and lay.sequence_parallel and lay.pipeline_model_parallel_size > 1
        for lay in layouts
    )


def test_fsdp_draws_keep_megatron_lms_rules_and_cover_each_path():
    """torch FSDP2 as Megatron-LM's arguments.py takes it (PP 1, EP 1, no distributed optimizer, an
    untied output layer: the untied GPT, or the position-wise model under CP); Megatron-FSDP with PP
    1 (its device mesh) in every strategy, with and without the overlap, on every model the DDP
    draws take; DP 2 and 4, TP, CP, EP, MBS 2 and uneven loss tokens on each path. The DDP draws are
    the ones drawn before FSDP was (index for index)."""
    draws = draw_layouts(400, seed=0)
    fsdp2 = [d.layout for d in draws if d.layout.data_parallel == "torch_fsdp2"]
    megatron = [d.layout for d in draws if d.layout.data_parallel == "megatron_fsdp"]
    assert 0.05 < len(fsdp2) / len(draws) < 0.2 and 0.1 < len(megatron) / len(draws) < 0.3
    for lay in fsdp2 + megatron:
        assert lay.pipeline_model_parallel_size == 1 and not lay.distributed_optimizer, lay
        assert lay.data_parallel_size in (2, 4), lay
    for lay in fsdp2:
        assert lay.expert_model_parallel_size == 1 and not lay.overlap_grad_reduce, lay
        assert lay.model == ("positionwise" if lay.context_parallel_size > 1 else "gpt_untied"), lay
    assert {lay.model for lay in megatron} == {
        "gpt", "positionwise", "moe", "moe_seq", "moe_global", "moe_global_z", "moe_bias", "moe_positionwise",
        "mtp", "mtp2", "moe_mtp",
    }  # fmt: skip
    assert {(lay.sharding_strategy, lay.overlap_grad_reduce) for lay in megatron} == {
        (strategy, overlap) for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params")
        for overlap in (False, True)
    }  # fmt: skip
    for path in (fsdp2, megatron):
        assert {lay.data_parallel_size for lay in path} == {2, 4}
        assert {lay.sequence_parallel for lay in path if lay.tensor_model_parallel_size > 1} == {
            True,
            False,
        }
        assert any(lay.context_parallel_size > 1 for lay in path)
        assert {lay.micro_batch_size for lay in path} == {1, 2} and {
            lay.num_microbatches for lay in path
        } == {1, 2, 4}
    assert any(lay.expert_model_parallel_size > 1 for lay in megatron)
    assert any(0 in d.lengths for d in draws if d.layout.data_parallel != "ddp")
    # draw 5 of seed 3, the router-count test's, is the DDP layout it was before FSDP was drawn
    assert draw_layouts(6, seed=3)[5].layout == Layout(
        data_parallel_size=2, num_microbatches=1, micro_batch_size=2, expert_model_parallel_size=2, model="moe_global",
        overlap_grad_reduce=True, distributed_optimizer=True,
    )  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2026])
def test_megatron_core_validates_every_draw(seed):
    """megatron-core's own checks (TransformerConfig, MoELayer's training check) accept each of
    3,000 draws; the check itself refuses what megatron-core refuses, such as MoE under TP without
    sequence parallelism (the draws an earlier fuzzer made, about 1 in 17)."""
    refused = {}
    for layout in {draw.layout for draw in draw_layouts(3000, seed)}:
        if (why := megatron_refusal(layout)) is not None:
            refused[layout] = why
    assert not refused, refused
    moe_tp = Layout(
        tensor_model_parallel_size=2, data_parallel_size=1, num_microbatches=2, model="moe"
    )
    assert "MoELayer.forward: ValueError" in megatron_refusal(moe_tp)
    assert megatron_refusal(replace(moe_tp, sequence_parallel=True)) is None
    assert (
        "TransformerConfig: ValueError: Cannot use sequence parallelism without tensor parallelism"
        in (megatron_refusal(replace(moe_tp, tensor_model_parallel_size=1, sequence_parallel=True)))
    )
    fsdp = Layout(
        data_parallel_size=2,
        num_microbatches=2,
        data_parallel="megatron_fsdp",
        sharding_strategy="optim",
    )
    assert megatron_refusal(fsdp) is None
    assert "Megatron-FSDP's device mesh: EinopsError" in megatron_refusal(
        replace(fsdp, pipeline_model_parallel_size=2)
    )


def _verify(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    command = (
        [sys.executable, "-c", script, *args]
        if script
        else [sys.executable, "-m", "megatron_ga_ext.cli", "verify", *args]
    )
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_fixed_seed_passes():
    proc = _verify("--fuzz", "6", "--seed", "0", "--json", "--timeout", "300")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [row["draw"] for row in sorted(out["draws"], key=lambda r: r["draw"])] == list(range(6))
    for row in out["draws"]:
        assert row["verdict"] in ("ok", "limited"), row
        if row["verdict"] == "ok":
            assert row["rel_err_token"] < 1e-5 and row["rel_err_mean_of_means"] < 1e-5
            assert row["num_tokens"] == sum(row["lengths"])


UNCORRECTED = """
import sys
from tests.support.faults import without_row
without_row("get_tokens_per_expert_and_token_count")  # upstream's counts
from megatron_ga_ext.cli.main import main
sys.exit(main(["verify", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_the_fuzzer_finds_the_router_count_defect_without_the_correction():
    """Draw 5 of seed 3 is EP 2 x DP 2 x GA 1 with MoE global_aux_loss: with upstream's counts
    (micro-batch m's over both DP ranks, on every release) its token mode misses the reference, and
    the failing draw prints its row and how to rerun it; with install()'s correction it passes."""
    args = ("--fuzz", "12", "--seed", "3", "--draw", "5", "--timeout", "300")
    proc = _verify(*args, script=UNCORRECTED)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "EP2 x DP2 x GA1 (MoE global_aux_loss, overlapped grad reduce, distributed optimizer)"
        in proc.stdout
    )
    assert "FAIL" in proc.stdout
    row = (
        "row: Layout(data_parallel_size=2, num_microbatches=1, tensor_model_parallel_size=1, "
        "sequence_parallel=False"
    )
    assert row in proc.stdout and "model='moe_global'" in proc.stdout
    assert "rerun: megatron-ga verify --fuzz 12 --seed 3 --draw 5" in proc.stdout
    assert "0 of 1 draws pass" in proc.stdout
    fixed = _verify(*args)
    assert fixed.returncode == 0 and "1 of 1 draws pass" in fixed.stdout, (
        fixed.stdout[-3000:] + fixed.stderr[-2000:]
    )


def test_fuzz_arguments_are_checked(capsys):
    from megatron_ga_ext.cli.main import main

    assert main(["verify", "--fuzz", "3", "--draw", "5"]) == 2
    assert (
        "--fuzz takes N >= 1 draws, and --draw K one of them (0 <= K < N)"
        in capsys.readouterr().err
    )


def test_the_fsdp2_revert_of_make_verify_fuzz_holds_for_the_rest_of_the_process():
    """tools/verify_fuzz.py's FSDP2 revert, run as its verify process runs it: after a garbage
    collection install()'s fix is still out (a context manager no one holds would have put it back),
    and its exit puts it back."""
    import gc

    from megatron_ga_ext.integration import finalize
    from megatron_ga_ext.integration.features import torch_fsdp2 as fsdp
    from tools.verify_fuzz import FSDP2_AVERAGING

    fix = (fsdp.prepare_units, fsdp.check_units, finalize.scale_gradients)
    namespace: dict = {}
    exec(FSDP2_AVERAGING, namespace)
    try:
        gc.collect()
        assert fsdp.prepare_units is not fix[0] and fsdp.check_units is not fix[1]
        assert finalize.scale_gradients is not fix[2]
    finally:
        namespace["reverted"].__exit__(None, None, None)
    assert (fsdp.prepare_units, fsdp.check_units, finalize.scale_gradients) == fix
