"""What the oracle's worker stands in for, so that Megatron-LM's validation answers on a CPU as it
would on the training machine: an H100 (compute capability 9.0) with Transformer Engine installed.

1. ``torch.cuda.get_device_capability`` answers (9, 0) and ``get_device_properties`` an H100's
   numbers: ``validate_args`` asks for the device's architecture (``--moe-grouped-gemm``;
   ``get_device_arch_version`` in ``megatron/training/utils``), which needs a driver otherwise.
2. Where Transformer Engine is not installed, megatron-core's cached TE version
   (``megatron/core/utils.py`` ``_te_version``, 0.0.0 without it) is :data:`TE_VERSION`:
   ``validate_args`` refuses fp8 and other flags on a TE older than the one they need, a refusal the
   training image never gives.
3. Likewise TE's fused rotary embedding (``rope_utils.fused_apply_rotary_pos_emb``, None without TE)
   is a placeholder: ``TransformerConfig`` refuses ``--apply-rope-fusion`` (on by default with RoPE)
   where it is None.

No process group is made: ``parse_args`` reads the world from ``WORLD_SIZE`` and ``RANK``, which the
worker sets.
"""

from __future__ import annotations

import types
from typing import Any

#: The Transformer Engine version the stand-in reports where none is installed.
TE_VERSION = "2.10.0"
#: The device the stand-in reports (an H100 SXM).
CAPABILITY = (9, 0)


def _properties(*args: Any, **kwargs: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        major=CAPABILITY[0],
        minor=CAPABILITY[1],
        name="H100 (oracle stand-in)",
        total_memory=80 * 2**30,
        multi_processor_count=132,
    )


def install_standins() -> None:
    """Install 1 to 3 (the module docstring); call after megatron is imported (its import-time code
    reads torch.cuda as it is)."""
    import torch

    torch.cuda.get_device_capability = lambda *a, **k: CAPABILITY
    torch.cuda.get_device_properties = _properties
    import megatron.core.utils as core_utils

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        core_utils._te_version = core_utils.PkgVersion(TE_VERSION)
        import megatron.core.models.common.embeddings.rope_utils as rope_utils

        if rope_utils.fused_apply_rotary_pos_emb is None:
            rope_utils.fused_apply_rotary_pos_emb = _te_placeholder


def _te_placeholder(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "Transformer Engine stand-in: the oracle validates, it does not compute"
    )
