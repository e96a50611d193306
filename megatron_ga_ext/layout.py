"""Batch arithmetic of a Megatron launch, and its ledger. Pure Python: no torch, no megatron.

    DP  = world_size / (TP x PP x CP)
    GA  = num_microbatches = GBS / (MBS x DP)
    GBS = MBS x DP x GA                       (TP, PP, CP and EP never multiply it)
    bubble = (PP - 1) / (VPP x GA + PP - 1)

Every rule Megatron enforces (at start-up or, worse, mid-run) is checked here up front; a violation
raises a typed error that names the flag, the value, the rule and the nearest valid choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from megatron_ga_ext.errors import BatchSizeError, GAError, InterleaveError, LayoutError, SizeError

__all__ = [
    "FLAGS",
    "BatchLayout",
    "interleaved_microbatch_problem",
    "microbatch_group_error",
    "nearest_multiples",
    "require_positive_int",
    "virtual_pipeline_size",
]

#: Megatron's command-line spelling of each field.
FLAGS = {
    "world_size": "--world-size",
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
    "virtual_pipeline_model_parallel_size": "--virtual-pipeline-model-parallel-size",
    "microbatch_group_size_per_vp_stage": "--microbatch-group-size-per-virtual-pipeline-stage",
    "num_experts": "--num-experts",
    "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size",
    "seq_length": "--seq-length",
}

GRAD_SYNC_MODES = ("step", "microbatch")


def require_positive_int(flag: str, value: object, *, below_one: type[GAError] = SizeError) -> int:
    """Return ``value`` if it is an int >= 1, else raise :class:`SizeError` naming ``flag``.

    ``below_one`` is the type raised for an int < 1: ScheduleError where upstream asserted the same thing.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        hint = ""
        if isinstance(value, float) and math.isfinite(value) and value > 0:
            hint = f", e.g. {max(1, math.floor(value))} or {math.ceil(value)}"
        raise SizeError(
            f"{flag} {value!r} is not a whole number: sizes count samples or ranks; "
            f"give an integer >= 1{hint}."
        )
    if value < 1:
        raise below_one(f"{flag} {value} must be at least 1; give an integer >= 1.")
    return value


def nearest_multiples(value: int, step: int, count: int = 2) -> list[int]:
    """The ``count`` positive multiples of ``step`` nearest to ``value`` (ascending)."""
    low = (value // step) * step
    candidates = [m for m in range(low - step * count, low + step * (count + 1), step) if m > 0]
    candidates.sort(key=lambda m: (abs(m - value), m))
    return sorted(candidates[:count])


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _join(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def virtual_pipeline_size(
    num_layers: int, pipeline_model_parallel_size: int, num_layers_per_virtual_pipeline_stage: int
) -> int:
    """VPP = num_layers / PP / num_layers_per_virtual_pipeline_stage, as Megatron derives it."""
    require_positive_int("--num-layers", num_layers)
    require_positive_int("--num-layers-per-virtual-pipeline-stage", num_layers_per_virtual_pipeline_stage)
    if num_layers % pipeline_model_parallel_size:
        raise LayoutError(
            f"--num-layers {num_layers} is not a multiple of --pipeline-model-parallel-size "
            f"{pipeline_model_parallel_size}; every stage must hold the same number of layers. "
            f"Nearest valid --num-layers: {_join(nearest_multiples(num_layers, pipeline_model_parallel_size))}."
        )
    per_stage = num_layers // pipeline_model_parallel_size
    if per_stage % num_layers_per_virtual_pipeline_stage:
        raise LayoutError(
            f"--num-layers-per-virtual-pipeline-stage {num_layers_per_virtual_pipeline_stage} does not divide "
            f"the {per_stage} layers of each pipeline stage (--num-layers {num_layers} / "
            f"--pipeline-model-parallel-size {pipeline_model_parallel_size}); valid values: {_join(divisors(per_stage))}."
        )
    return per_stage // num_layers_per_virtual_pipeline_stage


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

    def __post_init__(self) -> None:
        for error in self._violations():
            raise error
        if self.global_batch_size is None:
            object.__setattr__(self, "global_batch_size", self.micro_batch_size * self.data_parallel_size)

    @classmethod
    def problems(cls, **kwargs: object) -> tuple["BatchLayout | None", list[GAError]]:
        """Build a layout, collecting every violated rule instead of raising the first."""
        probe = object.__new__(cls)
        for name, field in cls.__dataclass_fields__.items():
            object.__setattr__(probe, name, kwargs.get(name, field.default))
        errors = list(probe._violations())
        if errors:
            return None, errors
        return cls(**kwargs), []  # type: ignore[arg-type]

    # -- derived sizes -------------------------------------------------------------------------

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: ranks that hold one replica of the model."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

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
        """Data-parallel gradient syncs per step: 0 when DP = 1, else 1 (deferred) or GA (every micro-batch)."""
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
        for name, flag in FLAGS.items():
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            try:
                require_positive_int(flag, value)
            except SizeError as error:
                yield error
        if self.grad_sync not in GRAD_SYNC_MODES:
            yield SizeError(f"grad_sync {self.grad_sync!r} is not one of {', '.join(GRAD_SYNC_MODES)}.")

    def _parallel_violations(self) -> Iterator[GAError]:
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        if self.world_size % self.model_parallel_size:
            valid_pp = divisors(self.world_size // (tp * cp)) if self.world_size % (tp * cp) == 0 else []
            yield LayoutError(
                f"--world-size {self.world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {self.model_parallel_size}, "
                f"so data-parallel size world / (TP x PP x CP) is not whole. Nearest valid world sizes: "
                f"{_join(nearest_multiples(self.world_size, self.model_parallel_size))}"
                + (f"; or keep the world and use --pipeline-model-parallel-size in {{{_join(valid_pp)}}}." if valid_pp else ".")
            )
        expert_default = self.expert_model_parallel_size == 1 and self.expert_tensor_parallel_size in (None, tp)
        if not expert_default and self.world_size % self._expert_model_size:
            etp = self.expert_tensor_parallel_size or tp
            yield LayoutError(
                f"--world-size {self.world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
                f"--expert-model-parallel-size {self.expert_model_parallel_size} x --pipeline-model-parallel-size "
                f"{pp} = {self._expert_model_size}, as Megatron's expert groups require. Nearest valid world sizes: "
                f"{_join(nearest_multiples(self.world_size, self._expert_model_size))}."
            )
        if self.num_experts is not None and self.num_experts % self.expert_model_parallel_size:
            yield LayoutError(
                f"--num-experts {self.num_experts} is not divisible by --expert-model-parallel-size "
                f"{self.expert_model_parallel_size}; each expert rank must hold the same number of experts. "
                f"Valid --expert-model-parallel-size: {_join(divisors(self.num_experts))}."
            )
        if self.virtual_pipeline_size > 1 and pp == 1:
            yield LayoutError(
                f"--virtual-pipeline-model-parallel-size {self.virtual_pipeline_size} needs "
                f"--pipeline-model-parallel-size > 1 (given 1): interleaving splits pipeline stages. "
                f"Drop the virtual pipeline or raise PP."
            )

    def _batch_violations(self) -> Iterator[GAError]:
        mbs, dp, gbs = self.micro_batch_size, self.data_parallel_size, self.samples_per_step
        unit = mbs * dp
        if gbs % unit:
            fix = f"Nearest valid --global-batch-size: {_join(nearest_multiples(gbs, unit))}"
            if gbs % dp == 0:
                fix += f"; or --micro-batch-size in {{{_join(divisors(gbs // dp))}}}"
            yield BatchSizeError(
                f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x data-parallel size "
                f"{dp} = {unit} (data-parallel size = --world-size {self.world_size} / (TP x PP x CP = "
                f"{self.model_parallel_size})), so it cannot split into whole micro-batches. {fix}."
            )
            return
        if self.virtual_pipeline_size > 1:
            yield from self._interleave_violations()

    def _interleave_violations(self) -> Iterator[GAError]:
        pp, m = self.pipeline_model_parallel_size, self.num_microbatches
        group = self.microbatch_group_size_per_vp_stage or pp
        unit = self.micro_batch_size * self.data_parallel_size
        group_error = microbatch_group_error(group, pp)
        if group_error is not None:
            yield group_error
            return
        problem = interleaved_microbatch_problem(m, pp, group)
        if problem is not None:
            rule, nearest_m = problem
            yield InterleaveError(
                f"--global-batch-size {self.samples_per_step} gives num_microbatches = GBS / (MBS {self.micro_batch_size} "
                f"x DP {self.data_parallel_size}) = {m} with --virtual-pipeline-model-parallel-size "
                f"{self.virtual_pipeline_size} and --pipeline-model-parallel-size {pp}: {rule}. Nearest valid "
                f"--global-batch-size: {_join([k * unit for k in nearest_m])}."
            )


def microbatch_group_error(microbatch_group_size: int, pipeline_model_parallel_size: int) -> InterleaveError | None:
    """The error for N < PP, which the interleaved schedule cannot run (N = micro-batches per virtual stage)."""
    group, pp = microbatch_group_size, pipeline_model_parallel_size
    if group >= pp:
        return None
    return InterleaveError(
        f"--microbatch-group-size-per-virtual-pipeline-stage {group} is below --pipeline-model-parallel-size {pp}; "
        f"the interleaved schedule needs N >= PP. Use N >= {pp}."
    )


def interleaved_microbatch_problem(
    num_microbatches: int, pipeline_model_parallel_size: int, microbatch_group_size: int | None = None
) -> tuple[str, list[int]] | None:
    """The rule the interleaved schedule breaks with M micro-batches, and the nearest valid M; None if it runs.

    With N = microbatch_group_size (default PP), schedules.py needs M >= N and M % N in {0} or [PP, N).
    N < PP is a separate error, reported by the caller.
    """
    pp, m = pipeline_model_parallel_size, num_microbatches
    group = microbatch_group_size or pp
    if m >= group and not 0 < m % group < pp:
        return None
    valid_m = [k for k in range(group, group * (m // group + 3)) if k % group == 0 or k % group >= pp]
    rule = f"the interleaved schedule needs num_microbatches >= N = {group} and num_microbatches % N " + (
        "== 0 (N defaults to PP)" if group == pp else f"in {{0}} or [{pp}, {group})"
    )
    return rule, _nearest(valid_m, m)


def _nearest(candidates: list[int], value: int, count: int = 2) -> list[int]:
    return sorted(sorted(set(candidates), key=lambda c: (abs(c - value), c))[:count])
