"""The auxiliary losses' gradients in token mode, before and after install(), on real MoE and MTP
layers.

Upstream's own ``--calculate-per-token-loss`` pre-multiplies the router's aux and z-losses by every
routed position and computes their statistics over the padding too; install() routes with
padding_mask = (loss_mask == 0), which turns on the router's count defect of Megatron-LM #7452
(finding 10: the local count read back after an in-place all-reduce), corrected by install() too;
MTP weighs its tokens by local counts (#7452, finding 3). One 2-rank launch measures each against
the unpartitioned target (verify/aux.py): the router at DP 2 with aux_loss and with global_aux_loss,
MTP at DP 2 with uneven loss tokens across the ranks; and install() with upstream's router counts,
to show the defect the correction removes. (TP 2 and CP 2 run in ``megatron-ga verify``'s 4-rank
launch, tests/test_verify.py.)
"""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.slow


def _measure():

    from megatron_ga_ext.testing.shims import cpu_shims
    from megatron_ga_ext.verify.aux import AUX_LAYOUTS, measure_aux_coefficients
    from megatron_ga_ext.verify.run_config import VerifyConfig
    from tests.support.faults import without_row

    cfg = VerifyConfig(progress=False)
    layouts = tuple(layout for layout in AUX_LAYOUTS if layout.world_size == 2)
    with cpu_shims():
        measured = measure_aux_coefficients(cfg, layouts)
        # upstream's router counts: the table without the row that corrects them
        without_row("get_tokens_per_expert_and_token_count")
        unfixed = measure_aux_coefficients(
            cfg, tuple(lay for lay in layouts if lay.model == "moe_global")
        )
    return (
        [(c.layout, c.variant, c.coefficient, c.error) for c in measured],
        [(c.layout, c.variant, c.coefficient, c.error) for c in unfixed],
    )


@pytest.fixture(scope="module")
def per_rank():
    from megatron_ga_ext.testing.distributed import run_on_ranks

    warnings.filterwarnings("ignore", category=UserWarning)
    return run_on_ranks(_measure, 2)


def test_both_ranks_measure_the_same(per_rank):
    assert (
        per_rank[0] == per_rank[1]
    )  # the measured gradients are DP all-reduced: every rank holds them all


def test_the_measured_layouts(per_rank):
    measured, _ = per_rank[0]
    assert [(layout, variant) for layout, variant, *_ in measured] == [
        (layout, variant)
        for layout in ("DP2 x GA4 (MoE)", "DP2 x GA4 (MoE global_aux_loss)", "DP2 x GA4 (MTP)")
        for variant in ("upstream --calculate-per-token-loss", "with megatron-ga-ext")
    ]


def test_upstream_per_token_loss_misses_the_target(per_rank):
    from megatron.core.transformer import multi_token_prediction

    measured, _ = per_rank[0]
    before = {
        layout: (coefficient, error)
        for layout, variant, coefficient, error in measured
        if variant.startswith("upstream")
    }
    assert (
        before["DP2 x GA4 (MoE)"][0] > 1.1
    )  # counts and statistics over 128 positions, 72 of them loss tokens
    assert before["DP2 x GA4 (MoE global_aux_loss)"][1] > 0.3
    mtp_coefficient, mtp_error = before.pop("DP2 x GA4 (MTP)")
    if hasattr(
        multi_token_prediction, "process_mtp_loss"
    ):  # 0.17+: MTP tokens weighted n_u / (m_u N)
        assert mtp_coefficient > 1.05 and mtp_error > 0.3
    else:  # 0.16 attaches the MTP sum: every MTP token alpha / N already
        assert mtp_coefficient == pytest.approx(1.0, abs=1e-6) and mtp_error < 1e-5
    assert all(error > 0.3 for _, error in before.values()), before


def test_install_meets_the_token_mode_target(per_rank):
    measured, _ = per_rank[0]
    after = [
        (layout, coefficient, error)
        for layout, variant, coefficient, error in measured
        if variant == "with megatron-ga-ext"
    ]
    assert len(after) == 3
    for layout, coefficient, error in after:
        assert coefficient == pytest.approx(1.0, abs=1e-6) and error < 1e-5, layout


def test_upstream_router_counts_with_a_padding_mask_are_dp_times_the_target(per_rank):
    """#7452 finding 10 under global_aux_loss: with the padding mask and upstream's counts, the
    router pre-multiplies every piece of micro-batch m by T(m), m's loss tokens over both DP ranks,
    where the target (every token of m at the same weight, the reference computed from that
    definition) takes T(m) / DP: exactly DP = 2 times the target on every micro-batch, however
    uneven the batch. A rank-local weighting (n(m, r) / N per piece) would be off it by T(m) / (DP
    n(m, r)), 1.43 on this batch."""
    _, unfixed = per_rank[0]
    ((_, _, coefficient, error),) = [row for row in unfixed if row[1] == "with megatron-ga-ext"]
    assert 1.3 < coefficient < 2.5 and error > 0.5, (coefficient, error)
    assert coefficient == pytest.approx(2.0, abs=1e-5) and error == pytest.approx(1.0, abs=1e-5), (
        coefficient,
        error,
    )
