"""LossContract with counts that live on the host: checked there, added without a host-to-device
copy."""

import pytest
import torch

from megatron_ga_ext.errors import LossContractError
from megatron_ga_ext.integration.loss_contract import (
    SLOT_NEGATIVE,
    SLOT_NONFINITE,
    SLOT_TOKENS,
    LossContract,
)


def test_int_counts_add_up_exactly_past_int32():
    contract = LossContract()
    loss = torch.tensor(2.5)
    for count in (2**31 - 1, 2**31 - 1, 5):
        assert contract.check((loss, count, {})) == (loss, count, {})
    flags = contract.collect(torch.device("cpu"), is_last_stage=True)
    assert flags.dtype == torch.int64
    assert flags.tolist()[SLOT_TOKENS] == 2 * (2**31 - 1) + 5
    assert flags.tolist()[SLOT_NEGATIVE] == 0


def test_negative_int_count_fails_at_once_with_the_micro_batch():
    contract = LossContract()
    contract.check((torch.tensor(1.0), 3, {}))
    with pytest.raises(
        LossContractError, match=r"num_tokens = -2 at micro-batch 1; a token count is >= 0"
    ):
        contract.check((torch.tensor(1.0), -2, {}))


def test_nonfinite_loss_with_an_int_count_is_flagged_on_the_device():
    contract = LossContract()
    contract.check((torch.tensor(float("nan")), 4, {}))
    contract.check((torch.tensor(1.0), torch.tensor(3), {}))  # a device count in the same step
    flags = contract.collect(torch.device("cpu"), is_last_stage=True).tolist()
    assert flags[SLOT_TOKENS] == 7 and flags[SLOT_NONFINITE] == 1


def test_one_device_per_step():
    """A loss on another device than the step's first is named at collect, before the step's
    collectives."""
    for count in (3, torch.tensor(3)):
        contract = LossContract()
        contract.check((torch.tensor(1.0), count, {}))
        contract.check((torch.tensor(1.0, device="meta"), count, {}))
        with pytest.raises(
            LossContractError, match=r"micro-batch 1 returned its loss on meta, earlier ones on cpu"
        ):
            contract.collect(torch.device("cpu"), is_last_stage=True)
