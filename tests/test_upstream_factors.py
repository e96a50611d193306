"""Upstream fixes are detected, never applied twice (integration/upstream_factors.py).

Each auxiliary-loss correction measures at its first call whether upstream still does what it
corrects. One 2-rank gloo launch trains one step of verify's layouts through install(), in token
mode, against today's upstream (the correction applies) and against upstreams with a fix written in
(the correction steps aside, or, where it replaces upstream's value rather than scaling it, applies
without correcting twice), and compares the gradients with verify's token reference:

* the router's count, DP 2 with global_aux_loss (its reduce group spans DP): today's in-place count
  (#7452 finding 10); Megatron-LM #7481's local count; an upstream count that is the one the router
  needs already;
* the z-loss before 0.19, TP 2 with sequence parallelism: today's router (no TP x CP factor); 0.19's
  factor written into it (#5047);
* MTP (0.17+), DP 2: today's local n_u / m_u; an upstream that attaches the sum; one whose ratio is
  reduced over DP (#7498 / #7570 would reduce it so), not the token target on this batch.

A fixed upstream is upstream's own source with the fix written in, its ``__wrapped__`` the original,
so that install()'s fingerprint gate passes it as ``--no-ga-strict`` passes a changed source: the
measured check behind that gate is what is tested.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import textwrap
import warnings

import pytest

pytestmark = pytest.mark.slow

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
ROUTER = "megatron.core.transformer.moe.router"
MTP = "megatron.core.transformer.multi_token_prediction"
COUNTS = "get_tokens_per_expert_and_token_count"
#: (module, function, text upstream has, text with the fix) by fixed upstream
FIXES = {
    "local count (#7481)": (
        MOE_UTILS,
        COUNTS,
        "local_tokens_per_expert, reduce_group",
        "local_tokens_per_expert.clone(), reduce_group",
    ),
    # with TP x CP = 1, global_aux_loss's unit takes T(m) / DP: the router's count, given by
    # upstream itself
    "the router's count": (
        MOE_UTILS,
        COUNTS,
        "local_num_tokens = local_tokens_per_expert.sum() / topk",
        "local_num_tokens = global_tokens_per_expert.sum() / topk / reduce_group.size()",
    ),
    "z-loss factor (#5047)": (
        ROUTER,
        "TopKRouter.apply_z_loss",
        "z_loss * num_tokens)",
        "z_loss * num_tokens * self.tp_cp_group.size())",
    ),
    "MTP sum": (MTP, "process_mtp_loss", "(original_num_tokens / num_tokens_safe)", "1"),
    "MTP ratio over DP": (
        MTP,
        "process_mtp_loss",
        "(original_num_tokens / num_tokens_safe)",
        "(_dp_sum(original_num_tokens) / _dp_sum(num_tokens_safe))",
    ),
}


def _layouts():
    from megatron_ga_ext.verify.layouts import Layout

    return {
        "global": Layout(data_parallel_size=2, num_microbatches=4, model="moe_global"),
        "tp": Layout(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            data_parallel_size=1,
            num_microbatches=8,
            model="moe",
        ),
        "mtp": Layout(data_parallel_size=2, num_microbatches=4, model="mtp"),
    }


def _scenarios() -> list[tuple[str, str, str | None]]:
    """(name, layout, fix) this megatron-core runs: the z-loss correction exists before 0.19, MTP's
    from 0.17."""
    from megatron.core.transformer import multi_token_prediction

    from megatron_ga_ext.integration.features.aux_losses import router_scales_by_tp_cp

    rows = [
        ("count today", "global", None),
        ("count #7481", "global", "local count (#7481)"),
        ("count fixed", "global", "the router's count"),
    ]
    if not router_scales_by_tp_cp():
        rows += [("z today", "tp", None), ("z fixed", "tp", "z-loss factor (#5047)")]
    if hasattr(multi_token_prediction, "process_mtp_loss"):
        rows += [
            ("mtp today", "mtp", None),
            ("mtp sum", "mtp", "MTP sum"),
            ("mtp dp", "mtp", "MTP ratio over DP"),
        ]
    return rows


def _dp_sum(count):
    """The fixed MTP ratio's count reduced over DP x CP (Megatron-LM #7498 / #7570 would reduce it
    so)."""
    import torch
    from megatron.core import parallel_state

    count = count.clone().float()
    torch.distributed.all_reduce(
        count, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    return count


def _fixed(fix: str):
    """The upstream function with ``fix`` written into its source, compiled in its module's
    namespace."""
    module_name, name, old, new = FIXES[fix]
    module = importlib.import_module(module_name)
    owner, _, attribute = name.rpartition(".")
    original = vars(getattr(module, owner) if owner else module)[attribute]
    source = textwrap.dedent(inspect.getsource(original))
    assert source.count(old) == 1, (name, old)
    namespace: dict = {}
    exec(
        compile(source.replace(old, new), f"<{name} with {fix}>", "exec"),
        module.__dict__,
        namespace,
    )
    fixed = namespace[attribute]
    fixed.__wrapped__ = (
        original  # install()'s fingerprint gate reads upstream's source, as --no-ga-strict lets it
    )
    return module, owner, attribute, original, fixed


@contextlib.contextmanager
def _upstream(fix: str | None):
    """Upstream as it is, or with ``fix``: bound everywhere the original is (``from x import y``
    included)."""
    if fix is None:
        yield
        return
    module, owner, attribute, original, fixed = _fixed(fix)
    if owner:
        holders = [vars(getattr(module, owner))]
        setattr(getattr(module, owner), attribute, fixed)
    else:
        holders = [
            vars(m) for m in list(sys.modules.values()) if vars(m).get(attribute) is original
        ]
        for namespace in holders:
            namespace[attribute] = fixed
    module.__dict__["_dp_sum"] = _dp_sum
    try:
        yield
    finally:
        module.__dict__.pop("_dp_sum")
        if owner:
            setattr(getattr(module, owner), attribute, original)
        for namespace in holders if not owner else ():
            namespace[attribute] = original


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


def _run() -> dict[str, tuple[float, list[str]]]:
    """Each scenario on this rank: (its gradients' error against the token reference, what rank 0
    was told)."""
    from megatron_ga_ext.testing.shims import cpu_shims
    from megatron_ga_ext.verify.harness import relative_error, run_layout
    from megatron_ga_ext.verify.layouts import make_global_batch
    from megatron_ga_ext.verify.references import reference_grads
    from megatron_ga_ext.verify.run_config import VerifyConfig

    cfg = VerifyConfig(progress=False)
    batch = make_global_batch(cfg.lengths, cfg.model.seq_length, cfg.model.vocab_size)
    layouts = _layouts()
    scenarios = _scenarios()
    said = _Said()
    logger = logging.getLogger("megatron_ga_ext.integration.upstream_factors")
    logger.addHandler(said)
    logger.setLevel(logging.DEBUG)
    out = {}
    with cpu_shims():
        used = [layouts[name] for name in dict.fromkeys(layout for _, layout, _ in scenarios)]
        refs = reference_grads(cfg.model, used, batch)
        for name, layout, fix in scenarios:
            with _upstream(fix):
                grads, _ = run_layout(layouts[layout], "token", cfg, batch)
            out[name] = (
                relative_error(grads, refs[(layouts[layout].name, "token")]),
                said.messages,
            )
            said.messages = []
    return out


@pytest.fixture(scope="module")
def runs():
    from megatron_ga_ext.testing.distributed import run_on_ranks

    warnings.filterwarnings("ignore", category=UserWarning)
    return run_on_ranks(_run, 2)


def _said(runs, scenario: str) -> str:
    return "\n".join(runs[0][scenario][1])


def test_the_ranks_agree(runs):
    assert {name: error for name, (error, _) in runs[0].items()} == pytest.approx(
        {name: error for name, (error, _) in runs[1].items()}, rel=1e-3, abs=1e-9
    )


def test_today_each_correction_applies_and_meets_the_target(runs):
    today = [name for name in runs[0] if name.endswith("today")]
    for name in today:
        error, messages = runs[0][name]
        assert error < 1e-5, (name, error)
        assert not any(m.startswith("WARNING") for m in messages), (name, messages)
        measured = (
            "the router's count is corrected",
            "the z-loss gradient is scaled",
            "alpha / N instead",
        )
        assert any(m.startswith("DEBUG") and any(w in m for w in measured) for m in messages), (
            name,
            messages,
        )


def test_router_count_fixed_upstream_steps_aside_and_meets_the_target(runs):
    error, _ = runs[0]["count fixed"]
    said = _said(runs, "count fixed")
    assert error < 1e-5, error
    assert "WARNING" in said and "the router-count correction steps aside" in said, said


def test_router_count_with_7481_still_applies_never_twice(runs):
    """#7481 makes upstream's count local; the correction replaces the count, so it applies and
    meets the target."""
    error, _ = runs[0]["count #7481"]
    said = _said(runs, "count #7481")
    assert error < 1e-5, error
    assert "this rank's own (Megatron-LM #7481)" in said and "WARNING" not in said, said


def test_z_loss_factor_fixed_upstream_steps_aside_and_meets_the_target(runs):
    if "z fixed" not in runs[0]:
        pytest.skip(
            "0.19 and later: the router applies the TP x CP factor, and install() adds none"
        )
    error, _ = runs[0]["z fixed"]
    said = _said(runs, "z fixed")
    assert error < 1e-5, error
    assert "the z-loss correction steps aside" in said, said


def test_mtp_sum_upstream_steps_aside_and_meets_the_target(runs):
    if "mtp sum" not in runs[0]:
        pytest.skip(
            "megatron-core 0.16 has no process_mtp_loss: its MTP block attaches the sum itself"
        )
    error, _ = runs[0]["mtp sum"]
    said = _said(runs, "mtp sum")
    assert error < 1e-5, error
    assert "upstream attaches the sum already" in said and "MTP correction steps aside" in said, (
        said
    )


def test_mtp_ratio_over_dp_still_applies_never_twice(runs):
    """Upstream's ratio of counts reduced over DP is not the target on this batch (its
    micro-batches' ratios differ): the correction, which attaches the sum in place of upstream's
    product, applies, meets the target, and says so."""
    if "mtp dp" not in runs[0]:
        pytest.skip("megatron-core 0.16 has no process_mtp_loss")
    error, _ = runs[0]["mtp dp"]
    said = _said(runs, "mtp dp")
    assert error < 1e-5, error
    assert "no longer weighs by this rank's own counts" in said and "never on top of it" in said, (
        said
    )
    assert "WARNING" not in said, said
