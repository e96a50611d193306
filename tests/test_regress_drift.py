"""``make regress``'s drift listing (tools/regress.py drift): a checkout's parser flags that neither
a coverage row nor the off-path list names (whether or not a tested source's parser has them), the
hooked functions whose source no tested source has, against the nearest tested source, and the
callers of hooked functions that changed since that source."""

import shutil
from pathlib import Path

import pytest

from megatron_ga_ext.integration.compat import FINALIZE, TARGETS, matching_sources
from tools import regress

megatron_core = pytest.importorskip("megatron.core")


def checkout(tmp_path: Path) -> Path:
    """A tree holding this megatron-core's hooked modules (megatron-core alone: no
    megatron/training)."""
    installed = Path(megatron_core.__file__).parents[2]
    for target in TARGETS:
        source = target.path_in(installed)
        if source.exists():
            (destination := target.path_in(tmp_path)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
    return tmp_path


def test_an_unchanged_tree_matches_its_tested_source_and_a_changed_function_is_named(tmp_path):
    root = checkout(tmp_path)
    nearest, changed = regress.changed_functions(root)
    assert changed == [] and nearest == matching_sources()[0]
    finalize = root / (FINALIZE.replace(".", "/") + ".py")
    text = finalize.read_text()
    marker = "def finalize_model_grads("
    body = text.index(":\n", text.index(marker)) + 2  # the first line of its body
    finalize.write_text(text[:body] + "    _ = 'an upstream change'\n" + text[body:])
    assert regress.changed_functions(root) == (nearest, [f"{FINALIZE}.finalize_model_grads"])
    finalize.write_text(text.replace(marker, "def finalize_model_grads_renamed("))
    assert regress.changed_functions(root)[1] == [f"{FINALIZE}.finalize_model_grads (gone)"]


def test_drift_lists_the_unclassified_flags_and_the_changed_functions(
    tmp_path, monkeypatch, capsys
):
    root = checkout(tmp_path / "checkout")
    monkeypatch.setattr(regress, "nearest_tree", lambda name: root)
    monkeypatch.setattr(
        regress,
        "parser_flags",
        lambda roots: {
            root: ["--lr", "--cuda-graph-impl", "--zz-new-loss-flag", "--zz-old-but-unlisted"]
        },
    )
    assert regress.drift([root]) == 0
    out = capsys.readouterr().out
    assert (
        "2 flag(s) of its parser that neither a row of the coverage table (config/coverage/) nor "
        "the off-path list (config/off_path.py) names" in out
    )
    # a row names --cuda-graph-impl, the off-path list --lr; a flag is listed whoever else has it
    assert "  --zz-new-loss-flag\n" in out and "  --zz-old-but-unlisted\n" in out
    assert "--cuda-graph-impl" not in out and "  --lr\n" not in out
    assert "every hooked function's source is a tested one (nearest tested source: " in out
    assert "every caller of a hooked function is as in " in out


SCHEDULE_CALLER = """
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func


class Loop:
    def step(self, config):
        forward_backward_func = get_forward_backward_func()
        return forward_backward_func(config)

    def log(self):
        return 'no hooked name here'


def finalize(config):
    config.finalize_model_grads_func([])
"""


def test_callers_are_the_functions_that_name_a_hooked_function_and_their_changes_are_listed(
    tmp_path,
):
    old, new = tmp_path / "old", tmp_path / "new"
    for root in (old, new):
        (root / "megatron" / "training").mkdir(parents=True)
        (root / "megatron" / "training" / "loop.py").write_text(SCHEDULE_CALLER)
    assert sorted(regress.callers(old)) == [
        "megatron.training.loop:Loop.step",
        "megatron.training.loop:finalize",
    ]
    assert regress.changed_callers(new, old) == []
    changed = SCHEDULE_CALLER.replace(
        "return forward_backward_func(config)", "return None  # a replayed graph"
    )
    (new / "megatron" / "training" / "loop.py").write_text(
        changed.replace("def finalize(", "def finalize_v2(")
    )
    (new / "pretrain_moe.py").write_text(
        "def train(model):\n    return "
        "model.build_schedule_plan(model.config.finalize_model_grads_func)\n"
    )
    assert regress.changed_callers(new, old) == [
        "megatron.training.loop:Loop.step",
        "megatron.training.loop:finalize_v2 (new)",
        "pretrain_moe:train (new)",
        "megatron.training.loop:finalize (gone)",
    ]


def test_drift_report_names_both_kinds():
    report = regress.drift_report(
        "main@abc",
        [],
        "0.19.2",
        [f"{FINALIZE}.finalize_model_grads"],
        ["megatron.training.training:train_step"],
    )
    assert report.splitlines() == [
        "== drift of main@abc against the tested sources ==",
        "every flag of its parser is named by a coverage row or the off-path list",
        "1 hooked function(s) whose source no tested source has (nearest tested source: 0.19.2); "
        "read the change, then add the source to compat.UPSTREAM (make fingerprints):",
        f"  {FINALIZE}.finalize_model_grads",
        "1 caller(s) of hooked functions changed since 0.19.2; read each for a path that reaches "
        "the step without the hooks (a row of the coverage table, or a hook):",
        "  megatron.training.training:train_step",
    ]
    unseen = regress.drift_report("main@abc", [], "0.19.2", [], None).splitlines()[-1]
    assert unseen == f"callers not compared: no snapshot of 0.19.2 in {regress.snapshot_dir()}"
