"""The ledger ``check`` prints beside its problems: every number it knows, and where each came from.
Pure Python.

A launch whose layout holds gives :meth:`BatchLayout.ledger`; where a rule breaks, the numbers the
line still fixes are kept (the sizes as given, DP where it divides, the global batch as given) and
the ones that rule decides are None, never a made-up value. :func:`ledger_sources` names, for each
quantity, the flags it came from (as the line spelled them), Megatron's default, or the formula it
is derived by.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_ga_ext.core.layout import FLAGS, BatchLayout

__all__ = ["LEDGER_KEYS", "LEDGER_RULES", "known_ledger", "ledger_sources"]

#: Each quantity of the ledger: (label, the formula it is derived by; "" for a size the line gives).
LEDGER_RULES = {
    "world_size": ("world size", ""),
    "tensor_model_parallel_size": ("TP", ""),
    "pipeline_model_parallel_size": ("PP", ""),
    "virtual_pipeline_model_parallel_size": ("VPP", "model chunks per pipeline rank"),
    "context_parallel_size": ("CP", ""),
    "expert_model_parallel_size": ("EP", ""),
    "expert_data_parallel_size": ("expert DP", "world / (ETP x EP x PP)"),
    "data_parallel_size": ("DP", "world / (TP x PP x CP)"),
    "micro_batch_size": ("MBS", "samples per forward/backward"),
    "global_batch_size": ("GBS", "MBS x DP x GA; TP, PP, CP, EP never multiply it"),
    "num_microbatches": ("GA = num_microbatches", "GBS / (MBS x DP), per rank and per model chunk"),
    "samples_per_step": ("samples per step", "= GBS"),
    "samples_per_rank_per_step": ("samples per DP rank per step", "MBS x GA"),
    "seq_length": ("seq length", ""),
    "tokens_per_step": ("tokens per step", "GBS x seq_length (padding included)"),
    "dp_syncs_per_step": (
        "DP gradient syncs per step",
        "0 if DP = 1; 1 deferred; GA if every micro-batch syncs",
    ),
    "pipeline_bubble_fraction": ("pipeline bubble", "(PP - 1) / (VPP x GA + PP - 1)"),
}
LEDGER_KEYS = tuple(LEDGER_RULES)

#: The quantities the global batch decides (None while it breaks a rule).
_BY_BATCH = ("num_microbatches", "samples_per_rank_per_step", "pipeline_bubble_fraction")
#: Sizes a line gives; Megatron's default where it does not.
_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)


def known_ledger(
    kwargs: Mapping[str, Any], batch_known: bool = True
) -> tuple[dict[str, int | float | None], BatchLayout | None]:
    """(the ledger, the layout where every rule holds, else None) of BatchLayout ``kwargs``: the
    numbers a broken rule does not decide are kept. ``batch_known=False``: no global batch is known
    (a schedule that does not resolve), so none is shown, not Megatron's default MBS x DP."""
    layout, _ = BatchLayout.problems(**kwargs)
    if layout is not None and batch_known:
        return layout.ledger(), layout
    if layout is not None:
        ledger = layout.ledger()
        ledger.update(
            dict.fromkeys((*_BY_BATCH, "global_batch_size", "samples_per_step", "tokens_per_step"))
        )
        return ledger, None
    without_batch, _ = BatchLayout.problems(**{**kwargs, "global_batch_size": None})
    if without_batch is not None:
        ledger = without_batch.ledger()
        batch = kwargs.get("global_batch_size")
        ledger.update(dict.fromkeys(_BY_BATCH))
        ledger["global_batch_size"] = ledger["samples_per_step"] = batch
        seq = ledger["seq_length"]
        ledger["tokens_per_step"] = (
            batch * seq if isinstance(batch, int) and isinstance(seq, int) else None
        )
        return ledger, None
    return _raw(kwargs), None


def _raw(kwargs: Mapping[str, Any]) -> dict[str, int | float | None]:
    """The sizes as given, DP where world / (TP x PP x CP) is whole, nothing derived from a broken
    rule."""
    ledger: dict[str, int | float | None] = dict.fromkeys(LEDGER_KEYS)
    for key in ("world_size", *_SIZES, "micro_batch_size", "global_batch_size", "seq_length"):
        value = kwargs.get(key)
        ledger[key] = value if isinstance(value, int) and not isinstance(value, bool) else None
    ledger["virtual_pipeline_model_parallel_size"] = (
        kwargs.get("virtual_pipeline_model_parallel_size") or 1
    )
    ledger["samples_per_step"] = ledger["global_batch_size"]
    world = ledger["world_size"]
    sizes = [size for k in _SIZES[:3] if isinstance(size := ledger[k], int) and size >= 1]
    if isinstance(world, int) and len(sizes) == 3:
        model = sizes[0] * sizes[1] * sizes[2]
        ledger["data_parallel_size"] = world // model if world >= 1 and world % model == 0 else None
    return ledger


def ledger_sources(
    kwargs: Mapping[str, Any], spelled: Mapping[str, str], batch_source: str | None
) -> dict[str, str]:
    """Where each quantity came from: the flag as the line spelled it (``given`` of ``kwargs`` for a
    size from several flags), Megatron's default where the line leaves it, else its formula.
    ``spelled`` maps a declared flag to its spelling on the line; ``batch_source`` says where the
    global batch came from (None: the flag)."""
    given: Mapping[str, str] = kwargs.get("given") or {}
    sources = {key: rule for key, (_, rule) in LEDGER_RULES.items()}
    for key in (
        "world_size",
        *_SIZES,
        "virtual_pipeline_model_parallel_size",
        "micro_batch_size",
        "global_batch_size",
        "seq_length",
    ):
        flag = FLAGS.get(key)
        if key in given and " " in given[key]:
            sources[key] = given[key]
        elif flag is not None and flag in spelled:
            sources[key] = spelled[flag]
        elif key in _SIZES:
            sources[key] = "Megatron's default"
        elif key == "virtual_pipeline_model_parallel_size":
            sources[key] = "no interleaving (no flag sets a virtual pipeline)"
    if batch_source is not None:
        sources["global_batch_size"] = batch_source
    elif "--global-batch-size" not in spelled:
        sources["global_batch_size"] = "Megatron's default MBS x DP (no --global-batch-size)"
    return sources
