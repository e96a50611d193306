"""AuxLosses alone (integration/features/aux_losses.py), with a stand-in handle: the first step's N
kept on the device (read once, at the report), the chunks that routed without a padding mask, and
the report itself."""

from types import SimpleNamespace

import torch

from megatron_ga_ext import GAConfig
from megatron_ga_ext.integration.features import Finalizing, Step
from megatron_ga_ext.integration.features.aux_losses import AuxLosses
from tests.support.stand_in import StandIn


def test_finalize_keeps_the_first_steps_n_on_the_device_until_the_report():
    aux = AuxLosses(StandIn())
    tokens = torch.tensor(72)
    aux.finalize(Finalizing([], "token", tokens))
    assert aux.num_tokens is tokens  # not read here: no device-to-host copy in finalize
    aux.reported = True
    aux.finalize(Finalizing([], "token", torch.tensor(80)))
    assert aux.num_tokens is tokens


def test_a_model_that_routed_without_a_padding_mask_is_kept_once_until_the_report():
    aux, model = AuxLosses(StandIn()), torch.nn.Linear(1, 1)
    aux.routed_without_padding_mask(model)
    aux.routed_without_padding_mask(model)
    assert aux.unmasked_moe_models == [model]


def test_a_model_without_auxiliary_losses_reports_nothing_after_its_first_training_step(caplog):
    chunk = object()
    handle = StandIn(
        GAConfig(loss_reduction="microbatch"), model_configs={chunk: SimpleNamespace()}
    )
    aux = AuxLosses(handle)
    aux.end_step(
        Step({"num_microbatches": 1, "model": [chunk], "forward_only": True})
    )  # an evaluation: not yet
    assert not aux.reported
    aux.end_step(Step({"num_microbatches": 1, "model": [chunk]}))
    assert aux.reported and "auxiliary losses" not in caplog.text
