"""The rules of the pipeline layout on the layers it places, declared for ``megatron-ga check``:
--pipeline-model-parallel-layout's decoder ('t') and MTP ('m') layers against --num-layers and
--mtp-num-layers (megatron/core/transformer/pipeline_parallel_layer_layout.py), and the position
embedding MTP needs (validate_args). Pure Python.

launch/rules_parallel.py places these after its own rules in PARALLEL_RULES. Each cites its
upstream line at every tested source.
"""

from __future__ import annotations

from megatron_ga_ext.launch.rule import ARGS, LAYOUT, Rule, cite
from megatron_ga_ext.launch.rules_batch import give
from megatron_ga_ext.launch.view import View

__all__ = ["LAYOUT_RULES"]


def _count(view: View, kind: str) -> int | None:
    counts = view["layout_counts"]
    return None if counts is None else counts[kind]


LAYOUT_LAYERS = Rule(
    id="layout-layers",
    about="pipeline_model_parallel_layout",
    reads=("pipeline_model_parallel_layout", "num_layers"),
    broken=lambda v: (
        isinstance(v["num_layers"], int) and _count(v, "t") not in (None, v["num_layers"])
    ),
    given=lambda v: (
        f"--pipeline-model-parallel-layout places {_count(v, 't')} decoder layers ('t') and "
        f"{v.named('num_layers')}"
    ),
    says=lambda v: (
        f"Number of decoder layers {_count(v, 't')}must match num_layers {v['num_layers']}"
    ),
    fix=lambda v: (
        f"Place {v['num_layers']} 't' in the layout, or give --num-layers {_count(v, 't')}."
    ),
    edit=lambda v: give("num_layers", _count(v, "t")),
    source=cite(LAYOUT, 106, 106, 106, 106, 107),
    topic="parallel",
)

LAYOUT_MTP = Rule(
    id="layout-mtp",
    about="pipeline_model_parallel_layout",
    reads=("pipeline_model_parallel_layout", "mtp_num_layers"),
    broken=lambda v: _count(v, "m") is not None and _count(v, "m") != (v["mtp_num_layers"] or 0),
    given=lambda v: (
        f"--pipeline-model-parallel-layout places {_count(v, 'm')} MTP layers ('m') and "
        + (v.named("mtp_num_layers") if v["mtp_num_layers"] is not None else "no --mtp-num-layers")
    ),
    says="Number of mtp layers in layout must match mtp_num_layers",
    fix=lambda v: (
        f"Give --mtp-num-layers {_count(v, 'm')}, or place {v['mtp_num_layers'] or 0} 'm' in the "
        "layout."
    ),
    source=cite(LAYOUT, 111, 111, 111, 111, 112),
    topic="parallel",
)

MTP_POSITIONS = Rule(
    id="layout-mtp",
    about="position_embedding_type",
    reads=("mtp_num_layers", "position_embedding_type"),
    broken=lambda v: (
        bool(v["mtp_num_layers"]) and v["position_embedding_type"] not in ("rope", "none")
    ),
    given=lambda v: (
        f"{v.named('mtp_num_layers')} with --position-embedding-type {v['position_embedding_type']}"
        + ("" if "position_embedding_type" in v.given else " (the default)")
    ),
    says=lambda v: (
        "Multi-Token Prediction (MTP) is not supported with "
        f"{v['position_embedding_type']} position embedding type."
        "The supported position embedding types are rope and none."
    ),
    fix="Give --position-embedding-type rope.",
    edit=lambda v: give("position_embedding_type", "rope"),
    source=cite(ARGS, 1231, 731, 873, 857, 883),
    topic="parallel",
)

LAYOUT_RULES: tuple[Rule, ...] = (LAYOUT_LAYERS, LAYOUT_MTP, MTP_POSITIONS)
