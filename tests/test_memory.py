"""core/memory.py, core/model_shape.py, core/flops.py: the split by what MBS moves, precisions,
sharding, CP, recompute and the padded vocabulary, each against a number worked by hand from the
formula."""

import pytest

from megatron_ga_ext.core.flops import step_flops
from megatron_ga_ext.core.memory import Parallel, Precision, Recompute, memory
from megatron_ga_ext.core.model_shape import ModelShape, padded_vocab

#: A GPT small enough to count by hand: 2 layers, h 8, 2 heads, vocab 16, seq 4.
TINY = ModelShape(
    num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, padded_vocab_size=16
)


def test_padded_vocab_as_megatron_pads_it():
    """ceil(vocab / (128 x TP)) x 128 x TP: GPT-2's 50257 is 50304 at TP 1, 51200 at TP 8."""
    assert padded_vocab(50257, 128, 1) == 50304
    assert padded_vocab(50257, 128, 8) == 51200
    assert padded_vocab(128256, 128, 2) == 128256
    assert padded_vocab(128256, 128, 8) == 129024


def test_tiny_parameter_count_by_hand():
    """Per layer: attention 4 h^2 = 256, MLP 8 h^2 = 512, two LayerNorms 4 h = 32; final norm 16;
    embedding 128."""
    counts = TINY.counts
    assert counts.total == 2 * (256 + 512 + 32) + 16 + 128


def test_weights_do_not_move_with_mbs_activations_do():
    par = Parallel(world_size=1)
    one = memory(TINY, par, Precision(), 1, 1)
    four = memory(TINY, par, Precision(), 4, 1)
    assert four.weights_and_optimizer == one.weights_and_optimizer
    assert four.activations_peak == pytest.approx(4 * one.activations_peak)
    assert one.weights_and_optimizer == 18 * TINY.counts.total  # 2 + 4 + 12 B per parameter


@pytest.mark.parametrize(
    ("precision", "per_param"),
    [
        (Precision(), (2, 4, 12)),
        (Precision(params_dtype="fp32"), (4, 4, 8)),
        (Precision(params_dtype="fp16"), (2, 2, 12)),
        (Precision(grad_reduce_in_bf16=True), (2, 2, 12)),
        (Precision(fp8_param_gather=True), (1, 4, 12)),
    ],
)
def test_bytes_per_parameter_by_precision(precision, per_param):
    mem = memory(TINY, Parallel(world_size=1), precision, 1, 1)
    n = TINY.counts.total
    assert (mem.parameters, mem.gradients, mem.optimizer) == tuple(b * n for b in per_param)


@pytest.mark.parametrize(
    ("precision", "sharded"),
    [
        (Precision(use_distributed_optimizer=True), (False, False, True)),
        (Precision(fsdp_sharding="no_shard"), (False, False, False)),
        (Precision(fsdp_sharding="optim"), (False, False, True)),
        (Precision(fsdp_sharding="optim_grads"), (False, True, True)),
        (Precision(fsdp_sharding="optim_grads_params"), (True, True, True)),
    ],
)
def test_sharding_divides_by_dp(precision, sharded):
    base = memory(TINY, Parallel(world_size=4), Precision(), 1, 1)
    mem = memory(TINY, Parallel(world_size=4), precision, 1, 1)
    for part, is_sharded in zip(("parameters", "gradients", "optimizer"), sharded, strict=True):
        assert getattr(mem, part) == getattr(base, part) / (4 if is_sharded else 1)


def test_context_parallel_holds_seq_over_cp():
    """Each CP rank keeps seq / CP tokens: CP 2 halves the activations, as MBS / 2 would."""
    cp = memory(TINY, Parallel(world_size=2, context_parallel_size=2), Precision(), 2, 1)
    half = memory(TINY, Parallel(world_size=1), Precision(), 1, 1)
    assert cp.activations_peak == pytest.approx(half.activations_peak)


def test_full_recompute_keeps_layer_inputs():
    """Full uniform recompute of 1 layer: 2 s b h per layer kept, one layer's activations recomputed
    at once."""
    model = ModelShape(
        num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=128
    )
    par = Parallel(world_size=1)
    full = memory(model, par, Precision(), 1, 1, Recompute(granularity="full", method="uniform"))
    none = memory(model, par, Precision(), 1, 1)
    tokens, h = 32, 64
    per_layer = tokens * h * (10 + 24)
    rest = none.activations_peak / 1.05 - 8 * per_layer
    assert full.activations_peak == pytest.approx((8 * 2 * tokens * h + per_layer + rest) * 1.05)
    assert full.activations_peak < none.activations_peak / 4


def test_pipeline_in_flight_microbatches():
    """Without interleaving the first stage holds min(GA, PP) micro-batches; with VPP, PP (1 +
    (PP-1)/(PP VPP))."""
    par = Parallel(world_size=4, pipeline_model_parallel_size=4)
    assert memory(TINY, par, Precision(), 1, 2).in_flight == 2
    assert memory(TINY, par, Precision(), 1, 16).in_flight == 4
    vpp = Parallel(
        world_size=4, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2
    )
    assert memory(TINY, vpp, Precision(), 1, 16).in_flight == 4 * (1 + 3 / 8)
    one = memory(TINY, par, Precision(), 1, 16)
    assert one.activations_peak == pytest.approx(4 * one.activations_one_microbatch)


def test_flops_by_hand():
    """Narayanan et al. 2021 eq. 3 without its recompute forward (72, not 96) and with upstream's
    causal mask (s / 12h, not s / 6h): 72 B s L h^2 (1 + s / 12h + V / 12 L h)."""
    model = ModelShape(
        num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=256
    )
    b, s, h, n_layers, v = 8, 32, 64, 4, 256
    expected = 72 * b * s * h * h * n_layers * (1 + s / (12 * h) + v / (12 * n_layers * h))
    assert step_flops(model, b) == pytest.approx(expected)
