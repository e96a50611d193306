"""Behaviour, not text, decides whether install() patches a hooked function: the normalised
fingerprint (compat.py), the start-up probes (probes.py) and the verdict per function
(acceptance.py), in one process.

A fork of a function is upstream's own source, edited, compiled into the module's namespace (its
source kept in linecache, where inspect reads it): the function a fork's module would define."""

from __future__ import annotations

import ast
import importlib
import inspect
import linecache
import logging
import re
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")

from megatron_ga_ext.config.ga_config import GAConfig  # noqa: E402
from megatron_ga_ext.errors import CompatError, OptionError  # noqa: E402
from megatron_ga_ext.integration import acceptance, compat, probes  # noqa: E402
from megatron_ga_ext.integration.lifecycle import install, uninstall  # noqa: E402

FINALIZE = f"{compat.FINALIZE}.finalize_model_grads"
CALC_LOSS = f"{compat.SCHEDULES}.forward_step_calc_loss"
DIVISION = "                    output_tensor /= num_microbatches\n"
NO_PIPELINING = f"{compat.SCHEDULES}.forward_backward_no_pipelining"


def twice_the_scaling(source: str) -> str:
    """finalize scaling by 2/N: ``1.0 / num_tokens`` on 0.16, ``1.0 / safe_num_tokens`` from 0.18."""
    edited = re.sub(r"scaling = 1\.0 / (safe_)?num_tokens", r"scaling = 2.0 / \1num_tokens", source)
    assert edited != source
    return edited


#: The finalize probe's stand-ins follow finalize_model_grads as 0.18 on call it: on 0.16.1 (the
#: compatibility leg) upstream's finalize reaches DDP's own finish_grad_sync and the probe fails, so a
#: fork of 0.16.1 is judged by its fingerprint alone (docs/adopting.md).


def fork(module, name: str, edit) -> object:
    """``module.name`` with its source edited by ``edit(text)``, compiled as its module would
    (linecache holds it)."""
    source = textwrap.dedent(inspect.getsource(getattr(module, name)))
    edited = edit(source)
    filename = f"<fork of {name} {abs(hash(edited))}>"
    linecache.cache[filename] = (len(edited), None, edited.splitlines(keepends=True), filename)
    scope = dict(vars(module))
    exec(compile(edited, filename, "exec"), scope)
    return scope[name]


def _docstring_lines(source: str) -> tuple[int, int]:
    """The first and last line (0-based, inclusive) of the function's docstring."""
    docstring = ast.parse(source).body[0].body[0]
    return docstring.lineno - 1, docstring.end_lineno - 1


def cosmetic(source: str) -> str:
    """Another docstring, a comment, blank lines and another line break: the same AST."""
    first, last = _docstring_lines(source)
    lines = source.splitlines(keepends=True)
    ours = ['    """A fork\'s own docstring."""\n', "\n", "    # a fork's comment\n", "\n"]
    return "".join([*lines[:first], *ours, *lines[last + 1 :]]).replace("(\n", "(  # wrapped\n", 1)


def unrelated(source: str) -> str:
    """An unrelated statement after the docstring."""
    _, last = _docstring_lines(source)
    lines = source.splitlines(keepends=True)
    return "".join(
        [*lines[: last + 1], "    _fork_marker = 1  # an unrelated statement\n", *lines[last + 1 :]]
    )


def test_the_fingerprint_ignores_comments_docstrings_and_formatting_not_statements(tmp_path: Path):
    original = finalize_module.finalize_model_grads
    assert compat.fingerprint(
        fork(finalize_module, "finalize_model_grads", cosmetic)
    ) == compat.fingerprint(original)
    assert compat.fingerprint(
        fork(finalize_module, "finalize_model_grads", unrelated)
    ) != compat.fingerprint(original)
    # the file form and the live form are the same fingerprint (fingerprints.json is made from
    # files)
    path = Path(inspect.getsourcefile(original))
    assert compat.fingerprint_file(path, "finalize_model_grads") == compat.fingerprint(original)


def test_every_probe_measures_the_tested_arithmetic_on_the_installed_source():
    for target in compat.live_targets(compat.TARGETS):
        measured = probes.probe(target.qualified, target.resolve())
        if target.qualified in probes.PROBES:
            assert measured is not None and measured.same, (target.qualified, measured)
        else:
            assert measured is None


def test_a_changed_finalize_scaling_and_a_double_division_are_measured_as_changed():
    scaled_twice = fork(
        finalize_module,
        "finalize_model_grads",
        twice_the_scaling,
    )
    measured = probes.probe(FINALIZE, scaled_twice)
    assert measured.outcome == probes.CHANGED
    assert "scaled the gradient by 0.25 (tested sources: 1/N = 0.125" in measured.detail
    divided_twice = fork(
        schedules,
        "forward_step_calc_loss",
        lambda s: s.replace(
            DIVISION,
            DIVISION + "                output_tensor /= num_microbatches\n",  # in both modes
            1,
        ),
    )
    measured = probes.probe(CALC_LOSS, divided_twice)
    assert measured.outcome == probes.CHANGED
    assert "came back as (3, 3) with per-token loss on (tested sources: (6, 3)" in measured.detail
    assert "and (0.5, 3) off" in measured.detail


def test_the_verdicts_same_behaviour_unknown_accepted_and_changed(monkeypatch, caplog):
    target = {t.qualified: t for t in compat.TARGETS}
    edited = fork(finalize_module, "finalize_model_grads", unrelated)
    decision = acceptance.decide(target[FINALIZE], edited)
    assert decision.verdict == acceptance.SAME_BEHAVIOUR and not decision.sources
    assert "scales by 1/N" in decision.reason
    loop = fork(schedules, "forward_backward_no_pipelining", unrelated)
    assert acceptance.decide(target[NO_PIPELINING], loop).verdict == acceptance.UNKNOWN
    for name in (
        "forward_backward_no_pipelining",
        NO_PIPELINING,
        " x, forward_backward_no_pipelining ",
    ):
        accepted = acceptance.decide(target[NO_PIPELINING], loop, acceptance.accepted_names(name))
        assert accepted.verdict == acceptance.ACCEPTED
    scaled = fork(finalize_module, "finalize_model_grads", twice_the_scaling)
    names = acceptance.accepted_names("finalize_model_grads")
    assert (
        acceptance.decide(target[FINALIZE], scaled, names).verdict == acceptance.CHANGED
    )  # not waived
    # install(): the same verdicts, the refusal naming the function and the measured difference
    monkeypatch.setattr(finalize_module, "finalize_model_grads", scaled)
    monkeypatch.setenv(acceptance.ACCEPT_SOURCE, "finalize_model_grads")
    with pytest.raises(
        CompatError,
        match=r"finalize_model_grads has fingerprint \w+, which no tested source has, "
        r"and its behaviour changed: .* scaled the gradient by 0.25",
    ):
        install(GAConfig())
    monkeypatch.setattr(finalize_module, "finalize_model_grads", edited)
    monkeypatch.setattr(schedules, "forward_backward_no_pipelining", loop)
    monkeypatch.delenv(acceptance.ACCEPT_SOURCE)
    with pytest.raises(
        CompatError,
        match=r"forward_backward_no_pipelining has fingerprint \w+, which no tested "
        r"source has, and no probe measures its behaviour \(--ga-accept-source "
        r"forward_backward_no_pipelining, or MEGATRON_GA_ACCEPT_SOURCE=",
    ):
        install(GAConfig())
    with pytest.raises(
        OptionError, match=r"--ga-accept-source .* names forward_backward_no_pipelinig, which no"
    ):
        install(GAConfig(accept_source="forward_backward_no_pipelinig"))  # misspelt: waives nothing
    for accept in ("", "forward_backward_no_pipelining"):  # the setting, then the flag
        if accept:
            monkeypatch.delenv(acceptance.ACCEPT_SOURCE)
        else:
            monkeypatch.setenv(acceptance.ACCEPT_SOURCE, "forward_backward_no_pipelining")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_ga_ext.integration.acceptance"):
            install(GAConfig(accept_source=accept))
        uninstall()
        assert f"{FINALIZE}: same behaviour" in caplog.text
        assert f"{NO_PIPELINING}: accepted" in caplog.text
