"""The rules of validate_args on the data-parallel wrappers and the checkpoint formats tied to them,
declared for ``megatron-ga check``: torch FSDP2's seven restrictions, Megatron-FSDP's optimizer and
checkpoint format, and what ``--ckpt-format torch_dcp`` and ``fsdp_dtensor`` need. Pure Python.

Gradient-accumulation fusion is on by default (Megatron's ``--no-gradient-accumulation-fusion``
turns it off), so FSDP2 needs that flag on every line; the default --ckpt-format is torch_dist.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_ga_ext.launch.rule import ARGS, Rule, cite, switched
from megatron_ga_ext.launch.rules_batch import drop, give
from megatron_ga_ext.launch.view import View

__all__ = ["FSDP_RULES"]

FSDP2 = "--use-torch-fsdp2"


_fsdp2 = switched("use_torch_fsdp2", FSDP2, id="torch-fsdp2", topic="fsdp", about_reads=True)


TORCH_FSDP2 = (
    _fsdp2("pipeline_model_parallel_size", lambda v: v["pipeline_model_parallel_size"] != 1,
           lambda v: v.named("pipeline_model_parallel_size"),
           "--use-torch-fsdp2 is not supported with pipeline parallelism",
           f"Drop {FSDP2}, or use --pipeline-model-parallel-size 1.", drop("use_torch_fsdp2"),
           (608, 868, 1013, 1000, 1034)),
    _fsdp2("expert_model_parallel_size", lambda v: v["expert_model_parallel_size"] != 1,
           lambda v: v.named("expert_model_parallel_size"),
           "--use-torch-fsdp2 is not supported with expert parallelism",
           f"Drop {FSDP2}, or use --expert-model-parallel-size 1.", drop("use_torch_fsdp2"),
           (610, 870, 1015, 1002, 1036)),
    _fsdp2("use_distributed_optimizer", lambda v: bool(v["use_distributed_optimizer"]),
           lambda v: "--use-distributed-optimizer",
           "--use-torch-fsdp2 is not supported with MCore's distributed optimizer",
           "Drop --use-distributed-optimizer (FSDP2 shards the optimizer state itself).",
           drop("use_distributed_optimizer"), (612, 872, 1017, 1004, 1038)),
    _fsdp2("gradient_accumulation_fusion", lambda v: bool(v["gradient_accumulation_fusion"]),
           lambda v: "gradient-accumulation fusion (on unless --no-gradient-accumulation-fusion)",
           "--use-torch-fsdp2 is not supported with gradient accumulation fusion",
           "Add --no-gradient-accumulation-fusion.", give("gradient_accumulation_fusion"),
           (614, 874, 1019, 1006, 1040)),
    _fsdp2("ckpt_format", lambda v: v["ckpt_format"] not in ("torch_dist", "torch_dcp"),
           lambda v: v.named("ckpt_format"),
           "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp",
           "Use --ckpt-format torch_dist.", give("ckpt_format", "torch_dist"), (616, 876, 1021, 1008, 1042)),
    _fsdp2("untie_embeddings_and_output_weights", lambda v: not v["untie_embeddings_and_output_weights"],
           lambda v: "tied embeddings (no --untie-embeddings-and-output-weights)",
           "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights",
           "Add --untie-embeddings-and-output-weights.", give("untie_embeddings_and_output_weights"),
           (618, 878, 1023, 1010, 1044)),
    _fsdp2("fp16", lambda v: bool(v["fp16"]), lambda v: "--fp16",
           "--use-torch-fsdp2 not supported with fp16 yet",
           "Use --bf16 in place of --fp16.", drop("fp16") + give("bf16"), (620, 880, 1025, 1012, 1046)),
)  # fmt: skip

MEGATRON_FSDP = (
    Rule(
        id="megatron-fsdp",
        about="optimizer",
        reads=("use_megatron_fsdp", "optimizer"),
        broken=lambda v: bool(v["use_megatron_fsdp"]) and v["optimizer"] not in ("sgd", "adam"),
        given=lambda v: f"--use-megatron-fsdp with {v.named('optimizer')}",
        says=lambda v: f"Megatron-FSDP does not support the {v['optimizer']} optimizer yet.",
        fix="Use --optimizer adam or sgd.",
        edit=lambda v: give("optimizer", "adam"),
        source=cite(ARGS, None, None, 1123, 1127, 1150),
        topic="fsdp",
    ),
    Rule(
        id="megatron-fsdp",
        about="ckpt_format",
        reads=("use_megatron_fsdp", "ckpt_format"),
        broken=lambda v: bool(v["use_megatron_fsdp"]) and v["ckpt_format"] != "fsdp_dtensor",
        given=lambda v: (
            f"--use-megatron-fsdp with {v.named('ckpt_format')}"
            + ("" if "ckpt_format" in v.given else " (the default)")
        ),
        says="Megatron-FSDP requires the `fsdp_dtensor` checkpointing format.",
        fix="Give --ckpt-format fsdp_dtensor.",
        edit=lambda v: give("ckpt_format", "fsdp_dtensor"),
        source=cite(ARGS, 690, 971, 1142, 1146, 1169),
        topic="fsdp",
    ),
)


def _format(
    fmt: str, about: str, broken: Callable[[View], bool], says: str, lines: tuple[int, ...]
) -> Rule:
    return Rule(
        id="ckpt-format",
        about=about,
        reads=("ckpt_format", about),
        broken=lambda v: v["ckpt_format"] == fmt and broken(v),
        given=lambda v: (
            f"--ckpt-format {fmt} with "
            + (v.named(about) if about in v.given else f"no {v.flag(about)}")
        ),
        says=says,
        fix="Use --ckpt-format torch_dist.",
        edit=lambda v: give("ckpt_format", "torch_dist"),
        source=cite(ARGS, *lines),
        topic="fsdp",
    )


CKPT_FORMATS = (
    _format("torch_dcp", "use_torch_fsdp2", lambda v: not v["use_torch_fsdp2"],
            "--ckpt-format torch_dcp is only tested with FSDP.", (1042, 1333, 1499, 1613, 1668)),
    _format("torch_dcp", "tensor_model_parallel_size", lambda v: v["tensor_model_parallel_size"] > 1,
            "--ckpt-format torch_dcp is not tested with megatron tensor parallelism.",
            (1043, 1334, 1500, 1614, 1669)),
    _format("torch_dcp", "pipeline_model_parallel_size", lambda v: v["pipeline_model_parallel_size"] > 1,
            "--ckpt-format torch_dcp is not tested with megatron pipeline parallelism.",
            (1045, 1336, 1502, 1616, 1671)),
    _format("fsdp_dtensor", "use_megatron_fsdp", lambda v: not v["use_megatron_fsdp"],
            "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP.", (1050, 1341, 1507, 1621, 1676)),
)  # fmt: skip

FSDP_RULES: tuple[Rule, ...] = (*TORCH_FSDP2, *MEGATRON_FSDP, *CKPT_FORMATS)
