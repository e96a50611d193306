"""The hook table (integration/hooks.py): one row per Megatron target, the phase it serves, and
install() wiring exactly the rows this source has."""

import re
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")

from megatron_ga_ext import GAConfig
from megatron_ga_ext.integration import hooks
from megatron_ga_ext.integration.compat import TARGETS, megatron_core_version
from megatron_ga_ext.integration.lifecycle import install, uninstall
from megatron_ga_ext.integration.liveness import Counts

#: Fingerprinted because install() reads them (the calculator's interface), not because it wraps
#: them.
READ_ONLY = {
    "megatron.core.num_microbatches_calculator.get_num_microbatches",
    "megatron.core.num_microbatches_calculator.update_num_microbatches",
}


@pytest.fixture(autouse=True)
def clean():
    uninstall()
    yield
    uninstall()


def test_the_fingerprinted_rows_are_the_fingerprinted_targets():
    """Every target but those install() only reads and those whose arithmetic a correction assumes
    (not wrapped)."""
    rows = {hook.qualified for hook in hooks.all_rows() if hook.fingerprinted}
    assert rows == {target.qualified for target in TARGETS if target.assumed_by is None} - READ_ONLY
    assumed = {target.assumed_by for target in TARGETS} - {None}
    assert assumed <= {
        hook.wrap.__name__ for hook in hooks.all_rows() if hook.fingerprinted
    }  # a wrapped correction's


def test_each_row_is_one_target_in_a_known_phase():
    qualified = [hook.qualified for hook in hooks.all_rows()]
    assert len(qualified) == len(set(qualified))
    assert {hook.phase for hook in hooks.all_rows()} == set(hooks.PHASES)
    assert {hook.load for hook in hooks.all_rows()} == {"import", "loaded", "parser"}


class Recording:
    """An Installation double: every method a wrapper calls on it is recorded (and answers what the
    phase would)."""

    ANSWERS: ClassVar[dict[str, Any]] = {
        "before_optimizer_step": SimpleNamespace(skip=False),
        "adopt_live_calculator": False,
    }

    def __init__(self) -> None:
        self.called: list[str] = []
        self.active, self.config, self.contract, self.finalize = True, GAConfig(), object(), None
        self.counts, self.waiting_for_args, self.features = Counts(), False, []
        # wire() has nothing left to do
        self.wiring = SimpleNamespace(settled_hooks={hook.qualified for hook in hooks.all_rows()})

    def current(self) -> "Recording":
        return self

    def __getattr__(self, name: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> Any:
            self.called.append(name)
            return self if name == "feature" else self.ANSWERS.get(name)

        return method


class Optimizer:
    def step(self):
        return True, 1.0, None


def _bridge_state() -> SimpleNamespace:
    checkpoint = SimpleNamespace(save="/save", load=None, non_persistent_ckpt_type=None)
    return SimpleNamespace(
        cfg=SimpleNamespace(checkpoint=checkpoint, train=SimpleNamespace(train_samples=None)),
        train_state=SimpleNamespace(step=2, consumed_train_samples=32),
    )


def _configure(
    rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, *rest
):
    return None


#: Each wrapper that runs a phase of the step: a stand-in for the upstream function, the call, and
#: the phase methods the call must reach. Keyed by the wrapper's name.
PHASE_CALLS: dict[str, tuple[Callable, Callable[[Callable], Any], list[str]]] = {
    "_schedule": (
        lambda *a, **k: None,
        lambda w: w(num_microbatches=1),
        ["begin_step", "end_step"],
    ),
    "_forward_step_calc_loss": (
        lambda model, loss_func: loss_func,
        lambda w: w(None, print),
        ["micro_batch"],
    ),
    "_configure_calculator": (
        _configure,
        lambda w: w(0, None, 16, 2, 2),
        ["configure_from_megatron_args", "configure_calculator"],
    ),
    "_optimizer_builder": (
        lambda: Optimizer(),
        lambda w: w().step(),
        ["before_optimizer_step", "after_optimizer_step"],
    ),
    "_rerun_decision": (lambda machine: (False, False, 0), lambda w: w(None), ["rerun_decided"]),
    "scheduled_count": (
        lambda *a: (iter(()), 3, 0, 0),
        lambda w: w(None, None, 2),
        ["feature", "scheduled"],
    ),
    "planned_train_iters": (
        lambda args: None,
        lambda w: w(Namespace(train_iters=4, train_samples=None)),
        ["adopt_live_calculator"],
    ),
    "planned_num_samples": (
        lambda *a: (64, 0, 0),
        lambda w: w(SimpleNamespace(train=SimpleNamespace(train_samples=64))),
        ["planned_samples"],
    ),
    "printing_after_training_log": (lambda *a: None, lambda w: w(), ["after_log"]),
    "saving_sidecar": (
        lambda *a, **k: None,
        lambda w: w(_bridge_state(), None, None, None),
        ["after_save"],
    ),
    "loading_sidecar": (
        lambda *a, **k: (3, 0),
        lambda w: w(_bridge_state(), None, None, None),
        ["after_load"],
    ),
    "keeping_loss_mask": (lambda *a: (None, None, "mask"), lambda w: w(), ["feature"]),
}
#: The wrappers that serve a feature or the host port directly, without a phase (hooks.py's
#: docstring says which).
DIRECT = {
    "with_ga_flags",  # the parser: adds the --ga-* flags
    "stepping",  # Bridge's step: its host for the call (host.hosting)
    "padding_mask_forward",
    "padding_mask_schedule_plan",
    "masked_plan_run",
    "plan_masked_route",  # combined 1F1B's padding mask (padding_mask.py)
    "per_token_padding_expert_bias",
    "exact_token_counts",
    "tp_cp_scaled_z_loss",
    "global_count_mtp_loss",  # the auxiliary-loss corrections (aux_losses.py)
    "counting_bucket_group",  # the noise scale's meter
    "_finalize",  # makes the finalize wrapper
    "scaled_rates_get_lr",  # the batch schedule's rates
    "_record_checkpoint_args",  # the start-up checks' record of a checkpoint's settings
}


def test_every_row_runs_a_phase_through_a_recording_double_or_is_a_direct_one():
    """Each row's wrapper, called as upstream calls it around a stand-in, reaches the installation's
    phase methods (the double records what it calls, whatever the names in installation.py); the
    rest are named direct rows."""
    names = {hook.wrap.__name__ for hook in hooks.all_rows()}
    assert names == set(PHASE_CALLS) | DIRECT
    for hook in hooks.all_rows():
        if hook.wrap.__name__ in DIRECT:
            continue
        original, call, phases = PHASE_CALLS[hook.wrap.__name__]
        state = Recording()
        call(hook.wrap(original, state))
        assert [name for name in state.called if name in phases] == phases, (
            hook.qualified,
            state.called,
        )


def test_the_recording_double_sees_a_row_that_skips_its_phase():
    state = Recording()
    quiet = hooks.Hook(
        "step", hooks.SCHEDULES, "forward_backward_no_pipelining", lambda original, state: original
    )
    original, call, phases = PHASE_CALLS["_schedule"]
    call(quiet.wrap(original, state))
    assert state.called == [] != phases


def _live(hook):
    module = __import__(hook.module, fromlist=["_"])
    owner, _, name = hook.name.rpartition(".")
    return vars(getattr(module, owner) if owner else module).get(name)


def test_install_wires_every_row_this_source_has_and_uninstall_puts_each_back():
    core = [hook for hook in hooks.all_rows() if hook.load == "import"]
    before = {hook.qualified: _live(hook) for hook in core}
    state = install(GAConfig())
    patches = state.wiring.patches
    replaced = {p.replacement for p in (*patches.globals, *patches.attributes)}
    needed = {hook.qualified for hook in hooks.rows(state)}
    for hook in core:
        present = before[hook.qualified] is not None and hook.found_in(
            __import__(hook.module, fromlist=["_"])
        )
        assert (_live(hook) in replaced) == (present and hook.qualified in needed), hook.qualified
        assert (hook.qualified in state.wiring.settled_hooks) == (hook.qualified in needed)
    uninstall()
    assert {hook.qualified: _live(hook) for hook in core} == before


#: The megatron-core functions each flag set wraps (a row this source lacks is left out): the
#: phases' rows the installation needs and its features' own rows (docs/design.md gives the counts).
CALL = [
    "num_microbatches_calculator._configure_global_num_microbatches_calculator",
    "pipeline_parallel.schedules.forward_backward_no_pipelining",
    "pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving",
    "pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving",
    "pipeline_parallel.schedules.forward_step_calc_loss",
    "distributed.finalize_model_grads.finalize_model_grads",
    # the guards' liveness and finalize's verdict at the optimizer step
    "optimizer.get_megatron_optimizer",
    "optimizer.get_megatron_muon_optimizer",
    # a padding mask a loop gives, per token
    "transformer.moe.router.TopKRouter._apply_expert_bias",
]
TOKEN_LOSS = [
    # the verdict's deferral, said
    "rerun_state_machine.RerunStateMachine.should_checkpoint_and_exit",
    "models.gpt.gpt_model.GPTModel.forward",
    "models.gpt.gpt_model.GPTModel.build_schedule_plan",
    "models.common.model_chunk_schedule_plan.TransformerModelChunkSchedulePlan.run",
    "transformer.moe.moe_layer.MoELayer.route",
    "transformer.moe.moe_utils.get_tokens_per_expert_and_token_count",
    "transformer.moe.moe_utils.z_loss_func",
    "transformer.multi_token_prediction.process_mtp_loss",
]
GUARDS = ["datasets.data_schedule.wrap_data_iterator"]
NOISE = ["distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync"]
LR = ["optimizer_param_scheduler.OptimizerParamScheduler.get_lr"]
FLAG_SETS = {
    "token only": ({"guards": False}, CALL + TOKEN_LOSS),
    "token, guards": ({}, CALL + TOKEN_LOSS + GUARDS),
    "microbatch, guards": ({"loss_reduction": "microbatch"}, CALL + GUARDS),
    "token, noise scale": ({"noise_scale": 1}, CALL + TOKEN_LOSS + GUARDS + NOISE),
    "token, lr scaling": ({"lr_scaling": "sqrt"}, CALL + TOKEN_LOSS + GUARDS + LR),
}


@pytest.mark.parametrize("flags, expected", FLAG_SETS.values(), ids=FLAG_SETS)
def test_a_flag_set_wraps_the_rows_its_features_declare_and_no_other(flags, expected):
    rows = {hook.qualified: hook for hook in hooks.all_rows()}
    present = [
        name
        for name in (f"megatron.core.{short}" for short in expected)
        if rows[name].found_in(__import__(rows[name].module, fromlist=["_"]))
    ]
    state = install(GAConfig(**flags))
    wrapped = [name for name in state.wiring.patches.wrapped() if name.startswith("megatron.core.")]
    assert sorted(wrapped) == sorted(present)
    assert (
        f"{len(state.wiring.patches.wrapped())} upstream functions wrapped: "
        in hooks.wired_line(state)
    )


DOCS = Path(__file__).parents[1] / "docs"
#: The configurations docs/adopting.md counts the declared rows of.
ADOPTING_CONFIGS = {
    "token mode, nothing else (the default)": {},
    "token mode, `--ga-noise-scale 2`": {"noise_scale": 2},
    "`--ga-loss-reduction microbatch`": {"loss_reduction": "microbatch"},
}


def test_the_docs_count_the_rows_each_configuration_declares_and_wraps():
    """docs/adopting.md's table of declared rows, and docs/design.md's count of the megatron-core
    functions a token-only install wraps on 0.19.2, are what install() does."""
    text = (DOCS / "adopting.md").read_text()
    total = re.search(r"\| configuration \| rows declared \(of (\d+)\) \|", text)
    assert total is not None and int(total[1]) == len(hooks.all_rows())
    for label, flags in ADOPTING_CONFIGS.items():
        found = re.search(rf"\| {re.escape(label)} \| (\d+) \|", text)
        state = install(GAConfig(**flags))
        try:
            assert found is not None and int(found[1]) == len(hooks.rows(state)), label
        finally:
            uninstall()
    if megatron_core_version() != "0.19.2":
        return
    design = (DOCS / "design.md").read_text()
    core = re.search(r"a token-only install wraps (\d+)\s+megatron-core functions", design)
    training = re.search(r"training module is loaded (\d+)\s+of its own", design)
    state = install(GAConfig(guards=False))
    try:
        wrapped = state.wiring.patches.wrapped()
    finally:
        uninstall()
    # Megatron-LM's rows are wrapped only where an earlier test (or the launch) loaded its training
    # module, so the two counts are held apart.
    from_core = [name for name in wrapped if name.startswith("megatron.core.")]
    assert core is not None and int(core[1]) == len(from_core)
    from_training = len(wrapped) - len(from_core)
    assert training is not None and from_training in (0, int(training[1])), wrapped
