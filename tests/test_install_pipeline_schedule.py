"""install() on megatron-core's real pipeline schedule: 4 gloo ranks, PP 2 x DP 2, tiny GPT.

One launch checks, in order, as Megatron's training loop drives it:
1. a --rampup-batch-size given with --ga-convert-rampup runs as the exact step schedule (and, on
   0.16.1, as upstream's own rampup calculator), step after step;
2. every step's gradients, through install()'s loss contract and finalize, equal the unpartitioned
   token-level reference;
3. a forward/backward call with num_microbatches multiplied by PP is caught by the guard;
4. a model config that holds upstream's finalize_model_grads (a loop that set it before install())
   gets the extension's at the next step, whose gradients equal the reference again; a step whose
   config holds some other finalize is an error, not a silently unscaled gradient; uninstall() gives
   the config upstream's function back.
"""

import argparse
import inspect

import pytest

pytest.importorskip("megatron.core")

from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

pytestmark = pytest.mark.slow

PP, DP, MBS = 2, 2, 1
RAMPUP = ["2", "2", "12"]  # start 2, +2 every 12 / 3 = 4 samples, up to GBS 8
GBS = 8


def megatron_args(extra: list[str]) -> argparse.Namespace:
    """Megatron's own flags that matter here, plus ours from add_args (as extra_args_provider adds
    them)."""
    from megatron_ga_ext import add_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--global-batch-size", type=int)
    parser.add_argument("--rampup-batch-size", nargs="*")
    parser.add_argument("--seq-length", type=int)
    parser.add_argument("--pipeline-model-parallel-size", type=int)
    add_args(parser)
    return parser.parse_args(
        [
            "--micro-batch-size",
            str(MBS),
            "--global-batch-size",
            str(GBS),
            "--rampup-batch-size",
            *RAMPUP,
            "--seq-length",
            "16",
            "--pipeline-model-parallel-size",
            str(PP),
            *extra,
        ]
    )


def init_calculator(args: argparse.Namespace) -> None:
    """What megatron.training.global_vars does for this release."""
    from megatron.core import num_microbatches_calculator as calculators

    init = calculators.init_num_microbatches_calculator
    if (
        "step_batch_size_schedule" in inspect.signature(init).parameters
    ):  # 0.18+: the rampup is not passed
        init(
            0,
            None,
            args.global_batch_size,
            args.micro_batch_size,
            DP,
            step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None),
            seq_length=args.seq_length,
        )
    else:
        init(0, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size, DP)


def rank_main(wiring: str = "install") -> dict:
    """One rank. ``wiring``: "install" calls install(args); "vendored" relies on a patched
    megatron/core (patches/), which reads Megatron's parsed args (a stand-in for megatron.training's
    global) itself."""
    import sys
    import types

    from megatron_ga_ext.testing.shims import cpu_shims

    args = megatron_args(["--ga-convert-rampup"])
    if wiring == "install":
        import megatron_ga_ext

        megatron_ga_ext.install(args)
    else:
        global_vars = types.ModuleType("megatron.training.global_vars")
        global_vars._GLOBAL_ARGS = args
        sys.modules["megatron.training.global_vars"] = global_vars
    with cpu_shims():
        return _rank_main(args)


def _rank_main(args: argparse.Namespace) -> dict:
    import megatron.core
    from megatron.core import num_microbatches_calculator as calculators

    from megatron_ga_ext.errors import GuardError
    from megatron_ga_ext.integration.lifecycle import installed
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.harness import build_ddp, gradients, relative_error
    from megatron_ga_ext.verify.layouts import Layout
    from megatron_ga_ext.verify.models import init_model_parallel
    from megatron_ga_ext.verify.references import reference_grads
    from megatron_ga_ext.verify.run_config import VerifyConfig
    from megatron_ga_ext.verify.step import train_step

    cfg = VerifyConfig()
    plan = [step_batch(cfg, consumed, m) for consumed, _, m in expected_steps()]
    # The unpartitioned references first: they need TP = PP = 1 state.
    refs = [
        reference_grads(cfg.model, [layout], batch)[(layout.name, "token")]
        for layout, batch in plan
    ]
    init_calculator(args)
    init_model_parallel(pipeline_model_parallel_size=PP)
    ddp, names, config = build_ddp(plan[0][0], cfg, calculate_per_token_loss=True)
    from megatron.core.distributed import (
        finalize_model_grads,
    )  # bound after wiring: the extension's

    def step(layout: Layout, batch) -> None:
        train_step(
            ddp, config, layout, cfg, batch, finalize=finalize_model_grads, loss_func=masked_loss
        )

    evaluate(
        ddp, cfg, *plan[-1]
    )  # an evaluation pass first: its tokens must not reach the next step's count

    consumed, seen, errors = 0, [], []
    calculators.update_num_microbatches(
        consumed, consistency_check=True
    )  # checkpoint load at start
    for (layout, batch), ref in zip(plan, refs):  # Megatron's training loop
        calculators.update_num_microbatches(consumed, consistency_check=False)
        calculators.update_num_microbatches(consumed, consistency_check=True)
        m = calculators.get_num_microbatches()
        seen.append((consumed, calculators.get_current_global_batch_size(), m))
        step(layout, batch)
        mine = gradients(ddp, names)
        errors.append(relative_error(mine, ref))
        consumed += DP * MBS * m
    # The classic mistake: GA counted as GBS / (MBS x DP) x PP.
    layout, batch = step_batch(cfg, 0, calculators.get_num_microbatches() * PP)
    try:
        step(layout, batch)
        guard = None
    except GuardError as error:
        guard = str(error)
    wiring = "vendored" if installed().vendored else "install"
    early = (
        early_bound_finalize(ddp, config, cfg, plan[-1], refs[-1], names)
        if wiring == "install"
        else None
    )
    return {
        "seen": seen,
        "errors": errors,
        "guard": guard,
        "wiring": wiring,
        "megatron": megatron.core.__file__,
        "early_bound": early,
    }


def early_bound_finalize(ddp, config, cfg, step, ref, names) -> dict:
    """Item 4: configs that hold upstream's finalize, or another one, and what uninstall()
    leaves."""
    import megatron_ga_ext
    from megatron_ga_ext.errors import GuardError
    from megatron_ga_ext.integration.lifecycle import installed
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.harness import gradients, relative_error
    from megatron_ga_ext.verify.step import train_step

    layout, batch = step
    state = installed()
    upstream = state.finalize.original
    calls = state.counts.finalizes
    train_step(ddp, config, layout, cfg, batch, finalize=upstream, loss_func=masked_loss)
    adopted = (
        config.finalize_model_grads_func is state.finalize and state.counts.finalizes == calls + 1
    )
    error = relative_error(gradients(ddp, names), ref)

    def custom_finalize(*args, **kwargs):  # a finalize that never divides by the global token count
        return upstream(*args, **kwargs)

    try:
        train_step(ddp, config, layout, cfg, batch, finalize=custom_finalize, loss_func=masked_loss)
        skipped = None
    except GuardError as exc:
        skipped = str(exc)
    # install() with another config: the config still holds the first installation's finalize (as
    # Megatron's loop set it), directly or in a partial; the next step adopts the new one and trains
    # (no GuardError), and uninstall() puts the partial object itself back.
    import dataclasses
    from functools import partial

    megatron_ga_ext.install(dataclasses.replace(state.config, checks="async"))
    second = installed()
    train_step(ddp, config, layout, cfg, batch, finalize=state.finalize, loss_func=masked_loss)
    reinstalled = (
        config.finalize_model_grads_func is second.finalize and second.counts.finalizes == 1
    )
    second.finalize.poll(wait=True)
    error_reinstalled = relative_error(gradients(ddp, names), ref)
    held = partial(state.finalize, force_all_reduce=False)
    train_step(ddp, config, layout, cfg, batch, finalize=held, loss_func=masked_loss)
    adopted_partial = config.finalize_model_grads_func.func is second.finalize
    megatron_ga_ext.uninstall()
    restored_partial = config.finalize_model_grads_func is held
    config.finalize_model_grads_func = upstream
    return {
        "adopted": adopted,
        "error": error,
        "skipped": skipped,
        "restored": restored_partial,
        "reinstalled": reinstalled,
        "error_reinstalled": error_reinstalled,
        "adopted_partial": adopted_partial,
    }


def evaluate(ddp, cfg, layout, batch) -> None:
    """A forward-only pass, as Megatron's evaluate() runs it: no finalize, so no token division."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.step import forward_step, microbatches

    get_forward_backward_func()(
        forward_step_func=partial(forward_step, loss_func=masked_loss),
        data_iterator=iter(microbatches(layout, batch, "cpu")),
        model=[ddp],
        num_microbatches=layout.num_microbatches,
        seq_length=cfg.model.seq_length,
        micro_batch_size=MBS,
        forward_only=True,
    )


def step_batch(cfg, consumed: int, num_microbatches: int):
    """The layout and the global batch of the step that starts at ``consumed`` samples."""
    from megatron_ga_ext.verify.layouts import DEFAULT_LENGTHS, Layout, make_global_batch

    layout = Layout(
        data_parallel_size=DP, num_microbatches=num_microbatches, pipeline_model_parallel_size=PP
    )
    samples = range(consumed, consumed + layout.global_batch_size)
    lengths = tuple(DEFAULT_LENGTHS[i % len(DEFAULT_LENGTHS)] for i in samples)
    return layout, make_global_batch(
        lengths, cfg.model.seq_length, cfg.model.vocab_size, seed=consumed
    )


def expected_steps() -> list[tuple[int, int, int]]:
    from megatron_ga_ext import StepSchedule

    schedule = StepSchedule.from_rampup(*(int(v) for v in RAMPUP), GBS)
    out, consumed = [], 0
    while consumed < 24:
        gbs = schedule.global_batch_size_at(consumed)
        out.append((consumed, gbs, gbs // (MBS * DP)))
        consumed += gbs
    return out


def upstream_rampup_steps() -> list[tuple[int, int, int]] | None:
    """0.16.1's own rampup calculator, stepped the same way (None where the release has none)."""
    from megatron.core import num_microbatches_calculator as calculators

    cls = getattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator", None)
    if cls is None:
        return None
    calc = cls(GBS, MBS, DP, False, 0, *(int(v) for v in RAMPUP))
    out, consumed = [], 0
    while consumed < 24:
        calc.update(consumed, True)
        out.append((consumed, calc.get_current_global_batch_size(), calc.get()))
        consumed += DP * MBS * calc.get()
    return out


def run_and_check(wiring: str) -> None:
    """Launch the ranks and check what they saw (also run on patched trees by test_patches.py)."""
    results = run_on_ranks(
        rank_main, world_size=PP * DP, args=(wiring,), config=LaunchConfig(timeout_s=240)
    )
    expected = expected_steps()
    assert [gbs for _, gbs, _ in expected] == [2, 2, 4, 6, 8, 8]  # the ramp, then the full batch
    upstream = upstream_rampup_steps()
    if upstream is not None:
        assert upstream == expected
    for result in results:
        assert result["wiring"] == wiring
        assert result["seen"] == expected
        assert all(error < 1e-5 for error in result["errors"]), result["errors"]  # NaN fails too
        assert result["guard"] is not None
        assert (
            "num_microbatches=8, but the calculator's num_microbatches = GBS / (MBS x DP) is 4"
            in result["guard"]
        )
        assert (
            "8 = 4 x PP 2: pipeline parallelism never multiplies the global batch size"
            in result["guard"]
        )
        if wiring == "install":
            early = result["early_bound"]
            assert early["adopted"] and early["error"] < 1e-5 and early["restored"], early
            assert (
                early["reinstalled"]
                and early["error_reinstalled"] < 1e-5
                and early["adopted_partial"]
            ), early
            assert early["skipped"] is not None
            assert "never called megatron-ga-ext's finalize_model_grads" in early["skipped"]


def test_install_on_the_real_pipeline_schedule():
    run_and_check("install")
