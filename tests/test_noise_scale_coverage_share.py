"""The start-up line of ``--ga-noise-scale``: which share of this rank's parameters the measurement
covers.

The measured set depends on the layout: the tied embedding counts at PP 1 and not at PP 2 (its
stages' parts are summed after the reduction), the q/k layernorms count at TP 1 and not at TP 2 with
``qk_layernorm`` (finalize sums them over TP), and a TP rank other than 0 leaves its duplicates to
TP rank 0. On real megatron-core (the tiny GPT, gloo ranks, install(GAConfig(noise_scale=1)),
megatron's schedule and DDP), each layout's first measured step logs one line, and only one; each
rank's numbers are checked against its own parameters. Before the line existed, nothing in the run
said it (the capture was empty).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("megatron.core")

from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

pytestmark = pytest.mark.slow

SEQ = 16
STEPS = 2


def meter(state):
    """The installation's noise-scale meter (its NoiseScale feature's), or None without
    --ga-noise-scale."""
    from megatron_ga_ext.science.integration.noise_scale_feature import NoiseScale

    feature = state.feature(NoiseScale)
    return None if feature is None else feature.meter


def _qk_gpt(cfg, config):
    """The tiny GPT with q/k layernorms (megatron's local spec), on one pipeline stage."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config.qk_layernorm = True
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    return gpt, {}


def _layouts():
    from megatron_ga_ext.verify.layouts import Layout

    return [
        ("dp4", Layout(data_parallel_size=4, num_microbatches=2), False),
        (
            "pp2",
            Layout(pipeline_model_parallel_size=2, data_parallel_size=2, num_microbatches=2),
            False,
        ),
        (
            "tp2",
            Layout(tensor_model_parallel_size=2, data_parallel_size=2, num_microbatches=2),
            False,
        ),
        (
            "tp2-qk",
            Layout(tensor_model_parallel_size=2, data_parallel_size=2, num_microbatches=2),
            True,
        ),
    ]


class _Lines:
    """Records of the meter's logger (as caplog would: the subprocess ranks have no pytest
    fixture)."""

    def __init__(self) -> None:
        import logging

        self.lines: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        self.logger = logging.getLogger("megatron_ga_ext.science.integration.noise_scale")

    def __enter__(self) -> list[str]:
        import logging

        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def _run(layout, qk: bool):
    """Two measured steps of the layout: the lines logged, this rank's coverage, and its own
    parameter counts."""
    from functools import partial

    import torch
    from megatron.core import num_microbatches_calculator as calculators
    from megatron.core import parallel_state

    import megatron_ga_ext
    from megatron_ga_ext import GAConfig
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.harness import build_chunks
    from megatron_ga_ext.verify.layouts import make_global_batch
    from megatron_ga_ext.verify.models import ModelConfig, init_model_parallel
    from megatron_ga_ext.verify.run_config import VerifyConfig
    from megatron_ga_ext.verify.step import train_step

    cfg = VerifyConfig(layouts=(layout,), model=ModelConfig(seq_length=SEQ))
    init_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
    )
    state = megatron_ga_ext.install(
        GAConfig(noise_scale=1, pipeline_model_parallel_size=layout.pipeline_model_parallel_size)
    )
    calculators.init_num_microbatches_calculator(
        0, None, layout.global_batch_size, layout.micro_batch_size, layout.data_parallel_size
    )
    try:
        chunks, _, config = build_chunks(
            layout,
            cfg,
            calculate_per_token_loss=True,
            build_module=partial(_qk_gpt, cfg) if qk else None,
        )
        from megatron.core.distributed import (
            finalize_model_grads,
        )  # the extension's, after install()

        lengths = tuple(1 + (5 * i) % SEQ for i in range(layout.global_batch_size))
        batch = make_global_batch(lengths, SEQ, cfg.model.vocab_size, seed=3)
        with _Lines() as lines:
            for _ in range(STEPS):
                train_step(
                    chunks,
                    config,
                    layout,
                    cfg,
                    batch,
                    finalize=finalize_model_grads,
                    loss_func=partial(masked_loss, mode="token"),
                )
                meter(state).read()
        params = [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]
        coverage = meter(state).coverage(chunks)
        return {
            "lines": [line for line in lines if "covers" in line],
            "left_out": coverage.left_out,
            "elements": coverage.elements,
            "total": sum(p.numel() for _, p in params),
            "tied": sum(p.numel() for _, p in params if getattr(p, "shared_embedding", False)),
            "qk": sum(
                p.numel() for name, p in params if "q_layernorm" in name or "k_layernorm" in name
            ),
            "duplicates": sum(
                p.numel() for _, p in params if not getattr(p, "tensor_model_parallel", False)
            ),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "first_stage": parallel_state.is_pipeline_first_stage(),
        }
    finally:
        megatron_ga_ext.uninstall()
        calculators.unset_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
        torch.distributed.barrier()


def _rank():
    from megatron_ga_ext.testing.shims import cpu_shims

    with cpu_shims():
        return {name: _run(layout, qk) for name, layout, qk in _layouts()}


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_rank, 4, (), LaunchConfig(timeout_s=900))


def _share(line: str) -> tuple[float, int, int, str]:
    match = re.fullmatch(
        r"megatron-ga-ext: the noise scale covers ([0-9.]+)% of this rank's ([0-9,]+) parameter "
        r"elements \(([0-9,]+)\); left out: (.*)",
        line,
    )
    assert match, line
    share, total, counted, left = match.groups()
    return float(share), int(total.replace(",", "")), int(counted.replace(",", "")), left


@pytest.mark.parametrize("name", ["dp4", "pp2", "tp2", "tp2-qk"])
def test_the_first_measured_step_logs_the_share_once_on_rank_0(ranks, name):
    rank0 = ranks[0][name]
    assert len(rank0["lines"]) == 1, rank0["lines"]  # two measured steps, one line
    share, total, counted, left = _share(rank0["lines"][0])
    assert total == rank0["total"] == rank0["elements"]
    assert counted == total - sum(rank0["left_out"].values())
    assert share == pytest.approx(100 * counted / total, abs=0.05)
    assert all(
        not run[name]["lines"] for run in ranks[1:]
    )  # the other ranks' records are filtered out
    if name in ("dp4", "tp2"):  # PP 1: the tied embedding counts; TP rank 0 counts the duplicates
        assert left == "none" and share == 100.0
    if name == "pp2":
        assert (
            left == f"the tied embedding (summed across pipeline stages) ({rank0['tied']:,})"
            and rank0["tied"]
        )
    if name == "tp2-qk":
        assert (
            left == f"q/k layernorm (summed over TP in finalize) ({rank0['qk']:,})" and rank0["qk"]
        )


@pytest.mark.parametrize("name", ["dp4", "pp2", "tp2", "tp2-qk"])
def test_every_ranks_coverage_is_its_own_layouts(ranks, name):
    from megatron_ga_ext.science.integration.noise_scale_coverage import (
        QK_LAYERNORM,
        TIED_EMBEDDING,
        TP_DUPLICATE,
    )

    for run in (r[name] for r in ranks):
        expected = {}
        if name == "pp2":
            expected[TIED_EMBEDDING] = run["tied"]
        if name == "tp2-qk":  # on every TP rank: summed over TP, whichever rank
            expected[QK_LAYERNORM] = run["qk"]
        if name.startswith("tp2") and run["tp_rank"] == 1:
            expected[TP_DUPLICATE] = run["duplicates"] - expected.get(QK_LAYERNORM, 0)
        assert run["left_out"] == expected, (name, run)
