"""The batch layout a launch line gives: BatchLayout's arguments (the world size from ``world.py``),
the virtual pipeline its layer split derives, its sequence length, and what it leaves out or
contradicts. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_ga_ext.config.flags import BY_DEST, OPTIONS
from megatron_ga_ext.core.layout import FLAGS
from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.errors import GAError, UsageError
from megatron_ga_ext.launch.layer_split import LayerSplit, VirtualPipeline, virtual_pipeline
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.report import Note, Problem
from megatron_ga_ext.launch.world import Found, checked_world

__all__ = ["MISSING_MICRO_BATCH", "LaunchLayout", "layout_kwargs", "read_ints", "read_layout"]


@dataclass
class LaunchLayout:
    """BatchLayout arguments of a launch line, and the rules its layer split breaks."""

    kwargs: dict[str, Any]
    """BatchLayout's keyword arguments (None where the line leaves a size out), and ``given``: how
    the line gave each size it spelled otherwise; BatchLayout checks each value when it is built."""
    virtual_pipeline: VirtualPipeline
    seq_problems: list[str] = field(default_factory=list)
    read_problems: list[Problem] = field(default_factory=list)
    """What the line leaves out or contradicts: no --micro-batch-size, a check --world-size the line
    disagrees with, a Slurm start that splits the world (``missing_ok`` reads only)."""
    read_notes: list[Note] = field(default_factory=list)

    @property
    def problems(self) -> list[GAError]:
        """The rules the line's layer split breaks (the virtual pipeline's problems)."""
        return list(self.virtual_pipeline.problems)


def read_ints(launch: Launch) -> dict[str, int]:
    """Every integer flag given, by its argparse destination (UsageError naming the flag as
    spelled)."""
    return {
        OPTIONS[flag].dest: read_int(launch.name(flag), values[0])
        for flag, values in launch.values.items()
        if OPTIONS[flag].type is int and OPTIONS[flag].nargs == 1
    }


MISSING_MICRO_BATCH = "--micro-batch-size is missing; Megatron needs it to split the global batch."


def read_layout(
    launch: Launch, world_size: int | None = None, *, missing_ok: bool = False
) -> LaunchLayout:
    """The layout of ``launch``; ``world_size`` stands in for the launcher's where the line leaves
    it open. UsageError where it cannot be read. With ``missing_ok`` (check), a missing
    --micro-batch-size and a ``world_size`` the line contradicts are problems (the line's world is
    kept), not errors."""
    ints = read_ints(launch)
    kwargs: dict[str, Any] = {
        name: ints.get(BY_DEST[name].dest) for name in FLAGS if name in BY_DEST
    }
    given: dict[str, str] = {}
    found = Found() if missing_ok else None
    kwargs["world_size"] = checked_world(launch, ints, given, world_size, found)
    read_problems = found.problems if found is not None else []
    if kwargs["micro_batch_size"] is None:
        if not missing_ok:
            raise UsageError(MISSING_MICRO_BATCH)
        read_problems.append(
            Problem(
                message=MISSING_MICRO_BATCH,
                rule="micro-batch-size-missing",
                flag="--micro-batch-size",
                fix="Give --micro-batch-size N.",
            )
        )
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
    ):
        if kwargs[name] is None:
            kwargs[name] = 1
    seq_problems = _seq_length(launch, ints, kwargs, given)
    vpp = virtual_pipeline(_layer_split(launch, ints, kwargs["pipeline_model_parallel_size"]))
    kwargs["virtual_pipeline_model_parallel_size"] = vpp.size
    if vpp.given:
        given["virtual_pipeline_model_parallel_size"] = vpp.given
    for name in FLAGS:
        flag = BY_DEST[name].flag if name in BY_DEST else None
        if flag in launch.spelled and launch.spelled[flag] != flag and name not in given:
            given[name] = launch.spelled[flag]
    kwargs["given"] = given
    return LaunchLayout(
        kwargs=kwargs,
        virtual_pipeline=vpp,
        seq_problems=seq_problems,
        read_problems=read_problems,
        read_notes=found.notes if found is not None else [],
    )


def layout_kwargs(launch: Launch, world_size: int | None = None) -> dict[str, Any]:
    """BatchLayout arguments from a launch line, raising its first layer-split problem (the ledger's
    way)."""
    layout = read_layout(launch, world_size)
    if layout.problems:
        raise layout.problems[0]
    return layout.kwargs


def _layer_split(
    launch: Launch, ints: dict[str, int], pipeline_model_parallel_size: int
) -> LayerSplit:
    """The flags of ``launch`` that split the layers over the pipeline stages (``ints``: its integer
    flags)."""
    pattern = launch.get("--hybrid-layer-pattern") or launch.get("--hybrid-override-pattern")
    return LayerSplit(
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        num_layers=ints.get("num_layers"),
        decoder_num_layers=ints.get("decoder_num_layers"),
        num_layers_per_virtual_pipeline_stage=ints.get("num_layers_per_virtual_pipeline_stage"),
        num_virtual_stages_per_pipeline_rank=ints.get("num_virtual_stages_per_pipeline_rank"),
        pipeline_model_parallel_layout=launch.get("--pipeline-model-parallel-layout"),
        hybrid_layer_pattern=pattern,
        decoder_first_pipeline_num_layers=ints.get("decoder_first_pipeline_num_layers"),
        decoder_last_pipeline_num_layers=ints.get("decoder_last_pipeline_num_layers"),
        account_for_embedding_in_pipeline_split=launch.on(
            "--account-for-embedding-in-pipeline-split"
        ),
        account_for_loss_in_pipeline_split=launch.on("--account-for-loss-in-pipeline-split"),
    )


def _seq_length(
    launch: Launch, ints: dict[str, int], kwargs: dict[str, Any], given: dict[str, str]
) -> list[str]:
    """Megatron's seq_length: --seq-length, else --encoder-seq-length (arguments.py maps it so); the
    problems."""
    seq, encoder, decoder = (
        ints.get(k) for k in ("seq_length", "encoder_seq_length", "decoder_seq_length")
    )
    if seq is not None and encoder is not None:
        return [
            f"--seq-length {seq} and --encoder-seq-length {encoder} are both given; Megatron "
            "asserts encoder_seq_length is None when --seq-length is set (it copies one into the "
            "other). Keep one."
        ]
    if seq is None and encoder is not None:
        kwargs["seq_length"] = encoder
        given["seq_length"] = launch.name("--encoder-seq-length")
    if seq is None and encoder is None and decoder is not None:
        return [
            f"--decoder-seq-length {decoder} is given without --seq-length or "
            "--encoder-seq-length; Megatron asserts encoder_seq_length is not None: the decoder "
            "length does not set the sequence length "
            f"that schedules and tokens per step use. Add --seq-length."
        ]
    return []
