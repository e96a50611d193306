"""A --pipeline-model-parallel-layout read as Megatron reads it: its stages and the layers it
places, counted once unrolled. Pure Python.

Megatron (pipeline_parallel_layer_layout.py) drops the commas, unrolls ``(ab|cd)*n`` then ``x*n``,
and splits on '|': stages = '|' count + 1, and each of ``t`` (decoder), ``m`` (MTP), ``E``
(embedding), ``L`` (loss) places one layer. The unrolled text is bounded (:data:`MAX_LAYOUT`).
"""

from __future__ import annotations

import re

from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.errors import LayerSplitError

__all__ = ["LAYOUT", "MAX_LAYOUT", "layout_counts", "layout_stage_count"]

#: A pipeline layout is unrolled only up to this length (Megatron unrolls it in memory: longer ones
#: are hostile).
MAX_LAYOUT = 1_000_000

_UNROLL = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))

LAYOUT = "--pipeline-model-parallel-layout"


def layout_stage_count(text: str) -> int:
    """The stages (PP x VPP) of a --pipeline-model-parallel-layout, as Megatron counts them: commas
    dropped, ``(ab|cd)*n`` then ``x*n`` unrolled, then '|' separated. Unrolled up to
    :data:`MAX_LAYOUT` characters; a longer one is refused (LayerSplitError) before any of it is
    built."""
    return _unrolled(text).count("|") + 1


def layout_counts(text: str) -> dict[str, int]:
    """How many of each layer a --pipeline-model-parallel-layout places once unrolled: ``t``
    (decoder), ``m`` (MTP), ``E`` (embedding), ``L`` (loss), as pipeline_parallel_layer_layout.py
    counts them."""
    unrolled = _unrolled(text)
    return {kind: unrolled.count(kind) for kind in "tmEL"}


def _unrolled(text: str) -> str:
    unrolled = text.replace(",", "")
    for pattern in _UNROLL:
        length = len(unrolled)
        for match in pattern.finditer(unrolled):
            times = read_int(f"{LAYOUT} repeat count", match.group(2), error=LayerSplitError)
            length += len(match.group(1)) * times - len(match.group(0))
            if length > MAX_LAYOUT:
                raise LayerSplitError(
                    f"{LAYOUT} {text[:40]!r}{'...' if len(text) > 40 else ''} unrolls to more "
                    f"than {MAX_LAYOUT:,} layers; no model has that many. Check the "
                    "repeat counts ('(...)*n')."
                )
        unrolled = pattern.sub(lambda m: m.group(1) * int(m.group(2)), unrolled)
    return unrolled
