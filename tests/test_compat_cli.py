"""``megatron-ga compat``: what install() would decide on the importable megatron-core, without a
process group; exit 1 where it would refuse (in process: the fork is a function compiled from
upstream's edited source)."""

from __future__ import annotations

import importlib
import json

import pytest

pytest.importorskip("megatron.core")

from megatron_ga_ext.cli.main import main
from megatron_ga_ext.integration import acceptance
from megatron_ga_ext.integration.compat import TARGETS, live_targets, megatron_core_version
from tests.test_probes import fork, unrelated

schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")


def compat_json(capsys, *extra: str) -> tuple[int, dict]:
    status = main(["compat", "--json", *extra])
    return status, json.loads(capsys.readouterr().out)


def test_compat_accepts_the_installed_megatron_core_and_names_each_function(capsys, monkeypatch):
    monkeypatch.delenv(acceptance.ACCEPT_SOURCE, raising=False)
    status, found = compat_json(capsys)
    assert (
        status == 0 and found["refused"] == [] and found["megatron_core"] == megatron_core_version()
    )
    functions = {row["function"]: row for row in found["functions"]}
    assert list(functions) == [t.qualified for t in live_targets(TARGETS)]
    finalize = functions["megatron.core.distributed.finalize_model_grads.finalize_model_grads"]
    assert finalize["verdict"] == "tested" and megatron_core_version() in finalize["sources"]
    assert finalize["probe"]["outcome"] == "same" and "1/N" in finalize["probe"]["detail"]
    assert set(found["hosts"]) == {"Megatron-LM", "Megatron-Bridge"}


@pytest.mark.skipif(
    megatron_core_version().startswith(("0.16", "0.17")),
    reason="the finalize probe is measured on megatron-core 0.18 on (tests/test_probes.py)",
)
def test_compat_exits_1_naming_what_install_would_refuse_and_accepts_a_named_function(
    capsys, monkeypatch
):
    monkeypatch.delenv(acceptance.ACCEPT_SOURCE, raising=False)
    monkeypatch.setattr(
        schedules,
        "forward_backward_no_pipelining",
        fork(schedules, "forward_backward_no_pipelining", unrelated),
    )
    scaled = fork(
        finalize_module, "finalize_model_grads", lambda s: s.replace("1.0 / safe", "3.0 / safe")
    )
    edited = fork(
        finalize_module, "finalize_model_grads", unrelated
    )  # from upstream's source, not the one above
    monkeypatch.setattr(finalize_module, "finalize_model_grads", scaled)
    status, found = compat_json(capsys)
    loop = "megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining"
    finalize = "megatron.core.distributed.finalize_model_grads.finalize_model_grads"
    assert status == 1 and found["refused"] == [loop, finalize]
    rows = {row["function"]: row for row in found["functions"]}
    assert rows[loop]["verdict"] == acceptance.UNKNOWN and rows[loop]["probe"] is None
    assert (
        rows[finalize]["verdict"] == acceptance.CHANGED
        and "by 0.375" in rows[finalize]["probe"]["detail"]
    )
    status, found = compat_json(
        capsys, "--accept-source", "forward_backward_no_pipelining,finalize_model_grads"
    )
    assert status == 1 and found["refused"] == [finalize]  # a measured change is never waived
    monkeypatch.setattr(finalize_module, "finalize_model_grads", edited)
    status, found = compat_json(capsys, "--accept-source", "forward_backward_no_pipelining")
    assert status == 0, found["refused"]
    assert {r["function"]: r["verdict"] for r in found["functions"]}[finalize] == "same behaviour"
    status = main(["compat", "--accept-source", "forward_backward_no_pipelining"])  # the table
    out = capsys.readouterr().out
    assert status == 0 and "accepted" in out and "install() would accept this megatron-core" in out
