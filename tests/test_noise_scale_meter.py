"""The noise-scale meter's parts on fake buckets, on the CPU: the counted set, the loss scale, local
CUDA graphs.

Each test fails on the meter before its fix (said in its docstring); the real-model checks are
tests/test_noise_scale_gpt.py and tests/test_noise_scale_coverage_share.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ga_ext import GAConfig
from megatron_ga_ext.science.integration import noise_scale
from megatron_ga_ext.science.integration.noise_scale import NoiseScaleMeter
from megatron_ga_ext.science.integration.noise_scale_coverage import (
    PP_SYNCED,
    QK_LAYERNORM,
    TP_AVERAGED,
    TP_DUPLICATE,
    UNNAMED,
)
from megatron_ga_ext.science.integration.noise_scale_feature import NoiseScale


@pytest.fixture
def layout(monkeypatch):
    """Set this process's (TP rank, TP size, PP size) as parallel_state reports them."""
    from megatron.core import parallel_state

    def place(tp_rank: int = 0, tp_size: int = 1, pp_size: int = 1) -> None:
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp_size)
        monkeypatch.setattr(
            parallel_state, "get_pipeline_model_parallel_world_size", lambda: pp_size
        )

    place()
    return place


class _Bucket(SimpleNamespace):
    """A bucket (megatron's are weakly referenced by the meter's plans)."""


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_qkv = torch.nn.Linear(
            4, 12, bias=False
        )  # column-parallel: a shard on each TP rank
        self.linear_qkv.weight.tensor_model_parallel = True
        self.q_layernorm = torch.nn.LayerNorm(2)
        self.k_layernorm = torch.nn.LayerNorm(2)


class _Chunk(torch.nn.Module):
    """One model chunk as the meter sees it: a config, parameters with main_grad views into one
    bucket."""

    def __init__(self, qk_layernorm: bool = True) -> None:
        super().__init__()
        self.config = SimpleNamespace(qk_layernorm=qk_layernorm)
        self.self_attention = _Attention()
        self.input_layernorm = torch.nn.LayerNorm(4)  # a TP duplicate, whole on each rank
        self.router = torch.nn.Linear(4, 2, bias=False)
        self.router.weight.average_gradients_across_tp_domain = True
        params = list(self.parameters())
        data = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for param in params:
            param.main_grad = data[offset : offset + param.numel()].view_as(param)
            param.main_grad.fill_(1.0)
            offset += param.numel()
        self.bucket = _Bucket(params_list=params, grad_data=data)
        self.bucket_groups = [SimpleNamespace(buckets=[self.bucket])]

    def elements(self, *modules: torch.nn.Module) -> int:
        return sum(p.numel() for module in modules for p in module.parameters())


def _counted(meter: NoiseScaleMeter, chunk: _Chunk) -> int:
    return sum(end - start for start, end in meter.counted.plan(chunk.bucket).ranges)


def _meter() -> NoiseScaleMeter:
    return NoiseScaleMeter(GAConfig(noise_scale=1))


def test_qk_layernorm_and_tp_averaged_gradients_are_left_out_at_tp_above_1(layout):
    """Upstream's finalize sums the q/k layernorm gradients over TP (by name, under
    config.qk_layernorm) and averages those marked average_gradients_across_tp_domain: before, TP
    rank 0 counted its partial sum locally and the reduced one after (this test counted every
    element but the TP duplicates of other ranks, and failed)."""
    layout(tp_rank=0, tp_size=2)
    chunk, meter = _Chunk(), _meter()
    meter.learn_chunks([chunk])
    attention = chunk.self_attention
    qk = chunk.elements(attention.q_layernorm, attention.k_layernorm)
    assert _counted(meter, chunk) == chunk.elements(chunk) - qk - chunk.router.weight.numel()
    left_out = meter.coverage([chunk]).left_out
    assert left_out == {QK_LAYERNORM: qk, TP_AVERAGED: chunk.router.weight.numel()}


def test_at_tp_1_or_without_qk_layernorm_they_are_counted(layout):
    layout(tp_rank=0, tp_size=1)
    chunk, meter = _Chunk(), _meter()
    meter.learn_chunks([chunk])
    assert _counted(meter, chunk) == chunk.elements(chunk)
    layout(tp_rank=0, tp_size=2)
    chunk, meter = _Chunk(qk_layernorm=False), _meter()
    meter.learn_chunks([chunk])
    assert meter.coverage([chunk]).left_out == {TP_AVERAGED: chunk.router.weight.numel()}


def test_on_another_tp_rank_only_the_shards_count(layout):
    layout(tp_rank=1, tp_size=2)
    chunk, meter = _Chunk(), _meter()
    meter.learn_chunks([chunk])
    shard = chunk.self_attention.linear_qkv.weight.numel()
    assert _counted(meter, chunk) == shard
    assert meter.coverage([chunk]).left_out[TP_DUPLICATE] == chunk.elements(chunk.input_layernorm)


def test_a_chunk_not_seen_yet_leaves_its_duplicates_out_until_its_names_are_known(layout):
    """A TP duplicate whose name the meter has not seen may be a q/k layernorm: left out of both
    norms of that step, counted once the chunk is known; the plans are rebuilt only by learn_chunks,
    between steps."""
    layout(tp_rank=0, tp_size=2)
    chunk, meter = _Chunk(), _meter()
    shard = chunk.self_attention.linear_qkv.weight.numel()
    assert _counted(meter, chunk) == shard
    assert UNNAMED in meter.coverage([chunk]).left_out
    meter.learn_chunks([chunk])
    assert _counted(meter, chunk) == chunk.elements(
        chunk.self_attention.linear_qkv, chunk.input_layernorm
    )
    plan = meter.counted.plan(chunk.bucket)
    meter.learn_chunks([chunk])  # known already: the plan stands
    assert meter.counted.plan(chunk.bucket) is plan


def test_the_coverage_line_gives_the_share_and_the_classes(layout):
    layout(tp_rank=0, tp_size=2)
    chunk, meter = _Chunk(), _meter()
    meter.learn_chunks([chunk])
    line = meter.coverage([chunk]).line()
    total = chunk.elements(chunk)
    counted = total - chunk.elements(
        chunk.self_attention.q_layernorm, chunk.self_attention.k_layernorm, chunk.router
    )
    assert line.startswith(
        f"megatron-ga-ext: the noise scale covers {100 * counted / total:.1f}% of this rank's "
        f"{total:,} parameter elements ({counted:,}); left out: "
    )
    assert QK_LAYERNORM in line and TP_AVERAGED in line


def test_parameters_finalize_syncs_across_pipeline_stages_are_left_out_at_pp_above_1(layout):
    """Upstream's finalize sums routers marked flextron_router_pp_sync, and conditional embedders
    (pipeline_parallel, under config.has_cond_embedder), across the pipeline stages: each stage's
    local value is a partial sum."""
    layout(tp_rank=0, tp_size=1, pp_size=2)
    chunk = _Chunk(qk_layernorm=False)
    chunk.config.has_cond_embedder = True
    chunk.router.weight.flextron_router_pp_sync = True
    chunk.input_layernorm.weight.pipeline_parallel = True
    meter = _meter()
    meter.learn_chunks([chunk])
    synced = chunk.router.weight.numel() + chunk.input_layernorm.weight.numel()
    assert meter.coverage([chunk]).left_out == {PP_SYNCED: synced}
    layout(tp_rank=0, tp_size=1, pp_size=1)
    assert meter.coverage([chunk]).left_out == {}
    chunk.config.has_cond_embedder = (
        False  # upstream syncs pipeline_parallel parameters only under it
    )
    layout(tp_rank=0, tp_size=1, pp_size=2)
    meter = _meter()
    meter.learn_chunks([chunk])
    assert meter.coverage([chunk]).left_out == {PP_SYNCED: chunk.router.weight.numel()}


# -- the loss scale: read before the optimizer step
# ---------------------------------------------------------------


class _Fp16Optimizer:
    """A dynamic scaler's optimizer: the step grows the loss scale (as after its growth
    interval)."""

    def __init__(self, scale: float) -> None:
        self.scale = torch.tensor(scale)

    def get_loss_scale(self) -> torch.Tensor:
        return self.scale

    def step(self):
        self.scale = self.scale * 2
        return True, 1.0, None


def test_the_loss_scale_is_the_one_before_the_optimizer_step():
    """The gradients were scaled by S = 4; the step grows the scale to 8. Before, the meter divided
    by the scale read after the step (8^2): every norm came out 4 times too small, tr(Sigma) 5
    instead of 20."""
    from megatron_ga_ext.integration.hooks import optimizer_step
    from megatron_ga_ext.integration.lifecycle import install, uninstall

    uninstall()
    state = install(GAConfig(noise_scale=1))
    try:
        optimizer = _Fp16Optimizer(4.0)
        step = optimizer_step(optimizer.step, state, optimizer)
        scale2 = 16.0
        # two replicas of 10 tokens each, |g_r|^2 = 3 each, |g|^2 = 2: tr(Sigma) = 20, |G|^2 = 1
        vector = torch.tensor(
            [6.0 * scale2, 2.0 * 400 * scale2, 0.2, 20.0, 2.0, 0.0], dtype=torch.float64
        )
        meter = state.feature(NoiseScale).meter
        meter._pending = (vector, 1)
        state.counts.training_schedules += 1
        state.counts.finalizes += 1
        step()
        estimate = meter.last.estimate
        assert optimizer.scale.item() == 8.0
        assert estimate.trace_sigma == pytest.approx(20.0) and estimate.grad_sq == pytest.approx(
            1.0
        )
    finally:
        uninstall()


def test_without_a_kept_scale_the_optimizers_is_read():
    meter = _meter()
    meter._pending = (torch.tensor([6.0, 800.0, 0.2, 20.0, 2.0, 0.0], dtype=torch.float64), 1)
    measurement = meter.after_optimizer_step(SimpleNamespace())
    assert measurement.estimate.trace_sigma == pytest.approx(20.0)


# -- local CUDA graphs: wait for the backward replay before reading
# ------------------------------------------------


def test_the_local_read_waits_for_the_graph_replay_event_first(layout, monkeypatch):
    """Upstream's start_grad_sync waits for each parameter's _cudagraph_wgrad_ready_event before it
    reads the bucket; the meter reads before upstream's code runs. Before, it read without waiting
    (the order was norm only)."""
    events, order = [object(), object()], []
    chunk, meter = _Chunk(), _meter()
    for i, param in enumerate(chunk.bucket.params_list):
        param._cudagraph_wgrad_ready_event = events[i % 2]
    stream = SimpleNamespace(wait_event=lambda event: order.append(("wait", events.index(event))))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    original = noise_scale.squared_norm
    monkeypatch.setattr(
        noise_scale, "squared_norm", lambda values: order.append(("norm",)) or original(values)
    )
    meter.before_grad_sync(chunk.bucket_groups[0], (chunk,))
    assert order[:2] == [("wait", 0), ("wait", 1)]
    assert order[2:] and set(order[2:]) == {("norm",)}


def test_without_graph_events_no_stream_is_touched(layout, monkeypatch):
    chunk, meter = _Chunk(), _meter()
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda: pytest.fail("no event: no stream wait")
    )
    meter.before_grad_sync(chunk.bucket_groups[0], (chunk,))
    assert meter._local.item() == pytest.approx(chunk.elements(chunk))
