"""The layouts verify runs, the synthetic global batch, and how the batch splits into loss units.

A *unit* is what one loss-function call sees: micro-batch m of DP rank r, CP shard c. Megatron's
data order puts sample ``b = (m * DP + r) * MBS + j`` on DP rank r in micro-batch m; CP shard c
holds the sequence chunks c and 2*CP - 1 - c of 2*CP equal chunks (``get_batch_on_this_cp_rank``).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "AUXILIARY_KINDS",
    "DEFAULT_LAYOUTS",
    "MODEL_KINDS",
    "GlobalBatch",
    "Layout",
    "ModelKind",
    "make_global_batch",
]

#: The models verify builds (models.py; models.KINDS adds MoE and/or MTP to the GPT), written once:
#: Layout.model's type, the fuzzer's draws (fuzz.py) and the auxiliary-loss kinds below are read
#: from it.
ModelKind = Literal[
    "gpt",
    "positionwise",
    "moe",
    "mtp",
    "mtp2",
    "moe_mtp",
    "moe_global",
    "moe_global_z",
    "moe_seq",
    "moe_bias",
    "moe_positionwise",
    "gpt_untied",
]
MODEL_KINDS: tuple[ModelKind, ...] = typing.get_args(ModelKind)
#: The kinds with auxiliary losses (MoE load balancing and z-loss, MTP): every kind but the plain
#: GPTs.
AUXILIARY_KINDS: tuple[ModelKind, ...] = tuple(
    k for k in MODEL_KINDS if k not in ("gpt", "positionwise", "gpt_untied")
)


@dataclass(kw_only=True, frozen=True)
class Layout:
    """One parallel layout of the same global batch."""

    data_parallel_size: int
    num_microbatches: int
    tensor_model_parallel_size: int = 1
    """Each TP-split gradient is gathered over TP before the comparison."""
    sequence_parallel: bool = False
    """With TP > 1: sequence parallelism (the layers' norms are then verify's own, models.py)."""
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    """Experts split over this many of the DP ranks (the alltoall dispatcher); it does not multiply
    the world."""
    expert_tensor_parallel_size: int | None = None
    """Each expert split over this many ranks; None: TP's, megatron's default."""
    micro_batch_size: int = 1
    model: ModelKind = "gpt"
    """``positionwise`` for CP: no attention, so a shard's gradient is exact without ring attention;
    ``moe``, ``mtp``, ``moe_mtp``: the GPT with MoE layers and/or an MTP layer (``mtp2``: two);
    ``moe_global``, ``moe_seq``: MoE with global_aux_loss (without the z-loss), seq_aux_loss;
    ``moe_global_z``: global_aux_loss and the z-loss; ``moe_bias``: MoE with the expert bias
    (sigmoid scores); ``gpt_untied``: the GPT with an output layer of its own (torch FSDP2);
    ``moe_positionwise``: MoE layers without attention, for CP (models.KINDS)."""
    overlap_moe_expert_parallel_comm: bool = False
    """Combined 1F1B (``--overlap-moe-expert-parallel-comm``, EP > 1): the schedule runs the model
    through ``build_schedule_plan``; the config says bf16, as upstream requires, over fp32 weights."""
    delay_wgrad_compute: bool = False
    """``--delay-wgrad-compute`` (with combined 1F1B): weight gradients computed after the data
    gradients, inside the schedule."""
    overlap_grad_reduce: bool = False
    distributed_optimizer: bool = False
    data_parallel: Literal["ddp", "torch_fsdp2", "megatron_fsdp"] = "ddp"
    """The data-parallel wrapper: Megatron's DDP, torch FSDP2 (``--use-torch-fsdp2``;
    ``gpt_untied``, PP 1, EP 1) or Megatron-FSDP (``--use-megatron-fsdp``, with the distributed
    optimizer it implies); data_parallel.py."""
    sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = (
        "no_shard"
    )
    """Megatron-FSDP's ``--data-parallel-sharding-strategy``."""
    lengths: tuple[int, ...] | None = None
    """Loss tokens of each sample of the global batch, where the layout needs its own (a sample
    without any); None: the launch's."""

    @property
    def world_size(self) -> int:
        """TP x PP x CP x DP."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.data_parallel_size
        )

    @property
    def auxiliary(self) -> bool:
        """The model has auxiliary losses (MoE load balancing and z-loss, MTP)."""
        return self.model in AUXILIARY_KINDS

    @property
    def global_batch_size(self) -> int:
        """GBS = MBS x DP x GA."""
        return self.micro_batch_size * self.data_parallel_size * self.num_microbatches

    @property
    def name(self) -> str:
        sizes = (
            ("TP", self.tensor_model_parallel_size),
            ("PP", self.pipeline_model_parallel_size),
            ("VPP", self.virtual_pipeline_model_parallel_size),
            ("CP", self.context_parallel_size),
            ("EP", self.expert_model_parallel_size),
        )
        parts = [f"{flag}{size}" for flag, size in sizes if size > 1]
        if self.expert_tensor_parallel_size not in (None, self.tensor_model_parallel_size):
            parts.append(f"ETP{self.expert_tensor_parallel_size}")
        parts += [f"DP{self.data_parallel_size}", f"GA{self.num_microbatches}"]
        notes = [MODEL_NOTES[self.model]] if self.model in MODEL_NOTES else []
        if self.data_parallel != "ddp":
            notes.append(DATA_PARALLEL_NOTES[self.data_parallel].format(self.sharding_strategy))
        notes += ["sequence parallel"] * self.sequence_parallel
        notes += ["combined 1F1B"] * self.overlap_moe_expert_parallel_comm
        notes += ["delayed wgrad"] * self.delay_wgrad_compute
        notes += ["overlapped grad reduce"] * self.overlap_grad_reduce
        notes += ["distributed optimizer"] * self.distributed_optimizer
        notes += [f"loss tokens {', '.join(map(str, self.lengths))}"] if self.lengths else []
        return " x ".join(parts) + (f" ({', '.join(notes)})" if notes else "")

    def sample(self, microbatch: int, dp_rank: int, j: int) -> int:
        """Index in the global batch of sample j of micro-batch m on DP rank r."""
        return (microbatch * self.data_parallel_size + dp_rank) * self.micro_batch_size + j

    def cp_positions(self, cp_rank: int, seq_length: int) -> torch.Tensor:
        """Sequence positions CP shard c holds: chunks c and 2*CP-1-c of 2*CP."""
        cp = self.context_parallel_size
        if cp == 1:
            return torch.arange(seq_length)
        chunk = seq_length // (2 * cp)
        first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
        second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
        return torch.cat([first, second])

    def unit_samples(self) -> list[list[int]]:
        """The samples of each unit (m, r), in unit order. The auxiliary losses' units span CP (and
        TP): the router reduces its counts over TP x CP, and MTP rolls across CP shards."""
        return [
            [self.sample(m, r, j) for j in range(self.micro_batch_size)]
            for m in range(self.num_microbatches)
            for r in range(self.data_parallel_size)
        ]

    def unit_ids(self, seq_length: int) -> torch.Tensor:
        """[GBS, S] int64: the unit (m, r, c) -> (m * DP + r) * CP + c each token belongs to."""
        ids = torch.full((self.global_batch_size, seq_length), -1, dtype=torch.int64)
        cp = self.context_parallel_size
        for m in range(self.num_microbatches):
            for r in range(self.data_parallel_size):
                for j in range(self.micro_batch_size):
                    for c in range(cp):
                        ids[self.sample(m, r, j), self.cp_positions(c, seq_length)] = (
                            m * self.data_parallel_size + r
                        ) * cp + c
        return ids


MODEL_NOTES = {
    "positionwise": "position-wise",
    "moe": "MoE",
    "mtp": "MTP",
    "mtp2": "MTP depth 2",
    "moe_mtp": "MoE + MTP",
    "moe_global": "MoE global_aux_loss",
    "moe_global_z": "MoE global_aux_loss + z-loss",
    "moe_seq": "MoE seq_aux_loss",
    "moe_bias": "MoE expert bias",
    "moe_positionwise": "MoE, position-wise",
    "gpt_untied": "untied",
}
DATA_PARALLEL_NOTES = {"torch_fsdp2": "torch FSDP2", "megatron_fsdp": "Megatron-FSDP {}"}

COMBINED_1F1B: dict[str, Any] = {
    "expert_model_parallel_size": 2,
    "overlap_moe_expert_parallel_comm": True,
}

#: The layouts verify runs, by world size (one launch each); GBS = 8, MBS = 1, unless a layout gives
#: its own lengths.
DEFAULT_LAYOUTS = (
    Layout(data_parallel_size=1, num_microbatches=8),
    # seq_aux_loss counts per sequence: a micro-batch of a truncated sample (no loss tokens) and one
    # of a single token.
    Layout(
        data_parallel_size=1,
        num_microbatches=2,
        micro_batch_size=2,
        model="moe_seq",
        lengths=(1, 0, 16, 5),
    ),
    Layout(data_parallel_size=2, num_microbatches=4),
    Layout(
        data_parallel_size=2,
        num_microbatches=4,
        overlap_grad_reduce=True,
        distributed_optimizer=True,
    ),
    Layout(data_parallel_size=2, num_microbatches=4, model="moe"),
    Layout(data_parallel_size=2, num_microbatches=4, model="moe", expert_model_parallel_size=2),
    Layout(data_parallel_size=2, num_microbatches=4, model="mtp"),
    Layout(data_parallel_size=2, num_microbatches=4, model="moe_mtp"),
    Layout(
        data_parallel_size=2, num_microbatches=4, model="moe_global"
    ),  # #7452 finding 10 under global_aux_loss
    Layout(
        data_parallel_size=2, num_microbatches=4, model="moe_global_z"
    ),  # its z-loss per unit, the rest per m
    # Megatron's FSDP paths (data_parallel.py): torch FSDP2 (upstream's factor beside ours: aux.py),
    # Megatron-FSDP's four sharding strategies, with and without the overlapped reduce; the DP 4
    # ones close the table.
    Layout(
        data_parallel_size=2, num_microbatches=4, model="gpt_untied", data_parallel="torch_fsdp2"
    ),
    Layout(
        data_parallel_size=2,
        num_microbatches=4,
        data_parallel="megatron_fsdp",
        sharding_strategy="no_shard",
    ),
    Layout(
        data_parallel_size=2,
        num_microbatches=4,
        data_parallel="megatron_fsdp",
        sharding_strategy="optim",
    ),
    Layout(
        data_parallel_size=2,
        num_microbatches=4,
        data_parallel="megatron_fsdp",
        sharding_strategy="optim_grads",
        overlap_grad_reduce=True,
    ),
    # combined 1F1B (--overlap-moe-expert-parallel-comm): the model runs as a schedule plan
    Layout(data_parallel_size=2, num_microbatches=4, model="moe", **COMBINED_1F1B),
    Layout(
        data_parallel_size=2,
        num_microbatches=4,
        model="moe",
        delay_wgrad_compute=True,
        **COMBINED_1F1B,
    ),
    Layout(data_parallel_size=2, num_microbatches=4, model="moe_mtp", **COMBINED_1F1B),
    Layout(data_parallel_size=4, num_microbatches=2),
    Layout(pipeline_model_parallel_size=2, data_parallel_size=2, num_microbatches=4),
    Layout(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        data_parallel_size=2,
        num_microbatches=4,
    ),
    Layout(context_parallel_size=2, data_parallel_size=2, num_microbatches=4, model="positionwise"),
    # The MoE router's counts under TP and CP (Megatron-LM #7452, finding 10).
    Layout(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        data_parallel_size=2,
        num_microbatches=4,
        model="moe",
    ),
    Layout(
        context_parallel_size=2, data_parallel_size=2, num_microbatches=4, model="moe_positionwise"
    ),
    # combined 1F1B's padding mask cut for sequence parallelism (ETP 1: the alltoall dispatcher's
    # uneven gather over ETP is NCCL's, gloo refuses it), and its interleaved schedule
    Layout(
        tensor_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
        data_parallel_size=2,
        num_microbatches=4,
        model="moe",
        **COMBINED_1F1B,
    ),
    Layout(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        data_parallel_size=2,
        num_microbatches=4,
        model="moe",
        **COMBINED_1F1B,
    ),
    Layout(
        data_parallel_size=4, num_microbatches=2, model="gpt_untied", data_parallel="torch_fsdp2"
    ),
    Layout(
        context_parallel_size=2,
        data_parallel_size=2,
        num_microbatches=4,
        model="positionwise",
        data_parallel="torch_fsdp2",
    ),
    Layout(
        data_parallel_size=4,
        num_microbatches=2,
        data_parallel="megatron_fsdp",
        sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
    ),
)

#: Non-padding tokens per sample: very uneven, sample 1 is nearly all padding.
DEFAULT_LENGTHS = (16, 1, 13, 4, 16, 9, 2, 11)


@dataclass(frozen=True)
class GlobalBatch:
    """tokens, labels, loss_mask and position_ids, each [GBS, S]."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor


def make_global_batch(
    lengths: tuple[int, ...], seq_length: int, vocab_size: int, seed: int = 1234
) -> GlobalBatch:
    """Random tokens and labels; loss_mask[b, s] = 1 for s < lengths[b], 0 on the padding after."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(lengths), seq_length)
    tokens = torch.randint(0, vocab_size, shape, generator=gen)
    labels = torch.randint(0, vocab_size, shape, generator=gen)
    loss_mask = (torch.arange(seq_length)[None, :] < torch.tensor(lengths)[:, None]).float()
    position_ids = torch.arange(seq_length).expand(shape).clone()
    return GlobalBatch(tokens, labels, loss_mask, position_ids)
