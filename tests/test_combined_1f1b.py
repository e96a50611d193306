"""Combined 1F1B (--overlap-moe-expert-parallel-comm) in token mode: megatron-core's schedule plan
routes without the padding mask it is given (fine_grained_callables.py), so install() hands the
router the plan's mask. Two gloo ranks (EP 2 x DP 2) through install(), against the unpartitioned
reference: exact with the correction, and far off with its hook row reverted, as upstream's plan
routes. verify's default rows cover the rest (TP with SP, PP x VPP, MTP, the delayed weight
gradient)."""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5


def _measure() -> tuple[float, float]:
    from megatron_ga_ext.verify.harness import run_rank
    from megatron_ga_ext.verify.layouts import DEFAULT_LAYOUTS, DEFAULT_LENGTHS
    from megatron_ga_ext.verify.run_config import VerifyConfig
    from tests.support.faults import without_row

    warnings.filterwarnings("ignore", category=UserWarning)
    combined = next(lay for lay in DEFAULT_LAYOUTS if lay.overlap_moe_expert_parallel_comm)
    cfg = VerifyConfig(
        layouts=(combined,), lengths=DEFAULT_LENGTHS, modes=("token",), progress=False
    )
    corrected = run_rank(cfg)[0]
    without_row("MoELayer.route")
    reverted = run_rank(cfg)[0]
    return corrected.rel_err_token, reverted.rel_err_token


@pytest.fixture(scope="module")
def per_rank():
    from megatron_ga_ext.testing.distributed import run_on_ranks

    return run_on_ranks(_measure, 2)


def test_token_mode_is_exact_on_the_plan_path(per_rank):
    corrected, _ = per_rank[0]
    assert corrected < TOLERANCE


def test_without_the_routed_mask_the_plan_counts_padding(per_rank):
    _, reverted = per_rank[0]
    assert reverted > 0.1  # measured 0.32: load balancing over padding positions too


def test_a_padding_mask_upstream_gives_the_router_is_kept():
    """Where upstream's plan hands route() a mask itself, the correction steps aside; inside a
    plan's run a call without one gets the plan's chunk-state mask as [s, b] bool."""
    import types

    import torch

    from megatron_ga_ext.integration.features import padding_mask

    seen = []
    route = padding_mask.plan_masked_route(lambda layer, hidden, mask: seen.append(mask), None)
    hidden = torch.zeros(4, 2, 8)  # [s, b, h]
    ours = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])  # [b, s]: padding_mask = loss_mask == 0
    upstreams = torch.ones(4, 2, dtype=torch.bool)
    plan = types.SimpleNamespace(_model_chunk_state=types.SimpleNamespace(padding_mask=ours))
    run = padding_mask.masked_plan_run(
        staticmethod(lambda f, b, mask: route(None, hidden, mask)), None
    )
    run.__func__(plan, None, upstreams)
    assert seen[-1] is upstreams
    run.__func__(plan, None, None)
    assert torch.equal(seen[-1], ours.transpose(0, 1).bool())
    route(None, hidden)  # outside a plan's run: no mask
    assert seen[-1] is None
