"""Megatron's FSDP paths on real megatron-core over gloo, against the unpartitioned references (one
2-rank launch).

torch FSDP2 (``--use-torch-fsdp2``): upstream's per-token step is N / (DP x CP) times the target;
install() makes it exact (integration/features/torch_fsdp2.py), and reverting the fix (units left
averaging, no division) brings upstream's factor back. Megatron-FSDP: exact in all four sharding
strategies, with and without the overlapped reduce, in both modes. The harness wires
``no_sync_func`` as Megatron-LM's training does; wired always, Megatron-FSDP reduces twice.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest

pytestmark = pytest.mark.slow

LENGTHS = (16, 1, 13, 4)  # N = 34 at DP 2, GA 2: upstream's FSDP2 factor is 34 / 2 = 17
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _layouts():
    from megatron_ga_ext.verify.layouts import Layout

    fsdp2 = Layout(
        data_parallel_size=2, num_microbatches=2, model="gpt_untied", data_parallel="torch_fsdp2"
    )
    megatron = [
        Layout(
            data_parallel_size=2,
            num_microbatches=2,
            data_parallel="megatron_fsdp",
            sharding_strategy=strategy,
            overlap_grad_reduce=overlap,
        )
        for strategy in STRATEGIES
        for overlap in (False, True)
    ]
    return fsdp2, megatron


def _errors(grads, refs, layout) -> dict:
    from megatron_ga_ext.verify.harness import relative_error

    token, mom = refs[(layout.name, "token")], refs[(layout.name, "mean_of_means")]
    name = "decoder.final_layernorm.weight"
    return {
        "token": relative_error(grads, token),
        "mean_of_means": relative_error(grads, mom),
        "factor": float((grads[name] / token[name]).median()),
        "complete": sorted(grads) == sorted(token),
    }


def _unit_checks(cfg, layout) -> dict:
    """prepare_units / check_units / scale_gradients on a freshly wrapped FSDP2 chunk (no step)."""
    import torch

    from megatron_ga_ext.errors import LossContractError, OptionError
    from megatron_ga_ext.integration.features.torch_fsdp2 import (
        check_units,
        prepare_units,
        scale_gradients,
        upstream_scales,
    )
    from megatron_ga_ext.science.integration.noise_scale import check_core_layout
    from megatron_ga_ext.testing.shims import patched
    from megatron_ga_ext.verify.harness import build_ddp
    from megatron_ga_ext.verify.models import init_model_parallel

    out = {}
    init_model_parallel()
    chunk, _, _ = build_ddp(layout, cfg, calculate_per_token_loss=True)
    out["upstream_scales"] = upstream_scales(chunk)
    try:  # a megatron-core loop's --ga-noise-scale layout check (no Megatron args) sees the wrapper
        check_core_layout(8, [chunk])
        out["noise_scale"] = None
    except OptionError as exc:
        out["noise_scale"] = str(exc)
    prepare_units(chunk, "token")
    check_units(chunk, "token")  # passes
    try:
        check_units(chunk, "microbatch")
        out["microbatch_on_summing"] = None
    except LossContractError as exc:
        out["microbatch_on_summing"] = str(exc)
    chunk.module.decoder.layers[0].set_gradient_divide_factor(2.0)
    prepare_units(chunk, "token")  # leaves a unit a user set for check_units to name
    try:
        check_units([chunk], "token")
        out["user_factor"] = None
    except LossContractError as exc:
        out["user_factor"] = str(exc)
    # an upstream that implements scale_gradients for FSDP2 scales, and the extension does not scale
    # again
    for param in chunk.module.parameters():
        param.grad = torch.distributed.tensor.DTensor.from_local(
            torch.ones_like(param.to_local()), param.device_mesh, param.placements
        )
    calls = []
    with patched(type(chunk), {"scale_gradients": lambda self, factor: calls.append(factor)}):
        out["fixed_upstream_scales"] = upstream_scales(chunk)
        scale_gradients(chunk, 0.5)
    out["fixed_upstream_calls"] = calls
    out["grad_after_fixed_upstream"] = float(next(chunk.module.parameters()).grad.to_local().max())
    scale_gradients(chunk, 0.5)
    out["grad_after_noop_upstream"] = float(next(chunk.module.parameters()).grad.to_local().max())
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return out


def _no_sync_always(layout, cfg, batch, mode) -> dict:
    """The step with ``no_sync_func`` wired whatever the overlap (the harness's old wiring), through
    install()."""
    from megatron.core import num_microbatches_calculator as calculators
    from megatron.core import parallel_state

    import megatron_ga_ext
    from megatron_ga_ext.config.ga_config import GAConfig
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.testing.shims import patched
    from megatron_ga_ext.verify import harness, step
    from megatron_ga_ext.verify.models import init_model_parallel

    init_model_parallel()
    megatron_ga_ext.install(GAConfig(loss_reduction=mode))
    calculators.init_num_microbatches_calculator(0, None, layout.global_batch_size, 1, 2)
    try:
        chunks, names, config = harness.build_chunks(
            layout, cfg, calculate_per_token_loss=mode == "token"
        )
        from megatron.core.distributed import finalize_model_grads

        with patched(step, {"wire_sync": partial(_wire_always, chunks)}):
            step.train_step(
                chunks,
                config,
                layout,
                cfg,
                batch,
                finalize=finalize_model_grads,
                loss_func=partial(masked_loss, mode=mode),
            )
        return harness.gradients(chunks, names)
    finally:
        megatron_ga_ext.uninstall()
        calculators.unset_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()


def _wire_always(chunks, config, _chunks) -> None:
    """The harness's old wiring: no_sync whatever the overlap."""
    config.no_sync_func = chunks[0].no_sync


def _run():
    from megatron_ga_ext.testing.shims import cpu_shims
    from megatron_ga_ext.verify.data_parallel import megatron_fsdp_limited, torch_fsdp2_runs
    from megatron_ga_ext.verify.harness import run_layout
    from megatron_ga_ext.verify.layouts import make_global_batch
    from megatron_ga_ext.verify.references import reference_grads
    from megatron_ga_ext.verify.run_config import VerifyConfig

    cfg = VerifyConfig(lengths=LENGTHS, progress=False)
    fsdp2, megatron = _layouts()
    out = {}
    with cpu_shims():
        batch = make_global_batch(cfg.lengths, cfg.model.seq_length, cfg.model.vocab_size)
        refs = reference_grads(cfg.model, [fsdp2, *megatron], batch)
        out["fsdp2_runs"] = torch_fsdp2_runs()
        if out["fsdp2_runs"]:
            out.update(_fsdp2(cfg, batch, refs, fsdp2))
        else:
            out["fsdp2_upstream_stops"] = _upstream_stops(cfg, batch, fsdp2)
        for layout in megatron:
            for mode in ("token", "microbatch"):
                grads, n = run_layout(layout, mode, cfg, batch)
                out[(layout.name, mode, "ours")] = {**_errors(grads, refs, layout), "num_tokens": n}
                if megatron_fsdp_limited(layout):
                    grads, _ = run_layout(layout, mode, cfg, batch, extension=False)
                    out[(layout.name, mode, "upstream")] = _errors(grads, refs, layout)
        for layout in megatron[:4:2]:  # no_shard and optim without the overlap: the hazard
            out[(layout.name, "token", "no_sync always")] = _errors(
                _no_sync_always(layout, cfg, batch, "token"), refs, layout
            )
        if out["fsdp2_runs"]:
            out["units"] = _unit_checks(cfg, fsdp2)
        out.update(_expert_dp_one(cfg, batch))
    return out


def _expert_dp_one(cfg, batch) -> dict:
    """MoE with EP 2 at DP 2 (the experts' data-parallel group has one rank) on Megatron-FSDP
    optim_grads_params, in both modes through install(), and upstream's own microbatch step: (error
    against the mode's reference, worst error of a non-expert parameter), or the refusal."""
    from megatron_ga_ext.errors import LossContractError
    from megatron_ga_ext.verify.harness import relative_error, run_layout
    from megatron_ga_ext.verify.layouts import Layout
    from megatron_ga_ext.verify.references import reference_grads

    layout = Layout(
        data_parallel_size=2,
        num_microbatches=2,
        model="moe",
        expert_model_parallel_size=2,
        data_parallel="megatron_fsdp",
        sharding_strategy="optim_grads_params",
    )
    refs = reference_grads(cfg.model, [layout], batch)
    out = {}
    for mode, target, extension in (
        ("token", "token", True),
        ("microbatch", "mean_of_means", True),
        ("microbatch", "mean_of_means", False),
    ):
        key = ("expert_dp_one", mode, "ours" if extension else "upstream")
        try:
            grads, _ = run_layout(layout, mode, cfg, batch, extension=extension)
        except LossContractError as exc:
            out[key] = str(exc)
            continue
        ref = refs[(layout.name, target)]
        dense = {n: g for n, g in grads.items() if "local_experts" not in n}
        out[key] = (relative_error(grads, ref), relative_error(dense, ref))
    return out


def _fsdp2(cfg, batch, refs, fsdp2) -> dict:
    """torch FSDP2 through install() in both modes, upstream's own per-token step, and ours with the
    fix reverted."""
    from megatron_ga_ext.verify.harness import run_layout
    from tests.support.faults import fsdp2_sum_reverted

    out = {}
    for mode in ("token", "microbatch"):
        grads, n = run_layout(fsdp2, mode, cfg, batch)
        out[("fsdp2", mode, "ours")] = {**_errors(grads, refs, fsdp2), "num_tokens": n}
    grads, _ = run_layout(fsdp2, "token", cfg, batch, extension=False)
    out[("fsdp2", "token", "upstream")] = _errors(grads, refs, fsdp2)
    with fsdp2_sum_reverted():
        grads, _ = run_layout(fsdp2, "token", cfg, batch)
    out[("fsdp2", "token", "reverted")] = _errors(grads, refs, fsdp2)
    return out


def _upstream_stops(cfg, batch, fsdp2) -> str:
    """Before 0.19: upstream's own FSDP2 step (mean of means, no extension) and the error it stops
    with."""
    from megatron_ga_ext.verify.harness import run_layout

    try:
        run_layout(fsdp2, "microbatch", cfg, batch, extension=False)
    except TypeError as exc:
        return str(exc)
    return ""


@pytest.fixture(scope="module")
def outcomes():
    from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

    warnings.filterwarnings("ignore", category=UserWarning)
    return run_on_ranks(_run, 2, (), LaunchConfig(timeout_s=400))


def _needs_fsdp2(outcomes) -> None:
    from megatron_ga_ext.verify.data_parallel import TORCH_FSDP2_BEFORE_0_19

    if not outcomes[0]["fsdp2_runs"]:
        pytest.skip(TORCH_FSDP2_BEFORE_0_19)


def test_upstream_torch_fsdp2_stops_before_0_19(outcomes):
    """0.16-0.18: finalize passes finish_grad_sync a force_all_reduce the FSDP2 wrapper does not
    take."""
    if outcomes[0]["fsdp2_runs"]:
        pytest.skip("this megatron-core's torch FSDP2 wrapper takes force_all_reduce")
    assert all("force_all_reduce" in rank["fsdp2_upstream_stops"] for rank in outcomes)


def test_torch_fsdp2_token_mode_is_exact_where_upstream_is_n_over_dp_off(outcomes):
    _needs_fsdp2(outcomes)
    for rank in outcomes:
        ours, upstream = rank[("fsdp2", "token", "ours")], rank[("fsdp2", "token", "upstream")]
        assert ours["complete"] and ours["num_tokens"] == 34
        assert ours["token"] < 1e-5
        assert upstream["factor"] == pytest.approx(17.0, rel=1e-5)  # N / (DP x CP) = 34 / 2
        assert upstream["token"] == pytest.approx(16.0, rel=1e-4)


def test_torch_fsdp2_fails_with_the_fix_reverted(outcomes):
    _needs_fsdp2(outcomes)
    for rank in outcomes:
        reverted = rank[("fsdp2", "token", "reverted")]
        assert reverted["factor"] == pytest.approx(17.0, rel=1e-5) and reverted["token"] > 1


def test_torch_fsdp2_microbatch_mode_is_upstream_mean_of_means(outcomes):
    _needs_fsdp2(outcomes)
    for rank in outcomes:
        ours = rank[("fsdp2", "microbatch", "ours")]
        assert ours["complete"] and ours["mean_of_means"] < 1e-5 and ours["token"] > 1e-2


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_megatron_fsdp_is_exact_in_every_strategy_and_mode(outcomes, strategy):
    """With and without --overlap-grad-reduce, in both modes; where megatron-core 0.16's or 0.17's
    own step is off (data_parallel.MEGATRON_FSDP_OFF), the extension's step equals upstream's."""
    from megatron_ga_ext.verify.layouts import Layout

    for overlap, rank in ((overlap, rank) for overlap in (False, True) for rank in outcomes):
        name = Layout(
            data_parallel_size=2,
            num_microbatches=2,
            data_parallel="megatron_fsdp",
            sharding_strategy=strategy,
            overlap_grad_reduce=overlap,
        ).name
        token, microbatch = rank[(name, "token", "ours")], rank[(name, "microbatch", "ours")]
        if (
            name,
            "token",
            "upstream",
        ) in rank:  # megatron_fsdp_limited: upstream's own step is off as well
            for mode, ours in (("token", token), ("microbatch", microbatch)):
                upstream = rank[(name, mode, "upstream")]
                assert (
                    ours["token"] == pytest.approx(upstream["token"], rel=1e-5)
                    and upstream["token"] > 1e-2
                )
            continue
        assert token["complete"] and token["num_tokens"] == 34 and token["token"] < 1e-5
        assert microbatch["complete"] and microbatch["mean_of_means"] < 1e-5
        assert (
            token["mean_of_means"] > 1e-2 and microbatch["token"] > 1e-2
        )  # the two targets differ on this batch


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_no_sync_wired_as_megatron_lm_does(outcomes, strategy):
    """Megatron-LM sets no_sync_func only with --overlap-grad-reduce (training.py); wired always,
    Megatron-FSDP no_shard and optim reduce twice in token mode (no_shard: every gradient 2x; optim:
    part of them)."""
    from megatron_ga_ext.verify.layouts import Layout

    name = Layout(
        data_parallel_size=2,
        num_microbatches=2,
        data_parallel="megatron_fsdp",
        sharding_strategy=strategy,
    ).name
    if (name, "token", "upstream") in outcomes[0]:
        pytest.skip(
            "megatron-core 0.16-0.17: upstream's own step with Megatron-LM's wiring is off "
            "(MEGATRON_FSDP_OFF)"
        )
    for rank in outcomes:
        hazard = rank[(name, "token", "no_sync always")]
        assert (
            hazard["token"] > 0.5
        )  # the same layouts are exact with Megatron-LM's wiring (test above)
        if strategy == "no_shard":
            assert hazard["factor"] == pytest.approx(2.0, rel=1e-5)


def test_expert_data_parallel_group_of_one_rank(outcomes):
    """Upstream #6660's setting (a gradient buffer whose data-parallel group has one rank,
    optim_grads_params).

    On megatron-core 0.16 it doubles, and integration/fsdp.check_megatron_fsdp refuses it in both
    modes. From 0.17 no doubling: token mode (scaling factor 1) is exact; in microbatch mode
    Megatron-FSDP multiplies the experts' accumulated gradient by 1 / DP before each micro-batch's
    reduction on the unfused path (gloo's, and bf16 gradients'), so upstream's own step misses the
    mean of means in the expert gradients alone, and install() refuses the step, naming token mode
    as the fix."""
    for rank in outcomes:
        ours = {mode: rank[("expert_dp_one", mode, "ours")] for mode in ("token", "microbatch")}
        if isinstance(ours["token"], str):  # megatron-core 0.16 doubles: refused at finalize
            for refusal in ours.values():
                assert "Megatron-LM #6660" in refusal
                assert "an expert gradient buffer whose data-parallel group has one rank" in refusal
            continue
        token, _ = ours["token"]
        assert token < 1e-5
        refusal = ours["microbatch"]
        assert isinstance(refusal, str), refusal
        assert "an expert gradient buffer whose data-parallel group has one rank" in refusal
        assert "scaling factor 0.5 (1 / DP) before every micro-batch's reduction" in refusal
        assert (
            "at 2 micro-batches" in refusal
            and "Use --ga-loss-reduction token (exact here)" in refusal
        )
        upstream, upstream_dense = rank[("expert_dp_one", "microbatch", "upstream")]
        assert upstream > 1e-1 and upstream_dense < 1e-5


def test_wire_sync_follows_the_overlap():
    """The harness's wiring itself, on stand-in chunks of the wrapper types it recognises by
    name."""
    from types import SimpleNamespace

    from megatron_ga_ext.verify.data_parallel import wire_sync

    def chunk(kind, overlap):
        return type(
            kind,
            (),
            {"ddp_config": SimpleNamespace(overlap_grad_reduce=overlap), "no_sync": object()},
        )()

    for kind in (
        "DistributedDataParallel",
        "FullyShardedDataParallel",
        "TorchFullyShardedDataParallel",
    ):
        config = SimpleNamespace(no_sync_func="unset")
        wire_sync(config, [chunk(kind, False)])
        assert config.no_sync_func is None
        one = chunk(kind, True)
        wire_sync(config, [one])
        assert config.no_sync_func is (None if kind.startswith("Torch") else one.no_sync)
    two = [chunk("DistributedDataParallel", True), chunk("DistributedDataParallel", True)]
    wire_sync(config, two)
    assert config.no_sync_func == [c.no_sync for c in two]


def test_fsdp2_units_checked_each_step_and_upstream_never_scaled_twice(outcomes):
    _needs_fsdp2(outcomes)
    for rank in outcomes:
        units = rank["units"]
        assert units["upstream_scales"] is False
        assert (
            "--ga-noise-scale with --use-torch-fsdp2: torch FSDP2 reduce-scatters each"
            in units["noise_scale"]
        )
        assert "--ga-loss-reduction microbatch needs factor None" in units["microbatch_on_summing"]
        assert (
            "torch FSDP2 unit 'chunk 0 decoder.layers.0' reduces its gradients with gradient "
            "divide factor 2.0" in (units["user_factor"])
        )
        assert units["fixed_upstream_scales"] is True and units["fixed_upstream_calls"] == [0.5]
        assert (
            units["grad_after_fixed_upstream"] == 1.0
        )  # upstream's own scale_gradients did it (here: recorded)
        assert units["grad_after_noop_upstream"] == 0.5
