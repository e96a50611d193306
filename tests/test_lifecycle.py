"""install() / uninstall() on real megatron-core, in this process: what is patched, and put back."""

import argparse
import importlib
import importlib.util
import inspect
import logging
import re
import sys
import types

import pytest

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
from megatron.core import num_microbatches_calculator as calculators  # noqa: E402

import megatron_ga_ext  # noqa: E402
from megatron_ga_ext import CompatError, GAConfig, GuardError, ScheduleError, add_args  # noqa: E402
from megatron_ga_ext.errors import OptionError  # noqa: E402
from megatron_ga_ext.integration.compat import (  # noqa: E402
    FINALIZE,
    TARGETS,
    live_targets,
    matching_sources,
    megatron_core_version,
)
from megatron_ga_ext.integration.features.aux_losses import AuxLosses  # noqa: E402
from megatron_ga_ext.integration.features.guards import Guards  # noqa: E402
from megatron_ga_ext.integration.guards import GuardedCalculator  # noqa: E402
from megatron_ga_ext.integration.lifecycle import install, installed, uninstall  # noqa: E402

finalize_module = importlib.import_module(FINALIZE)
CORE_TARGETS = [
    t for t in live_targets(TARGETS) if not t.optional
]  # megatron.training is not in every wheel
ORIGINALS = {t.qualified: t.resolve() for t in CORE_TARGETS}
STEP_SCHEDULES = (
    "step_batch_size_schedule"
    in inspect.signature(calculators.init_num_microbatches_calculator).parameters
)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """Uninstall before monkeypatch undoes its own changes (it is set up first, so torn down
    last)."""
    uninstall()
    calculators.unset_num_microbatches_calculator()
    yield
    uninstall()
    calculators.unset_num_microbatches_calculator()
    sys.modules.pop("standin_training", None)


def standin_training() -> types.ModuleType:
    """A stand-in for megatron.training.training: binds names with `from ... import` before
    install()."""
    module = types.ModuleType("standin_training")
    exec(
        "from megatron.core.distributed import finalize_model_grads\nfrom "
        "megatron.core.num_microbatches_calculator import get_num_microbatches, "
        "update_num_microbatches\n",
        module.__dict__,
    )
    sys.modules[module.__name__] = module
    return module


def patched_now() -> dict:
    return {t.qualified: t.resolve() for t in CORE_TARGETS}


def test_install_patches_and_reaches_names_bound_before_it():
    training = standin_training()
    assert (
        training.finalize_model_grads
        is ORIGINALS[f"{finalize_module.__name__}.finalize_model_grads"]
    )
    state = install()
    assert installed() is state and state.version == megatron_core_version()
    assert (
        schedules.forward_step_calc_loss
        is not ORIGINALS[f"{schedules.__name__}.forward_step_calc_loss"]
    )
    wrapper = finalize_module.finalize_model_grads
    assert wrapper is state.finalize
    import megatron.core.distributed as distributed

    assert distributed.finalize_model_grads is wrapper
    assert training.finalize_model_grads is wrapper  # bound before install(), reached anyway
    # A module imported after install() binds the wrapper too.
    late = types.ModuleType("late")
    exec("from megatron.core.distributed import finalize_model_grads", late.__dict__)
    assert late.finalize_model_grads is wrapper
    uninstall()
    assert patched_now() == ORIGINALS
    assert (
        training.finalize_model_grads
        is ORIGINALS[f"{finalize_module.__name__}.finalize_model_grads"]
    )


def test_install_twice_uninstall_twice_and_in_both_orders():
    uninstall()  # nothing installed: harmless
    first = install()
    assert install() is first  # same config: the same installation, no second layer
    assert (
        schedules.forward_step_calc_loss.__wrapped__
        is ORIGINALS[f"{schedules.__name__}.forward_step_calc_loss"]
    )
    uninstall()
    uninstall()
    assert patched_now() == ORIGINALS
    install(GAConfig(loss_reduction="microbatch"))
    second = install(GAConfig(loss_reduction="token"))  # a new config replaces the old installation
    assert second.config.loss_reduction == "token" and installed() is second
    assert (
        schedules.forward_step_calc_loss.__wrapped__
        is ORIGINALS[f"{schedules.__name__}.forward_step_calc_loss"]
    )
    uninstall()
    assert patched_now() == ORIGINALS


def _changed_forward_step_calc_loss(
    model,
    output_tensor,
    loss_func,
    config,
    vp_stage,
    collect_non_loss_data,
    num_microbatches,
    forward_data_store,
    cp_group_size=None,
    is_last_stage=None,
):
    return output_tensor, 0  # a release we never saw


def test_unknown_fingerprint_refused_in_strict_mode_and_warned_otherwise(monkeypatch, caplog):
    this_source = "|".join(
        re.escape(name) for name in matching_sources()
    )  # what this tree's functions match
    assert this_source, "every hooked function of the megatron-core under test is a tested one"
    monkeypatch.setattr(schedules, "forward_step_calc_loss", _changed_forward_step_calc_loss)
    version = megatron_core_version()
    with pytest.raises(
        CompatError,
        match=rf"unknown upstream source in megatron-core {version}: "
        r"\S+forward_step_calc_loss has fingerprint [0-9a-f]{16}, which no tested source has, "
        r"and its behaviour changed: .*\(tested sources: \(6, 3\), undivided\).*\. The "
        r"nearest tested source is "
        rf"({this_source}) \(\d+ of \d+ hooked functions identical\).*tested on 0\.16\.1, "
        r"0\.17\.1, 0\.18\.2, 0\.19\.2, main@9f3fe8c925fb.*--no-ga-strict",
    ):
        install(GAConfig())
    assert (
        installed() is None and schedules.forward_step_calc_loss is _changed_forward_step_calc_loss
    )
    with caplog.at_level(logging.WARNING, logger="megatron_ga_ext.integration.compat"):
        install(GAConfig(strict=False))
    assert "forward_step_calc_loss" in caplog.text and version in caplog.text
    uninstall()
    assert schedules.forward_step_calc_loss is _changed_forward_step_calc_loss


def test_add_args_flags_and_config_from_args():
    parser = add_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--ga-loss-reduction",
            "microbatch",
            "--ga-zero-token-policy",
            "skip",
            "--no-ga-strict",
            "--ga-convert-rampup",
            "--step-batch-size-schedule",
            "0:16 100:32",
        ]
    )
    config = GAConfig.from_args(args)
    assert (
        config.loss_reduction,
        config.zero_token_policy,
        config.strict,
        config.convert_rampup,
    ) == (
        "microbatch",
        "skip",
        False,
        True,
    )
    assert config.step_batch_size_schedule == "0:16 100:32"
    assert GAConfig.from_args(parser.parse_args([])) == GAConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--ga-loss-reduction", "mean"])
    help_text = parser.format_help()
    for flag in (
        "--ga-loss-reduction",
        "--ga-zero-token-policy",
        "--ga-strict",
        "--no-ga-strict",
        "--ga-convert-rampup",
        "--step-batch-size-schedule",
    ):
        assert flag in help_text
    # A release that has the schedule flag keeps its own; no argparse conflict.
    upstream = argparse.ArgumentParser()
    upstream.add_argument("--step-batch-size-schedule", default="upstream")
    assert add_args(upstream).parse_args([]).step_batch_size_schedule == "upstream"


def init_calculator(
    global_batch_size,
    micro_batch_size,
    data_parallel_size,
    rampup=None,
    schedule=None,
    seq_length=None,
):
    """Call megatron-core's own init as its training code does for this release."""
    if STEP_SCHEDULES:
        calculators.init_num_microbatches_calculator(
            0,
            rampup,
            global_batch_size,
            micro_batch_size,
            data_parallel_size,
            step_batch_size_schedule=schedule,
            seq_length=seq_length,
        )
    else:
        calculators.init_num_microbatches_calculator(
            0, rampup, global_batch_size, micro_batch_size, data_parallel_size
        )


def test_calculator_backport_and_consumed_samples_guard():
    install(GAConfig(step_batch_size_schedule="0:16 64:32 160:64", pipeline_model_parallel_size=2))
    init_calculator(16 if not STEP_SCHEDULES else None, 2, 4)
    live = calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    assert isinstance(live, GuardedCalculator)
    assert type(live.inner).__name__ == "StepScheduleCalculator"
    seen, consumed = [], 0
    calculators.update_num_microbatches(0, consistency_check=True)
    while consumed < 300:
        calculators.update_num_microbatches(consumed, consistency_check=False)
        calculators.update_num_microbatches(consumed, consistency_check=True)
        seen.append(
            (calculators.get_current_global_batch_size(), calculators.get_num_microbatches())
        )
        consumed += 2 * 4 * calculators.get_num_microbatches()
    assert seen == [(16, 2)] * 4 + [(32, 4)] * 3 + [(64, 8)] * 3
    with pytest.raises(GuardError, match=r"128 = 64 x PP 2: pipeline parallelism never multiplies"):
        calculators.update_num_microbatches(consumed - 64 + 128, consistency_check=False)
    uninstall()
    assert (
        type(calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR).__name__ == "StepScheduleCalculator"
    )


def test_rampup_converted_or_left_to_upstream(caplog):
    install(GAConfig(convert_rampup=True, rampup_batch_size=(16, 8, 300000)))
    init_calculator(1024, 4, 2, rampup=[16, 8, 300000])
    live = calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    assert type(live.inner).__name__ == "StepScheduleCalculator"
    assert len(live.inner.step_schedule.stages) == 127
    uninstall()
    calculators.unset_num_microbatches_calculator()
    install(GAConfig(rampup_batch_size=(16, 8, 300000)))
    with caplog.at_level(logging.WARNING):
        init_calculator(1024, 4, 2, rampup=None if STEP_SCHEDULES else [16, 8, 300000])
    inner = calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR.inner
    if STEP_SCHEDULES:  # 0.18+: upstream drops the rampup; we say so
        assert type(inner).__name__ == "ConstantNumMicroBatchesCalculator"
        assert "--ga-convert-rampup" in caplog.text
    else:
        assert type(inner).__name__ == "RampupBatchsizeNumMicroBatchesCalculator"


def test_public_api_exports_install():
    assert megatron_ga_ext.install is install and megatron_ga_ext.uninstall is uninstall
    assert megatron_ga_ext.add_args is add_args


@pytest.fixture
def megatron_training(monkeypatch):
    """Stand-ins for Megatron-LM's megatron.training (not in the megatron-core wheel): args not
    parsed yet."""
    training = types.ModuleType("megatron.training")
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = None
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    return global_vars


def test_install_at_import_time_reads_megatron_args_once_parsed(megatron_training):
    state = install()  # the one line at the top of pretrain_gpt.py, before Megatron parses its args
    assert state.waiting_for_args and state.config == GAConfig() and state.contract is not None
    megatron_training._GLOBAL_ARGS = add_args(argparse.ArgumentParser()).parse_args(
        ["--ga-loss-reduction", "microbatch", "--step-batch-size-schedule", "0:16 64:32"]
    )
    init_calculator(16 if not STEP_SCHEDULES else None, 2, 4)  # Megatron's first call after parsing
    assert not state.waiting_for_args
    assert state.config.loss_reduction == "microbatch" and state.contract is None
    assert state.finalize.config.loss_reduction == "microbatch"
    assert (
        type(calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR.inner).__name__
        == "StepScheduleCalculator"
    )


def test_strictness_waits_for_megatron_args_too(megatron_training, monkeypatch):
    monkeypatch.setattr(schedules, "forward_step_calc_loss", _changed_forward_step_calc_loss)
    state = install()  # unknown source, but --no-ga-strict may still come
    assert state.waiting_for_args
    megatron_training._GLOBAL_ARGS = add_args(argparse.ArgumentParser()).parse_args([])
    with pytest.raises(
        CompatError,
        match=r"forward_step_calc_loss has fingerprint [0-9a-f]{16}, which no tested source has",
    ):
        init_calculator(16, 2, 4)
    uninstall()
    megatron_training._GLOBAL_ARGS = None
    state = install()
    megatron_training._GLOBAL_ARGS = add_args(argparse.ArgumentParser()).parse_args(
        ["--no-ga-strict"]
    )
    init_calculator(16, 2, 4)
    assert not state.waiting_for_args and state.config.strict is False
    uninstall()
    megatron_training._GLOBAL_ARGS = None
    install()  # and if Megatron never parses args (megatron-core only), the defaults hold: strict
    with pytest.raises(CompatError, match=r"forward_step_calc_loss"):
        init_calculator(16, 2, 4)


def test_config_refuses_unknown_choices():
    with pytest.raises(
        megatron_ga_ext.GAError, match=r"--ga-loss-reduction 'mean' is not one of token, microbatch"
    ):
        GAConfig(loss_reduction="mean")
    with pytest.raises(
        ValueError, match=r"--ga-zero-token-policy 'ignore' is not one of error, skip"
    ):
        GAConfig(zero_token_policy="ignore")


def test_uninstall_reaches_modules_imported_after_install_and_leaves_wrappers_inert():
    state = install()
    late = types.ModuleType("late_binder")
    exec(
        "from megatron.core.distributed.finalize_model_grads import finalize_model_grads\nfrom "
        "megatron.core.pipeline_parallel.schedules import forward_step_calc_loss",
        late.__dict__,
    )
    sys.modules[late.__name__] = late
    try:
        assert late.finalize_model_grads is state.finalize
        wrapper = late.forward_step_calc_loss
        uninstall()
        assert late.finalize_model_grads is ORIGINALS[f"{FINALIZE}.finalize_model_grads"]
        assert (
            late.forward_step_calc_loss is ORIGINALS[f"{schedules.__name__}.forward_step_calc_loss"]
        )
        # A wrapper someone kept a reference to calls straight through once uninstalled.
        assert not state.active and state.finalize.active is False
        assert wrapper is not late.forward_step_calc_loss
    finally:
        sys.modules.pop(late.__name__)


def parsed(*flags: str) -> argparse.Namespace:
    """Megatron's flags that install() reads at parse time, plus the --ga-* flags."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser.add_argument("--train-iters", type=int)
    parser.add_argument("--train-samples", type=int)
    return add_args(parser).parse_args(list(flags))


@pytest.mark.parametrize(
    "flags, error, message",
    [
        (
            [],
            OptionError,
            r"--ga-loss-reduction token \(the default\) needs --calculate-per-token-loss",
        ),
        (
            ["--ga-loss-reduction", "microbatch", "--calculate-per-token-loss"],
            OptionError,
            r"--ga-loss-reduction microbatch is upstream's mean of means, but "
            r"--calculate-per-token-loss",
        ),
        (
            [
                "--calculate-per-token-loss",
                "--step-batch-size-schedule",
                "0:16 64:32",
                "--train-iters",
                "100",
            ],
            ScheduleError,
            r"--step-batch-size-schedule with --train-iters 100: .* Give --train-samples",
        ),
    ],
)
def test_args_are_checked_when_megatron_has_parsed_them(megatron_training, flags, error, message):
    install()  # at the top of pretrain_gpt.py: nothing to check yet
    megatron_training._GLOBAL_ARGS = parsed(*flags)
    with pytest.raises(
        error, match=message
    ):  # Megatron's first call after parsing: before any model exists
        init_calculator(16, 2, 4)
    uninstall()
    megatron_training._GLOBAL_ARGS = None
    with pytest.raises(error, match=message):  # the args given to install() directly
        install(parsed(*flags))


def test_step_schedule_sizes_the_run_of_megatrons_training_loop(monkeypatch):
    """--train-samples under a converted rampup: the planned steps, not train_samples // GBS (fails
    before the fix)."""
    if (
        importlib.util.find_spec("megatron.training") is None
    ):  # in the 0.19.2 wheel; not in 0.16.1's
        pytest.skip("this megatron-core has no megatron.training")
    training = importlib.import_module(
        "megatron.training.training"
    )  # a missing dependency fails, never skips
    global_vars = sys.modules["megatron.training.global_vars"]
    args = argparse.Namespace(
        train_iters=None,
        train_samples=150,
        global_batch_size=24,
        rampup_batch_size=["8", "8", "64"],
        step_batch_size_schedule=None,
        full_validation=False,
        skip_train=False,
        eval_interval=1000,
        start_eval_at_iter=None,
        eval_iters=0,
        phase_transition_iterations=None,
        iteration=0,
    )
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    init_calculator(24, 2, 2, rampup=[8, 8, 64])
    training.update_train_iters(
        args
    )  # upstream's own count: 150 // 24 = 6 where it ignores the rampup (0.19+)
    upstream_train_iters, args.train_iters, args.train_samples = args.train_iters, None, 160
    calculators.unset_num_microbatches_calculator()
    install(GAConfig(convert_rampup=True, rampup_batch_size=(8, 8, 64)))
    init_calculator(24, 2, 2, rampup=[8, 8, 64])
    training.update_train_iters(args)
    assert args.train_iters == 10  # 4 x 8, 2 x 16, 4 x 24 = 160 samples; upstream: 160 // 24 = 6
    args.train_samples = (
        150  # the last step passes --train-samples: the dataset must hold its samples
    )
    args.train_iters = None
    training.update_train_iters(args)
    assert args.train_iters == 10 and training.get_train_valid_test_num_samples()[0] == 160
    uninstall()
    calculators.unset_num_microbatches_calculator()
    init_calculator(24, 2, 2, rampup=[8, 8, 64])
    args.train_iters = None
    training.update_train_iters(args)
    assert args.train_iters == upstream_train_iters != 10


@pytest.mark.parametrize("mode", ["token", "microbatch"])
def test_installed_loss_step_by_position_and_by_keyword(mode):
    """Megatron calls forward_step_calc_loss by position; a caller may name the arguments. Both
    calls count the forward step for its chunk and check (token) or report the mean of (microbatch)
    the loss function's outputs."""
    import torch
    from megatron.core.transformer import TransformerConfig

    from megatron_ga_ext.integration.loss_contract import masked_loss

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, calculate_per_token_loss=mode == "token"
    )
    losses, mask = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1, 1, 0])
    state = install(GAConfig(loss_reduction=mode))
    chunk, store = torch.nn.Linear(1, 1), []
    values = {
        "model": chunk,
        "output_tensor": losses,
        "loss_func": lambda out: masked_loss(out, mask),
        "config": config,
        "vp_stage": None,
        "collect_non_loss_data": False,
        "num_microbatches": 2,
        "forward_data_store": store,
        "cp_group_size": 1,
        "is_last_stage": True,
    }
    names = list(
        inspect.signature(ORIGINALS[f"{schedules.__name__}.forward_step_calc_loss"]).parameters
    )
    schedules.forward_step_calc_loss(*[values[name] for name in names])
    schedules.forward_step_calc_loss(**values)
    assert state.feature(Guards).counter.counts == {chunk: 2}
    if mode == "token":
        assert state.contract.microbatches == 2
        assert state.contract.collect(torch.device("cpu"), is_last_stage=True).tolist() == [
            4,
            0,
            0,
            0,
        ]
    assert [report["lm loss"].tolist() for report in store] == [
        [3.0, 2.0] if mode == "token" else [1.5, 1.0]
    ] * 2


def test_padding_mask_forward_masks_moe_models_and_stays_a_class_attribute():
    """GPTModel.forward's wrapper gives a MoE model that has a loss mask and no padding mask
    padding_mask = (loss_mask == 0), leaves a dense model's call as it is, keeps a subclass's own
    forward (which calls it through super()), and leaves nothing on the instances: a class-level
    patch applied later reaches every model."""
    import torch

    from megatron_ga_ext.integration.features.aux_losses import padding_mask_forward

    state = install()
    seen = []

    def forward(model, *args, **kwargs):
        padding_mask = kwargs.get("padding_mask")
        seen.append((model, None if padding_mask is None else padding_mask.tolist()))

    class Model:
        def __init__(self, experts, balancing="aux_loss"):
            self.config = types.SimpleNamespace(
                num_moe_experts=experts,
                sequence_parallel=False,
                moe_router_load_balancing_type=balancing,
            )

    class Subclass(Model):
        def forward(self, *args, **kwargs):
            seen.append("subclass")
            return super().forward(*args, **kwargs)

    Model.forward = padding_mask_forward(forward, state)
    dense, moe, sub = Model(None), Model(4), Subclass(None)
    for model in (dense, moe, sub, dense, moe, sub):
        model.forward(loss_mask=torch.tensor([1, 0]))
    assert seen == [(dense, None), (moe, [False, True]), "subclass", (sub, None)] * 2
    # quantile balancing: no load-balancing loss, and upstream's router refuses a padding mask there
    seen.clear()
    for balancing in ("quantile_balancing", ["aux_loss", "quantile_balancing"]):
        quantile = Model(4, balancing)
        quantile.forward(loss_mask=torch.tensor([1, 0]))
        assert seen.pop() == (quantile, None)
    seen.clear()
    assert not any("forward" in model.__dict__ for model in (dense, moe, sub))
    later = []
    Model.forward = lambda model, *args, **kwargs: later.append(model)
    for model in (dense, moe, sub):
        model.forward(loss_mask=torch.tensor([1, 0]))
    assert later == [dense, moe, sub]
    uninstall()


def test_a_call_without_a_loss_mask_gets_the_one_bridges_get_batch_kept():
    """Bridge's GPT step calls the model without loss_mask (Bridge #6103): the mask its get_batch
    kept is given to the next call, once, where it has the labels' shape; a call that passes its own
    keeps it."""
    import torch

    from megatron_ga_ext.integration.features.aux_losses import padding_mask_forward

    state = install()
    seen = []

    def forward(model, *args, **kwargs):
        seen.append((kwargs.get("loss_mask"), kwargs.get("padding_mask")))

    model = types.SimpleNamespace(
        config=types.SimpleNamespace(
            num_moe_experts=4, sequence_parallel=False, moe_router_load_balancing_type="aux_loss"
        )
    )
    wrapped, kept, own = (
        padding_mask_forward(forward, state),
        torch.tensor([[1, 0]]),
        torch.tensor([[1, 1]]),
    )
    labels = torch.zeros(1, 2)
    aux = state.feature(AuxLosses)
    aux.host_loss_mask = kept
    wrapped(model, labels=labels)
    wrapped(model, labels=labels)  # used once
    aux.host_loss_mask = kept
    wrapped(model, labels=labels, loss_mask=own)
    aux.host_loss_mask = kept
    wrapped(model, labels=torch.zeros(1, 3))  # another batch's shape: not this call's
    assert [
        (None if m is None else m.tolist(), None if p is None else p.tolist()) for m, p in seen
    ] == [
        ([[1, 0]], [[False, True]]),
        (None, None),
        ([[1, 1]], [[False, False]]),
        (None, None),
    ]
    assert aux.host_loss_mask is None
    uninstall()


def test_uninstall_leaves_a_wrapper_other_code_put_on_top_of_ours():
    """restore() puts an original back only where our replacement is still what is bound. Where
    other code wrapped ours after install(), its wrapper stays bound; ours beneath it is inert
    (calls upstream straight through), so the stack behaves as that wrapper over upstream's
    function."""
    import functools

    from megatron.core.models.gpt.gpt_model import GPTModel

    state = install()
    ours, ours_forward = schedules.forward_step_calc_loss, GPTModel.__dict__["forward"]

    @functools.wraps(ours)
    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    def their_forward(self, *args, **kwargs):
        return ours_forward(self, *args, **kwargs)

    schedules.forward_step_calc_loss, GPTModel.forward = theirs, their_forward
    training = standin_training()  # a module that bound our finalize since: put back there
    assert training.finalize_model_grads is state.finalize
    try:
        uninstall()
        assert (
            schedules.forward_step_calc_loss is theirs
            and GPTModel.__dict__["forward"] is their_forward
        )
        assert not state.active  # ours beneath theirs calls the original straight through
        assert training.finalize_model_grads is ORIGINALS[f"{FINALIZE}.finalize_model_grads"]
    finally:
        schedules.forward_step_calc_loss = ORIGINALS[f"{schedules.__name__}.forward_step_calc_loss"]
        GPTModel.forward = state_forward_original(ours_forward)


def state_forward_original(wrapper):
    """The function a functools.wraps wrapper wraps (GPTModel.forward before install())."""
    return getattr(wrapper, "__wrapped__", wrapper)


def test_a_partial_finalize_adopted_into_a_config_is_restored_and_a_reinstall_adopts_the_old_wrapper():
    import functools

    class Config:  # a model config as adopt_finalize sees it (weakly referenced)
        finalize_model_grads_func = None

    config = Config()
    upstream = ORIGINALS[f"{FINALIZE}.finalize_model_grads"]
    held = functools.partial(upstream, force_all_reduce=False)
    config.finalize_model_grads_func = held
    first = install()
    first.adopt_finalize(config)
    assert config.finalize_model_grads_func.func is first.finalize
    assert config.finalize_model_grads_func.keywords == {"force_all_reduce": False}
    config.finalize_model_grads_func = (
        first.finalize
    )  # what Megatron-LM's loop sets (training.py binds the name)
    second = install(GAConfig(checks="async"))
    assert second is not first and not first.active
    second.adopt_finalize(
        config
    )  # the old installation's wrapper, inert now: the new one takes its place
    assert config.finalize_model_grads_func is second.finalize
    uninstall()
    assert (
        config.finalize_model_grads_func is first.finalize
    )  # what the config held when it was adopted
    config.finalize_model_grads_func = held
    third = install()
    third.adopt_finalize(config)
    uninstall()
    assert config.finalize_model_grads_func is held  # the partial object itself
