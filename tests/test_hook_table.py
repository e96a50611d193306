"""The hook table (integration/hooks.py): one row per Megatron target, the phase it serves, and install() wiring
exactly the rows this source has."""

import inspect

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")

from megatron_ga_ext import GAConfig
from megatron_ga_ext.integration import hooks, installation
from megatron_ga_ext.integration.compat import TARGETS
from megatron_ga_ext.integration.lifecycle import install, uninstall

#: Fingerprinted because install() reads them (the calculator's interface), not because it wraps them.
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
    """Every target but those install() only reads and those whose arithmetic a correction assumes (not wrapped)."""
    rows = {hook.qualified for hook in hooks.HOOKS if hook.fingerprinted}
    assert rows == {target.qualified for target in TARGETS if target.assumed_by is None} - READ_ONLY
    assumed = {target.assumed_by for target in TARGETS} - {None}
    assert assumed <= {hook.wrap.__name__ for hook in hooks.HOOKS if hook.fingerprinted}  # a wrapped correction's


def test_each_row_is_one_target_in_a_known_phase():
    qualified = [hook.qualified for hook in hooks.HOOKS]
    assert len(qualified) == len(set(qualified))
    assert {hook.phase for hook in hooks.HOOKS} == set(hooks.PHASES)
    assert {hook.load for hook in hooks.HOOKS} == {"import", "loaded", "parser"}


def test_every_phase_the_step_reads_is_an_installation_method():
    """The step's order reads in installation.py: the methods the wrappers call exist there, once each."""
    methods = {name for name, _ in inspect.getmembers(installation.Installation, inspect.isfunction)}
    assert {
        "configure_calculator",
        "begin_step",
        "micro_batch",
        "end_step",
        "before_optimizer_step",
        "after_optimizer_step",
        "rerun_decided",
        "after_log",
        "after_save",
        "after_load",
    } <= methods


def _live(hook):
    module = __import__(hook.module, fromlist=["_"])
    owner, _, name = hook.name.rpartition(".")
    return vars(getattr(module, owner) if owner else module).get(name)


def test_install_wires_every_row_this_source_has_and_uninstall_puts_each_back():
    core = [hook for hook in hooks.HOOKS if hook.load == "import"]
    before = {hook.qualified: _live(hook) for hook in core}
    state = install(GAConfig())
    replaced = {p.replacement for p in (*state.patches.globals, *state.patches.attributes)}
    for hook in core:
        present = before[hook.qualified] is not None and hook.found_in(__import__(hook.module, fromlist=["_"]))
        assert (_live(hook) in replaced) == present, hook.qualified
        assert hook.qualified in state.settled_hooks
    uninstall()
    assert {hook.qualified: _live(hook) for hook in core} == before
