"""TorchFSDP2 alone (integration/features/torch_fsdp2.py), with a stand-in handle: chunks that are
not torch FSDP2 pass its phases in either mode; a unit that reduces as the other mode needs is named
at finalize (tests/test_fsdp.py: real FSDP2)."""

import pytest
import torch

from megatron_ga_ext import GAConfig, LossContractError
from megatron_ga_ext.integration.features import Finalizing, Step
from megatron_ga_ext.integration.features import torch_fsdp2 as fsdp
from megatron_ga_ext.integration.features.torch_fsdp2 import TorchFSDP2
from tests.support.stand_in import StandIn


@pytest.mark.parametrize("mode", ["token", "microbatch"])
def test_plain_and_ddp_chunks_pass_both_phases(mode):
    feature, model = TorchFSDP2(StandIn(GAConfig(loss_reduction=mode))), [torch.nn.Linear(2, 2)]
    feature.begin_step(Step({"num_microbatches": 1, "model": model}))
    feature.finalize(Finalizing(model, mode))


def test_a_unit_left_averaging_stops_the_token_step_at_finalize(monkeypatch):
    """A unit in FSDP2's default (an average) where token mode needs a sum: finalize names it."""
    unit = torch.nn.Linear(2, 2)
    monkeypatch.setattr(fsdp, "_units", lambda model: iter([("chunk 0 (root)", unit, object())]))
    feature = TorchFSDP2(StandIn(GAConfig(loss_reduction="token")))
    with pytest.raises(
        LossContractError, match=r"^torch FSDP2 unit 'chunk 0 \(root\)' reduces its gradients with "
    ):
        feature.finalize(Finalizing([unit], "token"))
    feature.finalize(Finalizing([unit], "microbatch"))  # FSDP2's own average is the mean of means


def test_begin_step_sets_every_unit_to_sum_in_token_mode_only(monkeypatch):
    calls = []

    class Unit:
        def set_gradient_divide_factor(self, factor):
            calls.append(("factor", factor))

        def set_force_sum_reduction_for_comms(self, enable):
            calls.append(("sum", enable))

    monkeypatch.setattr(fsdp, "_units", lambda model: iter([("chunk 0 (root)", Unit(), object())]))
    for mode in ("microbatch", "token"):
        TorchFSDP2(StandIn(GAConfig(loss_reduction=mode))).begin_step(
            Step({"num_microbatches": 1, "model": []})
        )
    assert calls == [("factor", 1.0), ("sum", True)]
