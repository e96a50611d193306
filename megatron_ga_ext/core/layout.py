"""Batch arithmetic of a Megatron launch, and its ledger. Pure Python: no torch, no megatron.

    DP  = world_size / (TP x PP x CP)
    GA  = num_microbatches = GBS / (MBS x DP)
    GBS = MBS x DP x GA                       (TP, PP, CP and EP never multiply it)
    bubble = (PP - 1) / (VPP x GA + PP - 1)

Every rule Megatron enforces (at start-up or, worse, mid-run) is checked here up front; a violation
raises a typed error that names the flag, the value, the rule and the nearest valid choices. The
rules a step schedule shares with a constant batch are ``rules.py``'s (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from megatron_ga_ext.core.megatron_flags import BY_DEST, LAUNCHER_OPTIONS, VIRTUAL_PIPELINE
from megatron_ga_ext.core.rules import (
    divisor_list,
    divisors,
    interleave_error,
    join,
    microbatch_group_error,
    multiple_error,
    require_positive_int,
)
from megatron_ga_ext.errors import GAError, LayoutError, SizeError

__all__ = ["FLAGS", "BatchLayout"]

_LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "microbatch_group_size_per_vp_stage",
    "num_experts",
    "micro_batch_size",
    "global_batch_size",
    "seq_length",
)
#: The command-line spelling of each BatchLayout field (core/megatron_flags.py declares them).
FLAGS = {
    "world_size": LAUNCHER_OPTIONS[2].flag,
    **{name: BY_DEST[name].flag for name in _LAYOUT_FIELDS[:5]},
    "virtual_pipeline_model_parallel_size": VIRTUAL_PIPELINE.flag,
    **{name: BY_DEST[name].flag for name in _LAYOUT_FIELDS[5:]},
}

GRAD_SYNC_MODES = ("step", "microbatch")


@dataclass(kw_only=True, frozen=True)
class BatchLayout:
    """One launch's parallel layout and batch sizes, checked on construction."""

    world_size: int
    """Number of ranks (GPUs): --nnodes x --nproc-per-node."""
    micro_batch_size: int
    """Samples in one forward/backward pass on one rank (MBS)."""
    global_batch_size: int | None = None
    """Samples per optimizer step (GBS); None takes Megatron's default MBS x DP."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    """Expert TP; None means the same as TP, as in Megatron."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (VPP); None or 1 is the non-interleaved schedule."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Contiguous micro-batches per virtual stage (N); None means PP, as in Megatron."""
    num_experts: int | None = None
    seq_length: int | None = None
    """Tokens per sample; needed only for token counts."""
    grad_sync: str = "step"
    """"step": one DP gradient sync per step (no_sync / deferred reduction, Megatron's way);
    "microbatch": a sync after every micro-batch."""
    given: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """How a launch line gave a size, where not by its FLAGS spelling: ``{"world_size":
    "--nproc_per_node 8 x --nnodes 2"}``; messages name that, so they name the flags the user
    wrote."""

    def __post_init__(self) -> None:
        for error in self._violations():
            raise error
        if self.global_batch_size is None:
            object.__setattr__(
                self, "global_batch_size", self.micro_batch_size * self.data_parallel_size
            )

    @classmethod
    def problems(cls, **kwargs: object) -> tuple[BatchLayout | None, list[GAError]]:
        """Build a layout, collecting every violated rule instead of raising the first."""
        probe = object.__new__(cls)
        for name, spec in cls.__dataclass_fields__.items():
            default = spec.default_factory() if callable(spec.default_factory) else spec.default
            object.__setattr__(probe, name, kwargs.get(name, default))
        errors = list(probe._violations())
        if errors:
            return None, errors
        return cls(**kwargs), []  # type: ignore[arg-type]

    # -- derived sizes -------------------------------------------------------------------------

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: ranks that hold one replica of the model."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    @property
    def data_parallel_size(self) -> int:
        """DP = world_size / (TP x PP x CP)."""
        return self.world_size // self.model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Expert DP = world_size / (ETP x EP x PP)."""
        return self.world_size // self._expert_model_size

    @property
    def virtual_pipeline_size(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def num_microbatches(self) -> int:
        """GA = GBS / (MBS x DP): micro-batches per rank per step, whatever PP is."""
        return self.samples_per_step // (self.micro_batch_size * self.data_parallel_size)

    @property
    def samples_per_step(self) -> int:
        return self.global_batch_size or self.micro_batch_size * self.data_parallel_size

    @property
    def samples_per_rank_per_step(self) -> int:
        """MBS x GA: samples one data-parallel rank processes per step."""
        return self.micro_batch_size * self.num_microbatches

    @property
    def tokens_per_step(self) -> int | None:
        """GBS x seq_length: tokens per step with fixed-length samples (padding included)."""
        return None if self.seq_length is None else self.samples_per_step * self.seq_length

    @property
    def dp_syncs_per_step(self) -> int:
        """Data-parallel gradient syncs per step: 0 when DP = 1, else 1 (deferred) or GA (every
        micro-batch)."""
        if self.data_parallel_size == 1:
            return 0
        return 1 if self.grad_sync == "step" else self.num_microbatches

    @property
    def pipeline_bubble_fraction(self) -> float:
        """(PP - 1) / (VPP x GA + PP - 1): idle fraction of a pipeline step."""
        pp = self.pipeline_model_parallel_size
        return (pp - 1) / (self.virtual_pipeline_size * self.num_microbatches + pp - 1)

    @property
    def _expert_model_size(self) -> int:
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        return etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size

    def ledger(self) -> dict[str, int | float | None]:
        """Every size of the launch, keyed as Megatron names them (the ``--json`` ledger)."""
        return {
            "world_size": self.world_size,
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_data_parallel_size": self.expert_data_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.samples_per_step,
            "num_microbatches": self.num_microbatches,
            "samples_per_step": self.samples_per_step,
            "samples_per_rank_per_step": self.samples_per_rank_per_step,
            "seq_length": self.seq_length,
            "tokens_per_step": self.tokens_per_step,
            "dp_syncs_per_step": self.dp_syncs_per_step,
            "pipeline_bubble_fraction": self.pipeline_bubble_fraction,
        }

    # -- rules ---------------------------------------------------------------------------------

    def _label(self, name: str) -> str:
        """How the launch gave a size: ``--world-size``, ``--micro_batch_size`` (as spelled), or
        ``world size (--nnodes 2 x --nproc_per_node 8)``."""
        given = self.given.get(name)
        if given is None:
            return FLAGS[name]
        return (
            given
            if " " not in given
            else f"{name.replace('_model_parallel', '').replace('_', ' ')} ({given})"
        )

    def named(self, name: str) -> str:
        """The size with its value: ``--world-size 16``, or ``world size 16 (--nnodes 2 x
        --nproc_per_node 8)``."""
        value = (
            getattr(self, name)
            if name != "virtual_pipeline_model_parallel_size"
            else self.virtual_pipeline_size
        )
        given = self.given.get(name)
        if given is not None and " " in given:
            return f"{name.replace('_model_parallel', '').replace('_', ' ')} {value} ({given})"
        return f"{self._label(name)} {value}"

    def _violations(self) -> Iterator[GAError]:
        sizes = list(self._size_violations())
        if sizes:
            yield from sizes
            return
        yield from self._parallel_violations()
        if self.world_size % self.model_parallel_size == 0 and self.global_batch_size is not None:
            yield from self._batch_violations()

    def _size_violations(self) -> Iterator[GAError]:
        optional = {
            "global_batch_size",
            "expert_tensor_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "microbatch_group_size_per_vp_stage",
            "num_experts",
            "seq_length",
        }
        for name in FLAGS:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            try:
                require_positive_int(self._label(name), value)
            except SizeError as error:
                yield error
        if self.grad_sync not in GRAD_SYNC_MODES:
            yield SizeError(
                f"grad_sync {self.grad_sync!r} is not one of {', '.join(GRAD_SYNC_MODES)}."
            )

    def _parallel_violations(self) -> Iterator[GAError]:
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        world = self.named("world_size")
        if self.world_size % self.model_parallel_size:
            keep = ""
            pps = [
                p
                for p in divisors(self.world_size // (tp * cp))[0]
                if self._fits_batch(tp * p * cp)
            ]
            if self.world_size % (tp * cp) == 0 and pps:
                keep = (
                    f"or keep the world and use --pipeline-model-parallel-size in {{{join(pps)}}}"
                )
            yield LayoutError(
                f"{world} is not divisible by --tensor-model-parallel-size {tp} x "
                "--pipeline-model-parallel-size "
                f"{pp} x --context-parallel-size {cp} = {self.model_parallel_size}, so "
                "data-parallel size world / "
                f"(TP x PP x CP) is not whole.{_sentence(self._worlds(), keep)}"
            )
        expert_default = (
            self.expert_model_parallel_size == 1 and self.expert_tensor_parallel_size in (None, tp)
        )
        if not expert_default and self.world_size % self._expert_model_size:
            etp = self.expert_tensor_parallel_size or tp
            yield LayoutError(
                f"{world} is not divisible by --expert-tensor-parallel-size {etp} x "
                "--expert-model-parallel-size "
                f"{self.expert_model_parallel_size} x --pipeline-model-parallel-size {pp} = "
                f"{self._expert_model_size}, "
                "as Megatron's expert groups "
                f"require.{_sentence(self._worlds(), self._expert_sizes())}"
            )
        if self.num_experts is not None and self.num_experts % self.expert_model_parallel_size:
            yield LayoutError(
                f"--num-experts {self.num_experts} is not divisible by "
                "--expert-model-parallel-size "
                f"{self.expert_model_parallel_size}; each expert rank must hold the same number "
                "of experts."
                f"{_sentence(self._expert_sizes())}"
            )
        if self.virtual_pipeline_size > 1 and pp == 1:
            yield LayoutError(
                f"{self.named('virtual_pipeline_model_parallel_size')} needs "
                "--pipeline-model-parallel-size > 1 (given 1): interleaving splits pipeline "
                "stages. Drop the virtual pipeline or raise PP."
            )

    def _fits_batch(self, model_parallel_size: int, world_size: int | None = None) -> bool:
        """At TP x PP x CP = ``model_parallel_size`` on ``world_size`` ranks, DP is whole and a
        given GBS is a multiple of MBS x DP."""
        world = self.world_size if world_size is None else world_size
        if world % model_parallel_size:
            return False
        dp = world // model_parallel_size
        return (
            self.global_batch_size is None
            or self.global_batch_size % (self.micro_batch_size * dp) == 0
        )

    def _worlds(self) -> str:
        """`` Nearest valid world sizes: a, b``: the two nearest the given that TP x PP x CP and the
        expert groups divide and at which a given GBS is a multiple of MBS x DP ("" where none is).
        Bounded whatever the sizes: with a GBS, DP runs over the divisors of GBS / MBS; without, the
        multiples either side of the world."""
        unit = math.lcm(self.model_parallel_size, self._expert_model_size)
        gbs, mbs = self.global_batch_size, self.micro_batch_size
        if gbs is None:
            below = self.world_size // unit * unit
            found = [w for w in (below, below + unit) if w > 0]
        elif gbs % mbs:
            found = []
        else:
            dps = divisors(gbs // mbs)[0]
            found = [
                self.model_parallel_size * d
                for d in dps
                if self.model_parallel_size * d % unit == 0
            ]
        found.sort(key=lambda w: (abs(w - self.world_size), w))
        return f"Nearest valid world sizes: {join(sorted(found[:2]))}" if found else ""

    def _expert_sizes(self) -> str:
        """``Valid --expert-model-parallel-size: 1, 2``: those that divide --num-experts and world /
        (ETP x PP)."""
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        group = etp * self.pipeline_model_parallel_size
        if self.num_experts is None or self.world_size % group:
            return ""
        valid = [ep for ep in divisors(self.num_experts)[0] if (self.world_size // group) % ep == 0]
        return f"Valid --expert-model-parallel-size: {join(valid)}" if valid else ""

    def _batch_violations(self) -> Iterator[GAError]:
        mbs, dp, gbs = self.micro_batch_size, self.data_parallel_size, self.samples_per_step
        if gbs % (mbs * dp):
            fix = (
                f"; or --micro-batch-size in {{{divisor_list(gbs // dp)}}}" if gbs % dp == 0 else ""
            )
            yield multiple_error(
                f"--global-batch-size {gbs}",
                gbs,
                mbs,
                dp,
                valid="--global-batch-size",
                fix=fix,
                dp_source=f" (data-parallel size = {self.named('world_size')} / (TP x PP x CP = "
                f"{self.model_parallel_size}))",
            )
            return
        if self.virtual_pipeline_size > 1:
            yield from self._interleave_violations()

    def _interleave_violations(self) -> Iterator[GAError]:
        pp = self.pipeline_model_parallel_size
        group = self.microbatch_group_size_per_vp_stage or pp
        group_error = microbatch_group_error(group, pp)
        if group_error is not None:
            yield group_error
            return
        error = interleave_error(
            f"--global-batch-size {self.samples_per_step}",
            self.samples_per_step,
            self.micro_batch_size,
            self.data_parallel_size,
            pp,
            self.named("virtual_pipeline_model_parallel_size"),
            group,
            valid="--global-batch-size",
        )
        if error is not None:
            yield error


def _sentence(*parts: str) -> str:
    """`` a; b.``: the non-empty parts as one sentence ("" where none is)."""
    given = [p for p in parts if p]
    return f" {'; '.join(given)}." if given else ""
