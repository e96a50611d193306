"""The loss helper, the loss contract and the DDP audit, in-process (no ranks, no megatron
launch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ga_ext.errors import LossContractError, OptionError
from megatron_ga_ext.integration.chunk_checks import check_ddp_chunks, check_per_token_flag
from megatron_ga_ext.integration.finalize import make_finalize_model_grads
from megatron_ga_ext.integration.loss_contract import (
    LossContract,
    masked_loss,
    mean_of_means_reports,
    reduce_reports,
)

LOSSES = [torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[10.0, 20.0, 30.0, 40.0]])]
MASKS = [torch.tensor([[1.0, 1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0, 0.0]])]


def test_masked_loss_token_mode_sums_and_counts_in_int64():
    loss, n, report = masked_loss(LOSSES[0], MASKS[0])
    assert loss.item() == 6.0
    assert n.dtype == torch.int64 and n.item() == 3
    assert report["lm loss"].tolist() == [6.0, 3.0]


def test_report_mean_is_the_optimised_loss_in_each_mode():
    token = [masked_loss(loss, m)[2] for loss, m in zip(LOSSES, MASKS)]
    assert reduce_reports(token)["lm loss"].item() == pytest.approx((6.0 + 10.0) / 4)
    means = [masked_loss(loss, m, mode="microbatch")[2] for loss, m in zip(LOSSES, MASKS)]
    assert reduce_reports(means)["lm loss"].item() == pytest.approx((6.0 / 3 + 10.0 / 1) / 2)


def test_masked_loss_rejects_mismatched_shapes_and_modes():
    with pytest.raises(
        LossContractError, match=r"losses has shape \(1, 4\) but loss_mask has shape \(3,\)"
    ):
        masked_loss(LOSSES[0], torch.ones(3))
    with pytest.raises(LossContractError, match="mode 'tokens' is not known"):
        masked_loss(LOSSES[0], MASKS[0], mode="tokens")


@pytest.mark.parametrize(
    "outputs, match",
    [
        ((torch.tensor(1.0), {}), r"returned a 2-tuple at micro-batch 0; token mode needs"),
        (torch.tensor(1.0), r"returned Tensor at micro-batch 0"),
        (
            (torch.tensor(1.0), torch.tensor(3.0), {}),
            r"num_tokens as a tensor of dtype torch\.float32",
        ),
        (
            (torch.tensor(1.0), torch.tensor(True), {}),
            r"num_tokens as a tensor of dtype torch\.bool",
        ),
        ((torch.tensor(1.0), torch.tensor([1, 2]), {}), r"and shape \(2,\)"),
        ((torch.tensor(1.0), 3.0, {}), r"num_tokens of type float"),
        ((1.0, torch.tensor(3), {}), r"a loss of type float"),
    ],
)
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

    READS = frozenset(
        {
            torch.Tensor.item,
            torch.Tensor.__bool__,
            torch.Tensor.tolist,
            torch.Tensor.__int__,
            torch.Tensor.__float__,
            torch.Tensor.numpy,
            torch.Tensor.__index__,
            torch.equal,
            torch.Tensor.equal,
            torch.allclose,
            torch.Tensor.allclose,
            torch.is_nonzero,
            torch.Tensor.is_nonzero,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"host read {func.__name__} during a per-micro-batch check")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.item(),
        lambda t: bool(t),
        lambda t: t.tolist(),
        lambda t: int(t),
        lambda t: float(t),
        lambda t: t.numpy(),
        lambda t: [0][t],
        lambda t: torch.equal(t, t),
        lambda t: t.equal(t),
        lambda t: torch.allclose(t, t),
        lambda t: t.allclose(t),
        lambda t: torch.is_nonzero(t),
        lambda t: t.is_nonzero(),
    ],
)
def test_no_host_reads_catches_every_read(read):
    with _NoHostReads(), pytest.raises(AssertionError, match="host read"):
        read(torch.tensor(1))


def test_contract_accumulates_device_flags_without_host_reads():
    contract = LossContract()
    micro = [masked_loss(loss, m) for loss, m in zip(LOSSES, MASKS)]
    bad_count = (micro[0][0], micro[0][1] - 10, micro[0][2])
    bad_loss = (micro[1][0] * float("inf"), micro[1][1], micro[1][2])
    wrapped = contract.wrap(lambda outputs: outputs)
    with _NoHostReads():
        for outputs in [*micro, bad_count, bad_loss]:
            wrapped(outputs)
    assert contract.microbatches == 4
    vector = contract.collect(torch.device("cpu"), is_last_stage=True)
    assert vector.dtype == torch.int64
    assert vector.tolist() == [
        3 + 1 + (3 - 10) + 1,
        1,
        1,
        0,
    ]  # tokens, negative, nonfinite, unchecked
    assert contract.microbatches == 0  # reset for the next step


class _DispatchedOps(TorchDispatchMode):
    """Records every aten op that reaches a kernel (views and metadata-only calls like detach
    included)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _step_ops(contract: LossContract, num_microbatches: int) -> tuple[list[str], list[str]]:
    """(ops per micro-batch check, ops of collect) for a step of ``num_microbatches``."""
    micro = [masked_loss(loss, m) for loss, m in zip(LOSSES, MASKS)] * (num_microbatches // 2)
    wrapped = contract.wrap(lambda outputs: outputs)
    with _DispatchedOps() as per_microbatch:
        for outputs in micro:
            wrapped(outputs)
    with _DispatchedOps() as collected:
        vector = contract.collect(torch.device("cpu"), is_last_stage=True)
    assert vector.tolist() == [num_microbatches // 2 * (3 + 1), 0, 0, 0]
    return per_microbatch.ops, collected.ops


def test_contract_keeps_references_only_per_microbatch():
    """Host bookkeeping per micro-batch: no op but the alias of the loss (a metadata-only detach).
    The step's checks run in collect as the same device ops whatever GA is, none of them a read to
    the host."""
    contract = LossContract()
    step_ops = None
    for num_microbatches in (16, 2):
        per_microbatch, collected = _step_ops(contract, num_microbatches)
        assert per_microbatch == ["detach"] * num_microbatches
        assert "_local_scalar_dense" not in collected  # what item, tolist, int and bool dispatch
        assert step_ops is None or collected == step_ops
        step_ops = collected


def test_collect_reads_nothing_to_the_host():
    """The step's vector is made with device ops only, for every mix of counts the contract
    accepts."""
    steps = [
        [torch.tensor(3), torch.tensor(4)],
        [torch.tensor(3), torch.tensor([4], dtype=torch.int32)],
        [torch.tensor(3, dtype=torch.uint32), torch.tensor(-4, dtype=torch.int8)],
        [3, torch.tensor(4)],
    ]
    for counts in steps:
        contract = LossContract()
        for count in counts:
            contract.check((torch.tensor(1.0), count, {}))
        with _NoHostReads():
            vector = contract.collect(torch.device("cpu"), is_last_stage=True)
        assert vector.tolist()[:2] == [sum(int(c) for c in counts), sum(int(c) < 0 for c in counts)]


def test_step_vector_is_the_host_arithmetic():
    """[tokens, negative, nonfinite, unchecked] as Python computes it, for counts of each native
    dtype and GA 1-8."""
    torch.manual_seed(0)
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.int8):
        for num_microbatches in (1, 3, 8):
            losses = list(torch.randn(num_microbatches) * 100)
            losses[num_microbatches // 2] = torch.tensor(float("nan"))
            counts = [
                torch.tensor(int(v), dtype=dtype)
                for v in torch.randint(-3 if dtype.is_signed else 0, 100, (num_microbatches,))
            ]
            contract = LossContract()
            for loss, count in zip(losses, counts):
                contract.check((loss, count, {}))
            vector = contract.collect(torch.device("cpu"), is_last_stage=True).tolist()
            assert vector == [sum(int(c) for c in counts), sum(int(c) < 0 for c in counts), 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_collect_counts_every_kind_of_nonfinite_loss(dtype, shape):
    """inf, -inf and nan are flagged; the largest finite value, -0.0 and the smallest subnormal are
    not."""
    finfo = torch.finfo(dtype)
    values = [
        1.0,
        float("inf"),
        -float("inf"),
        float("nan"),
        finfo.max,
        -finfo.max,
        -0.0,
        finfo.tiny / 2,
    ]
    contract = LossContract()
    for value in values:
        contract.check((torch.tensor(value, dtype=dtype).reshape(shape), torch.tensor(2), {}))
    assert contract.collect(torch.device("cpu"), is_last_stage=True).tolist() == [
        2 * len(values),
        0,
        3,
        0,
    ]


def test_contract_flags_an_unchecked_last_stage_only():
    assert LossContract().collect(torch.device("cpu"), is_last_stage=True).tolist() == [0, 0, 0, 1]
    assert LossContract().collect(torch.device("cpu"), is_last_stage=False).tolist() == [0, 0, 0, 0]


def test_wrap_passes_non_loss_data_through():
    wrapped = LossContract().wrap(lambda out, non_loss_data=False: "data")
    assert wrapped(torch.zeros(1), non_loss_data=True) == "data"


def _chunk(factor, average_in_collective=False, expert_factor=None):
    buffers = [SimpleNamespace(gradient_scaling_factor=factor)]
    experts = (
        [] if expert_factor is None else [SimpleNamespace(gradient_scaling_factor=expert_factor)]
    )
    return SimpleNamespace(
        ddp_config=SimpleNamespace(average_in_collective=average_in_collective),
        buffers=buffers,
        expert_parallel_buffers=experts,
    )


def test_ddp_audit_accepts_per_token_chunks_and_plain_modules():
    check_ddp_chunks(
        [_chunk(1.0, expert_factor=1.0), torch.nn.Linear(2, 2)],
        SimpleNamespace(calculate_per_token_loss=True),
    )


@pytest.mark.parametrize(
    "chunks, match",
    [
        (
            [_chunk(1.0), _chunk(0.125)],
            r"model chunk 1 .* gradient_scaling_factor 0\.125 \(= 1/8\).*8 times too small",
        ),
        ([_chunk(1.0, expert_factor=0.5)], r"gradient_scaling_factor 0\.5 \(= 1/2\)"),
        ([_chunk(1.0, average_in_collective=True)], r"average_in_collective=True"),
    ],
)
def test_ddp_audit_rejects_chunks_built_without_per_token_loss(chunks, match):
    with pytest.raises(LossContractError, match=match):
        check_ddp_chunks(chunks)


def test_per_token_flag_must_match_the_mode():
    """The model config as the step reads it, held to options.check_loss_mode (the one rule)."""
    with pytest.raises(OptionError, match="token needs --calculate-per-token-loss"):
        check_per_token_flag(SimpleNamespace(calculate_per_token_loss=False), "token")
    with pytest.raises(OptionError, match="microbatch is upstream's mean of means"):
        check_per_token_flag(SimpleNamespace(calculate_per_token_loss=True), "microbatch")
    with pytest.raises(OptionError, match="token needs --calculate-per-token-loss"):
        check_ddp_chunks([], SimpleNamespace(calculate_per_token_loss=False))


def test_microbatch_mode_reports_each_micro_batch_mean():
    """Upstream's pretrain_gpt reports [summed loss, n]; Megatron logs sum(report[0]) /
    sum(report[1]), the token mean. In microbatch mode the report becomes [mean, 1], so the logged
    loss is the mean of means optimised."""

    def upstream_loss_func(loss_mask, output_tensor):
        loss = torch.sum(output_tensor * loss_mask)
        n = loss_mask.sum().to(torch.int)
        return loss, n, {"lm loss": torch.cat([loss.view(1), n.view(1)])}

    func = mean_of_means_reports(upstream_loss_func)
    reports = [func(MASKS[m], LOSSES[m])[2] for m in range(len(LOSSES))]
    logged = reduce_reports(reports)["lm loss"]
    means = [
        float((LOSSES[m] * MASKS[m]).sum() / MASKS[m].sum().clamp(min=1))
        for m in range(len(LOSSES))
    ]
    assert float(logged) == pytest.approx(sum(means) / len(means), rel=1e-6)
    token_sum = sum(float((loss * mask).sum()) for loss, mask in zip(LOSSES, MASKS))
    token_mean = token_sum / float(sum(mask.sum() for mask in MASKS))
    assert abs(float(logged) - token_mean) > 1e-3  # the masks are uneven: the two means differ
    _, n, _ = func(MASKS[0], LOSSES[0])
    assert int(n) == int(MASKS[0].sum())  # the loss and count Megatron scales by are unchanged


def test_token_finalize_needs_a_contract():
    with pytest.raises(LossContractError, match="needs a LossContract"):
        make_finalize_model_grads(lambda *a, **k: None)


def test_narrow_device_counts_add_up_in_int64():
    """int32 and uint8 counts are summed in int64: two int32 maxima and a uint8 do not wrap."""
    contract = LossContract()
    for count in (
        torch.tensor(2**31 - 1, dtype=torch.int32),
        torch.tensor([2**31 - 1], dtype=torch.int32),
        torch.tensor(5, dtype=torch.uint8),
    ):
        contract.check((torch.tensor(1.0), count, {}))
    vector = contract.collect(torch.device("cpu"), is_last_stage=True)
    assert vector.dtype == torch.int64 and vector.tolist() == [2 * (2**31 - 1) + 5, 0, 0, 0]


@pytest.mark.parametrize(
    "dtype", ["uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"]
)
def test_every_integer_count_dtype_is_summed_and_checked(dtype):
    """uint16-64, which few torch ops take, are widened; signed counts below 0 are flagged."""
    contract = LossContract()
    values = (3, 4, -2) if dtype.startswith("int") else (3, 4, 250)
    for value in values:
        contract.check((torch.tensor(1.0), torch.tensor(value, dtype=getattr(torch, dtype)), {}))
    negative = int(dtype.startswith("int"))
    assert contract.collect(torch.device("cpu"), is_last_stage=True).tolist() == [
        sum(values),
        negative,
        0,
        0,
    ]


def test_a_later_count_of_another_shape_is_summed_or_refused_at_once():
    """A count of the step's dtype but another shape: a one-element count is summed with the others,
    a longer one is refused at its micro-batch."""
    contract = LossContract()
    for count in (torch.tensor(3), torch.tensor([4])):
        contract.check((torch.tensor(1.0), count, {}))
    assert contract.collect(torch.device("cpu"), is_last_stage=True).tolist() == [7, 0, 0, 0]
    contract.check((torch.tensor(1.0), torch.tensor(3), {}))
    with pytest.raises(
        LossContractError, match=r"num_tokens as a tensor of dtype torch\.int64 and shape \(2,\)"
    ):
        contract.check((torch.tensor(1.0), torch.tensor([4, 5]), {}))


def test_counts_of_another_shape_or_dtype_in_a_later_step():
    """One contract, steps whose counts differ in shape and dtype: each step's vector is its own."""
    contract = LossContract()
    steps = [
        [torch.tensor(3), torch.tensor(4)],
        [torch.tensor([3]), torch.tensor([4])],
        [torch.tensor(3, dtype=torch.int32), torch.tensor(4, dtype=torch.int32)],
        [torch.tensor(3), torch.tensor(4)],
    ]
    for counts in steps:
        for count in counts:
            contract.check((torch.tensor(1.0), count, {}))
        assert contract.collect(torch.device("cpu"), is_last_stage=True).tolist() == [7, 0, 0, 0]


def test_the_extensions_finalize_is_named_as_upstreams_in_a_yaml_config():
    """Megatron-Bridge saves its config (holding partial(finalize_model_grads, pg_collection=...))
    as YAML beside each checkpoint, naming a function by its module and __qualname__: the
    extension's finalize answers upstream's."""
    import functools

    yaml = pytest.importorskip("yaml")
    yaml_utils = pytest.importorskip("megatron.training.config.yaml_utils")
    from megatron.core.distributed import finalize_model_grads

    bound = functools.partial(
        make_finalize_model_grads(finalize_model_grads, LossContract()), pg_collection=None
    )
    with yaml_utils.safe_yaml_representers():
        text = yaml.safe_dump({"finalize_model_grads_func": bound})
    assert "_target_: megatron.core.distributed.finalize_model_grads.finalize_model_grads" in text
