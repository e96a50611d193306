"""The host port (integration/host.py): which loop is current, and what each adapter answers from
its own state."""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import dataclass, field

import pytest

from megatron_ga_ext.integration.bridge_loop import Bridge
from megatron_ga_ext.integration.core_loop import CoreLoop
from megatron_ga_ext.integration.host import Host, current_host, hosting, use_core_loop
from megatron_ga_ext.integration.megatron_lm import MEGATRON_LM
from megatron_ga_ext.science.integration.noise_scale_report import Reporter


class Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, name: str, value: float, iteration: int) -> None:
        self.scalars.append((name, value, iteration))

    def log(self, scalars: dict[str, float], iteration: int) -> None:
        self.scalars += [(name, value, iteration) for name, value in scalars.items()]


@pytest.fixture
def megatron_lm_args(monkeypatch):
    """Megatron-LM's global_vars with parsed args (and writers), as pretrain() leaves them."""
    module = types.ModuleType("megatron.training.global_vars")
    module._GLOBAL_ARGS = argparse.Namespace(
        curr_iteration=4, consumed_train_samples=96, train_iters=10
    )
    writer = Writer()
    module.get_tensorboard_writer, module.get_wandb_writer = lambda: writer, lambda: None
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", module)
    return module._GLOBAL_ARGS, writer


@dataclass
class _Section:
    train_iters: int = 12
    train_samples: int = 384


@dataclass
class _Logger:
    skip_train_metrics_log: bool = False


@dataclass
class _Config:
    train: _Section = field(default_factory=_Section)
    scheduler: _Section = field(default_factory=_Section)
    model: _Section = field(default_factory=_Section)
    logger: _Logger = field(default_factory=_Logger)


def bridge_state() -> types.SimpleNamespace:
    """The parts of Megatron-Bridge's GlobalState its adapter reads."""
    return types.SimpleNamespace(
        cfg=_Config(),
        train_state=types.SimpleNamespace(step=6, consumed_train_samples=192),
        tensorboard_logger=Writer(),
        wandb_logger=None,
    )


def test_without_a_loop_the_host_knows_nothing():
    host = current_host()
    assert type(host) is Host
    assert (host.parsed_args(), host.iteration(), host.consumed_samples(), host.writers()) == (
        None,
        None,
        None,
        (None, None),
    )
    assert host.settings().train_samples is None and not host.prints_after_log()


def test_megatron_lm_is_current_where_its_args_are_parsed(megatron_lm_args):
    args, writer = megatron_lm_args
    host = current_host()
    assert host is MEGATRON_LM
    assert (host.iteration(), host.consumed_samples(), host.settings().train_iters) == (5, 96, 10)
    host.set_train_iters(20)
    assert args.train_iters == 20 and host.settings().train_iters == 20
    host.record_metrics({"b_simple": 3.0}, 5)
    assert writer.scalars == [("b_simple", 3.0, 5)]


def test_bridge_is_current_for_the_call_it_announced_even_over_parsed_args(megatron_lm_args):
    state = bridge_state()
    with hosting(Bridge(state)):
        host = current_host()
        assert (host.name, host.iteration(), host.consumed_samples()) == ("Megatron-Bridge", 7, 192)
        assert host.settings().train_samples == 384
        host.set_train_iters(30)
        host.record_metrics({"b_simple": 2.0}, 7)
    assert state.cfg.train.train_iters == 30 and state.tensorboard_logger.scalars == [
        ("b_simple", 2.0, 7)
    ]
    assert current_host() is MEGATRON_LM


def test_a_core_loop_answers_with_the_callables_it_was_given(monkeypatch, capsys):
    lines, writer, lengths = [], Writer(), []
    use_core_loop(
        CoreLoop(
            iteration=lambda: 3,
            consumed_samples=lambda: 64,
            set_train_iters=lengths.append,
            writers=lambda: (writer, None),
            print_line=lines.append,
        )
    )
    try:
        host = current_host()
        assert (host.iteration(), host.consumed_samples()) == (3, 64)
        host.set_train_iters(9)
        reporter = Reporter(trace_path=None)
        reporter._say("noise scale line", host)
        assert lengths == [9] and lines == ["noise scale line"] and capsys.readouterr().out == ""
    finally:
        use_core_loop(Host())


def test_install_takes_a_core_loop_and_uninstall_forgets_it():
    from megatron_ga_ext import GAConfig, install, uninstall

    install(GAConfig(), host=CoreLoop(iteration=lambda: 11))
    try:
        assert current_host().iteration() == 11
    finally:
        uninstall()
    assert current_host().iteration() is None
