"""The loss helper, the loss contract and the DDP audit, in-process (no ranks, no megatron launch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_ga_ext.errors import LossContractError
from megatron_ga_ext.finalize import check_ddp_chunks, check_per_token_flag, make_finalize_model_grads
from megatron_ga_ext.reduction import LossContract, ReductionConfig, masked_loss, reduce_reports

LOSSES = [torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[10.0, 20.0, 30.0, 40.0]])]
MASKS = [torch.tensor([[1.0, 1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0, 0.0]])]


def test_masked_loss_token_mode_sums_and_counts_in_int64():
    loss, n, report = masked_loss(LOSSES[0], MASKS[0])
    assert loss.item() == 6.0
    assert n.dtype == torch.int64 and n.item() == 3
    assert report["lm loss"].tolist() == [6.0, 3.0]


def test_report_mean_is_the_optimised_loss_in_each_mode():
    token = [masked_loss(l, m)[2] for l, m in zip(LOSSES, MASKS)]
    assert reduce_reports(token)["lm loss"].item() == pytest.approx((6.0 + 10.0) / 4)
    means = [masked_loss(l, m, mode="microbatch")[2] for l, m in zip(LOSSES, MASKS)]
    assert reduce_reports(means)["lm loss"].item() == pytest.approx((6.0 / 3 + 10.0 / 1) / 2)


def test_masked_loss_rejects_mismatched_shapes_and_modes():
    with pytest.raises(LossContractError, match=r"losses has shape \(1, 4\) but loss_mask has shape \(3,\)"):
        masked_loss(LOSSES[0], torch.ones(3))
    with pytest.raises(LossContractError, match="mode 'tokens' is not known"):
        masked_loss(LOSSES[0], MASKS[0], mode="tokens")


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "sample"}, "reduction mode 'sample' is not known; choose one of token, microbatch"),
    ({"zero_tokens": "warn"}, r"zero_tokens policy 'warn' is not known; choose 'error' \(raise\) or 'skip'"),
])
def test_reduction_config_validates(kwargs, match):
    with pytest.raises(LossContractError, match=match):
        ReductionConfig(**kwargs)


@pytest.mark.parametrize("outputs, match", [
    ((torch.tensor(1.0), {}), r"returned a 2-tuple at micro-batch 0; token mode needs"),
    (torch.tensor(1.0), r"returned Tensor at micro-batch 0"),
    ((torch.tensor(1.0), torch.tensor(3.0), {}), r"num_tokens as a tensor of dtype torch\.float32"),
    ((torch.tensor(1.0), torch.tensor(True), {}), r"num_tokens as a tensor of dtype torch\.bool"),
    ((torch.tensor(1.0), torch.tensor([1, 2]), {}), r"and shape \(2,\)"),
    ((torch.tensor(1.0), 3.0, {}), r"num_tokens of type float"),
    ((1.0, torch.tensor(3), {}), r"a loss of type float"),
])
def test_contract_rejects_host_facts_at_once(outputs, match):
    with pytest.raises(LossContractError, match=match):
        LossContract().check(outputs)


def test_contract_counts_the_failing_microbatch():
    contract = LossContract()
    contract.check(masked_loss(LOSSES[0], MASKS[0]))
    with pytest.raises(LossContractError, match="2-tuple at micro-batch 1"):
        contract.check((torch.tensor(1.0), {}))


class _NoHostReads(TorchFunctionMode):
    """Fails on every device-to-host read a check could hide: item, bool, tolist, int, float, numpy,
    index, and the comparisons that answer a Python bool without ``__bool__`` (equal, allclose,
    is_nonzero)."""

    READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.__index__,
             torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose,
             torch.is_nonzero, torch.Tensor.is_nonzero}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"host read {func.__name__} during a per-micro-batch check")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("read", [
    lambda t: t.item(), lambda t: bool(t), lambda t: t.tolist(), lambda t: int(t), lambda t: float(t),
    lambda t: t.numpy(), lambda t: [0][t], lambda t: torch.equal(t, t), lambda t: t.equal(t),
    lambda t: torch.allclose(t, t), lambda t: t.allclose(t), lambda t: torch.is_nonzero(t),
    lambda t: t.is_nonzero(),
])
def test_no_host_reads_catches_every_read(read):
    with _NoHostReads(), pytest.raises(AssertionError, match="host read"):
        read(torch.tensor(1))


def test_contract_accumulates_device_flags_without_host_reads():
    contract = LossContract()
    micro = [masked_loss(l, m) for l, m in zip(LOSSES, MASKS)]
    bad_count = (micro[0][0], micro[0][1] - 10, micro[0][2])
    bad_loss = (micro[1][0] * float("inf"), micro[1][1], micro[1][2])
    wrapped = contract.wrap(lambda outputs: outputs)
    with _NoHostReads():
        for outputs in [*micro, bad_count, bad_loss]:
            wrapped(outputs)
    assert contract.microbatches == 4
    vector = contract.collect(torch.device("cpu"), is_last_stage=True)
    assert vector.dtype == torch.int64
    assert vector.tolist() == [3 + 1 + (3 - 10) + 1, 1, 1, 0]  # tokens, negative, nonfinite, unchecked
    assert contract.microbatches == 0  # reset for the next step


def test_contract_flags_an_unchecked_last_stage_only():
    assert LossContract().collect(torch.device("cpu"), is_last_stage=True).tolist() == [0, 0, 0, 1]
    assert LossContract().collect(torch.device("cpu"), is_last_stage=False).tolist() == [0, 0, 0, 0]


def test_wrap_passes_non_loss_data_through():
    wrapped = LossContract().wrap(lambda out, non_loss_data=False: "data")
    assert wrapped(torch.zeros(1), non_loss_data=True) == "data"


def _chunk(factor, average_in_collective=False, expert_factor=None):
    buffers = [SimpleNamespace(gradient_scaling_factor=factor)]
    experts = [] if expert_factor is None else [SimpleNamespace(gradient_scaling_factor=expert_factor)]
    return SimpleNamespace(ddp_config=SimpleNamespace(average_in_collective=average_in_collective),
                           buffers=buffers, expert_parallel_buffers=experts)


def test_ddp_audit_accepts_per_token_chunks_and_plain_modules():
    check_ddp_chunks([_chunk(1.0, expert_factor=1.0), torch.nn.Linear(2, 2)],
                     SimpleNamespace(calculate_per_token_loss=True))


@pytest.mark.parametrize("chunks, match", [
    ([_chunk(1.0), _chunk(0.125)], r"model chunk 1 .* gradient_scaling_factor 0\.125 \(= 1/8\).*8 times too small"),
    ([_chunk(1.0, expert_factor=0.5)], r"gradient_scaling_factor 0\.5 \(= 1/2\)"),
    ([_chunk(1.0, average_in_collective=True)], r"average_in_collective=True"),
])
def test_ddp_audit_rejects_chunks_built_without_per_token_loss(chunks, match):
    with pytest.raises(LossContractError, match=match):
        check_ddp_chunks(chunks)


def test_per_token_flag_must_match_the_mode():
    with pytest.raises(LossContractError, match="needs calculate_per_token_loss=True"):
        check_per_token_flag(SimpleNamespace(calculate_per_token_loss=False), "token")
    with pytest.raises(LossContractError, match="'microbatch' is upstream's mean of means"):
        check_per_token_flag(SimpleNamespace(calculate_per_token_loss=True), "microbatch")
    with pytest.raises(LossContractError, match="needs calculate_per_token_loss=True"):
        check_ddp_chunks([], SimpleNamespace(calculate_per_token_loss=False))


def test_token_finalize_needs_a_contract():
    with pytest.raises(LossContractError, match="needs a LossContract"):
        make_finalize_model_grads(lambda *a, **k: None)
