"""docs/adopting.md names every hook row with its change check, and every start-up probe the code
runs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from megatron_ga_ext.integration import hooks, probes

PAGE = Path(__file__).resolve().parents[1] / "docs" / "adopting.md"


def test_every_hook_row_has_its_change_check_in_the_adopters_page():
    text = PAGE.read_text()
    section = text.split("## Every hook row and its change check", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("`")[1]: line for line in section.splitlines() if line.startswith("| `")}
    every = getattr(hooks, "all_rows", None)
    rows = every() if every is not None else hooks.HOOKS
    assert {hook.qualified for hook in rows} == set(listed)
    for hook in rows:
        check = listed[hook.qualified].rsplit("|", 2)[-2]
        assert ("fingerprint" in check) == hook.fingerprinted or "as above" in check, hook.qualified


def test_every_start_up_probe_is_in_the_adopters_page():
    section = PAGE.read_text().split("**The start-up probes**", 1)[1].split("\n## ", 1)[0]
    for qualified in probes.PROBES:
        assert f"`{qualified.rsplit('.', 1)[-1]}`" in section, qualified
