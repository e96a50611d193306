"""The verify harness: launcher, layouts, reference weights, verdicts, and the command end to
end."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from megatron_ga_ext.cli.verify import rows_from_results
from megatron_ga_ext.integration.compat import megatron_core_version
from megatron_ga_ext.testing.distributed import LaunchConfig, WorkerError, run_on_ranks
from megatron_ga_ext.verify.aux import AUX_LAYOUTS, DATA_PARALLEL_LAYOUTS
from megatron_ga_ext.verify.data_parallel import megatron_fsdp_limited
from megatron_ga_ext.verify.harness import LayoutResult, relative_error
from megatron_ga_ext.verify.layouts import (
    DEFAULT_LAYOUTS,
    DEFAULT_LENGTHS,
    Layout,
    make_global_batch,
)
from megatron_ga_ext.verify.references import mean_of_means_weights, token_weights


def _all_reduce_rank():
    value = torch.tensor([float(torch.distributed.get_rank() + 1)])
    torch.distributed.all_reduce(value)
    return torch.distributed.get_rank(), value.item()


def _fail_on_rank_one():
    if torch.distributed.get_rank() == 1:
        raise KeyError("rank one is broken")
    return "fine"


def _sleep():
    time.sleep(30)


def _return_a_lambda():
    return lambda: None


def _exit_quietly_on_rank_one():
    if torch.distributed.get_rank() == 1:
        os._exit(0)
    time.sleep(30)


class _NeedsTwoArguments(Exception):
    """Pickles, but cannot be unpickled: ``args`` holds one value, ``__init__`` needs two."""

    def __init__(self, first, second):
        super().__init__(f"{first} {second}")


def _raise_unpicklable():
    raise _NeedsTwoArguments("broken", "on purpose")


def test_launcher_returns_each_rank_result():
    assert run_on_ranks(_all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)]


def test_launcher_reraises_a_worker_error_as_itself():
    with pytest.raises(KeyError, match="rank one is broken"):
        run_on_ranks(_fail_on_rank_one, 2)


def test_launcher_times_out():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"did not finish within the launch timeout of 2 s"):
        run_on_ranks(_sleep, 2, config=LaunchConfig(timeout_s=2))
    assert time.monotonic() - start < 10


def test_launcher_fails_fast_on_an_unpicklable_result():
    start = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"rank [01] returned a result that cannot be pickled .*plain data"
    ):
        run_on_ranks(_return_a_lambda, 2, config=LaunchConfig(timeout_s=60))
    assert time.monotonic() - start < 20


def test_launcher_fails_fast_when_a_rank_exits_zero_without_a_reply():
    start = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"rank 1 of 2 exited with code 0 without sending a reply"
    ):
        run_on_ranks(_exit_quietly_on_rank_one, 2, config=LaunchConfig(timeout_s=60))
    assert time.monotonic() - start < 20


def test_launcher_reports_a_reply_the_parent_cannot_unpickle():
    with pytest.raises(
        WorkerError,
        match=r"(?s)rank 0 of 1 sent a reply \(error\) that cannot be "
        r"unpickled.*_NeedsTwoArguments: broken on purpose",
    ):
        run_on_ranks(_raise_unpicklable, 1, config=LaunchConfig(timeout_s=60))


PARENT = """
import os, sys, time
from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

def rank_main(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(120)

run_on_ranks(rank_main, 2, (sys.argv[1],), LaunchConfig(timeout_s=120, start_method="fork"))
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_exit_when_their_parent_dies(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(f.name) for f in tmp_path.iterdir()]
        assert len(pids) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in pids)


def test_default_layouts_cover_every_layout_users_run():
    names = [layout.name for layout in DEFAULT_LAYOUTS]
    assert names == [
        "DP1 x GA8",
        "DP1 x GA2 (MoE seq_aux_loss, loss tokens 1, 0, 16, 5)",
        "DP2 x GA4",
        "DP2 x GA4 (overlapped grad reduce, distributed optimizer)",
        "DP2 x GA4 (MoE)",
        "EP2 x DP2 x GA4 (MoE)",
        "DP2 x GA4 (MTP)",
        "DP2 x GA4 (MoE + MTP)",
        "DP2 x GA4 (MoE global_aux_loss)",
        "DP2 x GA4 (MoE global_aux_loss + z-loss)",
        "DP2 x GA4 (untied, torch FSDP2)",
        "DP2 x GA4 (Megatron-FSDP no_shard)",
        "DP2 x GA4 (Megatron-FSDP optim)",
        "DP2 x GA4 (Megatron-FSDP optim_grads, overlapped grad reduce)",
        "EP2 x DP2 x GA4 (MoE, combined 1F1B)",
        "EP2 x DP2 x GA4 (MoE, combined 1F1B, delayed wgrad)",
        "EP2 x DP2 x GA4 (MoE + MTP, combined 1F1B)",
        "DP4 x GA2",
        "PP2 x DP2 x GA4",
        "PP2 x VPP2 x DP2 x GA4",
        "CP2 x DP2 x GA4 (position-wise)",
        "TP2 x DP2 x GA4 (MoE, sequence parallel)",
        "CP2 x DP2 x GA4 (MoE, position-wise)",
        "TP2 x EP2 x ETP1 x DP2 x GA4 (MoE, sequence parallel, combined 1F1B)",
        "PP2 x VPP2 x EP2 x DP2 x GA4 (MoE, combined 1F1B)",
        "DP4 x GA2 (untied, torch FSDP2)",
        "CP2 x DP2 x GA4 (position-wise, torch FSDP2)",
        "DP4 x GA2 (Megatron-FSDP optim_grads_params, overlapped grad reduce)",
    ]
    assert [layout.world_size for layout in DEFAULT_LAYOUTS] == sorted(
        layout.world_size for layout in DEFAULT_LAYOUTS
    )
    assert {len(layout.lengths or DEFAULT_LENGTHS) for layout in DEFAULT_LAYOUTS} == {
        len(DEFAULT_LENGTHS),
        4,
    }
    assert all(
        len(layout.lengths or DEFAULT_LENGTHS) == layout.global_batch_size
        for layout in DEFAULT_LAYOUTS
    )
    assert min(DEFAULT_LENGTHS) == 1  # one micro-batch nearly all padding


def test_cp_shards_follow_megatron_zigzag():
    layout = Layout(context_parallel_size=2, data_parallel_size=2, num_microbatches=4)
    assert layout.cp_positions(0, 16).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.cp_positions(1, 16).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    ids = layout.unit_ids(16)
    assert ids.min() == 0 and ids.max() == 4 * 2 * 2 - 1
    assert ids[layout.sample(3, 1, 0), 4].item() == (3 * 2 + 1) * 2 + 1


def test_reference_weights():
    batch = make_global_batch(DEFAULT_LENGTHS, 16, 64)
    mask = batch.loss_mask
    assert token_weights(mask).sum().item() == pytest.approx(1.0)
    ids = Layout(data_parallel_size=2, num_microbatches=4).unit_ids(16)
    weights = mean_of_means_weights(mask, ids)
    per_unit = torch.zeros(8).index_add_(0, ids.reshape(-1), weights.reshape(-1))
    assert torch.allclose(per_unit, torch.full((8,), 1 / 8))  # every unit weighs 1/U
    even = torch.ones_like(mask)
    assert torch.allclose(
        mean_of_means_weights(even, ids), token_weights(even)
    )  # all n equal: agree


def _result(layout, mode, token, mom, num_tokens=None):
    return LayoutResult(layout, mode, token, mom, num_tokens if mode == "token" else None, 0.1)


def test_rows_take_the_worst_rank_and_judge_each_mode_by_its_own_reference():
    results = {
        2: [
            [
                _result("DP2 x GA4", "token", 1e-7, 0.9),
                _result("DP2 x GA4", "microbatch", 3.0, 1e-7),
            ],
            [
                _result("DP2 x GA4", "token", 2e-5, 0.9),
                _result("DP2 x GA4", "microbatch", 3.0, 2e-7),
            ],
        ]
    }
    rows = rows_from_results(results, 1e-5)
    assert rows == [
        {
            "layout": "DP2 x GA4",
            "mode": "token",
            "rel_err_token": 2e-5,
            "rel_err_mean_of_means": 0.9,
            "num_tokens": None,
            "ok": False,
        },
        {
            "layout": "DP2 x GA4",
            "mode": "microbatch",
            "rel_err_token": 3.0,
            "rel_err_mean_of_means": 2e-7,
            "num_tokens": None,
            "ok": True,
        },
    ]


@pytest.mark.parametrize(
    "counts, num_tokens, ok", [((72, 72), 72, True), ((72, 71), None, False), ((64, 64), 64, False)]
)
def test_token_rows_need_every_rank_to_divide_by_the_global_count(counts, num_tokens, ok):
    results = {
        2: [
            [
                _result("DP2 x GA4", "token", 1e-7, 0.9, n),
                _result("DP2 x GA4", "microbatch", 3.0, 1e-7),
            ]
            for n in counts
        ]
    }
    token, microbatch = rows_from_results(results, 1e-5, expected_num_tokens=72)
    assert (token["num_tokens"], token["ok"]) == (num_tokens, ok)
    assert (microbatch["num_tokens"], microbatch["ok"]) == (None, True)


def test_rows_fail_on_nan_from_any_rank():
    results = {
        2: [
            [
                _result("DP2 x GA4", "token", 1e-7, 0.9),
                _result("DP2 x GA4", "microbatch", 3.0, 1e-7),
            ],
            [
                _result("DP2 x GA4", "token", math.nan, 0.9),
                _result("DP2 x GA4", "microbatch", 3.0, math.nan),
            ],
        ]
    }
    rows = rows_from_results(results, 1e-5)
    assert [math.isnan(r["rel_err_token"]) for r in rows] == [True, False]
    assert [math.isnan(r["rel_err_mean_of_means"]) for r in rows] == [False, True]
    assert [r["ok"] for r in rows] == [False, False]


def test_relative_error_judges_each_parameter_by_its_own_scale():
    ref = {
        "weight": torch.tensor([1.0, -2.0]),
        "norm": torch.tensor([6e-3, 1e-3]),
        "zero": torch.zeros(2),
    }
    off = {**ref, "norm": ref["norm"] * (1 + 1e-3)}  # 1e-3 relative error in the small parameter
    assert relative_error(off, ref) == pytest.approx(1e-3, rel=1e-3)
    assert relative_error({**ref, "zero": torch.tensor([0.0, 3e-6])}, ref) == pytest.approx(
        3e-6
    )  # absolute


def test_relative_error_propagates_nan_from_any_parameter():
    ref = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    assert relative_error({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}, ref) == 0.0
    assert math.isnan(
        relative_error({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([math.nan])}, ref)
    )


@pytest.mark.slow
def test_verify_command_end_to_end():
    """Every layout through install(), both modes, and the auxiliary losses' gradients before and
    after."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ga_ext.cli", "verify", "--json"],
        capture_output=True,
        text=True,
        timeout=1800,
    )  # the whole command 108 s on an idle 2-core machine, since the auxiliary coefficients have
    # launches of their own (verify/launches.py: riding on the layouts' 4-rank launch they took
    # it from 150 s to over 900 s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    skipped = {s["layout"] for s in out["skipped"]}
    # MTP rows need megatron-core >= 0.17, seq_aux_loss at MBS 2 and torch FSDP2 0.19; Megatron-FSDP
    # no_shard without the overlap misses on 0.16 (verify/data_parallel.py), as does 0.16's local
    # delayed weight gradient
    fsdp = {
        lay.name
        for lay in DEFAULT_LAYOUTS
        if lay.data_parallel == "torch_fsdp2"
        or megatron_fsdp_limited(lay)
        or lay.delay_wgrad_compute
    }
    assert skipped <= {
        "DP2 x GA4 (MTP)",
        "DP2 x GA4 (MoE + MTP)",
        "EP2 x DP2 x GA4 (MoE + MTP, combined 1F1B)",
        DEFAULT_LAYOUTS[1].name,
        *fsdp,
    }
    rows = out["rows"]
    lengths = {layout.name: layout.lengths or DEFAULT_LENGTHS for layout in DEFAULT_LAYOUTS}
    assert [(r["layout"], r["mode"]) for r in rows] == [
        (layout.name, mode)
        for layout in DEFAULT_LAYOUTS
        if layout.name not in skipped
        for mode in ("token", "microbatch")
    ]
    for row in rows:
        assert set(row) == {
            "layout",
            "mode",
            "rel_err_token",
            "rel_err_mean_of_means",
            "num_tokens",
            "ok",
        }
        assert row["ok"] is True
        if row["mode"] == "token":
            assert row["rel_err_token"] < 1e-5 < 0.1 < row["rel_err_mean_of_means"]
            assert row["num_tokens"] == sum(lengths[row["layout"]])
        else:
            assert row["rel_err_mean_of_means"] < 1e-5 < 0.1 < row["rel_err_token"]
    coefficients = {(c["layout"], c["variant"]): c for c in out["aux_coefficients"]}
    measured = [*AUX_LAYOUTS, *(lay for lay in DATA_PARALLEL_LAYOUTS if lay.name not in skipped)]
    assert {layout for layout, _ in coefficients} == {layout.name for layout in measured}
    for (layout, variant), c in coefficients.items():
        if variant == "with megatron-ga-ext":
            assert c["coefficient"] == pytest.approx(1.0, abs=1e-5) and c["error"] < 1e-5, c
        elif (
            layout != "DP2 x GA4 (MTP)" or megatron_core_version() != "0.16.1"
        ):  # 0.16 attaches MTP's sum
            assert variant == "upstream --calculate-per-token-loss" and c["error"] > 0.1, c
        fsdp2 = {lay.name: lay for lay in DATA_PARALLEL_LAYOUTS}
        if layout in fsdp2 and variant != "with megatron-ga-ext":  # upstream: N / (DP x CP), N = 72
            sizes = fsdp2[layout].data_parallel_size * fsdp2[layout].context_parallel_size
            assert c["coefficient"] == pytest.approx(72 / sizes, rel=1e-5), c
    assert "launching 4 rank(s)" in proc.stderr and "PP2 x VPP2 x DP2 x GA4" in proc.stderr


def test_verify_command_fails_when_token_mode_misses(capsys, monkeypatch):
    from megatron_ga_ext.cli import verify as command
    from megatron_ga_ext.integration.features.aux_losses import router_scales_by_tp_cp
    from megatron_ga_ext.verify import launches

    results = {
        2: [
            [
                _result("DP2 x GA4", "token", 3e-5, 0.9, 72),
                _result("DP2 x GA4", "microbatch", 3.0, 1e-7),
            ]
        ]
        * 2
    }
    monkeypatch.setattr(command, "_import_upstream", lambda: "megatron-core (not imported)")
    monkeypatch.setattr(launches, "launch_all", lambda layouts, **_: (results, []))
    parser = argparse.ArgumentParser()
    command.configure_parser(parser)
    assert command.run(parser.parse_args([])) == 1
    out = capsys.readouterr().out
    assert re.search(r"DP2 x GA4 +token +3\.00e-05 +9\.00e-01 +72 +FAIL\n", out)
    assert re.search(r"DP2 x GA4 +microbatch .* ok: mean of means\n", out)
    counts = (
        "72 or 22" if router_scales_by_tp_cp() else "72"
    )  # before 0.19 the seq_aux_loss row (N 22) is skipped
    assert (
        "1 row(s) FAIL (tolerance 1e-05; token rows must divide by N, their batch's loss "
        f"tokens: {counts})" in out
    )


def test_cpu_shims_restore_torch_and_megatron():
    from megatron.core.tensor_parallel import random as tp_random

    from megatron_ga_ext.testing.shims import FACTORIES, NEW_METHODS, cpu_shims

    def patched_names():
        return (
            (torch.cuda.current_device, torch.cuda.synchronize, tp_random._get_cuda_rng_state),
            [getattr(torch, name) for name in FACTORIES],
            {name: vars(torch.Tensor).get(name) for name in (*NEW_METHODS, "to", "cuda")},
        )

    before = patched_names()
    assert set(before[2].values()) == {None}  # torch.Tensor inherits these from TensorBase
    with cpu_shims():
        # every way megatron names CUDA: a string, an index (current_device()), a torch.device
        for device in ("cuda", "cuda:0", 0, torch.device("cuda"), torch.cuda.current_device()):
            assert torch.zeros(2, device=device).device.type == "cpu"
            assert torch.tensor([1.0], device=device).device.type == "cpu"
            assert torch.ones(1).new_empty((2,), device=device).device.type == "cpu"
            assert torch.ones(1).to(device).device.type == "cpu"
            assert torch.ones(1).to(device=device, dtype=torch.int64).dtype == torch.int64
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
        assert torch.ones(1).to(torch.float16).dtype == torch.float16  # a dtype is not a device
        assert (
            not torch._C._is_torch_function_mode_enabled()
        )  # no mode: other torch calls run as they are
    assert patched_names() == before


def test_cuda_without_a_device_is_a_clear_error(capsys, monkeypatch):
    """verify raises a VerifyError; the CLI's one error path prints it in one line and exits 2."""
    from megatron_ga_ext.cli.main import main
    from megatron_ga_ext.cli.verify import configure_parser, run
    from megatron_ga_ext.errors import VerifyError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    with pytest.raises(VerifyError, match="--device cuda: no CUDA device is visible"):
        run(parser.parse_args(["--device", "cuda"]))
    assert main(["verify", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert (
        "megatron-ga verify: error: --device cuda: no CUDA device is visible" in err
        and "Traceback" not in err
    )


def test_verify_without_megatron_core_says_what_to_install(capsys, monkeypatch):
    """A login-node install (no extras) has no torch nor megatron-core: one line and exit 2, no
    traceback."""
    from megatron_ga_ext.cli.main import main

    monkeypatch.setitem(sys.modules, "megatron", None)  # `import megatron.core` raises ImportError
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    assert main(["verify"]) == 2
    err = capsys.readouterr().err
    assert (
        "needs torch and megatron-core" in err
        and "pip install torch megatron-core, or from a checkout" in err
    )
    assert "Traceback" not in err
