"""How to install what a command needs: one place for the words, so that no message names a registry
package this project does not own (``megatron-ga-ext`` on the registry is unclaimed: anyone could
publish it). Pure Python."""

from __future__ import annotations

__all__ = ["install_hint"]

#: What each extra brings, installed on its own from the registry (packages their owners publish).
_EXTRAS = {"plot": "matplotlib", "megatron": "torch megatron-core"}


def install_hint(extra: str) -> str:
    """``pip install matplotlib``, or the extra from a checkout or a wheel built from it."""
    return (
        f"pip install {_EXTRAS[extra]}, or from a checkout of megatron-ga-ext pip install "
        f"'./megatron-ga-ext[{extra}]' (or the wheel built from it: pip install "
        "'megatron_ga_ext-<version>-"
        f"py3-none-any.whl[{extra}]')"
    )
