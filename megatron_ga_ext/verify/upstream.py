"""``megatron-ga verify --upstream``: verify's layouts on whatever megatron-core is importable,
install() not called.

The same layouts and unpartitioned references as ``verify``, run by megatron-core alone: a pristine
release shows its defects as failing token rows (with the factor of docs/upstream.md), a tree with
patches/upstream applied (its root first on PYTHONPATH: ``python patches/upstream.py tree --source
S``) passes them. The step is what a user of the patches runs (:func:`forward_kwargs`,
:func:`configure`):

* the forward step passes MoE models ``padding_mask = (loss_mask == 0)`` in token mode, as
  Megatron-LM's ``pretrain_gpt.py`` with the padding-mask fix would (microbatch mode routes every
  position, as upstream does);
* where the source has ``TransformerConfig.mtp_loss_normalize_by_lm_tokens`` (patch 0003), token
  mode sets it: the objective verify's MTP reference is (every MTP token at alpha / N).

Each rank checks, before each layout, that every function install() would hook is megatron-core's
own object (:func:`check_unhooked`): nothing of this package is in the step.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from megatron_ga_ext.errors import VerifyError

__all__ = ["HOOKED", "check_unhooked", "configure", "forward_kwargs"]

#: (module, attribute path) of what install() wraps or replaces, and where megatron binds it for its
#: callers.
HOOKED = (
    ("megatron.core.pipeline_parallel.schedules", "forward_step_calc_loss"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving"),
    (
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_without_interleaving",
    ),
    ("megatron.core.distributed.finalize_model_grads", "finalize_model_grads"),
    ("megatron.core.distributed", "finalize_model_grads"),
    ("megatron.core.num_microbatches_calculator", "get_num_microbatches"),
    ("megatron.core.num_microbatches_calculator", "update_num_microbatches"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.forward"),
    ("megatron.core.transformer.moe.moe_utils", "get_tokens_per_expert_and_token_count"),
    ("megatron.core.transformer.moe.moe_utils", "z_loss_func"),
    ("megatron.core.transformer.moe.router", "get_tokens_per_expert_and_token_count"),
    ("megatron.core.transformer.moe.router", "z_loss_func"),
    ("megatron.core.transformer.moe.router", "TopKRouter._apply_expert_bias"),
    ("megatron.core.transformer.multi_token_prediction", "process_mtp_loss"),
)

#: The field of patch 0003 (patches/upstream/*/0003-mtp-normalize-by-lm-tokens.patch).
MTP_FIELD = "mtp_loss_normalize_by_lm_tokens"


def check_unhooked() -> None:
    """Raise VerifyError unless each of :data:`HOOKED` that this megatron-core has is its own
    function: every layer of it (a decorator's wrapper and what it wraps) is code from the
    importable megatron/core or torch (upstream decorates some with ``torch.compiler.disable``). A
    wrapper made with ``functools.wraps`` carries the wrapped function's name and module, so its
    code's file is what is judged."""
    import megatron.core
    import torch

    own = (Path(megatron.core.__file__).resolve().parent, Path(torch.__file__).resolve().parent)
    problems = []
    for module_name, path in HOOKED:
        obj: Any = importlib.import_module(module_name)
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:  # not in this release (process_mtp_loss before 0.17)
            continue
        foreign = [
            f for f in _code_files(obj) if not any(Path(f).resolve().is_relative_to(d) for d in own)
        ]
        if foreign:
            problems.append(f"{module_name}.{path} runs code from {', '.join(foreign)}")
    if problems:
        raise VerifyError(
            "verify --upstream runs megatron-core alone, but functions install() hooks are not "
            "upstream's own: " + "; ".join(problems)
        )


def _code_files(obj: Any) -> list[str]:
    """The files of the code of ``obj`` and of each function it wraps (``__wrapped__``)."""
    files = []
    while obj is not None:
        code = getattr(obj, "__code__", None)
        files.append(code.co_filename if code is not None else repr(obj))
        obj = getattr(obj, "__wrapped__", None)
    return files


def forward_kwargs(model: Any, micro: dict[str, Any], mode: str) -> dict[str, Any]:
    """The padding mask a patched pretrain_gpt.py passes: MoE models in token mode."""
    if mode != "token" or not getattr(model.config, "num_moe_experts", None):
        return {}
    return {"padding_mask": micro["loss_mask"] == 0}


def configure(config: Any, mode: str) -> None:
    """Token mode on a source with patch 0003's field: the partition-invariant MTP objective."""
    if mode == "token" and hasattr(config, MTP_FIELD):
        setattr(config, MTP_FIELD, True)
