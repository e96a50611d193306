"""``megatron-ga verify --fuzz N --seed S``: layouts drawn at random, each against the unpartitioned
reference.

verify's default layouts are the ones we chose; the fuzzer draws the rest of the space a user can
run, so that the next bug of the router-count kind (Megatron-LM #7452) is ours to find first. Each
draw picks, under the rules megatron-core itself enforces (and the CPU's: at most 4 ranks, no
Transformer Engine):

* a model: dense GPT, MoE (aux_loss, seq_aux_loss or global_aux_loss, with or without the z-loss;
  the expert bias), MTP of depth 1 or 2, MoE + MTP, and, under CP, the position-wise models
  (attention under CP needs Transformer Engine's ring attention);
* TP (with sequence parallelism, or without it for dense models: megatron-core refuses MoE under TP
  without it), PP and VPP (MTP with PP, not VPP), CP, EP, the expert TP size, DP, with world = TP x
  PP x CP x DP <= 4;
* MBS and GA, and per-sample loss-token counts drawn from 1 to the sequence length (from 0 at MBS >
  1: a sample without loss tokens beside others), so that units, DP ranks, CP and TP shards hold
  uneven counts;
* overlapped grad reduce and the distributed optimizer;
* the data-parallel wrapper (:data:`WRAPPERS`): Megatron's DDP, torch FSDP2 (the untied GPT, or the
  position-wise model under CP; TP with and without sequence parallelism; PP 1, EP 1 and no
  distributed optimizer, as Megatron-LM's arguments.py demands) or Megatron-FSDP (each sharding
  strategy, with and without the overlapped reduce; every model the DDP draws take, EP included; PP
  1: its device mesh is the whole world as DP x CP x EP x TP). The wrapper comes from a stream of
  its own, so a DDP draw is the layout the fuzzer drew at that index before FSDP was drawn.

Every draw is one megatron-core trains: :func:`megatron_refusal` runs its own validation on a draw
(for Megatron-FSDP its device-mesh check too), and a test runs it on thousands. Each draw runs one
step in both modes through install(), like every verify row, and checks token mode against the token
reference with N = the batch's loss tokens, and microbatch mode against the mean-of-means reference.
Draw k of seed S is the same on every machine: ``--fuzz N --seed S --draw k`` reruns it alone, and a
failing draw prints its ``Layout(...)`` and lengths, a row to add to
:data:`layouts.DEFAULT_LAYOUTS`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from megatron_ga_ext.verify.layouts import Layout, ModelKind

__all__ = ["Draw", "draw_layouts"]

SEQ_LENGTH = 16
MAX_WORLD = 4
#: The MoE kinds a draw picks from (one MoE layer kind each; moe_mtp and moe_positionwise are drawn
#: apart).
MOE_KINDS: tuple[ModelKind, ...] = ("moe", "moe_seq", "moe_global", "moe_global_z", "moe_bias")


@dataclass(frozen=True)
class Draw:
    """One drawn layout and the loss tokens of each sample of its global batch."""

    index: int
    layout: Layout
    lengths: tuple[int, ...]

    @property
    def row(self) -> str:
        """The draw as a verify row: the layout's constructor and the batch's lengths."""
        return f"{self.layout!r}, lengths={self.lengths}"


#: Each data-parallel wrapper's share of the draws.
WRAPPERS = {"ddp": 0.7, "torch_fsdp2": 0.1, "megatron_fsdp": 0.2}
ShardingStrategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
SHARDING_STRATEGIES: tuple[ShardingStrategy, ...] = (
    "no_shard",
    "optim",
    "optim_grads",
    "optim_grads_params",
)


def draw_layouts(count: int, seed: int) -> list[Draw]:
    """``count`` draws of ``seed``; draw k depends on the seed and k alone (its wrapper on
    ``Random("S:k:wrapper")``, a DDP layout on ``Random("S:k")``, an FSDP one on the wrapper's
    stream)."""
    return [_draw_wrapped(seed, k) for k in range(count)]


def _draw_wrapped(seed: int, index: int) -> Draw:
    rng = random.Random(f"{seed}:{index}:wrapper")
    [wrapper] = rng.choices(list(WRAPPERS), weights=list(WRAPPERS.values()))
    if wrapper == "ddp":
        return _draw(random.Random(f"{seed}:{index}"), index)
    return _draw_fsdp(rng, index, wrapper)


def _draw_fsdp(rng: random.Random, index: int, wrapper: str) -> Draw:
    """A torch FSDP2 or Megatron-FSDP layout: PP 1, DP 2 or 4, TP or CP or EP where the model allows
    them."""
    cp = rng.choice((1, 1, 2))
    model: ModelKind
    if cp > 1:
        model = (
            "positionwise"
            if wrapper == "torch_fsdp2"
            else rng.choice(("positionwise", "moe_positionwise"))
        )
    else:
        model = (
            "gpt_untied"
            if wrapper == "torch_fsdp2"
            else rng.choice(("gpt", *MOE_KINDS, "mtp", "mtp2", "moe_mtp"))
        )
    moe = "moe" in model
    tp = rng.choice((1, 2)) if cp == 1 else 1
    sequence_parallel = tp > 1 and (moe or rng.random() < 0.7)
    dp = rng.choice([d for d in (2, 4) if tp * cp * d <= MAX_WORLD])
    ep = rng.choice([e for e in (1, 2) if dp % e == 0]) if moe and tp == 1 and cp == 1 else 1
    megatron_fsdp = wrapper == "megatron_fsdp"
    layout = Layout(
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        data_parallel_size=dp,
        num_microbatches=rng.choice((1, 2, 4)),
        micro_batch_size=rng.choice((1, 2)),
        model=model,
        overlap_grad_reduce=megatron_fsdp and rng.random() < 0.5,
        data_parallel="megatron_fsdp" if megatron_fsdp else "torch_fsdp2",
        sharding_strategy=rng.choice(SHARDING_STRATEGIES) if megatron_fsdp else "no_shard",
    )
    return Draw(index, layout, _lengths(rng, layout))


def _draw(rng: random.Random, index: int) -> Draw:
    cp = rng.choice((1, 1, 2))
    model: ModelKind
    if cp > 1:
        model = rng.choice(("positionwise", "moe_positionwise"))
        tp, pp, vpp = 1, 1, 1
    else:
        model = rng.choice(("gpt", *MOE_KINDS, "mtp", "mtp2", "moe_mtp"))
        tp = rng.choice((1, 2))
        pp = rng.choice((1, 2))
        vpp = rng.choice((1, 2)) if pp > 1 and "mtp" not in model else 1
    moe = "moe" in model
    # megatron-core refuses MoE under TP without sequence parallelism in training (MoELayer.forward)
    sequence_parallel = tp > 1 and (moe or rng.random() < 0.7)
    dp = rng.choice([d for d in (1, 2, 4) if tp * pp * cp * d <= MAX_WORLD])
    ep = rng.choice([e for e in (1, 2) if dp % e == 0]) if moe and tp == 1 and cp == 1 else 1
    etp = None
    if moe and tp > 1:
        etp = rng.choice((None, 1))  # experts split like TP (megatron's default), or not at all
    elif moe and cp == 1 and ep == 1 and dp > 1:
        etp = rng.choice((None, 2))  # experts split over two DP ranks
    micro_batch_size = rng.choice((1, 2))
    ga_choices = (
        (1, 2, 4) if pp == 1 else (pp, 2 * pp)
    )  # the interleaved schedule wants GA a multiple of PP
    num_microbatches = rng.choice(ga_choices)
    distributed_optimizer = dp > 1 and rng.random() < 0.3
    layout = Layout(
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        data_parallel_size=dp,
        num_microbatches=num_microbatches,
        micro_batch_size=micro_batch_size,
        model=model,
        overlap_grad_reduce=rng.random() < 0.3,
        distributed_optimizer=distributed_optimizer,
    )
    return Draw(index, layout, _lengths(rng, layout))


def _lengths(rng: random.Random, layout: Layout) -> tuple[int, ...]:
    """Loss tokens per sample, 1 to the sequence length; at MBS > 1 a sample may hold none (a
    truncated SFT sample; now and then a whole micro-batch), with at least one loss token in the
    batch."""
    low = 0 if layout.micro_batch_size > 1 else 1
    while True:
        lengths = tuple(
            0 if low == 0 and rng.random() < 0.2 else rng.randint(1, SEQ_LENGTH)
            for _ in range(layout.global_batch_size)
        )
        if sum(lengths):
            return lengths


def megatron_refusal(layout: Layout) -> str | None:
    """What megatron-core's own validation says of ``layout``, or None where it trains it: the
    TransformerConfig verify builds for it (its ``__post_init__`` checks), the MoE layer's training
    check (``MoELayer.forward`` refuses TP without sequence parallelism before it touches a tensor),
    run on a stand-in layer that stops at the first attribute past the checks, and Megatron-FSDP's
    device mesh (:func:`_megatron_fsdp_mesh_refusal`)."""
    from megatron_ga_ext.verify.harness import layout_config
    from megatron_ga_ext.verify.models import ModelConfig

    try:
        config = layout_config(layout, ModelConfig(), calculate_per_token_loss=True)
    except (AssertionError, ValueError, TypeError) as exc:
        return f"TransformerConfig: {type(exc).__name__}: {exc}"
    if (
        layout.data_parallel == "megatron_fsdp"
        and (why := _megatron_fsdp_mesh_refusal(layout)) is not None
    ):
        return why
    if not getattr(config, "num_moe_experts", None):
        return None
    from megatron.core.transformer.moe.moe_layer import MoELayer

    try:
        MoELayer.forward(_CheckedLayer(config, layout.tensor_model_parallel_size), None)
    except _PastTheChecks:
        return None
    except (AssertionError, ValueError) as exc:
        return f"MoELayer.forward: {type(exc).__name__}: {exc}"
    return None


def _megatron_fsdp_mesh_refusal(layout: Layout) -> str | None:
    """Megatron-FSDP's device-mesh check (``mcore_fsdp_adapter._get_dp_tp_mesh``, run as the wrapper
    is built) on a stand-in world of the layout's size: it lays the whole world out as DP x CP x EP
    x TP, so a layout with PP > 1 stops there."""
    import einops
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    dist = mcore_fsdp_adapter.dist
    mcore_fsdp_adapter.dist = _World(layout.world_size)
    try:
        dp_cp = _Group(layout.data_parallel_size * layout.context_parallel_size)
        mcore_fsdp_adapter._get_dp_tp_mesh(dp_cp, _Group(layout.tensor_model_parallel_size))
    except _PastTheChecks:
        return None
    except (AssertionError, einops.EinopsError) as exc:
        return f"Megatron-FSDP's device mesh: {type(exc).__name__}: {exc}"
    finally:
        mcore_fsdp_adapter.dist = dist
    return None


class _PastTheChecks(Exception):
    """The stand-in was asked for something its checks do not read: they passed."""


class _World:
    """torch.distributed as Megatron-FSDP's mesh check reads it: the world's size and a group's; the
    first ranks it asks for come after the check."""

    def __init__(self, size: int) -> None:
        self._size = size

    def get_world_size(self, group: _Group | None = None) -> int:
        return self._size if group is None else group.size()

    def get_process_group_ranks(self, group: _Group) -> list[int]:
        raise _PastTheChecks("get_process_group_ranks")


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _CheckedLayer:
    """An MoE layer in training as far as its checks read it: the config and the attention TP
    group."""

    def __init__(self, config: object, tensor_model_parallel_size: int) -> None:
        self.config, self.training = config, True
        self.attn_tp_group = self.tp_group = _Group(tensor_model_parallel_size)

    def __getattr__(self, name: str) -> object:
        raise _PastTheChecks(name)


@dataclass(frozen=True)
class DrawResult:
    """One draw's verdict on one rank: its rows (both modes), or why it did not run."""

    draw: Draw
    results: tuple = ()
    """LayoutResult of each mode (harness.py)."""
    limited: str | None = None
    """A limit the coverage table states for this layout on this release: not run."""
    error: str | None = None
    """The exception the step raised, if any."""


SEQ_AUX_BEFORE_0_19 = (
    "seq_aux_loss with --micro-batch-size > 1 before 0.19: upstream's per-sequence count (1 / MBS)"
)


def seq_aux_limited(layout: Layout) -> bool:
    """seq_aux_loss at MBS > 1 on a release whose router keeps its per-sequence count (a limit
    docs/reduction.md states)."""
    from megatron_ga_ext.integration.features.aux_losses import router_scales_by_tp_cp

    return (
        layout.model == "moe_seq" and layout.micro_batch_size > 1 and not router_scales_by_tp_cp()
    )


def known_limit(draw: Draw) -> str | None:
    """A draw whose layout meets a limit the docs state on the installed megatron-core, or None."""
    from megatron.core.transformer import multi_token_prediction

    from megatron_ga_ext.verify.data_parallel import (
        TORCH_FSDP2_BEFORE_0_19,
        megatron_fsdp_limited,
        torch_fsdp2_runs,
    )

    layout = draw.layout
    if seq_aux_limited(layout):
        return SEQ_AUX_BEFORE_0_19
    if layout.data_parallel == "torch_fsdp2" and not torch_fsdp2_runs():
        return TORCH_FSDP2_BEFORE_0_19
    if (why := megatron_fsdp_limited(layout)) is not None:
        return why
    if _refused_one_rank_expert_buffer(layout):
        return ONE_RANK_EXPERT_BUFFER
    if (
        "mtp" in layout.model
        and not hasattr(multi_token_prediction, "process_mtp_loss")
        and min(draw.lengths) <= 1
    ):
        return (
            "MTP on 0.16 with a sample of one loss token: upstream divides microbatch mode's MTP "
            "mean by 0"
        )
    if layout.model == "moe_mtp" and (layout.sequence_parallel or 0 in draw.lengths):
        return MOE_IN_MTP
    if (
        layout.expert_tensor_parallel_size not in (None, layout.tensor_model_parallel_size)
        and layout.expert_model_parallel_size == 1
        and _experts_marked_by_ep_alone()
    ):
        return EXPERTS_MARKED_BY_EP
    return None


ONE_RANK_EXPERT_BUFFER = (
    "Megatron-FSDP with sharded gradients and an expert data-parallel group of one rank (EP "
    "takes every DP rank): megatron-core 0.16 doubles the accumulated gradient (#6660), "
    "later releases scale it by 1 / DP again at each micro-batch's reduction in "
    "microbatch mode on gloo's unfused path; install() refuses the step there "
    "(integration/features/torch_fsdp2.check_megatron_fsdp; token mode exact from 0.17: "
    "tests/test_fsdp.py)"
)


def _refused_one_rank_expert_buffer(layout: Layout) -> bool:
    """A layout whose step install() refuses in some mode (:data:`ONE_RANK_EXPERT_BUFFER`)."""
    import torch

    from megatron_ga_ext.integration.compat import megatron_core_version

    if layout.data_parallel != "megatron_fsdp" or "moe" not in layout.model:
        return False
    if layout.sharding_strategy not in ("optim_grads", "optim_grads_params"):
        return False
    expert_tp = layout.expert_tensor_parallel_size or layout.tensor_model_parallel_size
    expert_dp = layout.world_size // (
        layout.pipeline_model_parallel_size * layout.expert_model_parallel_size * expert_tp
    )
    if expert_dp != 1:
        return False
    if megatron_core_version().startswith("0.16."):
        return True
    return layout.num_microbatches > 1 and torch.distributed.get_backend() == "gloo"


EXPERTS_MARKED_BY_EP = (
    "an expert TP size of its own with EP 1 on a release that marks expert parameters "
    "(allreduce=False) only where EP > 1: neither DDP nor verify can tell an expert's "
    "shard; not run"
)


def _experts_marked_by_ep_alone() -> bool:
    """megatron-core's linear layers mark an expert parameter as such only where EP > 1 (0.16)."""
    import inspect

    from megatron.core.tensor_parallel import layers

    return "not (self.is_expert and self.expert_parallel)" in inspect.getsource(
        layers.ColumnParallelLinear
    )


MOE_IN_MTP = (
    "MoE inside the MTP layer, token mode, under sequence parallelism or with a sample without "
    "loss tokens: upstream rolls that layer's padding mask within each TP shard and "
    "fills the rolled-in position as a loss token, so its router counts positions the "
    "loss tokens do not"
)


def run_draws(draws: tuple[Draw, ...], device: str = "cpu") -> list[DrawResult]:
    """This rank's verdict on each draw (every draw of a launch has the launch's world size). An
    exception of the step is kept as the draw's error (every rank raises it alike where
    megatron-core refuses the layout)."""
    from megatron_ga_ext.verify.harness import run_rank
    from megatron_ga_ext.verify.run_config import VerifyConfig

    out = []
    for draw in draws:
        limit = known_limit(draw)
        if limit is not None:
            out.append(DrawResult(draw, limited=limit))
            continue
        cfg = VerifyConfig(
            layouts=(draw.layout,), lengths=draw.lengths, device=device, progress=False
        )
        try:
            out.append(DrawResult(draw, results=tuple(run_rank(cfg))))
        except Exception as exc:
            out.append(DrawResult(draw, error=f"{type(exc).__name__}: {exc}"))
    return out
