"""Break each token-mode check on purpose, on real megatron-core (4 gloo ranks, one launch).

Every scenario runs megatron's own schedule and finalize_model_grads through the extension's loss
contract and finalize wrapper; the launch returns, per scenario, either the error each rank raised
or what the step produced, and the tests below match them.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.errors import GAError, LossContractError, OptionError
from megatron_ga_ext.integration.loss_contract import LossContract, masked_loss

pytestmark = pytest.mark.slow

DP4 = dict(data_parallel_size=4, num_microbatches=2)
PP2 = dict(pipeline_model_parallel_size=2, data_parallel_size=2, num_microbatches=4)
BIG = 2**31  # one micro-batch count alone would overflow megatron's int32 accumulator


def _two_tuple(output, mask):
    loss, _, report = masked_loss(output, mask)
    return loss, report


def _float_count(output, mask):
    loss, n, report = masked_loss(output, mask)
    return loss, n.float(), report


def _vector_count(output, mask):
    loss, n, report = masked_loss(output, mask)
    return loss, torch.stack([n, n]), report


def _negative_count(output, mask):
    loss, n, report = masked_loss(output, mask)
    return loss, n - 1000, report


def _nan_loss(output, mask):
    loss, n, report = masked_loss(output, mask)
    return loss * float("nan"), n, report


def _no_tokens(output, mask):
    return masked_loss(output, torch.zeros_like(mask))


def _huge_count(output, mask):
    loss, n, report = masked_loss(output, mask)
    return loss, n + BIG, report


#: name -> (layout, loss function, options)
SCENARIOS = {
    "two_tuple": (DP4, _two_tuple, {}),
    "float_count": (DP4, _float_count, {}),
    "vector_count": (DP4, _vector_count, {}),
    "negative_count": (DP4, _negative_count, {}),
    "nan_loss": (DP4, _nan_loss, {}),
    "flag_off": (DP4, masked_loss, {"flag_at_build": False, "flag_at_step": False}),
    "ddp_before_flag": (DP4, masked_loss, {"flag_at_build": False}),
    "average_in_collective": (
        DP4,
        masked_loss,
        {"flag_at_build": False, "average_in_collective": True},
    ),
    "zero_tokens_error": (DP4, _no_tokens, {}),
    "zero_tokens_skip": (DP4, _no_tokens, {"zero_tokens": "skip"}),
    "unwrapped": (DP4, masked_loss, {"wrap": False}),
    "huge_count": (DP4, _huge_count, {}),
    "pp_token": (PP2, masked_loss, {}),
    "pp_huge_count": (PP2, _huge_count, {}),
    "dp_token": (DP4, masked_loss, {}),
    "async_token": (DP4, masked_loss, {"checks": "async"}),
    "async_pp": (PP2, masked_loss, {"checks": "async"}),
    "async_nan": (DP4, _nan_loss, {"checks": "async"}),
    "async_negative_count": (PP2, _negative_count, {"checks": "async"}),
    "async_zero_tokens": (DP4, _no_tokens, {"checks": "async"}),
}
#: Tensor methods that read a value back to the host (a device-to-host synchronization on a GPU).
HOST_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")


class _CountHostReads(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self._reads = {getattr(torch.Tensor, name) for name in HOST_READS}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self._reads
        return func(*args, **(kwargs or {}))


def _scenario(name, cfg, batch, refs):
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from megatron_ga_ext.integration.finalize import make_finalize_model_grads
    from megatron_ga_ext.verify.harness import build_ddp, gradients, relative_error
    from megatron_ga_ext.verify.layouts import Layout
    from megatron_ga_ext.verify.step import train_step

    layout_kwargs, loss_func, opts = SCENARIOS[name]
    layout = Layout(**layout_kwargs)
    ddp, names, config = build_ddp(
        layout,
        cfg,
        calculate_per_token_loss=opts.get("flag_at_build", True),
        ddp_config=DistributedDataParallelConfig(
            average_in_collective=opts.get("average_in_collective", False)
        ),
    )
    config.calculate_per_token_loss = opts.get("flag_at_step", True)
    contract = LossContract()
    finalize = make_finalize_model_grads(
        finalize_model_grads,
        contract,
        config=GAConfig(
            zero_token_policy=opts.get("zero_tokens", "error"), checks=opts.get("checks", "sync")
        ),
    )
    with warnings.catch_warnings(record=True) as caught, _CountHostReads() as reads:
        warnings.simplefilter("always")
        train_step(
            ddp,
            config,
            layout,
            cfg,
            batch,
            finalize=finalize,
            loss_func=contract.wrap(loss_func) if opts.get("wrap", True) else loss_func,
        )
    pending = finalize._pending is not None
    late = finalize.poll(
        wait=True
    )  # --ga-checks async: where install() reads the verdict (after the step)
    grads = gradients(ddp, names)
    ref = next(
        grads for (_, kind), grads in refs.items() if kind == "token"
    )  # the dense token target
    n = (late or finalize.reads.verdict).num_tokens
    scaled = {k: v * 72 / n for k, v in ref.items()} if n else ref
    return {
        "num_tokens": n,
        "rel_err": relative_error(grads, scaled),
        "max_grad": float(torch.stack([g.abs().max() for g in grads.values()]).max()),  # NaN-safe
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "host_reads": reads.count,
        "pending_after_step": pending,
    }


def _fsdp_checks(cfg) -> dict:
    """check_ddp_chunks on real Megatron-FSDP chunks built with and without the per-token flag
    (torch FSDP2's units are checked each step instead: tests/test_fsdp.py)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from megatron_ga_ext.integration.chunk_checks import check_ddp_chunks
    from megatron_ga_ext.verify.models import build_gpt, transformer_config

    out = {}
    for per_token in (True, False):
        config = transformer_config(
            cfg.model,
            pipeline_model_parallel_size=1,
            context_parallel_size=1,
            calculate_per_token_loss=per_token,
        )
        model, _ = build_gpt(cfg.model, config, pre_process=True, post_process=True)
        chunk = FullyShardedDataParallel(
            config,
            DistributedDataParallelConfig(
                use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
            ),
            model,
        )
        try:
            check_ddp_chunks([chunk])
            out[f"megatron_fsdp_{per_token}"] = ("ok", None)
        except LossContractError as exc:
            out[f"megatron_fsdp_{per_token}"] = ("error", exc)
    return out


def _run_scenarios():
    from megatron.core import parallel_state

    from megatron_ga_ext.testing.shims import cpu_shims
    from megatron_ga_ext.verify.layouts import DEFAULT_LAYOUTS, make_global_batch
    from megatron_ga_ext.verify.models import init_model_parallel
    from megatron_ga_ext.verify.references import reference_grads
    from megatron_ga_ext.verify.run_config import VerifyConfig

    cfg = VerifyConfig(progress=False)
    batch = make_global_batch(cfg.lengths, cfg.model.seq_length, cfg.model.vocab_size)
    out = {}
    with cpu_shims():
        refs = reference_grads(cfg.model, DEFAULT_LAYOUTS[:1], batch)
        for name, (layout_kwargs, _, _) in SCENARIOS.items():
            init_model_parallel(
                pipeline_model_parallel_size=layout_kwargs.get("pipeline_model_parallel_size", 1)
            )
            try:
                out[name] = ("ok", _scenario(name, cfg, batch, refs))
            except (
                GAError
            ) as exc:  # LossContractError, or OptionError for the mode-versus-flag rule
                out[name] = ("error", exc)
            finally:
                parallel_state.destroy_model_parallel()
        init_model_parallel()
        out.update(_fsdp_checks(cfg))
        parallel_state.destroy_model_parallel()
        out["count_groups"] = ("ok", _count_groups())
    return out


def _count_groups() -> dict | None:
    """GTP weight remat (0.19+) is a DP-like axis: the finalize sums N over DP x CP x GTP, with a
    pg_collection or without one, as upstream's finalize does. None on releases without GTP."""
    import inspect

    import torch
    from megatron.core import parallel_state

    from megatron_ga_ext.integration.finalize import _groups

    if (
        "gtp_remat_size"
        not in inspect.signature(parallel_state.initialize_model_parallel).parameters
    ):
        return None
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.initialize_model_parallel(gtp_remat_size=2)  # world 4 = replicate DP 2 x GTP 2
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        ranks = torch.distributed.get_process_group_ranks
        return {
            "upstream": ranks(pgc.dp_cp_gtp_remat),
            "replicate": ranks(pgc.dp_cp),
            "with_pg_collection": ranks(_groups(pgc)[1]),
            "without": ranks(_groups(None)[1]),
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def outcomes():
    """{scenario: [(status, payload) per rank]} from one 4-rank launch."""
    from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

    warnings.filterwarnings("ignore", category=UserWarning)
    per_rank = run_on_ranks(_run_scenarios, 4, (), LaunchConfig(timeout_s=240))
    return {name: [rank[name] for rank in per_rank] for name in per_rank[0]}


def _raise(outcome):
    """Re-raise the error every rank raised (they must agree), or return rank 0's payload."""
    statuses = {status for status, _ in outcome}
    assert len(statuses) == 1, f"ranks disagree: {outcome}"
    status, payload = outcome[0]
    if status == "error":
        raise payload
    return payload


@pytest.mark.parametrize(
    "name, match",
    [
        (
            "two_tuple",
            r"returned a 2-tuple at micro-batch 0; token mode needs \(summed loss, num_tokens",
        ),
        (
            "float_count",
            r"num_tokens as a tensor of dtype torch\.float32 .*must be an integer scalar",
        ),
        ("vector_count", r"num_tokens as a tensor of dtype torch\.int64 and shape \(2,\)"),
        ("negative_count", r"micro-batch\(es\) returned a negative num_tokens"),
        ("nan_loss", r"8 micro-batch\(es\) in this global batch returned a non-finite loss"),
        ("ddp_before_flag", r"gradient_scaling_factor 0\.25 \(= 1/4\).*4 times too small"),
        ("average_in_collective", r"average_in_collective=True"),
        ("zero_tokens_error", r"the global batch has 0 non-padding tokens"),
        ("unwrapped", r"4 last-stage rank\(s\) ran no micro-batch through the LossContract"),
    ],
)
def test_broken_check_raises(outcomes, name, match):
    with pytest.raises(LossContractError, match=match):
        _raise(outcomes[name])


@pytest.mark.parametrize(
    "name, match",
    [
        (
            "async_nan",
            r"--ga-checks async, verdict of training step 1: 8 micro-batch\(es\) in this global "
            r"batch returned a non-finite loss",
        ),
        (
            "async_negative_count",
            r"--ga-checks async, verdict of training step 1: \d+ micro-batch\(es\) returned a "
            r"negative",
        ),
        (
            "async_zero_tokens",
            r"--ga-checks async, verdict of training step 1: the global batch has 0 non-padding "
            r"tokens",
        ),
    ],
)
def test_async_checks_raise_when_the_verdict_is_read(outcomes, name, match):
    with pytest.raises(LossContractError, match=match):
        _raise(outcomes[name])


@pytest.mark.parametrize("sync, checked", [("dp_token", "async_token"), ("pp_token", "async_pp")])
def test_async_checks_read_nothing_in_the_step_and_scale_as_sync(outcomes, sync, checked):
    """The same gradients and N as sync mode, with one host read fewer per step (sync's
    vector.tolist()) and the verdict still pending when the step returns."""
    for (_, sync_result), (_, async_result) in zip(outcomes[sync], outcomes[checked]):
        assert async_result["num_tokens"] == sync_result["num_tokens"] == 72
        assert async_result["rel_err"] < 1e-5
        assert async_result["host_reads"] == sync_result["host_reads"] - 1
        assert async_result["pending_after_step"] and not sync_result["pending_after_step"]


def test_per_token_flag_off_at_the_step_is_the_options_rule(outcomes):
    with pytest.raises(
        OptionError, match=r"--ga-loss-reduction token needs --calculate-per-token-loss"
    ):
        _raise(outcomes["flag_off"])


def test_zero_tokens_skip_applies_zero_gradient(outcomes):
    result = _raise(outcomes["zero_tokens_skip"])
    assert result["num_tokens"] == 0
    assert result["max_grad"] == 0.0
    assert any(
        "0 non-padding tokens" in w and "Skipping this optimizer step" in w
        for w in result["warnings"]
    )


@pytest.mark.parametrize("name", ["huge_count", "pp_huge_count"])
def test_count_is_summed_in_int64(outcomes, name):
    """8 micro-batches of 2^31 + n tokens: exact in int64, where int32 would wrap around."""
    expected = 72 + 8 * BIG
    for status, result in outcomes[name]:
        assert status == "ok"
        assert result["num_tokens"] == expected
        assert result["rel_err"] < 1e-5  # gradients divided by exactly that count


def test_pipeline_stages_share_the_last_stage_count(outcomes):
    results = [payload for _, payload in outcomes["pp_token"]]
    assert [r["num_tokens"] for r in results] == [72, 72, 72, 72]
    assert max(r["rel_err"] for r in results) < 1e-5
    assert not math.isnan(results[0]["max_grad"])


def test_megatron_fsdp_chunks_are_checked(outcomes):
    """Megatron-FSDP keeps its factor in param_and_grad_buffer (nn.Module.buffers is a method
    there)."""
    assert _raise(outcomes["megatron_fsdp_True"]) is None
    with pytest.raises(
        LossContractError,
        match=r"wrapped in FullyShardedDataParallel with gradient_scaling_factor "
        r"0\.25 \(= 1/4\), i\.e\. before calculate_per_token_loss was set",
    ):
        _raise(outcomes["megatron_fsdp_False"])


def test_token_count_group_spans_the_gtp_remat_axis_on_every_path(outcomes):
    for _, groups in outcomes["count_groups"]:
        if groups is None:
            pytest.skip("no GTP weight remat in this megatron-core (before 0.19)")
        assert len(groups["upstream"]) == 4 and len(groups["replicate"]) == 2
        assert groups["with_pg_collection"] == groups["without"] == groups["upstream"]
